// The opt-in step traces of the daemons (stage_worker/step_trace.h, coordinator/batch_trace.h):
// CONVEYOR_TRACE_DIR=DIR makes each append JSON lines to a file of its own in DIR.
#pragma once

#include <cstdio>
#include <string>

#include "common/status.h"

namespace conveyor {

// The folder $CONVEYOR_TRACE_DIR names, as the process's options snapshot read it at start-up
// (common/options.h: trace.dir); "" when it is unset or empty (no trace).
std::string trace_dir_from_environment();
// DIR/file_name opened for appending (DIR is created); the error names the path and why.
Expected<std::FILE*> open_trace_file(const std::string& dir, const std::string& file_name);

}  // namespace conveyor

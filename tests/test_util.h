// Helpers shared by the test programs.
#pragma once

#include <cstdlib>
#include <string>

namespace conveyor::testing {

// The repository root: $CONVEYOR_SOURCE_DIR when set (tests run from a bundle on another
// machine), else the source tree the test was built from.
inline std::string source_dir() {
  if (const char* env = std::getenv("CONVEYOR_SOURCE_DIR"); env && *env) return env;
  return CONVEYOR_SOURCE_DIR;
}

}  // namespace conveyor::testing

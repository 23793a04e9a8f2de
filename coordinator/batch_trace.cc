#include "coordinator/batch_trace.h"

#include "common/trace_file.h"

namespace conveyor {

Expected<std::unique_ptr<BatchTrace>> BatchTrace::from_environment() {
  const std::string dir = trace_dir_from_environment();
  if (dir.empty()) return std::unique_ptr<BatchTrace>();
  auto f = open_trace_file(dir, "coordinator.jsonl");
  if (!f) return f.status();
  return std::make_unique<BatchTrace>(*f);
}

BatchTrace::~BatchTrace() { std::fclose(file_); }

void BatchTrace::write(const std::string& json_object) {
  std::fputs(json_object.c_str(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
}

}  // namespace conveyor

#include "common/trace_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/options.h"

namespace conveyor {

std::string trace_dir_from_environment() { return process_options().trace_dir; }

Expected<std::FILE*> open_trace_file(const std::string& dir, const std::string& file_name) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error("CONVEYOR_TRACE_DIR: cannot create " + dir + ": " + ec.message());
  const std::string path = (std::filesystem::path(dir) / file_name).string();
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f) return Status::error("CONVEYOR_TRACE_DIR: cannot open " + path + ": " + std::strerror(errno));
  return f;
}

}  // namespace conveyor

#include "transport/ucx_check.h"

#include <filesystem>

namespace conveyor::transport {

Status ucx_status(ucs_status_t status, const char* call, const char* file, int line) {
  return Status::error(std::string(call) + " failed at " +
                       std::filesystem::path(file).filename().string() + ":" +
                       std::to_string(line) + ": " + ucs_status_string(status));
}

}  // namespace conveyor::transport

// Helpers shared by the test programs.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace conveyor::testing {

// The repository root: $CONVEYOR_SOURCE_DIR when set (tests run from a bundle on another
// machine), else the source tree the test was built from.
inline std::string source_dir() {
  if (const char* env = std::getenv("CONVEYOR_SOURCE_DIR"); env && *env) return env;
  return CONVEYOR_SOURCE_DIR;
}

// Tensor-parallel ranks sharing one GPU (how a one-GPU machine tests the split) wait for
// each other inside kernels, which only works when nothing makes one rank wait for the
// GPU to go idle while another spins: their streams must never share a hardware queue
// (CUDA_DEVICE_MAX_CONNECTIONS >= 16; the default, 8, can serialise two ranks' kernels),
// and kernels must be loaded at start (CUDA_MODULE_LOADING=EAGER; loading one lazily, on
// first launch, waits for the context's running kernels). scripts/gpu_check.sh sets both;
// tests skip their shared-GPU variants otherwise.
inline bool gpu_sharing_ranks_allowed() {
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  return connections != nullptr && std::atoi(connections) >= 16 && loading != nullptr &&
         std::string(loading) == "EAGER";
}

// The folder of the programs (conveyor-coordinator, conveyor-worker, ...): $CONVEYOR_BIN_DIR
// when set (a bundle keeps them beside the tests), else the build tree's bin/.
inline std::string bin_dir() {
  if (const char* env = std::getenv("CONVEYOR_BIN_DIR"); env && *env) return env;
  return std::string(CONVEYOR_BINARY_DIR) + "/bin";
}

// A loopback TCP port nobody listens on: bound, then closed (the kernel does not hand it out
// again at once). 0 when no socket could be bound.
inline int unused_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool bound = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (fd >= 0) ::close(fd);
  return bound ? ntohs(a.sin_port) : 0;
}

// A file's bytes ("" when it cannot be read).
inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Sets an environment variable for one scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace conveyor::testing

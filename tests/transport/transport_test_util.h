// Helpers for the transport tests: deterministic payload patterns, and a child process that
// is always killed and reaped.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace conveyor::testing {

// Fills `bytes` bytes with a pattern determined by `seed` (different seeds differ everywhere).
inline void fill_pattern(void* data, std::size_t bytes, std::uint64_t seed) {
  auto* p = static_cast<unsigned char*>(data);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    const std::uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < bytes; ++i) p[i] = static_cast<unsigned char>(seed + i);
}

// Offset of the first byte that differs from fill_pattern(seed), or -1 when all match.
inline long long check_pattern(const void* data, std::size_t bytes, std::uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    const std::uint64_t v = x * 0x2545F4914F6CDD1Dull;
    if (std::memcmp(p + i, &v, 8) != 0) {
      for (std::size_t k = 0; k < 8; ++k)
        if (p[i + k] != reinterpret_cast<const unsigned char*>(&v)[k])
          return static_cast<long long>(i + k);
    }
  }
  for (; i < bytes; ++i)
    if (p[i] != static_cast<unsigned char>(seed + i)) return static_cast<long long>(i);
  return -1;
}

// A child process started with posix_spawn; the destructor kills (SIGKILL) and reaps it.
class ChildProcess {
 public:
  ChildProcess() = default;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() { kill_and_reap(); }

  // Starts `argv[0]` with `argv` and the current environment plus `extra_env`
  // ("NAME=value").
  bool start(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    env_storage_.clear();
    for (char** e = environ; *e; ++e) env_storage_.emplace_back(*e);
    for (const auto& e : extra_env) env_storage_.push_back(e);
    std::vector<char*> env;
    for (auto& e : env_storage_) env.push_back(e.data());
    env.push_back(nullptr);
    return posix_spawn(&pid_, args[0], nullptr, nullptr, args.data(), env.data()) == 0;
  }

  pid_t pid() const { return pid_; }

  // Waits up to `timeout` for the child to exit; its exit code, or -1 (still running or
  // killed by a signal).
  int wait_exit(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (pid_ > 0) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      if (std::chrono::steady_clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

  void kill_and_reap() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  std::vector<std::string> env_storage_;
};

}  // namespace conveyor::testing

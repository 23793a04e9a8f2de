// Child processes for multi-process tests: started with fork/exec, stdout readable line by
// line, always killed (SIGKILL after a grace period) when the object goes away.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace conveyor::testing {

// Runs `command` through the shell; its stdout (add 2>&1 for stderr too), and its exit status
// in `rc` (-1 when it did not exit).
inline std::string run_shell(const std::string& command, int& rc) {
  rc = -1;
  std::FILE* p = ::popen(command.c_str(), "r");
  if (!p) return "";
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  if (WIFEXITED(status)) rc = WEXITSTATUS(status);
  return out;
}

// True while child `pid` runs. Once it has exited (or is no child of ours any more) it is
// reaped, `pid` becomes -1 and its wait status goes to `status` (when there is one).
inline bool child_running(pid_t& pid, std::optional<int>* status = nullptr) {
  if (pid <= 0) return false;
  int st = 0;
  const pid_t r = ::waitpid(pid, &st, WNOHANG);
  if (r == pid || (r < 0 && errno == ECHILD)) {
    if (r == pid && status != nullptr) *status = st;
    pid = -1;
    return false;
  }
  return true;
}

class ChildProcess {
 public:
  // stdout is captured (read_line_matching); stderr goes to `log` (or is inherited).
  explicit ChildProcess(const std::vector<std::string>& argv, const std::string& log = "") {
    int fds[2];
    if (::pipe(fds) != 0) return;
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::dup2(fds[1], 1);
      if (!log.empty()) {
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) ::dup2(fd, 2);
      }
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    out_ = fds[0];
    ::fcntl(out_, F_SETFL, ::fcntl(out_, F_GETFL) | O_NONBLOCK);
  }
  ~ChildProcess() {
    stop(std::chrono::milliseconds(3000));
    if (out_ >= 0) ::close(out_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool running() { return child_running(pid_, &exit_status_); }
  // The exit code once it exited (waits up to `timeout`), or nullopt.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (running() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (pid_ > 0 || !exit_status_) return std::nullopt;
    return WIFEXITED(*exit_status_) ? WEXITSTATUS(*exit_status_) : 128 + WTERMSIG(*exit_status_);
  }
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  // SIGTERM, then SIGKILL after `grace`.
  void stop(std::chrono::milliseconds grace) {
    if (!running()) return;
    signal(SIGTERM);
    if (!wait_exit(grace)) {
      signal(SIGKILL);
      wait_exit(std::chrono::milliseconds(5000));
    }
  }
  // The first stdout line containing `needle` within `timeout` ("" if none).
  std::string read_line_matching(const std::string& needle, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      size_t nl;
      while ((nl = buffer_.find('\n')) != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (line.find(needle) != std::string::npos) return line;
      }
      char buf[4096];
      const ssize_t n = ::read(out_, buf, sizeof(buf));
      if (n > 0) buffer_.append(buf, size_t(n));
      else if (n == 0 && !running()) return "";
      else std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "";
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buffer_;
  std::optional<int> exit_status_;
};

}  // namespace conveyor::testing

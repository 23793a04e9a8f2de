// What the Slurm test programs (test_slurm*.cc) share: the script's path and the daemons'
// folder, shell commands with their output, and the processes found by their environment.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace conveyor::slurm_test {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

inline std::string errno_text() { return std::strerror(errno); }

inline std::string script_path() { return testing::source_dir() + "/scripts/slurm/conveyor.sbatch"; }
inline std::string bin_dir() { return std::string(CONVEYOR_BINARY_DIR) + "/bin"; }

// `s` as one word for sh.
inline std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Output {
  int rc = -1;  // the exit code; -1 when it did not exit normally
  std::string text;
};

// Runs `cmd` with sh, killed after `limit` (coreutils timeout); returns its stdout (add
// 2>&1 to `cmd` for stderr as well).
inline Output sh(const std::string& cmd, seconds limit = seconds(30)) {
  Output out;
  const std::string line = "timeout -k 5 " + std::to_string(limit.count()) + " sh -c " + quoted(cmd);
  FILE* p = ::popen(line.c_str(), "r");
  if (!p) {
    out.text = "popen(" + line + ") failed: " + errno_text();
    return out;
  }
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.text.append(buf.data(), n);
  const int status = ::pclose(p);
  if (status == -1) out.text += "\npclose failed: " + errno_text();
  else if (WIFEXITED(status)) out.rc = WEXITSTATUS(status);
  return out;
}

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "(cannot read " + path.string() + ")";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// The full path of program `name` on PATH or in the sbin folders (daemons live there and a
// non-login root shell may lack them on PATH), or "".
inline std::string find_program(const std::string& name) {
  std::string dirs = std::getenv("PATH") ? std::getenv("PATH") : "";
  dirs += ":/usr/sbin:/sbin:/usr/local/sbin";
  std::stringstream ss(dirs);
  for (std::string d; std::getline(ss, d, ':');) {
    if (d.empty()) continue;
    const fs::path p = fs::path(d) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

// `n` distinct TCP ports free now (each socket stays bound until all are chosen).
inline ::testing::AssertionResult free_ports(int n, std::vector<int>& ports) {
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
  };
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      close_all();
      return ::testing::AssertionFailure() << "socket: " << errno_text();
    }
    fds.push_back(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const std::string why = errno_text();
      close_all();
      return ::testing::AssertionFailure() << "bind/getsockname on port 0: " << why;
    }
    ports.push_back(ntohs(addr.sin_port));
  }
  close_all();
  return ::testing::AssertionSuccess();
}

// The processes (other than this one) whose environment holds every one of `entries`
// ("NAME=value"), with their executable.
struct Proc {
  pid_t pid;
  std::string exe;
  std::string cmdline;
};
inline std::vector<Proc> processes_with_env(const std::vector<std::string>& entries) {
  std::vector<Proc> out;
  std::error_code ec;
  for (fs::directory_iterator it("/proc", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = pid_t(std::stol(name));
    if (pid == ::getpid()) continue;
    std::ifstream in(it->path() / "environ", std::ios::binary);
    if (!in) continue;  // gone, or not ours to read
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string env = std::string(1, '\0') + ss.str();
    bool all = true;
    for (const auto& e : entries) all = all && env.find(std::string(1, '\0') + e + std::string(1, '\0')) != std::string::npos;
    if (!all) continue;
    std::error_code ec2;
    Proc p{pid, fs::read_symlink(it->path() / "exe", ec2).string(), read_text(it->path() / "cmdline")};
    for (char& c : p.cmdline)
      if (c == '\0') c = ' ';
    out.push_back(std::move(p));
  }
  return out;
}

inline std::string describe(const std::vector<Proc>& procs) {
  std::string s;
  for (const auto& p : procs) s += "\n  pid " + std::to_string(p.pid) + ": " + p.cmdline;
  return s;
}

// A daemon of the test cluster: its own session, stdout and stderr to `log`, stdin from
// /dev/null, killed with its process group (SIGTERM, then SIGKILL) by stop() or when it

}  // namespace conveyor::slurm_test

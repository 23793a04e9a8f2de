// The systemd units in scripts/systemd/ pass `systemd-analyze verify` with no complaint (an
// unknown key or a malformed value is only a warning there, so any output fails the test),
// with ExecStart pointed at this build's programs. A unit with a typo must be caught: the
// test checks that too, so it cannot pass by not looking.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;

std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Copies the units into `dir` with ExecStart at this build's bin/; returns the copies.
std::vector<fs::path> staged_units(const fs::path& dir, const std::string& extra_line = "") {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(fs::path(testing::source_dir()) / "scripts" / "systemd")) {
    if (e.path().extension() != ".service") continue;
    std::ifstream in(e.path());
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = std::regex_replace(ss.str(), std::regex("/opt/conveyor/bin/"), std::string(CONVEYOR_BINARY_DIR) + "/bin/");
    if (!extra_line.empty()) text = std::regex_replace(text, std::regex("\\[Service\\]\n"), "[Service]\n" + extra_line + "\n");
    std::ofstream(dir / e.path().filename()) << text;
    out.push_back(dir / e.path().filename());
  }
  return out;
}

std::string verify_command(const std::vector<fs::path>& units) {
  std::string cmd = "systemd-analyze verify";
  for (const auto& u : units) cmd += " '" + u.string() + "'";
  return cmd;
}

TEST(SystemdUnits, VerifyCleanly) {
  ASSERT_EQ(run("command -v systemd-analyze").first, 0) << "systemd-analyze is missing (scripts/setup.sh installs systemd)";
  const fs::path dir = fs::temp_directory_path() / ("conveyor-units-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto units = staged_units(dir);
  ASSERT_EQ(units.size(), 2u) << "expected the coordinator and worker units";
  auto [rc, out] = run(verify_command(units));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "") << out;

  // The same check sees a typo.
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto [rc2, out2] = run(verify_command(staged_units(dir, "Restrat=always")));
  EXPECT_NE(out2.find("Restrat"), std::string::npos) << out2;
  fs::remove_all(dir);
}

TEST(SystemdUnits, DaemonsAreNotifyServicesWithAWatchdog) {
  for (const char* name : {"conveyor-coordinator.service", "conveyor-worker.service"}) {
    std::ifstream in(fs::path(testing::source_dir()) / "scripts" / "systemd" / name);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string t = ss.str();
    for (const char* key : {"Type=notify", "WatchdogSec=", "Restart=on-failure", "NoNewPrivileges=yes"})
      EXPECT_NE(t.find(key), std::string::npos) << name << " lacks " << key;
  }
}

// The coordinator tells systemd it is ready: a datagram socket stands in for systemd's
// NOTIFY_SOCKET, and READY=1 must arrive once the daemon listens.
TEST(SystemdUnits, CoordinatorNotifiesReady) {
  const fs::path dir = fs::temp_directory_path() / ("conveyor-notify-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string sock_path = (dir / "notify").string();
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(sock_path.size(), sizeof(addr.sun_path));
  std::strcpy(addr.sun_path, sock_path.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  std::ofstream(dir / "cluster.yaml") << "model: {path: \"" << testing::source_dir() << "/models/brown-gpt2\"}\n"
                                      << "http: {port: 0}\ncontrol: {port: 0, join_token: t}\n";
  ::setenv("NOTIFY_SOCKET", sock_path.c_str(), 1);
  std::string got;
  {
    testing::ChildProcess coordinator({std::string(CONVEYOR_BINARY_DIR) + "/bin/conveyor-coordinator", "--config",
                                       (dir / "cluster.yaml").string()},
                                      (dir / "coordinator.log").string());
    ::unsetenv("NOTIFY_SOCKET");
    pollfd p{fd, POLLIN, 0};
    while (got.find("READY=1") == std::string::npos && ::poll(&p, 1, 30000) == 1) {
      char buf[512];
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n > 0) got.append(buf, size_t(n)).append("\n");
    }
    coordinator.stop(std::chrono::milliseconds(3000));
  }
  ::close(fd);
  EXPECT_NE(got.find("READY=1"), std::string::npos) << "notifications: " << got;
  EXPECT_NE(got.find("STATUS=serving brown-gpt2"), std::string::npos) << got;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conveyor

// A worker given a wrong coordinator address says which address and why (issue 28): a name
// that does not resolve stops it at start, naming the name and the resolver's reason; an
// address where nothing listens is retried, with a line every few seconds naming the address
// and "connection refused" (ZeroMQ alone would retry in silence for ever).
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using testing::ChildProcess;

std::string worker_bin() { return testing::bin_dir() + "/conveyor-worker"; }

fs::path log_path(const std::string& tag) {
  return fs::temp_directory_path() / ("conveyor-test-worker-" + tag + "-" + std::to_string(::getpid()) + ".log");
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(WorkerCoordinatorAddress, AnUnresolvableNameStopsTheWorkerNamingIt) {
  const fs::path log = log_path("dns");
  ChildProcess w({worker_bin(), "--coordinator", "nosuchhost.invalid:5555", "--join-token", "t", "--backend", "cpu"},
                 log.string());
  EXPECT_EQ(w.wait_exit(std::chrono::seconds(20)), 1);
  const std::string text = read(log);
  EXPECT_NE(text.find("--coordinator nosuchhost.invalid:5555"), std::string::npos) << text;
  EXPECT_NE(text.find("cannot resolve 'nosuchhost.invalid'"), std::string::npos) << text;
  fs::remove(log);
}

TEST(WorkerCoordinatorAddress, AnAddressWithoutAPortIsRefusedAtStart) {
  const fs::path log = log_path("port");
  ChildProcess w({worker_bin(), "--coordinator", "127.0.0.1", "--join-token", "t", "--backend", "cpu"}, log.string());
  EXPECT_EQ(w.wait_exit(std::chrono::seconds(20)), 1);
  const std::string text = read(log);
  EXPECT_NE(text.find("'127.0.0.1' has no port"), std::string::npos) << text;
  fs::remove(log);
}

TEST(WorkerCoordinatorAddress, ARefusedConnectionIsRetriedNamingTheAddressEveryFewSeconds) {
  const fs::path log = log_path("refused");
  const std::string at = "127.0.0.1:" + std::to_string(testing::unused_loopback_port());
  ChildProcess w({worker_bin(), "--coordinator", at, "--join-token", "t", "--backend", "cpu"}, log.string());
  const std::string line = "cannot reach the coordinator at " + at + ": connection refused; retrying";
  std::string text;
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
       std::chrono::steady_clock::now() < until && count(text, line) < 2;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    text = read(log);
  }
  EXPECT_GE(count(text, line), 2u) << text;
  EXPECT_TRUE(w.running()) << "a refused connection is retried, not fatal: " << text;
  // ZeroMQ's own complaint, which names no address, is not repeated every second.
  EXPECT_LE(count(text, "not sent"), 1u) << text;
  w.stop(std::chrono::milliseconds(3000));
  fs::remove(log);
}

}  // namespace
}  // namespace conveyor

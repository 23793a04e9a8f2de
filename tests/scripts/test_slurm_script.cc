// scripts/slurm/conveyor.sbatch run without Slurm (test_slurm.cc runs it on a real cluster):
// its refusals name what is wrong, and --check prints the job's copy of a cluster file,
// which the coordinator's own parser reads.
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

#include "tests/scripts/slurm_test_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using namespace slurm_test;

struct ScriptRun {
  fs::path dir;
  ScriptRun() {
    dir = fs::temp_directory_path() / ("conveyor-slurm-script-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::create_directory_symlink(testing::source_dir() + "/models/brown-gpt2", dir / "model");
  }
  ~ScriptRun() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  // The script run outside any Slurm job from `dir` with `env` (sh assignments) and `args`.
  Output run(const std::string& env, const std::string& args, bool with_stderr = true) const {
    return sh("cd " + quoted(dir.string()) + " && env -u SLURM_JOB_ID -u SLURM_JOB_NODELIST -u CONVEYOR_CONFIG " + env +
              " bash " + quoted(script_path()) + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null"));
  }
};

TEST(SlurmScript, RefusesABadSetupNamingWhatIsWrong) {
  ScriptRun s;
  std::ofstream(s.dir / "cluster.yaml") << "model: {path: model}\npipeline: {stages: 3}\n";
  const std::string bin = "CONVEYOR_BIN=" + quoted(bin_dir());

  Output r = s.run(bin, "");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("no cluster file"), std::string::npos) << r.text;

  r = s.run(bin, "/nonexistent/cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("'/nonexistent/cluster.yaml' does not exist"), std::string::npos) << r.text;

  r = s.run("CONVEYOR_BIN=/nonexistent/bin", "cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("/nonexistent/bin/conveyor-coordinator is missing"), std::string::npos) << r.text;

  r = s.run(bin + " CONVEYOR_WORKERS_PER_NODE=0", "cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("CONVEYOR_WORKERS_PER_NODE"), std::string::npos) << r.text;

  r = s.run(bin, "cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("not inside a Slurm job"), std::string::npos) << r.text;

  r = s.run(bin + " CONVEYOR_CONFIG=cluster.yaml", "--check");
  EXPECT_EQ(r.rc, 0) << r.text;
}

// --check: the coordinator itself reads the cluster file as it is (block or flow style) with
// the flags the job gives it, and prints what it would run with: both hosts the bind
// address, the model path relative to the file, the join token from the environment, every
// other value as the file has it.
TEST(SlurmScript, CheckShowsWhatTheCoordinatorWouldRunWith) {
  ScriptRun s;
  const std::string env = "CONVEYOR_BIN=" + quoted(bin_dir()) + " CONVEYOR_BIND_HOST=0.0.0.0";
  const std::vector<std::pair<std::string, std::string>> files = {
      {"block.yaml",
       "# the demo\nmodel:\n  path: model   # relative\n  name: demo\nhttp:\n  port: 8123\n  api_key: 'k,1'\n"
       "control:\n    host: 127.0.0.1\n    port: 5566\n    join_token: file-token\npipeline:\n  stages: 3\n"},
      {"flow.yaml",
       "model: {path: \"model\", name: demo}\nhttp: {port: 8123, api_key: \"k,1\"}  # a comment\n"
       "control: {host: 127.0.0.1, port: 5566, join_token: file-token}\npipeline: {stages: 3}\n"},
      {"multi.yaml",  // a flow mapping over several lines: the awk rewriting of old refused it
       "model: {path: model, name: demo}\nhttp: {port: 8123,\n  api_key: \"k,1\"}\n"
       "control: {host: 127.0.0.1, port: 5566,\n  join_token: file-token}\npipeline: {stages: 3}\n"},
  };
  for (const auto& [name, text] : files) {
    std::ofstream(s.dir / name) << text;
    const Output r = s.run("CONVEYOR_JOIN_TOKEN=env-token " + env, "--check " + name, /*with_stderr=*/false);
    ASSERT_EQ(r.rc, 0) << name << ":\n" << s.run(env, "--check " + name).text;
    const json cfg = json::parse(r.text, nullptr, false);
    ASSERT_FALSE(cfg.is_discarded()) << r.text;
    EXPECT_EQ(cfg["http"]["host"], "0.0.0.0") << r.text;
    EXPECT_EQ(cfg["control"]["host"], "0.0.0.0") << r.text;
    EXPECT_EQ(cfg["http"]["port"], 8123) << r.text;
    EXPECT_EQ(cfg["control"]["port"], 5566) << r.text;
    EXPECT_EQ(cfg["http"]["api_key_set"], true) << r.text;
    EXPECT_EQ(cfg["control"]["join_token_from"], "environment") << r.text;
    // A wildcard bind address: UCX's choice of interface (the workers pass their own --host).
    EXPECT_EQ(cfg["control"]["data_interface"], "any") << r.text;
    EXPECT_EQ(cfg["control"]["data_interface_from"], "wildcard address 0.0.0.0") << r.text;
    EXPECT_EQ(cfg["model"]["name"], "demo") << r.text;
    EXPECT_EQ(fs::path(cfg["model"]["path"].get<std::string>()).lexically_normal(), (s.dir / "model").lexically_normal())
        << r.text;
    EXPECT_EQ(cfg["pipeline"]["stages"], 3) << r.text;
  }

  // A loopback bind address keeps the data plane on lo, the interface holding it.
  {
    const Output r = s.run("CONVEYOR_JOIN_TOKEN=env-token CONVEYOR_BIN=" + quoted(bin_dir()) + " CONVEYOR_BIND_HOST=127.0.0.1",
                           "--check block.yaml", /*with_stderr=*/false);
    ASSERT_EQ(r.rc, 0) << r.text;
    const json cfg = json::parse(r.text, nullptr, false);
    ASSERT_FALSE(cfg.is_discarded()) << r.text;
    EXPECT_EQ(cfg["control"]["host"], "127.0.0.1") << r.text;
    EXPECT_EQ(cfg["control"]["data_interface"], "lo") << r.text;
    EXPECT_EQ(cfg["control"]["data_interface_from"], "address 127.0.0.1") << r.text;
  }
  // An address this host does not hold is refused, naming it and the host's interfaces.
  Output r = s.run("CONVEYOR_BIN=" + quoted(bin_dir()) + " CONVEYOR_BIND_HOST=192.0.2.254", "--check block.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("'192.0.2.254' (192.0.2.254) is not an address of this host"), std::string::npos) << r.text;
  // A broken file is refused with the coordinator's own message (file, line, reason).
  std::ofstream(s.dir / "bad.yaml") << "model: {path: model}\npipeline: {stages: 0}\n";
  r = s.run(env, "--check bad.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("bad.yaml"), std::string::npos) << r.text;
  EXPECT_NE(r.text.find("the coordinator refuses"), std::string::npos) << r.text;
}

}  // namespace
}  // namespace conveyor

// `conveyor local` when a daemon cannot start: the launcher prints the daemon's own reason
// (not only where its log is) and exits non-zero at once, instead of waiting. And where its
// daemons' data plane runs: on loopback (`lo`) alone, never on an interface UCX would pick
// by itself (issue 28: a bridge that came and went hung the cluster). And where the join
// token goes: in each daemon's environment, never on a command line (issue 29). And Ctrl-C on a
// cluster that hangs ends it all within about a second (issue 28).
// Real processes on loopback; each test is bounded in time and stops what it started.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using conveyor::testing::ChildProcess;
using Clock = std::chrono::steady_clock;

std::string bin(const std::string& name) { return conveyor::testing::bin_dir() + "/" + name; }
std::string source(const std::string& path) { return conveyor::testing::source_dir() + "/" + path; }

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh folder under the temporary directory, removed when the test ends.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("conveyor-test-cli-" + tag + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Runs `conveyor local ARGS` (from `conveyor`, which finds the daemons beside itself) and
// waits for it to exit; stderr is returned in `err`, the exit code (or nothing when it was
// still running after `limit`) and the seconds it took in the others.
struct Outcome {
  std::optional<int> code;
  std::string err;
  double seconds = 0;
};
Outcome run_local(const std::string& conveyor, const std::vector<std::string>& args, const fs::path& dir,
                  std::chrono::seconds limit) {
  std::vector<std::string> argv = {conveyor, "local", "--port", "0", "--backend", "cpu", "--log-dir",
                                   (dir / "logs").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto t0 = Clock::now();
  Outcome o;
  {
    ChildProcess local(argv, (dir / "stderr").string());
    o.code = local.wait_exit(limit);
    o.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }  // still running: stopped here (and its daemons with it)
  o.err = read_file(dir / "stderr");
  return o;
}

TEST(ConveyorLocal, ImpossiblePlanPrintsTheCoordinatorsReason) {
  TempDir dir("plan");
  // A model of 2 layers cannot be cut into 3 stages: the coordinator refuses its config.
  const Outcome o = run_local(bin("conveyor"), {"--model", source("tests/data/hf_fixtures/hd32_l2"), "--stages", "3"},
                              dir.path, std::chrono::seconds(30));
  ASSERT_TRUE(o.code.has_value()) << "conveyor local still ran after 30 s; stderr:\n" << o.err;
  EXPECT_NE(*o.code, 0) << o.err;
  EXPECT_LT(o.seconds, 15) << o.err;
  EXPECT_NE(o.err.find("the coordinator did not start"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("impossible plan: 3 stages for a model of 2 layers"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("coordinator.log"), std::string::npos) << o.err;  // and where the rest is
}

TEST(ConveyorLocal, WorkerThatExitsAtStartPrintsItsReason) {
  TempDir dir("worker-exits");
  // A bin folder of a copy of `conveyor` (it looks for the daemons beside its own file), the
  // real coordinator, and a worker that fails the way a real one does when it cannot start.
  const fs::path b = dir.path / "bin";
  fs::create_directories(b);
  fs::copy_file(bin("conveyor"), b / "conveyor");
  fs::create_symlink(bin("conveyor-coordinator"), b / "conveyor-coordinator");
  std::ofstream(b / "conveyor-worker") << "#!/bin/sh\n"
                                       << "echo 'conveyor-worker: worker: cannot create the UCX data plane: "
                                          "no usable transport (test)' >&2\n"
                                       << "exit 1\n";
  fs::permissions(b / "conveyor-worker", fs::perms::owner_all, fs::perm_options::add);
  const Outcome o = run_local((b / "conveyor").string(), {"--model", source("models/brown-gpt2"), "--stages", "2"},
                              dir.path, std::chrono::seconds(30));
  ASSERT_TRUE(o.code.has_value()) << "conveyor local still ran after 30 s; stderr:\n" << o.err;
  EXPECT_NE(*o.code, 0) << o.err;
  EXPECT_LT(o.seconds, 15) << o.err;
  EXPECT_NE(o.err.find("exited during start-up (status 1): worker: cannot create the UCX data plane: no usable "
                       "transport (test)"),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find(".log"), std::string::npos) << o.err;
}

TEST(ConveyorLocal, ModelNoWorkerCanLoadPrintsTheLoadError) {
  TempDir dir("corrupt");
  // The coordinator needs only the config and the tokenizer; the workers find the weights
  // file is not a safetensors file.
  const fs::path model = dir.path / "model";
  fs::create_directories(model);
  for (const char* f : {"config.json", "vocab.json", "merges.txt"})
    fs::copy_file(source("models/brown-gpt2") + "/" + f, model / f);
  std::ofstream(model / "model.safetensors") << "this is not a safetensors file";
  const Outcome o = run_local(bin("conveyor"), {"--model", model.string(), "--stages", "2"}, dir.path,
                              std::chrono::seconds(60));
  ASSERT_TRUE(o.code.has_value()) << "conveyor local still ran after 60 s; stderr:\n" << o.err;
  EXPECT_NE(*o.code, 0) << o.err;
  EXPECT_LT(o.seconds, 40) << o.err;
  EXPECT_NE(o.err.find("worker0 failed to load its layers: "), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("worker1 failed to load its layers: "), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("no worker could load the model"), std::string::npos) << o.err;
}

// A NUL-separated /proc file (cmdline, environ) as its strings.
std::vector<std::string> proc_strings(pid_t pid, const char* file) {
  std::vector<std::string> out;
  std::stringstream in(read_file(fs::path("/proc") / std::to_string(pid) / file));
  for (std::string item; std::getline(in, item, '\0');) out.push_back(item);
  return out;
}

// The processes whose parent is `parent`.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::istringstream status(read_file(e.path() / "status"));
    for (std::string line; std::getline(status, line);)
      if (line.rfind("PPid:", 0) == 0 && std::stol(line.substr(5)) == parent) out.push_back(std::stoi(name));
  }
  return out;
}

// The join token `conveyor local` made is in its daemons' environments (readable by their
// user alone), the same in each; on no command line (every user reads those: ps) and in no
// file of the log folder.
void expect_token_only_in_environment(pid_t local, const fs::path& logs) {
  const std::vector<pid_t> daemons = children_of(local);
  EXPECT_GE(daemons.size(), 3u) << "the coordinator and two workers";
  std::string token;
  for (pid_t pid : daemons)
    for (const std::string& var : proc_strings(pid, "environ"))
      if (var.rfind("CONVEYOR_JOIN_TOKEN=", 0) == 0) {
        const std::string value = var.substr(std::strlen("CONVEYOR_JOIN_TOKEN="));
        if (token.empty()) token = value;
        EXPECT_EQ(value, token) << "pid " << pid;
      }
  ASSERT_GE(token.size(), 16u) << "no CONVEYOR_JOIN_TOKEN in the daemons' environments";
  for (pid_t pid : daemons) {
    const std::vector<std::string> argv = proc_strings(pid, "cmdline");
    ASSERT_FALSE(argv.empty()) << "pid " << pid;
    for (const std::string& arg : argv) EXPECT_EQ(arg.find(token), std::string::npos) << "pid " << pid << ": " << arg;
  }
  for (const auto& e : fs::directory_iterator(logs))
    EXPECT_EQ(read_file(e.path()).find(token), std::string::npos) << e.path();
}

// A cluster as `conveyor local` starts it: the coordinator (control.host 127.0.0.1) and every
// worker (--host 127.0.0.1) say their data plane is on lo, and the cluster serves.
TEST(ConveyorLocal, DaemonsKeepTheDataPlaneOnLoopback) {
  TempDir dir("loopback");
  if (std::getenv("UCX_NET_DEVICES")) GTEST_SKIP() << "UCX_NET_DEVICES is set: it wins over the address";
  const fs::path logs = dir.path / "logs";
  ChildProcess local({bin("conveyor"), "local", "--port", "0", "--backend", "cpu", "--log-dir", logs.string(), "--model",
                      source("models/brown-gpt2"), "--stages", "2"},
                     (dir.path / "stderr").string());
  const std::string ready = local.read_line_matching("ready at", std::chrono::seconds(120));
  ASSERT_NE(ready, "") << "conveyor local did not become ready; stderr:\n" << read_file(dir.path / "stderr");
  const std::string coordinator = read_file(logs / "coordinator.log");
  EXPECT_NE(coordinator.find("coordinator: data plane on lo (address 127.0.0.1)"), std::string::npos) << coordinator;
  for (const char* worker : {"worker0", "worker1"}) {
    const std::string log = read_file(logs / (std::string(worker) + ".log"));
    EXPECT_NE(log.find(std::string(worker) + ": data plane on lo (address 127.0.0.1)"), std::string::npos)
        << worker << ":\n"
        << log;
  }
  expect_token_only_in_environment(local.pid(), logs);
  local.stop(std::chrono::seconds(15));
}

// Ctrl-C on a cluster that hangs (a worker stopped with SIGSTOP while streams run, so the
// accepted requests can never finish): `conveyor local` and every daemon it started are gone
// within about a second. It once waited 5 s for the coordinator and 3 s more for the
// workers, 9.6 s in all (issue 28).
TEST(ConveyorLocal, CtrlCOnAHungClusterEndsEverythingWithinASecond) {
  TempDir dir("ctrl-c");
  ChildProcess local({bin("conveyor"), "local", "--port", "0", "--backend", "cpu", "--log-dir", (dir.path / "logs").string(),
                      "--model", source("models/brown-gpt2"), "--stages", "2"},
                     (dir.path / "stderr").string());
  const std::string ready = local.read_line_matching("ready at", std::chrono::seconds(120));
  int port = 0;
  ASSERT_EQ(std::sscanf(ready.c_str(), "conveyor local: ready at http://127.0.0.1:%d", &port), 1)
      << ready << read_file(dir.path / "stderr");
  const std::vector<pid_t> daemons = children_of(local.pid());
  ASSERT_EQ(daemons.size(), 3u) << "a coordinator and two workers";
  std::atomic<int> streaming{0};
  std::vector<std::thread> streams;
  for (int i = 0; i < 4; ++i)
    streams.emplace_back([&] {
      conveyor::HttpRequest r;
      r.method = "POST";
      r.target = "/v1/completions";
      r.body = nlohmann::json{{"prompt", "The jury said"}, {"max_tokens", 200}, {"ignore_eos", true}, {"stream", true}}.dump();
      r.timeout = std::chrono::seconds(30);
      bool counted = false;
      r.on_body = [&](std::string_view) {
        if (!std::exchange(counted, true)) ++streaming;
      };
      (void)conveyor::http_call("127.0.0.1", port, r);
    });
  for (const auto until = Clock::now() + std::chrono::seconds(30); streaming < 4 && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ::kill(daemons.back(), SIGSTOP);  // a worker: the pipeline hangs
  const auto t0 = Clock::now();
  local.signal(SIGINT);
  const auto code = local.wait_exit(std::chrono::seconds(15));
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(code.has_value()) << "conveyor local still runs 15 s after Ctrl-C";
  EXPECT_LT(took, 1.5) << read_file(dir.path / "stderr");
  for (pid_t d : daemons) EXPECT_NE(::kill(d, 0), 0) << "daemon " << d << " outlived conveyor local";
  for (auto& t : streams) t.join();
}

// The coordinator's --check on the cluster file `conveyor local` writes says the interface
// its data plane will use, and what chose it; --data-interface and UCX_NET_DEVICES win.
TEST(ConveyorLocal, CoordinatorCheckReportsTheLoopbackInterface) {
  TempDir dir("check");
  std::ofstream(dir.path / "cluster.yaml") << "model: {path: \"" << source("models/brown-gpt2") << "\"}\n"
                                           << "http: {host: 127.0.0.1, port: 0}\n"
                                           << "control: {host: 127.0.0.1, port: 0, join_token: \"t\"}\n"
                                           << "pipeline: {stages: 2}\n";
  // `env` in front: a clean UCX_NET_DEVICES, or the one a case sets.
  auto check = [&](const std::vector<std::string>& env, const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {"/usr/bin/env", "-u", "UCX_NET_DEVICES"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.insert(argv.end(), {bin("conveyor-coordinator"), "--config", (dir.path / "cluster.yaml").string(), "--check"});
    argv.insert(argv.end(), flags.begin(), flags.end());
    ChildProcess p(argv, (dir.path / "check.err").string());
    std::string out;
    for (std::string line; !(line = p.read_line_matching("", std::chrono::seconds(20))).empty();) out += line + "\n";
    EXPECT_EQ(p.wait_exit(std::chrono::seconds(10)), 0) << read_file(dir.path / "check.err");
    const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << out << read_file(dir.path / "check.err");
    return j.is_discarded() ? nlohmann::json() : j["control"];
  };
  nlohmann::json c = check({}, {});
  EXPECT_EQ(c["data_interface"], "lo") << c;
  EXPECT_EQ(c["data_interface_from"], "address 127.0.0.1") << c;
  c = check({}, {"--data-interface", "any"});
  EXPECT_EQ(c["data_interface"], "any") << c;
  EXPECT_EQ(c["data_interface_from"], "--data-interface") << c;
  c = check({"UCX_NET_DEVICES=lo"}, {"--data-interface", "any"});
  EXPECT_EQ(c["data_interface"], "lo") << c;
  EXPECT_EQ(c["data_interface_from"], "UCX_NET_DEVICES") << c;
}

// With several GPUs and no shape, `conveyor local` takes the layout the measured figures say
// is best for the objective, says which and why, and writes the objective into the cluster
// file; a bad figures file is refused with its line. The choice comes before any daemon
// starts, so it is checked here whether or not this machine has the two GPUs (the workers
// then fail to start, or serve until the test stops them).
TEST(ConveyorLocal, SeveralGpusAndNoShapeTakeTheLayoutMeasuredBestForTheObjective) {
  TempDir dir("layout");
  std::ofstream(dir.path / "figures.jsonl")
      << R"({"layout": "tp", "gpus": 2, "clients": 1, "tokens_per_s": 266, "itl_ms_p50": 3.48, "device": "test"})" "\n"
      << R"({"layout": "stages", "gpus": 2, "clients": 1, "tokens_per_s": 170, "itl_ms_p50": 5.22})" "\n"
      << R"({"layout": "replicas", "gpus": 2, "clients": 1, "tokens_per_s": 190, "itl_ms_p50": 4.98})" "\n";
  auto start = [&](const std::string& objective, const fs::path& figures) {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{bin("conveyor"), "local", "--port", "0", "--backend", "cuda", "--gpus", "2", "--log-dir",
                                 (dir.path / "logs").string(), "--model", source("models/brown-gpt2"), "--objective",
                                 objective, "--layout-figures", figures.string()},
        (dir.path / "stderr").string());
  };
  {
    auto local = start("latency", dir.path / "figures.jsonl");
    const std::string line = local->read_line_matching("objective latency", std::chrono::seconds(30));
    EXPECT_NE(line.find("2 GPUs, objective latency: tp (1 stage(s) x 1 replica(s), tp 2): 1 stage at tp 2 measured "
                        "3.48 ms between tokens at 1 client"),
              std::string::npos)
        << line << read_file(dir.path / "stderr");
    EXPECT_NE(read_file(dir.path / "logs" / "cluster.yaml").find("objective: latency"), std::string::npos);
  }
  std::ofstream(dir.path / "bad.jsonl") << "{\"layout\": \"ring\", \"gpus\": 2}\n";
  auto bad = start("throughput", dir.path / "bad.jsonl");
  EXPECT_EQ(bad->wait_exit(std::chrono::seconds(30)), 2);
  bad.reset();
  EXPECT_NE(read_file(dir.path / "stderr").find("bad.jsonl:1: "), std::string::npos) << read_file(dir.path / "stderr");
}

}  // namespace

// scripts/slurm/conveyor.sbatch on a real one-node Slurm cluster that the test starts in a
// temporary folder (munged, slurmctld and slurmd as its children, on free ports): a
// 3-stage CPU pipeline of the demo model with three workers on the node, submitted with
// sbatch; /health must turn ok and a completion come back, then scancel (or the SIGTERM
// the time limit sends the batch shell) must end the job and leave no coordinator or
// worker behind. Every process of that cluster, the job's included, carries the cluster's
// SLURM_CONF in its environment: teardown finds them by it and kills whatever is left, on
// every path. Without Slurm and munge the test is skipped.
//
// test_slurm_script.cc runs the script without Slurm.
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

#include "cli/http_client.h"
#include "tests/netns/netns_harness.h"
#include "tests/scripts/slurm_cluster.h"
#include "tests/scripts/slurm_test_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using namespace slurm_test;

// How the job is told to stop.
struct StopWay {
  const char* name;
  const char* command;      // followed by the job id
  const char* final_state;  // scontrol's JobState once the job has ended
  bool script_stops_all;    // the script alone stops workers and coordinator, and says so
};

const StopWay kStopWays[] = {
    // Slurm sends SIGTERM to every process of the job at once (the script traps it) and
    // SIGKILL after KillWait.
    {"Scancel", "scancel", "CANCELLED", false},
    // What the time limit does with the script's --signal=B:TERM@60: SIGTERM to the batch
    // shell alone; the script stops the workers, then the coordinator, and exits 0.
    {"TimeLimitSignal", "scancel --batch --signal=TERM", "COMPLETED", true},
};

// What the test names show for the parameter (gtest would print its bytes).
void PrintTo(const StopWay& way, std::ostream* os) { *os << way.name; }

class SlurmJob : public ::testing::TestWithParam<StopWay> {};

TEST_P(SlurmJob, ServesThenStopsLeavingNothing) {
  for (const char* prog : {"munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol"})
    if (find_program(prog).empty())
      GTEST_SKIP() << prog << " is not installed: scripts/setup.sh installs Slurm and munge (slurmctld slurmd slurm-client munge)";
  if (::geteuid() != 0) GTEST_SKIP() << "slurmd must run as root (it starts job steps as the submitting user)";
  const StopWay& way = GetParam();
  const auto started = Clock::now();

  SlurmCluster cluster;
  ASSERT_TRUE(cluster.start());

  // The operator's cluster file as cluster_configs/local-cpu.yaml has it: loopback hosts,
  // a model path relative to the file and a join token, all of which the job's copy
  // replaces; the ports are free now.
  const fs::path job = cluster.dir / "job";
  std::error_code ec;
  fs::create_directories(job, ec);
  ASSERT_FALSE(ec) << ec.message();
  fs::create_directory_symlink(testing::source_dir() + "/models/brown-gpt2", job / "model", ec);
  ASSERT_FALSE(ec) << "symlink " << (job / "model") << ": " << ec.message();
  std::vector<int> ports;
  ASSERT_TRUE(free_ports(2, ports));
  const int http_port = ports[0];
  {
    std::ofstream y(job / "cluster.yaml");
    y << "model:\n  path: model   # relative to this file\n  name: brown-gpt2\n"
      << "http:\n  host: 127.0.0.1\n  port: " << ports[0] << "\n"
      << "control:\n  host: 127.0.0.1\n  port: " << ports[1] << "\n  join_token: local-demo-token\n"
      << "pipeline:\n  stages: 3\n  replicas: 1\n";
    ASSERT_TRUE(y.good()) << "cannot write " << (job / "cluster.yaml");
  }

  // Three CPU workers on this node (one CPU thread each: the machine may have two cores);
  // no CONVEYOR_JOIN_TOKEN, so the script makes one.
  const fs::path job_out = job / "job.out";
  const Output submitted = sh("cd " + quoted(job.string()) + " && env -u CONVEYOR_JOIN_TOKEN CONVEYOR_BIN=" +
                              quoted(bin_dir()) + " CONVEYOR_WORKERS_PER_NODE=3 CONVEYOR_WORKER_ARGS=" +
                              quoted("--backend cpu --kv-cache-mb 64") +
                              " CONVEYOR_CPU_THREADS=1 CONVEYOR_STOP_TIMEOUT=10 sbatch --parsable --job-name=conveyor-test"
                              " --time=5 --output=" + quoted(job_out.string()) + " " + quoted(script_path()) +
                              " cluster.yaml 2>&1");
  ASSERT_EQ(submitted.rc, 0) << "sbatch: " << submitted.text;
  const std::string job_id = trimmed(submitted.text.substr(0, submitted.text.find(';')));
  ASSERT_FALSE(job_id.empty()) << submitted.text;
  ASSERT_EQ(job_id.find_first_not_of("0123456789"), std::string::npos) << "sbatch printed: " << submitted.text;

  // Bounded wait for the pipeline; the job must stay alive meanwhile.
  bool healthy = false;
  std::string state;
  for (const auto deadline = Clock::now() + seconds(90); !healthy && Clock::now() < deadline;) {
    HttpRequest h;
    h.target = "/health";
    h.timeout = milliseconds(2000);
    const auto r = http_call("127.0.0.1", http_port, h);
    healthy = r.ok() && r->status == 200;
    if (healthy) break;
    state = job_field(job_id, "JobState");
    if (state != "PENDING" && state != "CONFIGURING" && state != "RUNNING") break;
    std::this_thread::sleep_for(milliseconds(250));
  }
  ASSERT_TRUE(healthy) << "no ok /health within 90 s; job " << job_id << " is " << state << "; its output:\n"
                       << read_text(job_out) << cluster.logs();

  HttpRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json{{"model", "brown-gpt2"}, {"prompt", "The jury said"}, {"max_tokens", 4}, {"temperature", 0}}.dump();
  req.timeout = milliseconds(20000);
  const auto resp = http_call("127.0.0.1", http_port, req);
  ASSERT_TRUE(resp.ok()) << resp.error();
  ASSERT_EQ(resp->status, 200) << resp->body;
  const json body = json::parse(resp->body, nullptr, false);
  ASSERT_FALSE(body.is_discarded()) << resp->body;
  ASSERT_TRUE(body.contains("choices") && body["choices"].is_array() && !body["choices"].empty()) << resp->body;
  ASSERT_TRUE(body["choices"][0]["text"].is_string()) << resp->body;
  EXPECT_FALSE(body["choices"][0]["text"].get<std::string>().empty()) << resp->body;

  // The job says where the REST endpoint is: the first node, as Slurm addresses it.
  EXPECT_NE(read_text(job_out).find("REST endpoint: http://" + cluster.node + ":" + std::to_string(http_port)),
            std::string::npos)
      << read_text(job_out);

  // Stop: the job ends and nothing of it is left.
  const Output stop = sh(std::string(way.command) + " " + job_id + " 2>&1");
  ASSERT_EQ(stop.rc, 0) << way.command << ": " << stop.text;
  const std::vector<std::string> of_the_job = {cluster.marker(), "SLURM_JOB_ID=" + job_id};
  std::vector<Proc> left;
  for (const auto deadline = Clock::now() + seconds(30); Clock::now() < deadline;) {
    state = job_field(job_id, "JobState");
    left = processes_with_env(of_the_job);
    if (state == way.final_state && left.empty()) break;
    std::this_thread::sleep_for(milliseconds(200));
  }
  const std::string out = read_text(job_out);
  EXPECT_EQ(state, way.final_state) << out;
  bool conveyor_left = false;
  for (const auto& p : left) {
    const std::string exe = fs::path(p.exe).filename().string();
    conveyor_left = conveyor_left || exe == "conveyor-coordinator" || exe == "conveyor-worker";
  }
  EXPECT_FALSE(conveyor_left) << "a coordinator or worker outlived the job:" << describe(left);
  EXPECT_TRUE(left.empty()) << "left of the job:" << describe(left);
  EXPECT_NE(out.find("conveyor.sbatch: SIGTERM: stopping"), std::string::npos) << out;
  if (way.script_stops_all) {
    for (const char* line : {"conveyor.sbatch: stopping the workers", "conveyor.sbatch: stopping the coordinator",
                             "conveyor.sbatch: stopped"})
      EXPECT_NE(out.find(line), std::string::npos) << "no '" << line << "' in the job's output:\n" << out;
    EXPECT_EQ(out.find("did not stop"), std::string::npos) << out;
    EXPECT_EQ(job_field(job_id, "ExitCode"), "0:0") << out;
  }
  std::printf("test_slurm: cluster up, job served and stopped (%s) in %.1f s\n", way.name,
              std::chrono::duration<double>(Clock::now() - started).count());
}

INSTANTIATE_TEST_SUITE_P(StopWays, SlurmJob, ::testing::ValuesIn(kStopWays),
                         [](const ::testing::TestParamInfo<StopWay>& info) { return std::string(info.param.name); });

// ---- several nodes --------------------------------------------------------------------

// `sbatch -N 3` on three Slurm nodes, each a network namespace of its own with its own
// address (one slurmd per namespace, slurmctld in the root namespace): the coordinator on
// the first node, two workers on every node (one step per node), each worker bound to its
// node's address. The job serves; `scancel` of one node's step takes that node's workers
// away and spares on the other nodes take their stages; the job goes on serving the same
// answers; scancel of the job leaves nothing.
TEST(SlurmNodes, ThreeNodesServeAndSurviveScancelOfOneNodesStep) {
  for (const char* prog : {"munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol"})
    if (find_program(prog).empty())
      GTEST_SKIP() << prog << " is not installed: scripts/setup.sh installs Slurm and munge (slurmctld slurmd slurm-client munge)";
  if (const std::string why = netns_test::netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (find_program("nsenter").empty()) GTEST_SKIP() << "nsenter (util-linux) is not installed";
  const auto started = Clock::now();

  const fs::path topo_dir = fs::temp_directory_path() / ("conveyor-slurm-nodes-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(topo_dir, ec);
  fs::create_directories(topo_dir, ec);
  ASSERT_FALSE(ec) << ec.message();
  netns_test::Topology topo;  // declared first: torn down after the Slurm cluster
  ASSERT_TRUE(topo.create(topo_dir, {"node1", "node2", "node3"}));
  SlurmCluster cluster;
  cluster.ns_nodes = topo.nodes();
  cluster.controller_address = topo.host_address();
  cluster.own_children = {topo.relay_pid()};
  ASSERT_TRUE(cluster.start());

  const fs::path job = cluster.dir / "job";
  fs::create_directories(job, ec);
  ASSERT_FALSE(ec) << ec.message();
  fs::create_directory_symlink(testing::source_dir() + "/models/brown-gpt2", job / "model", ec);
  ASSERT_FALSE(ec) << ec.message();
  {
    // The operator's file: loopback hosts, which the job's flags replace; each node has its
    // own ports, so fixed ones do.
    std::ofstream y(job / "cluster.yaml");
    y << "model:\n  path: model\n  name: brown-gpt2\n"
      << "http:\n  host: 127.0.0.1\n  port: 8000\n"
      << "control:\n  host: 127.0.0.1\n  port: 5555\n  join_token: local-demo-token\n"
      << "pipeline:\n  stages: 3\n"
      << "heartbeat:\n  interval_ms: 200\n  liveness_ms: 2000\n";
    ASSERT_TRUE(y.good());
  }
  const std::string first = topo.node("node1").address;
  const fs::path job_out = job / "job.out";
  const Output submitted = sh("cd " + quoted(job.string()) + " && env -u CONVEYOR_JOIN_TOKEN CONVEYOR_BIN=" +
                              quoted(bin_dir()) + " CONVEYOR_WORKERS_PER_NODE=2 CONVEYOR_WORKER_ARGS=" +
                              quoted("--backend cpu --kv-cache-mb 64") +
                              " CONVEYOR_CPU_THREADS=1 CONVEYOR_STOP_TIMEOUT=10 sbatch -N 3 --parsable"
                              " --job-name=conveyor-test --time=5 --output=" + quoted(job_out.string()) + " " +
                              quoted(script_path()) + " cluster.yaml 2>&1");
  ASSERT_EQ(submitted.rc, 0) << "sbatch: " << submitted.text;
  const std::string job_id = trimmed(submitted.text.substr(0, submitted.text.find(';')));
  ASSERT_EQ(job_id.find_first_not_of("0123456789"), std::string::npos) << "sbatch printed: " << submitted.text;

  auto call = [&](const std::string& method, const std::string& target, const std::string& body) {
    HttpRequest r;
    r.method = method;
    r.target = target;
    r.body = body;
    if (!body.empty()) r.headers = {{"Content-Type", "application/json"}};
    r.timeout = milliseconds(30000);
    return http_call(first, 8000, r);
  };
  auto cluster_info = [&] {
    auto r = call("GET", "/v1/cluster", "");
    return r && r->status == 200 ? json::parse(r->body, nullptr, false) : json();
  };
  auto count = [](const json& info, const std::function<bool(const json&)>& pred) {
    int n = 0;
    if (info.is_object())
      for (const auto& w : info["workers"]) n += pred(w);
    return n;
  };
  auto state_is = [](const json& w, std::initializer_list<const char*> states) {
    const std::string s = w.value("state", "");
    return std::any_of(states.begin(), states.end(), [&](const char* x) { return s == x; });
  };

  // Serving: three stages ready, six workers on three nodes, each at its node's address.
  json info;
  std::string state;
  for (const auto deadline = Clock::now() + seconds(120); Clock::now() < deadline;) {
    auto h = call("GET", "/health", "");
    info = cluster_info();
    if (h && h->status == 200 && count(info, [](const json&) { return true; }) == 6) break;
    state = job_field(job_id, "JobState");
    if (state != "PENDING" && state != "CONFIGURING" && state != "RUNNING") break;
    std::this_thread::sleep_for(milliseconds(250));
  }
  ASSERT_EQ(count(info, [](const json&) { return true; }), 6)
      << "job " << job_id << " is " << state << "; /v1/cluster: " << info.dump() << "\n" << read_text(job_out) << cluster.logs();
  for (const auto& n : topo.nodes())
    EXPECT_EQ(count(info, [&](const json& w) { return w.value("host", "") == n.address; }), 2)
        << n.name << " " << n.address << ": " << info.dump();
  EXPECT_NE(read_text(job_out).find("REST endpoint: http://" + first + ":8000"), std::string::npos) << read_text(job_out);

  const std::string request =
      json{{"model", "brown-gpt2"}, {"prompt", "The jury said"}, {"max_tokens", 6}, {"temperature", 0}}.dump();
  auto resp = call("POST", "/v1/completions", request);
  ASSERT_TRUE(resp.ok()) << resp.error();
  ASSERT_EQ(resp->status, 200) << resp->body;
  const std::string answer = json::parse(resp->body)["choices"][0]["text"];

  // scancel of node2's step: its two workers go; the job and the pipeline go on.
  std::string step;
  const Output steps = sh("squeue -h -s -j " + job_id + " -o '%i %N' 2>&1", seconds(10));
  std::istringstream lines(steps.text);
  for (std::string id, nodes; lines >> id >> nodes;)
    if (nodes == "node2" && id.find(".batch") == std::string::npos) step = id;
  ASSERT_FALSE(step.empty()) << "no step of job " << job_id << " on node2: " << steps.text;
  const auto cancelled = Clock::now();
  const Output scancel_step = sh("scancel " + step + " 2>&1");
  ASSERT_EQ(scancel_step.rc, 0) << scancel_step.text;
  const std::string node2 = topo.node("node2").address;
  bool repaired = false;
  for (const auto deadline = Clock::now() + seconds(60); !repaired && Clock::now() < deadline;) {
    auto h = call("GET", "/health", "");
    info = cluster_info();
    repaired = h && h->status == 200 &&
               count(info, [&](const json& w) { return w.value("host", "") == node2 && state_is(w, {"ready", "loading", "spare"}); }) == 0 &&
               count(info, [&](const json& w) { return state_is(w, {"ready"}); }) == 3;
    if (!repaired) std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(repaired) << "/v1/cluster: " << info.dump() << "\n" << read_text(job_out);
  const double repair_s = std::chrono::duration<double>(Clock::now() - cancelled).count();
  resp = call("POST", "/v1/completions", request);
  ASSERT_TRUE(resp.ok()) << resp.error();
  ASSERT_EQ(resp->status, 200) << resp->body;
  EXPECT_EQ(json::parse(resp->body)["choices"][0]["text"], answer);
  EXPECT_EQ(job_field(job_id, "JobState"), "RUNNING") << read_text(job_out);
  for (const auto until = Clock::now() + seconds(10);
       read_text(job_out).find("the workers' step on node2 ended") == std::string::npos && Clock::now() < until;)
    std::this_thread::sleep_for(milliseconds(100));
  EXPECT_NE(read_text(job_out).find("the workers' step on node2 ended"), std::string::npos) << read_text(job_out);

  // scancel of the job: it ends and nothing of it is left.
  const Output stop = sh("scancel " + job_id + " 2>&1");
  ASSERT_EQ(stop.rc, 0) << stop.text;
  const std::vector<std::string> of_the_job = {cluster.marker(), "SLURM_JOB_ID=" + job_id};
  std::vector<Proc> left;
  for (const auto deadline = Clock::now() + seconds(30); Clock::now() < deadline;) {
    state = job_field(job_id, "JobState");
    left = processes_with_env(of_the_job);
    if (state == "CANCELLED" && left.empty()) break;
    std::this_thread::sleep_for(milliseconds(200));
  }
  EXPECT_EQ(state, "CANCELLED") << read_text(job_out);
  EXPECT_TRUE(left.empty()) << "left of the job:" << describe(left);
  std::printf("test_slurm: 3 nodes served; scancel of node2's step repaired in %.1f s; whole test %.1f s\n", repair_s,
              std::chrono::duration<double>(Clock::now() - started).count());
  if (!::testing::Test::HasFailure()) fs::remove_all(topo_dir, ec);
}

// ---- without Slurm ------------------------------------------------------------------------

}  // namespace
}  // namespace conveyor

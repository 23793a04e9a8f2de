// A cluster whose processes run on nodes of their own (tests/netns/netns_harness.h): a
// coordinator on node "coord", workers on nodes n1..nN, each bound to its node's address, as
// an operator would start them. Used by the namespace fault tests and conveyor-bench-soak.
#pragma once

#include <algorithm>
#include <functional>
#include <regex>

#include "tests/cluster/cluster_harness.h"
#include "tests/netns/netns_harness.h"

namespace conveyor::netns_test {

using cluster_test::bin;
using cluster_test::ChildProcess;
using cluster_test::Cluster;
using cluster_test::json;
using cluster_test::model_dir;
using cluster_test::temp_dir;

// A coordinator on node "coord" and workers n1..n4 on theirs, started as an operator would:
// the cluster file names the coordinator node's address, each worker its own.
struct NetnsCluster {
  static constexpr int kLivenessMs = 3000;
  static constexpr int kHeartbeatMs = 200;
  static constexpr int kControlPort = 5555;  // every node has its own ports: an operator's fixed ones
  static constexpr int kHttpPort = 8000;

  Topology topo;
  Cluster cluster;  // the processes and the REST client; destroyed before the topology

  // `n_nodes` worker nodes n1..n<n_nodes> (at least `n_workers`; the others stay free for
  // workers started later), a worker on each of the first `n_workers`.
  ::testing::AssertionResult start(const std::string& tag, int stages, int n_workers, int n_nodes = 0) {
    cluster.dir = temp_dir("netns-" + tag);
    std::vector<std::string> names = {"coord"};
    for (int i = 1; i <= std::max(n_nodes, n_workers); ++i) names.push_back("n" + std::to_string(i));
    if (auto r = topo.create(cluster.dir, names); !r) return r;
    const auto& coord = topo.node("coord");
    stages_ = stages;
    if (auto r = start_coordinator(coord, coord.address, stages, heartbeat_yaml()); !r) return r;
    for (int i = 1; i <= n_workers; ++i) start_worker("n" + std::to_string(i));
    return cluster.wait_until([&](const json& info) { return ready_workers(info) == stages * cluster.replicas; },
                              seconds(60));
  }

  // A new coordinator on node "coord" with the same cluster file (the one before must be
  // gone); the workers find it by themselves.
  ::testing::AssertionResult restart_coordinator() {
    const auto& coord = topo.node("coord");
    return start_coordinator(coord, coord.address, stages_, heartbeat_yaml(), "coordinator-restarted.log");
  }

  // One node running everything as `conveyor local` does: the control plane on 127.0.0.1
  // (REST on the node's address, for the test's clients), workers given no --host, so their
  // data plane follows their route to the coordinator. `before` runs first, given the
  // node's namespace.
  ::testing::AssertionResult start_local(const std::string& tag, int stages,
                                         const std::function<::testing::AssertionResult(const std::string&)>& before) {
    cluster.dir = temp_dir("netns-" + tag);
    if (auto r = topo.create(cluster.dir, {"local"}); !r) return r;
    const auto& node = topo.node("local");
    if (auto r = before(node.netns); !r) return r;
    if (auto r = start_coordinator(node, "127.0.0.1", stages, ""); !r) return r;
    for (int i = 1; i <= stages; ++i)
      cluster.workers.push_back(std::make_unique<ChildProcess>(
          std::vector<std::string>{find_program("ip"), "netns", "exec", node.netns, bin("conveyor-worker"),
                                   "--coordinator", "127.0.0.1:" + std::to_string(kControlPort), "--name",
                                   "w" + std::to_string(i), "--join-token", cluster.token, "--kv-cache-mb", "64",
                                   "--backend", "cpu"},
          (cluster.dir / ("w" + std::to_string(i) + ".log")).string()));
    return cluster.wait_until([&](const json& info) { return ready_workers(info) == stages; }, seconds(60));
  }

  // The coordinator on `node`: REST on the node's address, the control plane on `control_host`.
  ::testing::AssertionResult start_coordinator(const Node& node, const std::string& control_host, int stages,
                                               const std::string& yaml_extra, const std::string& log = "coordinator.log") {
    cluster.http_host = node.address;
    cluster.http_port = kHttpPort;
    cluster.control_port = kControlPort;
    std::ofstream(cluster.dir / "cluster.yaml")
        << "model: {path: \"" << model_dir() << "\"}\n"
        << "http: {host: " << node.address << ", port: " << kHttpPort << "}\n"
        << "control: {host: " << control_host << ", port: " << kControlPort << ", join_token: " << cluster.token << "}\n"
        << "pipeline: {stages: " << stages << ", replicas: " << cluster.replicas << "}\n"
        << yaml_extra;
    cluster.coordinator = std::make_unique<ChildProcess>(
        std::vector<std::string>{find_program("ip"), "netns", "exec", node.netns, bin("conveyor-coordinator"),
                                 "--config", (cluster.dir / "cluster.yaml").string()},
        (cluster.dir / log).string());
    const std::string line = cluster.coordinator->read_line_matching("listening on", std::chrono::seconds(30));
    const std::string want = "listening on http://" + node.address + ":" + std::to_string(kHttpPort) + " (control tcp://" +
                             control_host + ":" + std::to_string(kControlPort) + ")";
    if (line.find(want) == std::string::npos)
      return ::testing::AssertionFailure() << "coordinator did not start (want '" << want << "', got '" << line
                                           << "'): " << Cluster::read(cluster.dir / log);
    return ::testing::AssertionSuccess();
  }

  // A worker named `name` (default: the node's name) on `node`.
  ChildProcess& start_worker(const std::string& node, std::string name = "") {
    const auto& n = topo.node(node);
    if (name.empty()) name = node;
    cluster.workers.push_back(std::make_unique<ChildProcess>(
        std::vector<std::string>{find_program("ip"), "netns", "exec", n.netns, bin("conveyor-worker"),
                                 "--coordinator", topo.node("coord").address + ":" + std::to_string(kControlPort),
                                 "--host", n.address, "--name", name, "--join-token", cluster.token, "--kv-cache-mb",
                                 "64", "--backend", "cpu", "--coordinator-liveness-ms", std::to_string(kLivenessMs)},
        (cluster.dir / (name + ".log")).string()));
    return *cluster.workers.back();
  }

  static int ready_workers(const json& info) {
    int n = 0;
    for (const auto& w : info["workers"]) n += w.value("state", "") == "ready";
    return n;
  }
  static const json* worker(const json& info, const std::string& name) {
    for (const auto& w : info["workers"])
      if (w.value("name", "") == name) return &w;
    return nullptr;
  }
  // The worker serving `stage` of pipeline 0.
  std::string serving(int stage) {
    const json info = cluster.info();
    for (const auto& w : info["workers"])
      if (w.value("state", "") == "ready" && w.value("pipeline", -1) == 0 && w.value("stage", -1) == stage)
        return w.value("name", "");
    return "";
  }
  static std::string heartbeat_yaml() {
    return "heartbeat: {interval_ms: " + std::to_string(kHeartbeatMs) + ", liveness_ms: " + std::to_string(kLivenessMs) +
           "}\n";
  }
  int64_t epoch() {
    const json info = cluster.info();
    return info.is_object() ? info["pipelines"][0].value("epoch", int64_t(-1)) : -1;
  }
  // The workers the coordinator declared dead for their silence, in order.
  std::vector<std::string> silent_deaths() {
    std::vector<std::string> out;
    std::istringstream in(Cluster::read(cluster.dir / "coordinator.log"));
    const std::regex re("loses (\\S+): missed heartbeats");
    std::smatch m;
    for (std::string line; std::getline(in, line);)
      if (std::regex_search(line, m, re)) out.push_back(m[1]);
    return out;
  }
  // Lines of every worker log that say a stale micro-batch was dropped.
  int stale_drops() {
    int n = 0;
    for (const auto& node : topo.nodes()) {
      std::istringstream in(Cluster::read(cluster.dir / (node.name + ".log")));
      for (std::string line; std::getline(in, line);) n += line.find("dropped a stale micro-batch") != std::string::npos;
    }
    return n;
  }

 private:
  int stages_ = 0;
};

}  // namespace conveyor::netns_test

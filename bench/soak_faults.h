// conveyor-bench-soak's faults: on a cluster of real processes (tests/cluster/cluster_harness.h),
// one fault at a time, chosen by a seeded generator, then the cluster brought back to its plan:
//
//   kill     SIGKILL to a serving worker; a fresh worker joins as the next spare
//   stop     SIGSTOP to a serving worker for 0.2 to 4 s (past the 2 s liveness window it is
//            replaced and comes back as a spare, fenced), then SIGCONT
//   drain    the admin API drains a serving worker (a spare takes its stage); the drained
//            worker is then sent SIGTERM and a fresh one joins
//   replan   the admin API re-plans to another shape (stages x replicas), and back
//   reset    the coordinator's TCP connections to a serving worker are reset (`ss -K`; only
//            with CONVEYOR_DATA_SHM=0, as the daemons of one host otherwise move micro-batches
//            over shared memory, which has no connection to reset)
//   restart  the coordinator is SIGKILLed and started again on its ports; the workers find
//            it, its clients lose their connections (and send their requests again)
//
// and where the processes run on nodes of their own (network namespaces, tests/netns/):
//
//   cut        a serving worker's link goes down for 0.5 to 6 s (past the 3 s liveness
//              window it is replaced and comes back as a spare), then up again
//   partition  a serving worker's node stops seeing the coordinator, or one other worker's
//              node, for 0.5 to 6 s, then sees it again
//
// (`reset` is loopback's: `ss` sees no other namespace's sockets.)
//
// Header-only: one program includes it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/options.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/connection_reset.h"
#include "tests/netns/netns_cluster.h"

namespace conveyor::soak {

using cluster_test::Cluster;
using cluster_test::json;
using Clock = std::chrono::steady_clock;

// What the load and the faults share.
struct SoakState {
  Clock::time_point t0 = Clock::now();
  std::atomic<bool> stop{false};
  std::atomic<int> restart_generation{0};  // bumped just before the coordinator is killed
  std::atomic<bool> coordinator_down{false};
  std::mutex mu;
  std::vector<std::pair<double, std::string>> faults;  // (seconds since t0, kind), in order
  double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
};

class FaultInjector {
 public:
  // `netns`: the processes run on nodes of their own (null: on loopback, in `cluster`).
  FaultInjector(Cluster& cluster, netns_test::NetnsCluster* netns, uint64_t seed, SoakState& state, int stages,
                int replicas)
      : c_(cluster), netns_(netns), rng_(seed), s_(state), stages_(stages), replicas_(replicas) {
    // The daemons inherit this process's environment, and read CONVEYOR_DATA_SHM as it does.
    has_ss_ = !netns_ && !process_options().data_shared_memory && std::system("ss -V >/dev/null 2>&1") == 0;
    for (size_t i = 0; i < c_.workers.size(); ++i) {
      names_.push_back(netns_ ? "n" + std::to_string(i + 1) : "w" + std::to_string(i));
      nodes_.push_back(netns_ ? names_.back() : "");
      ended_.push_back(false);
    }
  }

  // Applies one fault chosen at random and waits (up to 120 s) for the cluster to serve its
  // plan again; returns a line saying what it did.
  std::string strike() {
    reap_crashes();
    const std::string kind = pick_kind();
    {
      std::lock_guard lk(s_.mu);
      s_.faults.emplace_back(s_.now(), kind);
    }
    const std::string what = apply(kind);
    ++counts[kind];
    if (!back_to_plan(std::chrono::seconds(120))) {
      ++not_recovered;
      return what + "; NOT back to " + std::to_string(stages_) + " x " + std::to_string(replicas_) +
             " within 120 s: " + c_.info().dump().substr(0, 2000);
    }
    return what;
  }

  std::map<std::string, int> counts;  // faults applied, by kind
  int not_recovered = 0;              // faults after which the plan did not come back
  int replans_refused = 0;
  std::vector<std::string> crashes;  // workers that ended unasked: name, exit status, what their log says

  // Workers that ended although no fault ended them (a crash): noted and replaced by a fresh
  // worker, so that the soak goes on with its capacity.
  void reap_crashes() {
    for (size_t i = 0; i < names_.size(); ++i) {
      if (ended_[i] || c_.workers[i]->running()) continue;
      ended_[i] = true;
      const auto code = c_.workers[i]->wait_exit(std::chrono::milliseconds(0));
      std::string said, last;  // UCX's "Caught signal" line where there is one, else the last line
      std::istringstream log(Cluster::read(c_.dir / (names_[i] + ".log")));
      for (std::string line; std::getline(log, line);) {
        if (said.empty() && line.find("Caught signal") != std::string::npos) said = line;
        if (!line.empty()) last = line;
      }
      if (said.empty()) said = last;
      crashes.push_back(names_[i] + " at " + std::to_string(int(s_.now())) + " s (exit " +
                        (code ? std::to_string(*code) : std::string("?")) + "): " + said.substr(0, 200));
      std::printf("soak: %7.1f s  CRASH: %s; %s\n", s_.now(), crashes.back().c_str(), add_spare().c_str());
      std::fflush(stdout);
    }
  }

 private:
  // A kind of fault, by weight, among those this cluster can take.
  std::string pick_kind() {
    static const std::vector<std::pair<std::string, int>> kinds = {
        {"kill", 3}, {"stop", 3}, {"drain", 2}, {"replan", 2}, {"reset", 2}, {"restart", 1}, {"cut", 3}, {"partition", 3}};
    auto can = [&](const std::string& k) { return k == "reset" ? has_ss_ : (k == "cut" || k == "partition") ? !!netns_ : true; };
    int total = 0;
    for (const auto& [k, w] : kinds) total += can(k) ? w : 0;
    int pick = int(rng_() % uint64_t(total));
    for (const auto& [k, w] : kinds)
      if (can(k) && (pick -= w) < 0) return k;
    return "kill";
  }

  std::string apply(const std::string& kind) {
    if (kind == "cut") return cut();
    if (kind == "partition") return partition();
    if (kind == "kill") return kill();
    if (kind == "stop") return stop();
    if (kind == "drain") return drain();
    if (kind == "replan") return replan();
    if (kind == "reset") return reset();
    return restart();
  }

  // A ready worker serving a stage, by name ("" when none).
  std::string victim() {
    std::vector<std::string> names;
    const json info = c_.info();
    if (!info.is_object()) return "";
    for (const auto& w : info["workers"])
      if (w.value("state", std::string()) == "ready" && w.value("stage", -1) >= 0) names.push_back(w["name"]);
    return names.empty() ? "" : names[rng_() % names.size()];
  }
  int index(const std::string& name) const {
    for (size_t i = 0; i < names_.size(); ++i)
      if (names_[i] == name) return int(i);
    return -1;
  }
  cluster_test::ChildProcess* process(const std::string& name) {
    const int i = index(name);
    return i < 0 ? nullptr : c_.workers[size_t(i)].get();
  }
  // A fresh worker, "w<N>": on loopback, or on a node no running worker is on.
  std::string add_spare() {
    const std::string name = "w" + std::to_string(c_.workers.size());
    if (!netns_) {
      c_.add_worker(name, c_.token);
      names_.push_back(name), nodes_.push_back(""), ended_.push_back(false);
      return name + " joins";
    }
    for (const auto& n : netns_->topo.nodes()) {
      bool taken = n.name == "coord";
      for (size_t i = 0; i < nodes_.size() && !taken; ++i) taken = nodes_[i] == n.name && c_.workers[i]->running();
      if (taken) continue;
      netns_->start_worker(n.name, name);
      names_.push_back(name), nodes_.push_back(n.name), ended_.push_back(false);
      return name + " joins on " + n.name;
    }
    return "no free node for a fresh worker";
  }

  std::string kill() {
    const std::string v = victim();
    if (v.empty() || !process(v)) return "kill: no serving worker";
    ended_[size_t(index(v))] = true;
    process(v)->signal(SIGKILL);
    process(v)->wait_exit(std::chrono::seconds(5));
    return "kill: SIGKILL to " + v + ", " + add_spare();
  }

  std::string stop() {
    const std::string v = victim();
    if (v.empty() || !process(v)) return "stop: no serving worker";
    const int ms = 200 + int(rng_() % 3800);
    process(v)->signal(SIGSTOP);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    process(v)->signal(SIGCONT);
    return "stop: SIGSTOP to " + v + " for " + std::to_string(ms) + " ms, then SIGCONT";
  }

  std::string drain() {
    const std::string v = victim();
    if (v.empty() || !process(v)) return "drain: no serving worker";
    auto r = c_.post("/v1/cluster/workers/" + v + "/drain", json::object());
    if (!r || r->status != 200) return "drain: " + v + " refused: " + (r ? r->body : r.error());
    // Drained: it serves nothing; let it go and let a fresh worker take its place.
    ended_[size_t(index(v))] = true;
    process(v)->signal(SIGTERM);
    const auto code = process(v)->wait_exit(std::chrono::seconds(20));
    const std::string joined = add_spare();
    std::string said = r->body.substr(0, 160);
    said.erase(std::remove(said.begin(), said.end(), '\n'), said.end());
    return "drain: " + v + " (" + said + "), then SIGTERM (exit " +
           (code ? std::to_string(*code) : std::string("none")) + "), " + joined;
  }

  // POST /v1/cluster/plan; true when it was taken (the cluster then moves to it).
  bool plan(int stages, int replicas, std::string& why) {
    auto r = c_.post("/v1/cluster/plan", {{"stages", stages}, {"replicas", replicas}});
    if (r && r->status == 200) return true;
    why = r ? "HTTP " + std::to_string(r->status) + " " + r->body.substr(0, 200) : r.error();
    return false;
  }

  std::string replan() {
    static const std::vector<std::pair<int, int>> shapes = {{2, 2}, {3, 1}, {2, 3}, {1, 2}, {2, 1}};
    const auto [st, rep] = shapes[rng_() % shapes.size()];
    std::string why;
    const std::string shape = std::to_string(st) + " x " + std::to_string(rep);
    if (!plan(st, rep, why)) {
      ++replans_refused;
      return "replan: to " + shape + " refused: " + why;
    }
    const bool there = c_.wait_until(
        [&](const json& i) { return i["plan"]["stages"] == st && i["plan"]["replicas"] == rep && all_ready(i); },
        std::chrono::seconds(60));
    std::this_thread::sleep_for(std::chrono::milliseconds(500 + rng_() % 2500));  // serve a while in that shape
    if (!plan(stages_, replicas_, why)) return "replan: to " + shape + ", back refused: " + why;
    return "replan: to " + shape + (there ? "" : " (not ready within 60 s)") + ", and back";
  }

  std::string reset() {
    const std::string v = victim();
    if (v.empty() || !process(v)) return "reset: no serving worker";
    const int n = cluster_test::reset_connections(c_.coordinator->pid(), process(v)->pid(), c_.control_port);
    return "reset: " + std::to_string(n) + " connection(s) between the coordinator and " + v;
  }

  // The victim's node (netns only), "" when none serves.
  std::string victim_node(std::string& v) {
    v = victim();
    const int i = index(v);
    return i < 0 ? "" : nodes_[size_t(i)];
  }

  std::string cut() {
    std::string v;
    const std::string node = victim_node(v);
    if (node.empty()) return "cut: no serving worker";
    const int ms = 500 + int(rng_() % 5500);
    const auto down = netns_->topo.cut(node);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    const auto up = netns_->topo.restore(node);
    return "cut: " + v + "'s link (" + node + ") down for " + std::to_string(ms) + " ms" +
           (down && up ? "" : ": FAILED " + std::string(down ? up.message() : down.message()));
  }

  std::string partition() {
    std::string v;
    const std::string node = victim_node(v);
    if (node.empty()) return "partition: no serving worker";
    std::string other = "coord";
    if (rng_() % 2) {  // another worker's node instead of the coordinator's
      const std::string w = victim();
      if (index(w) >= 0 && nodes_[size_t(index(w))] != node) other = nodes_[size_t(index(w))];
    }
    const int ms = 500 + int(rng_() % 5500);
    netns_test::LinkShape hide;
    hide.blocked = {netns_->topo.node(other).address};
    const auto cut = netns_->topo.shape(node, hide);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    const auto healed = netns_->topo.shape(node, {});
    return "partition: " + v + " (" + node + ") and " + other + " apart for " + std::to_string(ms) + " ms" +
           (cut && healed ? "" : ": FAILED " + std::string(cut ? healed.message() : cut.message()));
  }

  std::string restart() {
    {
      std::lock_guard lk(s_.mu);  // clients see the generation change before their connection breaks
      s_.coordinator_down = true;
      ++s_.restart_generation;
    }
    batch_timeout_replays_before += batch_timeout_replays();
    c_.coordinator->signal(SIGKILL);
    c_.coordinator->wait_exit(std::chrono::seconds(10));
    const auto started = netns_ ? netns_->restart_coordinator() : c_.restart_coordinator();
    s_.coordinator_down = false;
    return std::string("restart: SIGKILL to the coordinator, started again") + (started ? "" : ": FAILED " + std::string(started.message()));
  }

 public:
  // conveyor_batch_timeout_replays_total of the coordinator now (0 when it does not answer).
  double batch_timeout_replays() {
    auto m = c_.get("/metrics");
    const double v = m && m->status == 200 ? cluster_test::metric(m->body, "conveyor_batch_timeout_replays_total") : 0;
    return std::isnan(v) ? 0 : v;
  }
  double batch_timeout_replays_before = 0;  // of the coordinators killed so far

  static bool all_ready(const json& info) {
    for (const auto& p : info["pipelines"])
      if (!p.value("ready", false)) return false;
    return !info["pipelines"].empty();
  }
  bool back_to_plan(std::chrono::seconds limit) {
    return c_.wait_until(
        [&](const json& i) {
          reap_crashes();
          return i["plan"]["stages"] == stages_ && i["plan"]["replicas"] == replicas_ && all_ready(i);
        },
        limit);
  }

 private:
  Cluster& c_;
  netns_test::NetnsCluster* netns_;
  std::vector<std::string> names_, nodes_;  // of c_.workers[i]: its name, its node (netns)
  std::vector<bool> ended_;                 // and whether it ended (by a fault, or noticed as a crash)
  std::mt19937_64 rng_;
  SoakState& s_;
  int stages_, replicas_;
  bool has_ss_ = false;
};

}  // namespace conveyor::soak

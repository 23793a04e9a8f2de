// Faults beyond SIGKILL, on nodes with addresses of their own (tests/netns/netns_harness.h):
// a coordinator node and four worker nodes (a 3-stage pipeline of the demo model and one
// spare), each worker bound to its node's address (`--host`), links of 10 Gbit/s (tbf).
// Under a mixed load of concurrent requests (cluster_harness.h) each test does one thing to
// one serving node's link:
//
//   cut it for longer than the liveness window, then restore it   -> failover to the spare;
//                                                                    the node comes back as a spare
//   cut it for less than the liveness window                      -> a pause, no failover
//   200 ms of delay on it for a while                              -> slower, no failover
//   5% loss on it for a while                                      -> slower, no failover
//   hide the coordinator from it (its neighbours still reach it)   -> failover; the node comes back
//                                                                    as a spare
//   hide it from its upstream neighbour only (the data plane        -> the node is replaced by the
//   between them; both keep the coordinator)                          spare, being unreachable
//
// and checks: no request lost, every answer the engine's (the fault-free run), the
// pipeline's epoch and membership as stated, a node that comes back after it was replaced
// fenced (its micro-batches of the old epoch are dropped, it is a spare). Each test measures
// the time to recover: from the fault to the first answer of a small probe request sent
// after it, and prints one row of the table in docs/OPERATIONS.md.
#include <gtest/gtest.h>

#include <cmath>

#include "tests/cluster/cluster_harness.h"
#include "tests/netns/netns_cluster.h"
#include "tests/netns/netns_harness.h"

namespace conveyor {
namespace {

using namespace cluster_test;
using netns_test::LinkShape;
using netns_test::Topology;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

using netns_test::NetnsCluster;
constexpr int kLivenessMs = NetnsCluster::kLivenessMs;
constexpr int kControlPort = NetnsCluster::kControlPort;

// What one fault did to the load.
struct Outcome {
  int requests = 0, lost = 0, altered = 0;
  // The time to recover: the longest time, from the fault on, in which no probe was
  // answered (what a client sees as the cluster's pause).
  double recovery_s = -1;
  double worst_probe_s = 0;  // the slowest probe while the load ran
};

// Sends `n` mixed requests from 8 clients, again and again until the fault is over, plus a
// probe (a 2-token greedy request, one at a time), and runs `fault` once requests hold K/V on
// the pipeline; `fault` sets the time it struck.
Outcome run_fault(NetnsCluster& nc, uint32_t seed, int n, const std::function<void(Clock::time_point&)>& fault) {
  nc.cluster.faults_expected = true;  // cuts, loss, delay, partitions: replays are the point
  Reference ref;
  std::vector<Case> cases = make_cases(ref, n, seed);
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.stop_token_ids.push_back(0);
  const std::string probe_prompt = "The jury said";
  const Expected_ probe_expect = ref.run(ref.tokenizer.encode(probe_prompt), 2, greedy, {});

  struct Probe {
    Clock::time_point sent, done;
    bool ok;
  };
  std::mutex probes_mu;
  std::vector<Probe> probes;
  std::atomic<bool> stop_probe{false};
  std::thread probe([&] {
    while (!stop_probe) {
      Probe p{Clock::now(), {}, false};
      auto r = nc.cluster.post("/v1/completions",
                               json{{"prompt", probe_prompt}, {"max_tokens", 2}, {"temperature", 0}, {"return_token_ids", true}});
      p.done = Clock::now();
      if (r && r->status == 200) {
        const json j = json::parse(r->body, nullptr, false);
        p.ok = !j.is_discarded() && j["choices"][0]["token_ids"].get<std::vector<int32_t>>() == probe_expect.tokens;
      }
      {
        std::lock_guard lk(probes_mu);
        probes.push_back(p);
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
  });
  // The load goes on until the fault is over: it spans the whole fault.
  std::vector<std::string> failures;
  std::atomic<bool> fault_over{false};
  int passes = 0;
  std::thread load([&] {
    do {
      auto f = run_cases(nc.cluster, cases, 8);
      failures.insert(failures.end(), f.begin(), f.end());
      ++passes;
    } while (!fault_over);
  });
  // Strike once requests hold K/V on the pipeline (bounded wait).
  for (const auto until = Clock::now() + seconds(20); Clock::now() < until && !requests_running(nc.cluster.info());)
    std::this_thread::sleep_for(milliseconds(20));
  Clock::time_point struck = Clock::now();
  fault(struck);
  fault_over = true;
  load.join();
  // The probe must see the cluster answer after the fault even when the load ended first.
  auto answered_after_fault = [&] {
    std::lock_guard lk(probes_mu);
    return std::any_of(probes.begin(), probes.end(), [&](const Probe& p) { return p.sent >= struck && p.ok; });
  };
  for (const auto until = Clock::now() + seconds(60); Clock::now() < until && !answered_after_fault();)
    std::this_thread::sleep_for(milliseconds(50));
  stop_probe = true;
  probe.join();

  Outcome o;
  o.requests = passes * n + int(probes.size());
  for (const auto& f : failures) {
    ADD_FAILURE() << f;
    const bool altered = f.find("differ") != std::string::npos || f.find("finish_reason") != std::string::npos;
    (altered ? o.altered : o.lost) += 1;  // otherwise no answer, or an error
  }
  Clock::time_point last_answer = struck;  // probes run one at a time: answers come in order
  bool answered_after = false;
  for (const auto& p : probes) {
    if (!p.ok) ++o.lost, ADD_FAILURE() << "a probe request failed or differed";
    o.worst_probe_s = std::max(o.worst_probe_s, std::chrono::duration<double>(p.done - p.sent).count());
    if (p.ok && p.done >= struck) {
      o.recovery_s = std::max(o.recovery_s, std::chrono::duration<double>(p.done - last_answer).count());
      last_answer = p.done;
      answered_after = answered_after || p.sent >= struck;
    }
  }
  EXPECT_TRUE(answered_after) << "no probe sent after the fault was answered";
  return o;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

void print_row(const std::string& fault, const Outcome& o, const std::string& note) {
  std::printf("netns fault table: | %s | %d | %d | %d | %.1f s | %s |\n", fault.c_str(), o.requests, o.lost, o.altered,
              o.recovery_s, note.c_str());
  std::fflush(stdout);
}

class NetnsFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = netns_test::netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
  }
};

// The wire between nodes is real: the workers advertise their own node's address, and
// each stage reaches the next one on it.
TEST_F(NetnsFaults, WorkersAdvertiseTheirNodesAddress) {
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("addr", 3, 3));
  const json info = nc.cluster.info();
  for (int i = 1; i <= 3; ++i) {
    const json* w = NetnsCluster::worker(info, "n" + std::to_string(i));
    ASSERT_NE(w, nullptr) << info.dump();
    EXPECT_EQ(w->value("host", ""), nc.topo.node("n" + std::to_string(i)).address) << info.dump();
  }
  Outcome o = run_fault(nc, 7, 12, [](Clock::time_point&) {});
  EXPECT_EQ(o.lost + o.altered, 0);
  // Traffic went through every worker's wire, none was lost on the way.
  for (int i = 1; i <= 3; ++i) {
    auto s = nc.topo.stats("n" + std::to_string(i));
    EXPECT_GT(s["forwarded"], 100) << "n" << i;
    EXPECT_EQ(s["send_errors"], 0) << "n" << i;
  }
}

TEST_F(NetnsFaults, LinkCutLongerThanLivenessFailsOverAndTheNodeRejoinsAsSpare) {
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("cutlong", 3, 4));
  const std::string victim = nc.serving(1);
  ASSERT_FALSE(victim.empty());
  const int64_t epoch0 = nc.epoch();
  const json before = *NetnsCluster::worker(nc.cluster.info(), victim);
  double back_s = -1;
  Outcome o = run_fault(nc, 11, 24, [&](Clock::time_point& struck) {
    ASSERT_TRUE(nc.topo.cut(victim));
    struck = Clock::now();
    std::this_thread::sleep_for(milliseconds(kLivenessMs + 2000));
    ASSERT_TRUE(nc.topo.restore(victim));
    const auto restored = Clock::now();
    // Back, the same process, and a spare: not in the pipeline that replaced it.
    EXPECT_TRUE(nc.cluster.wait_until(
        [&](const json& info) {
          const json* w = NetnsCluster::worker(info, victim);
          return w && w->value("state", "") == "spare" && w->value("pid", 0) == before.value("pid", 0);
        },
        seconds(30)));
    back_s = std::chrono::duration<double>(Clock::now() - restored).count();
  });
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_GT(nc.epoch(), epoch0);
  EXPECT_NE(nc.serving(1), victim);
  // Only the node cut off was taken for dead: its upstream neighbour, re-wired away from it,
  // kept its heartbeats (it once waited for its send to the cut-off node to time out), and
  // the pause is one liveness window, not that plus a second failover.
  EXPECT_EQ(nc.silent_deaths(), std::vector<std::string>{victim});
  EXPECT_LT(o.recovery_s, kLivenessMs / 1000.0 + 1.5);
  print_row("link cut > liveness (" + std::to_string(kLivenessMs / 1000 + 2) + " s), restored", o,
            "failover to the spare; back as a spare " + seconds_text(back_s) +
                " after restore; stale micro-batches dropped: " + std::to_string(nc.stale_drops()));
}

TEST_F(NetnsFaults, LinkCutShorterThanLivenessOnlyPauses) {
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("cutshort", 3, 4));
  const std::string victim = nc.serving(1);
  ASSERT_FALSE(victim.empty());
  const int64_t epoch0 = nc.epoch();
  Outcome o = run_fault(nc, 12, 24, [&](Clock::time_point& struck) {
    ASSERT_TRUE(nc.topo.cut(victim));
    struck = Clock::now();
    std::this_thread::sleep_for(milliseconds(1000));
    ASSERT_TRUE(nc.topo.restore(victim));
  });
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_EQ(nc.epoch(), epoch0) << "a cut shorter than the liveness window must not fail the pipeline over";
  EXPECT_EQ(nc.serving(1), victim);
  print_row("link cut < liveness (1 s)", o, "pause, no failover");
}

TEST_F(NetnsFaults, Latency200msOnOneStageSlowsButKeepsServing) {
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("delay", 3, 4));
  const std::string victim = nc.serving(1);
  ASSERT_FALSE(victim.empty());
  const int64_t epoch0 = nc.epoch();
  Outcome o = run_fault(nc, 13, 24, [&](Clock::time_point& struck) {
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{.delay_ms = 200, .loss = 0, .blocked = {}}));
    struck = Clock::now();
    std::this_thread::sleep_for(milliseconds(5000));
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{}));
  });
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_EQ(nc.epoch(), epoch0);
  EXPECT_EQ(nc.serving(1), victim);
  // A micro-batch crosses the victim's wire twice (in and out), 200 ms each way.
  EXPECT_GE(o.worst_probe_s, 0.4) << "the delay did not take effect";
  print_row("200 ms latency on one stage's link (5 s)", o,
            "no failover; slowest probe " + seconds_text(o.worst_probe_s));
}

TEST_F(NetnsFaults, FivePercentLossOnOneStageKeepsServing) {
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("loss", 3, 4));
  const std::string victim = nc.serving(1);
  ASSERT_FALSE(victim.empty());
  const int64_t epoch0 = nc.epoch();
  int64_t lost_frames = 0;
  Outcome o = run_fault(nc, 14, 24, [&](Clock::time_point& struck) {
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{.delay_ms = 0, .loss = 0.05, .blocked = {}}));
    struck = Clock::now();
    std::this_thread::sleep_for(milliseconds(5000));
    lost_frames = nc.topo.stats(victim)["lost"];
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{}));
  });
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_GT(lost_frames, 0) << "the relay dropped nothing";
  EXPECT_EQ(nc.epoch(), epoch0);
  EXPECT_EQ(nc.serving(1), victim);
  print_row("5% loss on one stage's link (5 s)", o,
            "no failover; " + std::to_string(lost_frames) + " frames dropped; slowest probe " +
                seconds_text(o.worst_probe_s));
}

TEST_F(NetnsFaults, CoordinatorPartitionedFromOneNodeFailsOverAndFencesIt) {
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("partition", 3, 4));
  const std::string victim = nc.serving(1);  // a middle stage: its neighbours are workers
  ASSERT_FALSE(victim.empty());
  const int64_t epoch0 = nc.epoch();
  const json before = *NetnsCluster::worker(nc.cluster.info(), victim);
  int64_t blocked = 0, neighbour_frames = 0;
  Outcome o = run_fault(nc, 15, 24, [&](Clock::time_point& struck) {
    const int64_t forwarded0 = nc.topo.stats(victim)["forwarded"];
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{.blocked = {nc.topo.node("coord").address}}));
    struck = Clock::now();
    std::this_thread::sleep_for(milliseconds(kLivenessMs + 2000));
    auto s = nc.topo.stats(victim);
    blocked = s["blocked"];
    neighbour_frames = s["forwarded"] - forwarded0;  // none of them to or from the coordinator
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{}));
    EXPECT_TRUE(nc.cluster.wait_until(
        [&](const json& info) {
          const json* w = NetnsCluster::worker(info, victim);
          return w && w->value("state", "") == "spare" && w->value("pid", 0) == before.value("pid", 0);
        },
        seconds(30)));
  });
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_GT(blocked, 0) << "nothing was hidden from the node";
  EXPECT_GT(neighbour_frames, 0) << "the node's neighbours did not reach it during the partition";
  EXPECT_GT(nc.epoch(), epoch0);
  EXPECT_NE(nc.serving(1), victim);
  EXPECT_EQ(nc.silent_deaths(), std::vector<std::string>{victim});
  // The data plane stayed whole: requests went on through the node until the failover, so
  // clients never waited anything like the liveness window.
  EXPECT_LT(o.recovery_s, kLivenessMs / 1000.0 - 0.5);
  print_row("coordinator partitioned from one stage (" + std::to_string(kLivenessMs / 1000 + 2) + " s), healed", o,
            "failover to the spare; the node rejoins as a spare; stale micro-batches dropped: " +
                std::to_string(nc.stale_drops()));
}

// Issue 28: "a stage whose peer stays unreachable is reported and replaced like a dead one".
// The middle stage's node is hidden from its upstream neighbour's alone (the relay drops the
// frames between the two addresses), while both stay alive and in touch with the coordinator:
// no heartbeat is missed, so only the data plane can tell. Under load the upstream worker's
// send to the hidden node times out (10 s); the pipeline replays, the upstream dials the
// hidden node again, the same send fails again, and the coordinator replaces the node it
// cannot reach with the spare (its log says why). Nothing lost or altered; the two healthy
// stages keep their places (neither is taken for dead); the hidden node, never silent, is a
// spare; a bounded pause.
//
// UcxChannel's non-blocking TCP connects (UCX_TCP_CONN_NB=y): with UCX 1.13's blocking
// connect() on the channel's progress thread, a dropped SYN holds it for the kernel's SYN
// retries (about 2 minutes): the upstream worker's re-dial then stalls its data plane and its
// control thread (wire() waits 10 s for the progress thread), it misses its heartbeats and is
// the one replaced. The daemons here inherit no UCX_TCP_CONN_NB, so they take the channel's.
TEST_F(NetnsFaults, PeerUnreachableOnTheDataPlaneOnlyIsReplacedByTheSpare) {
  const testing::ScopedEnv default_connect("UCX_TCP_CONN_NB", nullptr);
  NetnsCluster nc;
  ASSERT_TRUE(nc.start("unreach", 3, 4));
  const std::string upstream = nc.serving(0), victim = nc.serving(1), downstream = nc.serving(2);
  ASSERT_FALSE(upstream.empty() || victim.empty() || downstream.empty());
  const int64_t epoch0 = nc.epoch();
  const json before = *NetnsCluster::worker(nc.cluster.info(), victim);
  double replaced_s = -1;
  int64_t blocked = 0;
  Outcome o = run_fault(nc, 17, 24, [&](Clock::time_point& struck) {
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{.blocked = {nc.topo.node(upstream).address}}));
    struck = Clock::now();
    // Replaced: another worker serves stage 1, and the hidden one is no longer dead (it kept
    // its heartbeats) but a spare, the same process.
    EXPECT_TRUE(nc.cluster.wait_until(
        [&](const json& info) {
          const json* w = NetnsCluster::worker(info, victim);
          return nc.serving(1) != victim && !nc.serving(1).empty() && w && w->value("state", "") == "spare" &&
                 w->value("pid", 0) == before.value("pid", 0);
        },
        seconds(60)));
    replaced_s = std::chrono::duration<double>(Clock::now() - struck).count();
    blocked = nc.topo.stats(victim)["blocked"];
    ASSERT_TRUE(nc.topo.shape(victim, LinkShape{}));
  });
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_GT(blocked, 0) << "nothing was hidden between the two nodes";
  EXPECT_GT(nc.epoch(), epoch0);
  EXPECT_NE(nc.serving(1), victim);
  EXPECT_EQ(nc.serving(0), upstream) << "the healthy upstream stage was replaced";
  EXPECT_EQ(nc.serving(2), downstream);
  EXPECT_EQ(nc.silent_deaths(), std::vector<std::string>{}) << "a worker missed its heartbeats";
  // Two send timeouts (10 s each: the first failure, then the same send on the new connection)
  // and the spare's wiring, with room for a loaded machine.
  EXPECT_LT(replaced_s, 40.0);
  const std::string log = Cluster::read(nc.cluster.dir / "coordinator.log");
  EXPECT_NE(log.find("loses " + victim + ": unreachable on the data plane from " + upstream), std::string::npos) << log;
  print_row("one stage hidden from its upstream neighbour's node only (data plane), healed after the replacement", o,
            "the upstream's send times out (10 s), the replay's on a new connection fails again: the hidden node is "
            "replaced by the spare " + seconds_text(replaced_s) + " after the fault and is a spare; no heartbeat missed");
}

// A bridge with a port (one end of a veth pair, both up, so it has carrier) and an address,
// in `netns`: what Docker or a VPN makes on a laptop.
::testing::AssertionResult add_stray_bridge(const std::string& netns, int round) {
  for (const auto& cmd : std::vector<std::vector<std::string>>{
           {"-n", netns, "link", "add", "stray0", "type", "bridge"},
           {"-n", netns, "link", "add", "stray0p", "type", "veth", "peer", "name", "stray0q"},
           {"-n", netns, "link", "set", "stray0p", "master", "stray0"},
           {"-n", netns, "addr", "add", "172.31." + std::to_string(round) + ".1/24", "dev", "stray0"},
           {"-n", netns, "link", "set", "stray0p", "up"},
           {"-n", netns, "link", "set", "stray0q", "up"},
           {"-n", netns, "link", "set", "stray0", "up"}})
    if (auto r = netns_test::ip(cmd); !r) return r;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult remove_stray_bridge(const std::string& netns) {
  if (auto r = netns_test::ip({"-n", netns, "link", "del", "stray0p"}); !r) return r;  // and its peer
  return netns_test::ip({"-n", netns, "link", "del", "stray0"});
}

// Issue 28: `conveyor local` on a machine where another program made and removed network
// bridges hung for good. Its workers' data plane offered every interface, UCX connected them
// over a bridge's address, and when the bridge went every replay went over the same dead
// connections. Here the cluster runs on one node as `conveyor local` runs it, its workers given
// no --host, with a bridge that has an address and carrier when they start; under load the
// bridge goes and comes back (another address) three times. The data plane stays on `lo`, the
// route to the coordinator: nothing lost or altered, no replay (the harness checks the
// coordinator's word at teardown), the same epoch throughout.
TEST_F(NetnsFaults, StrayBridgeComingAndGoingUnderLoadIsNeverUsed) {
  NetnsCluster nc;
  std::string netns;
  ASSERT_TRUE(nc.start_local("stray", 3, [&](const std::string& ns) {
    netns = ns;
    return add_stray_bridge(ns, 0);
  }));
  for (int i = 1; i <= 3; ++i) {
    const std::string log = Cluster::read(nc.cluster.dir / ("w" + std::to_string(i) + ".log"));
    EXPECT_NE(log.find("data plane on lo (route to 127.0.0.1:" + std::to_string(kControlPort) + " (address 127.0.0.1))"),
              std::string::npos)
        << log;
  }
  const int64_t epoch0 = nc.epoch();
  Outcome o = run_fault(nc, 16, 24, [&](Clock::time_point& struck) {
    struck = Clock::now();
    for (int round = 1; round <= 3; ++round) {
      ASSERT_TRUE(remove_stray_bridge(netns));
      std::this_thread::sleep_for(milliseconds(700));
      ASSERT_TRUE(add_stray_bridge(netns, round));
      std::this_thread::sleep_for(milliseconds(700));
    }
  });
  nc.cluster.faults_expected = false;  // a bridge that is not ours is no fault of the cluster's
  EXPECT_EQ(o.lost + o.altered, 0);
  EXPECT_EQ(nc.epoch(), epoch0) << "the pipeline replayed or failed over";
  print_row("a stray bridge removed and made again 3 times (conveyor local, no --host)", o,
            "no replay; the data plane stays on lo; slowest probe " + seconds_text(o.worst_probe_s));
}

}  // namespace
}  // namespace conveyor

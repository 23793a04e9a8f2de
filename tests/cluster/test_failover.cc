// Chaos on loopback: workers die by SIGKILL while 64 mixed requests are in flight (during
// prefill, mid-stream, two in a row), and every request must still complete with exactly
// the engine's tokens: no error, no duplicate, no gap in any stream. The coordinator gives
// the dead stage to a spare, bumps the pipeline's epoch and replays each sequence from its
// first token.
#include "tests/cluster/cluster_harness.h"

namespace conveyor {
namespace {

using namespace cluster_test;

// The name of a worker serving a stage, chosen by `rng`; empty when none is.
std::string serving_worker(Cluster& cluster, std::mt19937& rng) {
  auto r = cluster.get("/v1/cluster");
  if (!r || r->status != 200) {
    ADD_FAILURE() << "GET /v1/cluster: " << (r ? r->body : r.error());
    return "";
  }
  std::vector<std::string> names;
  const json info = json::parse(r->body);
  for (const auto& w : info.at("workers"))
    if (w.value("state", std::string()) == "ready" && w.value("stage", -1) >= 0) names.push_back(w.at("name").get<std::string>());
  return names.empty() ? "" : names[rng() % names.size()];
}

ChildProcess* worker_named(Cluster& cluster, const std::string& name) {
  for (size_t i = 0; i < cluster.workers.size(); ++i)
    if ("w" + std::to_string(i) == name) return cluster.workers[i].get();
  return nullptr;
}

// Runs the mixed load while `chaos` does its damage on another thread.
void run_with_chaos(Cluster& cluster, uint32_t seed, const std::function<void(std::mt19937&)>& chaos) {
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 64, seed);
  std::mt19937 rng(seed);
  std::vector<std::string> failures;
  std::thread load([&] { failures = run_cases(cluster, cases, 16); });
  chaos(rng);
  load.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_TRUE(failures.empty()) << "coordinator log:\n" << Cluster::read(cluster.dir / "coordinator.log").substr(0, 20000);
  auto health = cluster.get("/health");
  EXPECT_TRUE(health && health->status == 200) << (health ? health->body : health.error());
}

class Failover : public ::testing::TestWithParam<uint32_t> {};

// One serving worker killed at a random moment of the load; a fresh worker joins after.
TEST_P(Failover, KillOneServingWorker) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("kill1-" + std::to_string(GetParam()), 3, 4, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  run_with_chaos(cluster, GetParam(), [&](std::mt19937& rng) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 600));
    const std::string victim = serving_worker(cluster, rng);
    ASSERT_FALSE(victim.empty());
    worker_named(cluster, victim)->signal(SIGKILL);
    cluster.add_worker("w" + std::to_string(cluster.workers.size()), cluster.token);  // the next spare
  });
}

// Two serving workers killed one after the other (the second while the first's
// replacement may still be loading).
TEST_P(Failover, KillTwoInARow) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("kill2-" + std::to_string(GetParam()), 3, 5, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  run_with_chaos(cluster, GetParam() + 100, [&](std::mt19937& rng) {
    for (int k = 0; k < 2; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 400));
      const std::string victim = serving_worker(cluster, rng);
      if (victim.empty()) continue;  // the pipeline is being repaired: nothing serves yet
      worker_named(cluster, victim)->signal(SIGKILL);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Seeds, Failover, ::testing::Values(1u, 2u, 3u));

}  // namespace
}  // namespace conveyor

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

// An operator drains a serving worker under load (`conveyor drain`): a spare takes its
// stage and nothing fails; without a spare the drain is refused with 409 and nothing moves.
TEST(Drain, ServingWorkerUnderLoadLosesNothing) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("drain", 3, 4));
  std::string victim;
  run_with_chaos(cluster, 77, [&](std::mt19937& rng) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    victim = serving_worker(cluster, rng);
    ASSERT_FALSE(victim.empty());
    testing::ChildProcess cli({bin("conveyor"), "drain", victim, "--url", "http://127.0.0.1:" + std::to_string(cluster.http_port)});
    const std::string line = cli.read_line_matching("drained", std::chrono::seconds(30));
    EXPECT_NE(line.find("its stage went to"), std::string::npos) << line;
    EXPECT_EQ(cli.wait_exit(std::chrono::seconds(30)), 0);
  });
  const json info = json::parse(cluster.get("/v1/cluster")->body);
  for (const auto& w : info.at("workers"))
    if (w.at("name") == victim) EXPECT_EQ(w.at("state"), "drained");
  // No spare left: the next drain of a serving worker is refused and changes nothing.
  std::mt19937 rng(5);
  const std::string second = serving_worker(cluster, rng);
  auto r = cluster.post("/v1/cluster/workers/" + second + "/drain", json::object());
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r->status, 409) << r->body;
  EXPECT_NE(r->body.find("no spare"), std::string::npos) << r->body;
  auto unknown = cluster.post("/v1/cluster/workers/nobody/drain", json::object());
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(unknown->status, 404);
  auto health = cluster.get("/health");
  EXPECT_TRUE(health && health->status == 200);
}

}  // namespace
}  // namespace conveyor

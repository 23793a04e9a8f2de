// Live re-planning on loopback, under the mixed load whose every answer must equal the
// engine's: `conveyor plan` from 3 stages to 2 and back and from 1 replica to 2; a plan the
// workers cannot run is refused and changes nothing; a pipeline that loses a stage with no
// spare shrinks over the survivors and grows back when a worker joins; malformed plans get
// 400 with the field named.
#include "tests/cluster/cluster_harness.h"

namespace conveyor {
namespace {

using namespace cluster_test;

int stages_of(const json& info) { return info.at("plan").at("stages").get<int>(); }
int replicas_of(const json& info) { return info.at("plan").at("replicas").get<int>(); }

// Every pipeline of the plan is ready.
bool all_ready(const json& info) {
  for (const auto& p : info.at("pipelines"))
    if (!p.value("ready", false)) return false;
  return true;
}

int plan_cli(Cluster& cluster, const std::vector<std::string>& args, std::string* line = nullptr) {
  std::vector<std::string> argv = {bin("conveyor"), "plan", "--url", "http://127.0.0.1:" + std::to_string(cluster.http_port)};
  argv.insert(argv.end(), args.begin(), args.end());
  testing::ChildProcess cli(argv);
  const std::string l = cli.read_line_matching("conveyor plan", std::chrono::seconds(30));
  if (line) *line = l;
  return cli.wait_exit(std::chrono::seconds(30)).value_or(-1);
}

TEST(Replan, StagesThreeToTwoAndBackThenTwoReplicasUnderLoad) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("replan", 3, 6));
  run_load(cluster, 11, 64, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::string line;
    EXPECT_EQ(plan_cli(cluster, {"--stages", "2"}, &line), 0) << line;
    EXPECT_NE(line.find("now 2 stage(s) x 1 replica(s)"), std::string::npos) << line;
    EXPECT_TRUE(cluster.wait_until([](const json& i) { return stages_of(i) == 2 && all_ready(i); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(plan_cli(cluster, {"--stages", "3"}), 0);
    EXPECT_TRUE(cluster.wait_until([](const json& i) { return stages_of(i) == 3 && all_ready(i); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(plan_cli(cluster, {"--replicas", "2"}), 0);
    EXPECT_TRUE(cluster.wait_until([](const json& i) { return replicas_of(i) == 2 && all_ready(i); }));
  });
  // With two replicas the load is shared: both pipelines take requests.
  const json before = cluster.info();
  run_load(cluster, 12, 32, [] {});
  const json after = cluster.info();
  ASSERT_EQ(after.at("pipelines").size(), 2u) << after.dump();
  for (size_t p = 0; p < 2; ++p)
    EXPECT_GE(after["pipelines"][p]["admitted"].get<int>() - before["pipelines"][p]["admitted"].get<int>(), 8)
        << "pipeline " << p << " took too few of 32 requests: " << after.dump();
  // Explicit layer ranges; a plan the workers cannot run changes nothing.
  std::string line;
  EXPECT_EQ(plan_cli(cluster, {"--replicas", "1", "--layers", "0:1,1:5,5:6"}, &line), 0) << line;
  EXPECT_TRUE(cluster.wait_until([](const json& i) {
    return i["plan"]["layers"] == json::parse("[[0,1],[1,5],[5,6]]") && replicas_of(i) == 1 && all_ready(i);
  }));
  run_load(cluster, 13, 16, [] {});
  auto r = cluster.post("/v1/cluster/plan", {{"stages", 3}, {"replicas", 3}});
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r->status, 409) << r->body;
  EXPECT_NE(r->body.find("need 9 workers and 6 can serve"), std::string::npos) << r->body;
  EXPECT_EQ(replicas_of(cluster.info()), 1);
}

TEST(Replan, MalformedPlansAreRefusedWithTheField) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("replan-bad", 2, 2));
  struct Bad {
    json body;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {json::array(), "JSON object"},
      {json::object(), "the plan is empty"},
      {{{"stage", 2}}, "unknown field 'stage'"},
      {{{"stages", 0}}, "stages must be an integer from 1 to 6"},
      {{{"stages", 7}}, "stages must be an integer from 1 to 6"},
      {{{"stages", "two"}}, "stages must be an integer"},
      {{{"replicas", 0}}, "replicas must be an integer from 1 to 64"},
      {{{"layers", {{0, 3}, {4, 6}}}}, "contiguous"},
      {{{"layers", {{0, 3}, {3, 5}}}}, "end at 5 but the model has 6"},
      {{{"layers", {{0, 3}, {3}}}}, "[begin, end] ranges of integers"},
      {{{"stages", 3}, {"layers", {{0, 3}, {3, 6}}}}, "2 ranges for 3 stages"},
  };
  for (const Bad& b : bad) {
    auto r = cluster.post("/v1/cluster/plan", b.body);
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r->status, 400) << b.body.dump() << " -> " << r->body;
    EXPECT_NE(r->body.find(b.says), std::string::npos) << b.body.dump() << " -> " << r->body;
  }
  std::string line;
  EXPECT_EQ(plan_cli(cluster, {"--layers", "0-3"}, &line), 2);
  EXPECT_EQ(plan_cli(cluster, {"--stages", "3"}, &line), 1);  // 2 workers cannot run 3 stages
  const json info = cluster.info();
  EXPECT_EQ(stages_of(info), 2);
  EXPECT_EQ(info.at("target").at("stages"), 2);
}

// No spare: the pipeline that lost a worker is re-planned over the two survivors (their
// memory allows), and a worker that joins later brings the plan back to 3 stages.
TEST(Replan, ShrinksOverSurvivorsAndGrowsBack) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("shrink", 3, 3, "heartbeat: {interval_ms: 200, liveness_ms: 1500}\n"));
  run_load(cluster, 21, 64, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    cluster.faults_expected = true;
    cluster.workers[1]->signal(SIGKILL);
    EXPECT_TRUE(cluster.wait_until([](const json& i) { return stages_of(i) == 2 && all_ready(i); }));
  });
  EXPECT_EQ(cluster.info().at("target").at("stages"), 3);
  run_load(cluster, 22, 32, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cluster.add_worker("w3", cluster.token);
    EXPECT_TRUE(cluster.wait_until([](const json& i) { return stages_of(i) == 3 && all_ready(i); }));
  });
}

}  // namespace
}  // namespace conveyor

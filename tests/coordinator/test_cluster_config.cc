// The cluster file: the shipped examples load, relative model paths follow the file, and
// each kind of mistake is refused with the file, the line and the reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <stdlib.h>
#include <unistd.h>

#include "coordinator/cluster_config.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;

std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

TEST(ClusterConfig, ShippedExamplesLoad) {
  ::setenv("CONVEYOR_JOIN_TOKEN", "from-the-environment", 0);  // for examples that take it from there
  int n = 0;
  for (const auto& e : fs::directory_iterator(testing::source_dir() + "/cluster_configs")) {
    if (e.path().extension() != ".yaml") continue;
    ++n;
    auto cfg = load_cluster_config(e.path().string());
    ASSERT_TRUE(cfg) << cfg.error();
    EXPECT_EQ(cfg->model.n_layer, 6) << e.path();
    EXPECT_EQ(int(cfg->layers.size()), cfg->stages) << e.path();
    EXPECT_TRUE(check_layer_split(cfg->layers, cfg->stages, cfg->model.n_layer)) << e.path();
    EXPECT_GE(cfg->in_flight, cfg->stages) << e.path();
  }
  EXPECT_GE(n, 2);
}

TEST(ClusterConfig, RelativeModelPathIsRelativeToTheFile) {
  const fs::path dir = fs::temp_directory_path() / ("conveyor-cfg-" + std::to_string(::getpid()));
  fs::create_directories(dir / "sub");
  const fs::path rel = fs::relative(model_dir(), dir / "sub");
  std::ofstream(dir / "sub" / "c.yaml") << "model: {path: \"" << rel.string() << "\"}\ncontrol: {join_token: t}\n";
  auto cfg = load_cluster_config((dir / "sub" / "c.yaml").string());
  fs::remove_all(dir);
  ASSERT_TRUE(cfg) << cfg.error();
  EXPECT_EQ(cfg->model_name, "brown-gpt2");
  EXPECT_EQ(cfg->layers, (std::vector<std::pair<int64_t, int64_t>>{{0, 6}}));
}

// A cluster file of the test model and a join token, then `yaml` (its line 3 on).
auto parse(const std::string& yaml) {
  return parse_cluster_config("model: {path: \"" + model_dir() + "\"}\ncontrol: {join_token: t}\n" + yaml, "c.yaml");
}

std::string error_of(const std::string& yaml) {
  auto cfg = parse(yaml);
  return cfg ? std::string() : cfg.error();
}

TEST(ClusterConfig, MistakesNameTheLine) {
  EXPECT_NE(error_of("pipeline: {stages: 2, replica: 1}\n").find("c.yaml:3"), std::string::npos);
  EXPECT_NE(error_of("pipeline: {stages: 2, replica: 1}\n").find("replica"), std::string::npos);
  EXPECT_NE(error_of("scheduler:\n  in_flight: two\n").find("c.yaml:4"), std::string::npos);
  EXPECT_NE(error_of("pipeline: {stages: 7}\n").find("impossible plan"), std::string::npos);
  EXPECT_NE(error_of("pipeline: {stages: 2, layers: [[0, 3], [4, 6]]}\n").find("impossible plan"), std::string::npos);
  EXPECT_NE(error_of("heartbeat: {interval_ms: 500, liveness_ms: 400}\n").find("liveness_ms"), std::string::npos);
  EXPECT_NE(error_of("http: {port: 70000}\n").find("65535"), std::string::npos);
  EXPECT_EQ(error_of("pipeline: {stages: 2, layers: [[0, 4], [4, 6]]}\n"), "");
}

TEST(ClusterConfig, PipelineWait) {
  auto dflt = parse("");
  ASSERT_TRUE(dflt) << dflt.error();
  EXPECT_EQ(dflt->pipeline_wait_ms, 30000);
  auto set = parse("scheduler: {pipeline_wait_ms: 0}\n");
  ASSERT_TRUE(set) << set.error();
  EXPECT_EQ(set->pipeline_wait_ms, 0);
  const std::string negative = error_of("scheduler:\n  pipeline_wait_ms: -1\n");
  EXPECT_NE(negative.find("c.yaml:4"), std::string::npos) << negative;
  EXPECT_NE(negative.find("'scheduler.pipeline_wait_ms' must be at least 0"), std::string::npos) << negative;
  EXPECT_NE(error_of("scheduler: {pipeline_wait_ms: soon}\n").find("pipeline_wait_ms"), std::string::npos);
}

// control.data_interface: absent, the data plane follows control.host (empty here); set,
// the daemon takes it as given (transport/net_interface.h checks the names at start).
TEST(ClusterConfig, DataInterface) {
  auto parse = [](const std::string& control) {
    return parse_cluster_config("model: {path: \"" + model_dir() + "\"}\ncontrol: " + control + "\n", "c.yaml");
  };
  auto dflt = parse("{join_token: t}");
  ASSERT_TRUE(dflt) << dflt.error();
  EXPECT_EQ(dflt->data_interface, "");
  auto set = parse("{join_token: t, host: 0.0.0.0, data_interface: lo}");
  ASSERT_TRUE(set) << set.error();
  EXPECT_EQ(set->data_interface, "lo");
  auto wrong = parse("{join_token: t, data_interface: [lo]}");
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.error().find("data_interface"), std::string::npos) << wrong.error();
}

ModelConfig shape(int64_t layers, int64_t C, int64_t V) {
  ModelConfig c;
  c.n_layer = layers, c.n_embd = C, c.n_head = 4, c.n_inner = 4 * C, c.n_positions = 256, c.vocab_size = V;
  return c;
}

TEST(ClusterConfig, DefaultSplitBalancesTheLmHead) {
  using L = std::vector<std::pair<int64_t, int64_t>>;
  // A head as costly as a layer or less: one more layer on the earlier stages.
  EXPECT_EQ(balanced_layer_split(shape(7, 1024, 1024), 3), (L{{0, 3}, {3, 5}, {5, 7}}));
  EXPECT_EQ(balanced_layer_split(shape(96, 12288, 50257), 4), (L{{0, 24}, {24, 48}, {48, 72}, {72, 96}}));
  // brown-gpt2's shape: the head (V*C = 1.33 layers) sends a layer to the first stage.
  EXPECT_EQ(balanced_layer_split(shape(6, 256, 4096), 3), (L{{0, 3}, {3, 5}, {5, 6}}));
  // A huge head: the last stage gets no more than one layer.
  EXPECT_EQ(balanced_layer_split(shape(4, 64, 200000), 2), (L{{0, 3}, {3, 4}}));
  EXPECT_EQ(balanced_layer_split(shape(5, 64, 64), 1), (L{{0, 5}}));
  EXPECT_EQ(balanced_layer_split(shape(3, 64, 64), 3), (L{{0, 1}, {1, 2}, {2, 3}}));
  for (int stages = 1; stages <= 12; ++stages)
    EXPECT_TRUE(check_layer_split(balanced_layer_split(shape(12, 128, 4096), stages), stages, 12));
}

TEST(ClusterConfig, ExplicitSplitsAreChecked) {
  using L = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_FALSE(check_layer_split(L{{0, 2}, {2, 2}, {2, 6}}, 3, 6));
  EXPECT_FALSE(check_layer_split(L{{0, 2}, {2, 6}}, 3, 6));
  EXPECT_FALSE(check_layer_split(L{{0, 2}, {3, 6}}, 2, 6));
}


// Found by fuzz/fuzz_cluster_config (issue 28): a complex key ("? key") made check_keys'
// as<std::string>() throw YAML::BadConversion out of parse_cluster_config, killing the
// coordinator at start instead of naming the line.
TEST(ClusterConfig, ComplexKeysAreRefusedNotThrown) {
  const std::string crash = "model:\n  p path: brown-gpt2\ncontrol:\n  join_token: \"secret\"\npipeline:\n?  stag: 3\n";
  auto cfg = parse_cluster_config(crash, "c.yaml");
  ASSERT_FALSE(cfg);
  EXPECT_NE(cfg.error().find("c.yaml:"), std::string::npos) << cfg.error();
  EXPECT_NE(error_of("pipeline:\n  ? [stages]\n  : 2\n").find("is a list, not a name"), std::string::npos);
  EXPECT_NE(error_of("? {model: 1}\n: 2\n").find("is a mapping, not a name"), std::string::npos);
}

// log.format: text (the default) or json; anything else names the line and the choices.
TEST(ClusterConfig, LogFormat) {
  EXPECT_FALSE(parse("").value().log_json);
  EXPECT_FALSE(parse("log: {format: text}\n").value().log_json);
  EXPECT_TRUE(parse("log: {format: json}\n").value().log_json);
  const std::string bad = error_of("log: {format: xml}\n");
  EXPECT_NE(bad.find("c.yaml:3"), std::string::npos) << bad;
  EXPECT_NE(bad.find("'log.format' must be text or json, got 'xml'"), std::string::npos) << bad;
  EXPECT_NE(error_of("log: {level: info}\n").find("unknown key 'level' in 'log'"), std::string::npos);
}

// objective: throughput (the default) or latency (layout_choice.h); anything else is named.
TEST(ClusterConfig, Objective) {
  EXPECT_EQ(parse("").value().objective, Objective::Throughput);
  EXPECT_EQ(parse("objective: latency\n").value().objective, Objective::Latency);
  EXPECT_EQ(parse("objective: throughput\n").value().objective, Objective::Throughput);
  const std::string bad = error_of("objective: speed\n");
  EXPECT_NE(bad.find("c.yaml:3"), std::string::npos) << bad;
  EXPECT_NE(bad.find("'objective' must be latency or throughput, got 'speed'"), std::string::npos) << bad;
  EXPECT_NE(error_of("objective: [latency]\n").find("'objective' must be latency or throughput"), std::string::npos);
}

// scheduler.step_ahead: on unless the file says false; anything but a boolean is named.
TEST(ClusterConfig, StepAhead) {
  EXPECT_TRUE(parse("").value().step_ahead);
  EXPECT_FALSE(parse("scheduler: {step_ahead: false}\n").value().step_ahead);
  EXPECT_TRUE(parse("scheduler: {step_ahead: true}\n").value().step_ahead);
  const std::string bad = error_of("scheduler: {step_ahead: sometimes}\n");
  EXPECT_NE(bad.find("c.yaml:3"), std::string::npos) << bad;
  EXPECT_NE(bad.find("step_ahead"), std::string::npos) << bad;
}

// The scheduler block is checked against ranges, and every mistake is listed with its line
// in the file's order, not only the first (issue 29).
TEST(ClusterConfig, EveryMistakeIsListedWithItsLine) {
  const std::string all = error_of(
      "scheduler:\n  max_batch_tokens: 1\n  max_queue: 100000000\nheartbeat: {interval_ms: 5}\n"
      "pipeline: {replica: 2}\nhttp: {threads: many}\n");
  const std::vector<std::string> expected = {
      "c.yaml:4: 'scheduler.max_batch_tokens' must be 0 (auto) or at least 16 and at most 1048576 (it is 1)",
      "c.yaml:5: 'scheduler.max_queue' must be at least 1 and at most 1000000 (it is 100000000)",
      "c.yaml:6: 'heartbeat.interval_ms' must be at least 10 and at most 60000 (it is 5)",
      "c.yaml:7: unknown key 'replica' in 'pipeline' (known: layers, replicas, stages)",
      "c.yaml:8: 'http.threads' must be a whole number, at least 1 and at most 256"};
  std::string want;
  for (const auto& e : expected) want += (want.empty() ? "" : "\n") + e;
  EXPECT_EQ(all, want);
  // Each bound of a range, and 0 where it means auto.
  EXPECT_EQ(error_of("scheduler: {max_batch_tokens: 16, max_queue: 1000000, in_flight: 0, batch_timeout_ms: 0}\n"), "");
  EXPECT_NE(error_of("scheduler: {batch_timeout_ms: 5}\n").find("0 (never) or at least 100"), std::string::npos);
  EXPECT_NE(error_of("scheduler: {in_flight: 65}\n").find("(it is 65)"), std::string::npos);
  EXPECT_NE(error_of("scheduler: {max_queue: 0}\n").find("'scheduler.max_queue' must be at least 1"), std::string::npos);
  EXPECT_NE(error_of("scheduler: {max_running: 99999999999999999999}\n").find("must be a whole number"),
            std::string::npos);
}

// --check runs the same validation as the daemon's start: every mistake on stderr, one a
// line under the program's name, and exit status 2; a good file prints the scheduler too.
TEST(ClusterConfig, CoordinatorCheckListsEveryMistake) {
  const std::string coordinator = testing::bin_dir() + "/conveyor-coordinator";
  if (!fs::exists(coordinator)) GTEST_SKIP() << "conveyor-coordinator is not built in " << testing::bin_dir();
  const fs::path dir = fs::temp_directory_path() / ("conveyor-check-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string head = "model: {path: \"" + model_dir() + "\"}\ncontrol: {join_token: t}\n";
  std::ofstream(dir / "bad.yaml") << head << "scheduler:\n  max_batch_tokens: 1\n  max_queue: 100000000\n";
  std::ofstream(dir / "good.yaml") << head << "scheduler: {max_batch_tokens: 64}\n";
  int rc = -1;
  const std::string bad = testing::run_shell(coordinator + " --check --config " + (dir / "bad.yaml").string() + " 2>&1", rc);
  EXPECT_EQ(rc, 2) << bad;
  const std::string file = (dir / "bad.yaml").string();
  EXPECT_NE(bad.find("conveyor-coordinator: " + file + ":4: 'scheduler.max_batch_tokens' must be 0 (auto) or at least 16"),
            std::string::npos) << bad;
  EXPECT_NE(bad.find("conveyor-coordinator: " + file + ":5: 'scheduler.max_queue' must be at least 1 and at most 1000000"),
            std::string::npos) << bad;
  const std::string good = testing::run_shell(coordinator + " --check --config " + (dir / "good.yaml").string(), rc);
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0) << good;
  EXPECT_NE(good.find("\"max_batch_tokens\": 64"), std::string::npos) << good;
}

}  // namespace
}  // namespace conveyor

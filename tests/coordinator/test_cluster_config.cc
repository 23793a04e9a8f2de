// The cluster file: the shipped examples load, relative model paths follow the file, and
// each kind of mistake is refused with the file, the line and the reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <stdlib.h>
#include <unistd.h>

#include "coordinator/cluster_config.h"
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
  EXPECT_EQ(cfg->layers, even_layer_split(6, 1));
}

std::string error_of(const std::string& yaml) {
  auto cfg = parse_cluster_config("model: {path: \"" + model_dir() + "\"}\ncontrol: {join_token: t}\n" + yaml, "c.yaml");
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

TEST(ClusterConfig, EvenSplitGivesTheExtraLayersToEarlierStages) {
  using L = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(even_layer_split(6, 3), (L{{0, 2}, {2, 4}, {4, 6}}));
  EXPECT_EQ(even_layer_split(7, 3), (L{{0, 3}, {3, 5}, {5, 7}}));
  EXPECT_EQ(even_layer_split(96, 4).back(), (std::pair<int64_t, int64_t>{72, 96}));
  EXPECT_FALSE(check_layer_split(L{{0, 2}, {2, 2}, {2, 6}}, 3, 6));
  EXPECT_FALSE(check_layer_split(L{{0, 2}, {2, 6}}, 3, 6));
  EXPECT_FALSE(check_layer_split(L{{0, 2}, {3, 6}}, 2, 6));
}

}  // namespace
}  // namespace conveyor

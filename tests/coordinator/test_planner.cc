// The planner decides where a plan's stages go, as pure functions of the workers, the model
// and the shape: no threads, no sockets.
#include <gtest/gtest.h>

#include <set>

#include "coordinator/cluster_config.h"
#include "coordinator/planner.h"

namespace conveyor {
namespace {

ModelConfig model() {
  ModelConfig c;
  c.n_embd = 256, c.n_head = 4, c.n_layer = 6, c.n_inner = 1024, c.n_positions = 256, c.vocab_size = 1000;
  return c;
}
const std::string kPath = "/models/m";

WorkerInfo worker(const std::string& name, int64_t memory_bytes = 0) {
  WorkerInfo w;
  w.name = name;
  w.memory_bytes = memory_bytes;
  return w;
}

Shape shape(int stages, int replicas) { return {stages, replicas, balanced_layer_split(model(), stages)}; }

TEST(Planner, PlacesEverySlotOnADistinctWorker) {
  const ModelConfig m = model();
  Workers ws;
  for (const char* n : {"a", "b", "c", "d"}) ws[n] = worker(n);
  auto placed = place(ws, {m, kPath}, shape(2, 2));
  ASSERT_TRUE(placed) << placed.error();
  ASSERT_EQ(placed->size(), 4u);
  std::set<std::string> distinct(placed->begin(), placed->end());
  EXPECT_EQ(distinct.size(), 4u);
}

TEST(Planner, TooFewWorkersSaysHowMany) {
  const ModelConfig m = model();
  Workers ws;
  ws["a"] = worker("a");
  ws["b"] = worker("b");
  auto placed = place(ws, {m, kPath}, shape(3, 1));
  ASSERT_FALSE(placed);
  EXPECT_NE(placed.error().find("need 3 workers and 2 can serve"), std::string::npos) << placed.error();
  // `without` takes a worker out of the pool.
  auto without = place(ws, {m, kPath}, shape(2, 1), "a");
  ASSERT_FALSE(without);
  EXPECT_NE(without.error().find("1 can serve"), std::string::npos) << without.error();
}

TEST(Planner, OnlyPlannableWorkersServe) {
  const ModelConfig m = model();
  Workers ws;
  for (const char* n : {"a", "b", "c", "d"}) ws[n] = worker(n);
  ws["a"].state = MemberState::Dead;
  ws["b"].state = MemberState::Drained;
  ws["c"].leaving = true;
  EXPECT_FALSE(place(ws, {m, kPath}, shape(2, 1)));
  auto one = place(ws, {m, kPath}, shape(1, 1));
  ASSERT_TRUE(one) << one.error();
  EXPECT_EQ((*one)[0], "d");
}

TEST(Planner, AWorkerHoldingAStagesLayersKeepsThem) {
  const ModelConfig m = model();
  const Shape sh = shape(2, 1);
  Workers ws;
  for (const char* n : {"a", "b"}) ws[n] = worker(n);
  // "a" re-registered saying it still holds the second stage's layers of this model.
  ws["a"].holding = transport::HeldStage{.layer_begin = sh.layers[1].first, .layer_end = sh.layers[1].second,
                                         .model = kPath};
  auto placed = place(ws, {m, kPath}, sh);
  ASSERT_TRUE(placed) << placed.error();
  EXPECT_EQ((*placed)[1], "a");
  EXPECT_EQ((*placed)[0], "b");
  // Layers of another checkpoint do not count.
  ws["a"].holding->model = "/models/other";
  placed = place(ws, {m, kPath}, sh);
  ASSERT_TRUE(placed);
  EXPECT_EQ((*placed)[0], "a");
}

TEST(Planner, LargestStageGoesToTheRoomiestWorker) {
  const ModelConfig m = model();
  const Shape sh{2, 1, {{0, 1}, {1, 6}}};  // the second stage is five layers and the head
  const int64_t big = stage_weight_bytes(m, sh.layers[1], 4);
  Workers ws;
  ws["small"] = worker("small", stage_weight_bytes(m, sh.layers[0], 4) + 1);
  ws["large"] = worker("large", big + 1);
  auto placed = place(ws, {m, kPath}, sh);
  ASSERT_TRUE(placed) << placed.error();
  EXPECT_EQ((*placed)[0], "small");
  EXPECT_EQ((*placed)[1], "large");
  // A stage that fits nowhere names the layers, the bytes and the worker.
  ws["large"].memory_bytes = big / 2;
  placed = place(ws, {m, kPath}, sh);
  ASSERT_FALSE(placed);
  EXPECT_NE(placed.error().find("layers [1, 6) need"), std::string::npos) << placed.error();
}

TEST(Planner, LargestFeasibleShrinksStagesThenReplicas) {
  const ModelConfig m = model();
  Workers ws;
  for (const char* n : {"a", "b", "c"}) ws[n] = worker(n);
  const Shape target = shape(2, 2);  // needs 4
  auto feasible = largest_feasible(ws, {m, kPath}, target);
  ASSERT_TRUE(feasible) << feasible.error();
  // Two replicas of one stage (2 workers) before one replica of two stages: replicas first.
  EXPECT_EQ(feasible->shape.replicas, 2);
  EXPECT_EQ(feasible->shape.stages, 1);
  EXPECT_EQ(feasible->workers.size(), 2u);
  EXPECT_EQ(feasible->shape.layers, balanced_layer_split(m, 1));
  // The target itself, when it fits, keeps its own layer ranges.
  ws["d"] = worker("d");
  const Shape custom{2, 2, {{0, 2}, {2, 6}}};
  feasible = largest_feasible(ws, {m, kPath}, custom);
  ASSERT_TRUE(feasible);
  EXPECT_EQ(feasible->shape, custom);
  // Nobody: the error is why the target cannot be placed.
  auto none = largest_feasible({}, {m, kPath}, target);
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().find("need 4 workers"), std::string::npos) << none.error();
}

TEST(Planner, PlanRequestsAreCheckedAgainstTheModel) {
  const ModelConfig m = model();
  const Shape target = shape(2, 1);
  Shape out;
  PlanRequest r;
  EXPECT_EQ(shape_from_request(r, m, target, out).error, CoreError::Invalid);  // empty
  r.stages = 7;
  CoreStatus s = shape_from_request(r, m, target, out);
  EXPECT_EQ(s.error, CoreError::Invalid);
  EXPECT_EQ(s.param, "stages");
  r.stages = 3;
  ASSERT_TRUE(shape_from_request(r, m, target, out).ok());
  EXPECT_EQ(out.stages, 3);
  EXPECT_EQ(out.layers, balanced_layer_split(m, 3));
  EXPECT_EQ(out.replicas, 1);
  r = {};
  r.replicas = 65;
  EXPECT_EQ(shape_from_request(r, m, target, out).param, "replicas");
  r = {};
  r.layers = std::vector<LayerRange>{{0, 4}, {4, 6}};
  ASSERT_TRUE(shape_from_request(r, m, target, out).ok());
  EXPECT_EQ(out.stages, 2);
  EXPECT_EQ(out.layers[0], LayerRange(0, 4));
  r.layers = std::vector<LayerRange>{{0, 4}, {5, 6}};  // a gap
  s = shape_from_request(r, m, target, out);
  EXPECT_EQ(s.error, CoreError::Invalid);
  EXPECT_EQ(s.param, "layers");
}

}  // namespace
}  // namespace conveyor

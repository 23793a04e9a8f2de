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

// What an fp32 worker says the model takes (as a CPU stage describes it): 12 C^2 + 13 C
// parameters a layer (C = 256, I = 4C), the embeddings (V + P) C, the head V C + 2 C.
StageFootprint fp32_footprint() {
  const ModelConfig c = model();
  const int64_t C = c.n_embd, I = c.n_inner, V = c.vocab_size, P = c.n_positions;
  StageFootprint f;
  f.layer_bytes = (4 * C * C + 2 * C * I + 9 * C + I) * 4;
  f.embedding_bytes = (V + P) * C * 4;
  f.head_bytes = (V * C + 2 * C) * 4;
  f.embedding_and_head_bytes = f.embedding_bytes + f.head_bytes;
  f.kv_bytes_per_token_per_layer = 2 * C * 4;
  return f;
}

// A worker that registered with room for `weight_memory_bytes` of weights (0: no limit) and
// described the model in fp32.
WorkerInfo worker(const std::string& name, int64_t weight_memory_bytes = 0) {
  WorkerInfo w;
  w.name = name;
  w.caps.weight_memory_bytes = weight_memory_bytes;
  w.footprint = fp32_footprint();
  return w;
}

int64_t fp32_bytes(LayerRange layers) { return stage_weight_bytes(fp32_footprint(), layers, model().n_layer); }

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
  for (const char* n : {"a", "b", "c", "d", "e"}) ws[n] = worker(n);
  ws["a"].state = MemberState::Dead;
  ws["b"].state = MemberState::Drained;
  ws["c"].leaving = true;
  ws["e"].footprint.reset();  // it has not said what the model takes in its format
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
  const int64_t big = fp32_bytes(sh.layers[1]);
  Workers ws;
  ws["small"] = worker("small", fp32_bytes(sh.layers[0]) + 1);
  ws["large"] = worker("large", big + 1);
  auto placed = place(ws, {m, kPath}, sh);
  ASSERT_TRUE(placed) << placed.error();
  EXPECT_EQ((*placed)[0], "small");
  EXPECT_EQ((*placed)[1], "large");
  // A stage that fits nowhere names the layers, the bytes and the worker.
  ws["large"].caps.weight_memory_bytes = big / 2;
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

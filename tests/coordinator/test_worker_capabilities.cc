// Workers describe themselves, and the coordinator computes from the description alone
// (issue 27): a worker of a weight format the coordinator has never heard of ("q3": three-bit
// matrices with odd group scales, an odd K/V page) registers and answers its welcome over
// the wire as any worker does, and the planner places stages by the bytes it described, the
// scheduler batches by the figures it gave and keeps prefixes in whole pages of its size.
// Nothing in coordinator/ knows "q3"; it is a name in a test.
#include <gtest/gtest.h>


#include "coordinator/cluster_config.h"
#include "coordinator/planner.h"
#include "coordinator/scheduler.h"
#include "tests/coordinator/greedy_request.h"
#include "tests/test_util.h"
#include "transport/control_messages.h"

namespace conveyor {
namespace {

using transport::AnyControlMsg;
using transport::ControlMessage;

ModelConfig model() {
  ModelConfig c;
  c.n_embd = 256, c.n_head = 4, c.n_layer = 6, c.n_inner = 1024, c.n_positions = 256, c.vocab_size = 1000;
  return c;
}
const std::string kPath = "/models/m";
constexpr int64_t MiB = int64_t(1) << 20;

// What the other end decodes: the JSON as text and back.
AnyControlMsg over_the_wire(const ControlMessage& m) {
  ControlMessage out;
  out.body = nlohmann::json::parse(m.body.dump());
  out.blob = m.blob;
  auto back = transport::decode_control(out);
  EXPECT_TRUE(back.ok()) << back.error();
  return back.ok() ? *back : AnyControlMsg{transport::ShutdownMsg{}};
}

// The q3 worker's description: no figure of it is one a known backend has.
StageCapabilities q3_capabilities(int64_t weight_memory_bytes) {
  return {.dtype = DType::F16, .weight_format = "q3", .weight_memory_bytes = weight_memory_bytes, .kv_page_tokens = 24,
          .max_rows_per_step = 350, .max_sequences_per_step = 100, .max_prompt_rows_per_step = 300,
          .extra_in_flight = 2};
}
StageFootprint q3_footprint() {
  return {.layer_bytes = 3 * MiB + 7, .embedding_bytes = 10 * MiB + 3, .head_bytes = 20 * MiB + 5,
          .embedding_and_head_bytes = 25 * MiB + 1, .kv_bytes_per_token_per_layer = 99};
}

// A worker as the coordinator knows it after its register and its footprint (control.cc),
// both taken off the wire.
WorkerInfo joined(const std::string& name, const StageCapabilities& caps,
                  const StageFootprint& footprint) {
  auto reg = std::get<transport::RegisterMsg>(over_the_wire(transport::encode(transport::RegisterMsg{
      .name = name, .backend = "q3-accelerator", .capabilities = caps, .data_address = {std::byte{1}}})));
  auto fp = std::get<transport::FootprintMsg>(over_the_wire(transport::encode(transport::FootprintMsg{.footprint = footprint})));
  WorkerInfo w;
  w.name = name;
  w.backend = reg.backend;
  w.caps = reg.capabilities;
  w.footprint = fp.footprint;
  return w;
}

int64_t q3_bytes(LayerRange layers) { return stage_weight_bytes(q3_footprint(), layers, model().n_layer); }

TEST(StageCapabilities, TheDescriptionCrossesTheWireUnchanged) {
  const WorkerInfo w = joined("q3", q3_capabilities(40 * MiB), q3_footprint());
  EXPECT_EQ(w.caps, q3_capabilities(40 * MiB));
  EXPECT_EQ(*w.footprint, q3_footprint());
  // The welcome names the model the worker describes.
  auto welcome = std::get<transport::WelcomeMsg>(over_the_wire(
      transport::encode(transport::WelcomeMsg{.heartbeat_ms = 500, .model = transport::model_shape(model())})));
  ASSERT_TRUE(welcome.model.has_value());
  const ModelConfig back = transport::model_config(*welcome.model);
  EXPECT_EQ(back.n_layer, 6);
  EXPECT_EQ(back.n_inner, 1024);
  EXPECT_EQ(back.vocab_size, 1000);
}

TEST(StageCapabilities, StageBytesAreTheDescribedOnes) {
  // Layers, plus the embedding on the first stage, the head on the last, and a stage that is
  // both takes what the worker said of both (it keeps its tied head once).
  EXPECT_EQ(q3_bytes({2, 4}), 2 * (3 * MiB + 7));
  EXPECT_EQ(q3_bytes({0, 3}), 3 * (3 * MiB + 7) + 10 * MiB + 3);
  EXPECT_EQ(q3_bytes({3, 6}), 3 * (3 * MiB + 7) + 20 * MiB + 5);
  EXPECT_EQ(q3_bytes({0, 6}), 6 * (3 * MiB + 7) + 25 * MiB + 1);
}

TEST(StageCapabilities, ThePlannerPlacesByTheDescribedBytes) {
  const ModelConfig m = model();
  const Shape halves{2, 1, {{0, 3}, {3, 6}}};
  const int64_t first = q3_bytes(halves.layers[0]), last = q3_bytes(halves.layers[1]);
  ASSERT_LT(first, last);  // the head weighs more than the embedding in q3
  // Each room is exactly one stage's bytes: the larger stage goes to the larger room.
  Workers ws;
  ws["q3-small"] = joined("q3-small", q3_capabilities(first), q3_footprint());
  ws["q3-large"] = joined("q3-large", q3_capabilities(last), q3_footprint());
  auto placed = place(ws, {m, kPath}, halves);
  ASSERT_TRUE(placed) << placed.error();
  EXPECT_EQ((*placed)[0], "q3-small");
  EXPECT_EQ((*placed)[1], "q3-large");
  // One byte less and the last stage fits nowhere: the error gives the described bytes.
  ws["q3-large"].caps.weight_memory_bytes = last - 1;
  placed = place(ws, {m, kPath}, halves);
  ASSERT_FALSE(placed);
  EXPECT_NE(placed.error().find("layers [3, 6) need " + std::to_string(last >> 20) + " MiB"), std::string::npos)
      << placed.error();
  // Each worker is measured in its own format: in the same room, a worker whose format takes
  // twice the bytes a layer cannot take the last stage, the q3 worker can.
  StageFootprint wide = q3_footprint();
  wide.layer_bytes *= 2;
  Workers mixed;
  mixed["q3"] = joined("q3", q3_capabilities(last), q3_footprint());
  mixed["wide"] = joined("wide", q3_capabilities(last), wide);
  placed = place(mixed, {m, kPath}, halves);
  ASSERT_TRUE(placed) << placed.error();
  EXPECT_EQ((*placed)[1], "q3");
  EXPECT_EQ((*placed)[0], "wide");
  mixed["q3"] = joined("q3", q3_capabilities(last), wide);  // now both store layers wide
  placed = place(mixed, {m, kPath}, halves);
  ASSERT_FALSE(placed);
  const int64_t wide_last = stage_weight_bytes(wide, halves.layers[1], m.n_layer);
  EXPECT_NE(placed.error().find("need " + std::to_string(wide_last >> 20) + " MiB"), std::string::npos)
      << placed.error();
}

TEST(StageCapabilities, TheLargestFeasiblePlanFollowsTheDescribedBytes) {
  const ModelConfig m = model();
  const Shape target{2, 1, balanced_layer_split(m, 2)};
  // One worker with room for the whole model only as q3 stores it (its tied head once): one
  // stage of six layers.
  const int64_t whole = q3_bytes({0, 6});
  Workers ws;
  ws["q3"] = joined("q3", q3_capabilities(whole), q3_footprint());
  auto feasible = largest_feasible(ws, {m, kPath}, target);
  ASSERT_TRUE(feasible) << feasible.error();
  EXPECT_EQ(feasible->shape.stages, 1);
  EXPECT_EQ(feasible->workers, std::vector<std::string>{"q3"});
  // Were its embedding and head counted apart (6 layers + 10 MiB + 20 MiB), it would not fit.
  ASSERT_LT(whole, 6 * q3_footprint().layer_bytes + q3_footprint().embedding_bytes + q3_footprint().head_bytes);
  ws["q3"].caps.weight_memory_bytes = whole - 1;
  EXPECT_FALSE(largest_feasible(ws, {m, kPath}, target));
  // A worker that has not described the model is not planned at all.
  ws["q3"].caps.weight_memory_bytes = whole;
  ws["q3"].footprint.reset();
  EXPECT_FALSE(largest_feasible(ws, {m, kPath}, target));
}

TEST(StageCapabilities, TheSchedulerBatchesByTheDescribedFigures) {
  const WorkerInfo q3 = joined("q3", q3_capabilities(0), q3_footprint());
  StageCapabilities paged16 = q3_capabilities(0);
  paged16.kv_page_tokens = 16, paged16.max_rows_per_step = 0, paged16.max_sequences_per_step = 64;
  paged16.max_prompt_rows_per_step = 64, paged16.extra_in_flight = 1;
  const WorkerInfo other = joined("other", paged16, q3_footprint());
  const std::vector<const WorkerInfo*> one{&q3};
  const StageFigures f = Scheduler::figures_of(one);
  EXPECT_EQ(f, (StageFigures{.max_rows = 350, .sequences = 100, .prompt_rows = 300, .extra_in_flight = 2,
                             .kv_page_tokens = 24, .backends = "q3-accelerator"}));
  ClusterConfig cfg;  // every limit auto
  const BatchLimits l = Scheduler::batch_limits(cfg, f, /*stages=*/2, /*depth=*/3);
  EXPECT_EQ(l.max_sequences, 100);
  EXPECT_EQ(l.prefill_chunk, 300);
  EXPECT_EQ(l.prefill_tokens, 300 * 2 / 3);
  EXPECT_EQ(l.max_rows, 300);  // 100 + 200 rows, within its 350
  EXPECT_EQ(l.max_running, 3 * 100);
  EXPECT_EQ(Scheduler::batch_limits(cfg, f, 1, 1).max_rows, 350);  // 100 + 300 capped at its row limit
  // Beside a stage of 16-position pages, prefixes go in whole pages of both: 48 positions;
  // the hard row limit is the smaller one, the batching the larger, the extra depth the smaller.
  const std::vector<const WorkerInfo*> two{&q3, nullptr, &other};
  const StageFigures g = Scheduler::figures_of(two);
  EXPECT_EQ(g.kv_page_tokens, 48);
  EXPECT_EQ(g.max_rows, 350);
  EXPECT_EQ(g.sequences, 100);
  EXPECT_EQ(g.extra_in_flight, 1);
}

TEST(StageCapabilities, PrefixesAreKeptInWholePagesOfTheDescribedSize) {
  const std::string model_dir = testing::source_dir() + "/models/brown-gpt2";
  ClusterConfig cfg;
  cfg.model = load_model_config(model_dir).value();
  auto tok = Tokenizer::load(model_dir);
  ASSERT_TRUE(tok.ok()) << tok.error();
  std::vector<PipelineRun> pipelines(1);
  pipelines[0].limits = {.max_sequences = 64, .max_rows = 256, .prefill_chunk = 64, .prefill_tokens = 64,
                         .max_running = 64};
  const WorkerInfo q3 = joined("q3", q3_capabilities(0), q3_footprint());
  const std::vector<const WorkerInfo*> stages{&q3};
  pipelines[0].figures = Scheduler::figures_of(stages);
  Scheduler scheduler(cfg, std::make_shared<const Tokenizer>(std::move(tok).value()), pipelines);
  auto submit = [&] {
    auto r = testing::greedy_request(60, 4);
    CompletionSink sink;
    sink.on_update = [](ChoiceUpdate) {};
    sink.on_done = [](const std::string&) {};
    ASSERT_TRUE(scheduler.submit(r, sink).ok());
    scheduler.admit([](const PipelineRun&) { return true; }, [](const PipelineRun&) { return int64_t(10000); });
  };
  submit();
  auto b = scheduler.next_step(pipelines[0], 1);
  ASSERT_TRUE(b.has_value());
  ASSERT_EQ(b->steps.size(), 1u);
  BatchResult r;
  r.batch_id = b->batch_id, r.pipeline = 0, r.epoch = b->epoch;
  SeqResult token;
  token.seq_id = b->steps[0].slice.seq_id, token.token = 7;
  r.seqs.push_back(token);
  Scheduler::sent(pipelines[0], std::move(*b));
  EXPECT_EQ(scheduler.on_result(r), nullptr);
  scheduler.deliver();
  // Its 60-token prompt is kept as two whole 24-position pages.
  EXPECT_EQ(scheduler.prefix_stats().entries, 1);
  EXPECT_EQ(scheduler.prefix_stats().cached_tokens, 48);
  // The same prompt again forks those 48 positions.
  submit();
  auto next = scheduler.next_step(pipelines[0], 1);
  ASSERT_TRUE(next.has_value());
  ASSERT_FALSE(next->forks.empty());
  EXPECT_EQ(next->forks.back().num_tokens, 48);
}

}  // namespace
}  // namespace conveyor

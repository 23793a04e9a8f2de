// TpStage (stage/cuda/tp_stage.h): a stage's layers tensor parallel over 2 and 3 ranks
// against the CPU stage on random weights, in fp16 and bf16: logits close after prefill
// chunks and decode steps, greedy tokens of the CUDA-graph decode equal wherever the CPU's
// top-2 gap is well above the error, and the same for a two-stage split whose second stage
// takes its input from the host. Ranks run on distinct GPUs where the machine has enough,
// else they share GPU 0 (the all-reduce then runs the custom kernel at every size): the
// sharding, the all-reduces inside the captured graphs and the rank threads are the same
// code either way.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(TpStage, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/ops.h"
#include "stage/cuda/tp_stage.h"
#include "stage/cpu/cpu_stage.h"
#include "model/weights.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using cuda::GpuStageOptions;
using cuda::TpStage;

using testing::rel_err;
using testing::step_both;
using testing::top1;

// The tests' largest group: 3 ranks (a 5-rank group is only refused).
using testing::can_place;
using testing::devices_for;
using testing::kNoPlace;

ModelConfig tp_config() {
  ModelConfig c;
  c.n_layer = 3;
  c.n_embd = 128;
  c.n_head = 4;     // head_dim 32; 3 ranks get 1, 1 and 2 heads
  c.n_inner = 300;  // 150 / 100 units per rank: not multiples of 8 (the cuBLASLt path for FC2)
  c.n_positions = 256;
  c.vocab_size = 1013;
  c.layer_norm_epsilon = 1e-5f;
  c.activation = Activation::GeluNew;
  c.tie_word_embeddings = true;
  return c;
}

GpuStageOptions options(DType dt) {
  GpuStageOptions o;
  o.dtype = dt;
  o.name = "tp-test";
  o.max_tokens = 256;
  o.max_seqs = 8;
  o.kv_cache_max_bytes = int64_t(32) << 20;
  return o;
}



template <class T>
class TpStageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!can_place(3)) GTEST_SKIP() << kNoPlace;
    seed = std::random_device{}();
    rng.seed(seed);
  }

 public:
  static DType dtype() { return std::is_same_v<T, cuda::half> ? DType::F16 : DType::BF16; }
  static double logit_tol() { return std::is_same_v<T, cuda::half> ? 1e-2 : 5e-2; }
  std::vector<int32_t> tokens(size_t n) {
    std::vector<int32_t> t(n);
    for (auto& x : t) x = int32_t(rng() % 1013u);
    return t;
  }
  uint32_t seed = 0;
  std::mt19937 rng;
};
using ElemTypes = ::testing::Types<cuda::half, cuda::bf16>;
TYPED_TEST_SUITE(TpStageTest, ElemTypes);

#define SEED_TRACE() SCOPED_TRACE("seed " + std::to_string(this->seed))

TYPED_TEST(TpStageTest, PrefillChunksAndGraphDecodeMatchCpu) {
  SEED_TRACE();
  const ModelConfig cfg = tp_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
  const int64_t V = cfg.vocab_size;
  for (int ranks : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(ranks));
    auto cpu = CpuStage::create(w).value();
    auto gpu = TpStage::create(w, devices_for(ranks), options(this->dtype())).value();
    ASSERT_EQ(gpu->ranks(), ranks);
    // Sequence 1 prefilled in two chunks, the others at once.
    auto p1 = this->tokens(37), p2 = this->tokens(5), p3 = this->tokens(100);
    std::vector<int32_t> ids(p1.begin(), p1.begin() + 20);
    ids.insert(ids.end(), p2.begin(), p2.end());
    ids.insert(ids.end(), p3.begin(), p3.end());
    auto ref = step_both(*cpu, *gpu, {{1, 0, 20}, {2, 0, 5}, {3, 0, 100}}, ids, this->logit_tol(), "prefill");
    ref = step_both(*cpu, *gpu, {{1, 20, 17}}, std::vector<int32_t>(p1.begin() + 20, p1.end()), this->logit_tol(), "second chunk");
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(gpu->rank(r).cached_tokens(1), 37);

    // Graph decode of the three sequences (bucket 4: one padding row) against the CPU's greedy choice.
    SamplingParams greedy;
    greedy.temperature = 0;
    std::vector<cuda::SampleRow> rows(3, cuda::SampleRow{&greedy, {}, {}, 0});
    std::vector<int32_t> next = {top1(ref.data(), V).first, 11, 12};
    int32_t len[3] = {37, 5, 100};
    int compared = 0;
    for (int step = 0; step < 6; ++step) {
      std::vector<SeqSlice> slices;
      for (int s = 0; s < 3; ++s) slices.push_back({uint64_t(s + 1), len[s], 1});
      std::vector<int32_t> got(3);
      Status st = gpu->decode(slices, next.data(), rows, got.data());
      ASSERT_TRUE(st.ok()) << st.message();
      std::vector<float> hidden(size_t(3 * cfg.n_embd)), logits(size_t(3 * V));
      ASSERT_TRUE(cpu->embed(slices, next.data(), hidden.data()).ok());
      ASSERT_TRUE(cpu->forward(slices, hidden.data()).ok());
      ASSERT_TRUE(cpu->logits(slices, hidden.data(), false, logits.data()).ok());
      for (int s = 0; s < 3; ++s) {
        const auto [tok, gap] = top1(logits.data() + s * V, V);
        if (gap > 0.05f) {  // well above the logits' error
          EXPECT_EQ(got[size_t(s)], tok) << "step " << step << " row " << s << " gap " << gap;
          ++compared;
        }
        next[size_t(s)] = tok;
        ++len[s];
      }
    }
    EXPECT_GT(compared, 0);
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(gpu->rank(r).captured_graphs(), 1u) << "rank " << r;
      // Every rank planned each step's products before the step (no rank plans while a
      // peer's all-reduce waits for it: on two GPUs that hung, 2026-11-26).
      for (int64_t planned_rows : {125, 17}) EXPECT_TRUE(gpu->rank(r).products_planned(planned_rows, false)) << "rank " << r;
      EXPECT_TRUE(gpu->rank(r).products_planned(4, true)) << "rank " << r;
    }
  }
}

TYPED_TEST(TpStageTest, SecondStageOfAPipelineTakesHostActivations) {
  SEED_TRACE();
  const ModelConfig cfg = tp_config();
  const StageWeights first = random_stage_weights(cfg, 0, 1, this->seed);
  const StageWeights second = random_stage_weights(cfg, 1, cfg.n_layer, this->seed);
  const StageWeights whole = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
  auto cpu = CpuStage::create(whole).value();
  auto a = TpStage::create(first, devices_for(2), options(this->dtype())).value();
  auto b = TpStage::create(second, devices_for(2), options(this->dtype())).value();
  EXPECT_FALSE(a->has_head());
  EXPECT_FALSE(b->has_embedding());
  const std::vector<SeqSlice> slices = {{7, 0, 30}, {8, 0, 4}};
  const auto ids = this->tokens(34);
  std::vector<float> hidden(size_t(34 * cfg.n_embd));
  ASSERT_TRUE(a->embed(slices, ids.data()).ok());
  ASSERT_TRUE(a->forward(slices).ok());
  ASSERT_TRUE(a->download_hidden(hidden.data(), 34).ok());
  ASSERT_TRUE(b->upload_hidden(hidden.data(), 34).ok());
  ASSERT_TRUE(b->forward(slices).ok());
  std::vector<float> got(size_t(2 * cfg.vocab_size)), ref(got.size()), cpu_hidden(hidden.size());
  ASSERT_TRUE(b->logits(slices, false, got.data()).ok());
  ASSERT_TRUE(cpu->embed(slices, ids.data(), cpu_hidden.data()).ok());
  ASSERT_TRUE(cpu->forward(slices, cpu_hidden.data()).ok());
  ASSERT_TRUE(cpu->logits(slices, cpu_hidden.data(), false, ref.data()).ok());
  for (size_t i = 0; i < 2; ++i)
    EXPECT_LT(rel_err(got.data() + i * size_t(cfg.vocab_size), ref.data() + i * size_t(cfg.vocab_size),
                      size_t(cfg.vocab_size)),
              this->logit_tol())
        << "row " << i;
}

// Int8 weight-only matrices (per-channel scales) at tp 1 and 2: prefill logits within the
// quantisation error of the CPU's fp32, and the graph decode's greedy tokens equal to the
// CPU's wherever the top-2 gap is well above that error.
TEST(TpStage, Int8WeightsStayCloseToTheCpu) {
  if (!can_place(2)) GTEST_SKIP() << kNoPlace;
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ModelConfig cfg = tp_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, seed);
  const int64_t V = cfg.vocab_size;
  std::mt19937 rng(seed);
  for (int ranks : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(ranks));
    GpuStageOptions o = options(DType::F16);
    o.int8_weights = true;
    auto gpu = TpStage::create(w, devices_for(ranks), o).value();
    auto cpu = CpuStage::create(w).value();
    std::vector<SeqSlice> slices = {{1, 0, 40}, {2, 0, 9}};
    std::vector<int32_t> ids(49);
    for (auto& x : ids) x = int32_t(rng() % uint32_t(V));
    std::vector<float> hidden(size_t(49 * cfg.n_embd)), ref(size_t(2 * V)), got(ref.size());
    ASSERT_TRUE(cpu->embed(slices, ids.data(), hidden.data()).ok());
    ASSERT_TRUE(cpu->forward(slices, hidden.data()).ok());
    ASSERT_TRUE(cpu->logits(slices, hidden.data(), false, ref.data()).ok());
    ASSERT_TRUE(gpu->embed(slices, ids.data()).ok());
    ASSERT_TRUE(gpu->forward(slices).ok());
    ASSERT_TRUE(gpu->logits(slices, false, got.data()).ok());
    for (size_t i = 0; i < 2; ++i)
      EXPECT_LT(rel_err(got.data() + i * size_t(V), ref.data() + i * size_t(V), size_t(V)), 0.08) << "row " << i;
    SamplingParams greedy;
    greedy.temperature = 0;
    std::vector<cuda::SampleRow> rows(2, cuda::SampleRow{&greedy, {}, {}, 0});
    std::vector<int32_t> next = {top1(ref.data(), V).first, top1(ref.data() + V, V).first};
    int32_t len[2] = {40, 9};
    int compared = 0;
    for (int step = 0; step < 6; ++step) {
      slices = {{1, len[0], 1}, {2, len[1], 1}};
      std::vector<int32_t> out(2);
      Status st = gpu->decode(slices, next.data(), rows, out.data());
      ASSERT_TRUE(st.ok()) << st.message();
      std::vector<float> h(size_t(2 * cfg.n_embd)), logits(size_t(2 * V));
      ASSERT_TRUE(cpu->embed(slices, next.data(), h.data()).ok());
      ASSERT_TRUE(cpu->forward(slices, h.data()).ok());
      ASSERT_TRUE(cpu->logits(slices, h.data(), false, logits.data()).ok());
      for (int s = 0; s < 2; ++s) {
        const auto [tok, gap] = top1(logits.data() + s * V, V);
        if (gap > 0.2f) {
          EXPECT_EQ(out[size_t(s)], tok) << "step " << step << " row " << s << " gap " << gap;
          ++compared;
        }
        next[size_t(s)] = tok;
        ++len[s];
      }
    }
    EXPECT_GT(compared, 0);
  }
}

TEST(TpStage, RanksShareTheSmallestKvCapacityAndRefuseBadSplits) {
  if (!can_place(3)) GTEST_SKIP() << kNoPlace;
  const ModelConfig cfg = tp_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, 5);
  auto tp = TpStage::create(w, devices_for(3), options(DType::F16)).value();
  for (int r = 1; r < 3; ++r) EXPECT_EQ(tp->rank(r).kv_capacity_tokens(), tp->rank(0).kv_capacity_tokens());
  EXPECT_FALSE(tp->rank(1).holds_head());
  EXPECT_TRUE(tp->rank(0).holds_head());
  // Rank 1 holds no LM head: logits on it fail with a message, not a crash.
  const std::vector<SeqSlice> one = {{1, 0, 1}};
  EXPECT_FALSE(tp->rank(1).logits(one, false, nullptr).ok());
  auto five = TpStage::create(w, devices_for(5), options(DType::F16));  // 5 ranks, 4 heads
  ASSERT_FALSE(five.ok()) << "5 ranks over 4 heads were accepted";
  EXPECT_NE(five.error().find("heads"), std::string::npos) << five.error();
}

// A decode whose sampling rows (rank 0's alone) are wrong is refused before any rank starts:
// had rank 1 run the step, it would wait in the step's all-reduces for rank 0 forever. The
// stage then decodes as before.
TEST(TpStage, DecodeRefusedForRankZerosRowsLeavesTheRanksInStep) {
  if (!can_place(2)) GTEST_SKIP() << kNoPlace;
  const ModelConfig cfg = tp_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, 9);
  auto tp = TpStage::create(w, devices_for(2), options(DType::F16)).value();
  const std::vector<int32_t> prompt = {5, 6, 7, 8};
  ASSERT_TRUE(tp->embed(std::vector<SeqSlice>{{1, 0, 4}}, prompt.data()).ok());
  ASSERT_TRUE(tp->forward(std::vector<SeqSlice>{{1, 0, 4}}).ok());
  SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<SeqSlice> step = {{1, 4, 1}};
  const int32_t next = 9;
  int32_t got = -1;
  const std::vector<cuda::SampleRow> none;
  Status refused = tp->decode(step, &next, none, &got);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("sampling row"), std::string::npos) << refused.message();
  EXPECT_TRUE(tp->health().ok()) << "a refused call leaves the stage usable: " << tp->health().message();
  const std::vector<cuda::SampleRow> rows(1, cuda::SampleRow{&greedy, {}, {}, 0});
  for (int r = 0; r < 2; ++r) EXPECT_EQ(tp->rank(r).cached_tokens(1), 4) << "rank " << r;
  Status st = tp->decode(step, &next, rows, &got);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_GE(got, 0);
  EXPECT_LT(got, cfg.vocab_size);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(tp->rank(r).cached_tokens(1), 5) << "rank " << r;
}

// A kernel's illegal address stays in the GPU's CUDA context for the rest of the process: the
// stage's health then names the GPU and the fault (a worker exits on it, so that the coordinator
// fails over). Run in a child process (gtest's "threadsafe" death test runs this test alone in
// a fresh copy of the program), as the fault ends CUDA in the process that takes it.
TEST(TpStage, HealthNamesAStickyGpuFault) {
  if (!can_place(1)) GTEST_SKIP() << kNoPlace;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const ModelConfig cfg = tp_config();
        const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, 9);
        auto tp = TpStage::create(w, {0}, options(DType::F16));
        if (!tp) (std::fprintf(stderr, "create: %s\n", tp.error().c_str()), std::_Exit(2));
        if (Status h = (*tp)->health(); !h) (std::fprintf(stderr, "unhealthy at start: %s\n", h.message().c_str()), std::_Exit(3));
        cudaSetDevice(0);
        // 1 Mi halves from address 4,096: nothing is mapped there.
        cuda::gelu_forward(reinterpret_cast<cuda::half*>(uintptr_t(4096)), int64_t(1) << 20, nullptr);
        std::fprintf(stderr, "synchronise: %s\n", cudaGetErrorName(cudaDeviceSynchronize()));
        const Status h = (*tp)->health();
        std::fprintf(stderr, "health: %s\n", h ? "ok" : h.message().c_str());
        std::_Exit(h ? 4 : 0);
      },
      ::testing::ExitedWithCode(0), "health: tp-test: rank 0 on GPU 0: .*cudaErrorIllegalAddress");
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

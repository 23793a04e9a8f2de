// GpuStage (stage/cuda/gpu_stage.h) against CpuStage (stage/cpu/cpu_stage.h) on random weights,
// in fp16 and bf16: logits close (relative L2 per row), greedy tokens equal wherever the
// CPU's top-2 gap is well above the error; the CUDA-graph decode path against the same
// steps run eagerly; a two-stage pipeline split against one stage; sampling against
// sample_next on the same logits; and the errors (bad slices, a full K/V cache, memory).
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuStage, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "stage/cuda/gpu_stage.h"
#include "kernels/cuda/ops.h"
#include "stage/cpu/cpu_stage.h"
#include "kernels/cpu/sampling.h"
#include "model/weights.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

using cuda::GpuStage;
using cuda::GpuStageOptions;

using testing::have_gpu;
using testing::rel_err;
using testing::step_both;
using testing::top1;

ModelConfig small_config(Activation act = Activation::GeluNew, bool tied = true) {
  ModelConfig c;
  c.n_layer = 3;
  c.n_embd = 128;
  c.n_head = 2;    // head_dim 64
  c.n_inner = 300;  // not a multiple of 8: the cuBLASLt path for FC2, the scalar bias-GeLU
  c.n_positions = 256;
  c.vocab_size = 1013;
  c.layer_norm_epsilon = 1e-5f;
  c.activation = act;
  c.tie_word_embeddings = tied;
  return c;
}

GpuStageOptions options(DType dt, bool graphs = true) {
  GpuStageOptions o;
  o.dtype = dt;
  o.name = "test-stage";
  o.max_tokens = 256;
  o.max_seqs = 8;
  o.kv_cache_max_bytes = int64_t(64) << 20;
  o.cuda_graphs = graphs;
  return o;
}


double max_abs_diff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}


std::vector<int32_t> random_tokens(std::mt19937& rng, size_t n, int64_t V) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % uint32_t(V));
  return t;
}

template <class T>
class GpuStageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
    seed = std::random_device{}();
    rng.seed(seed);
  }

 public:
  static DType dtype() { return std::is_same_v<T, cuda::half> ? DType::F16 : DType::BF16; }
  static double logit_tol() { return std::is_same_v<T, cuda::half> ? 1e-2 : 5e-2; }
  uint32_t seed = 0;
  std::mt19937 rng;
};
using ElemTypes = ::testing::Types<cuda::half, cuda::bf16>;
TYPED_TEST_SUITE(GpuStageTest, ElemTypes);

#define SEED_TRACE() SCOPED_TRACE("seed " + std::to_string(this->seed))

TYPED_TEST(GpuStageTest, PrefillChunksAndDecodeMatchCpu) {
  SEED_TRACE();
  for (bool tied : {true, false}) {
    const ModelConfig cfg = small_config(tied ? Activation::GeluNew : Activation::Gelu, tied);
    const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
    auto cpu = CpuStage::create(w).value();
    auto gpu = GpuStage::create(w, options(this->dtype())).value();
    const int64_t V = cfg.vocab_size;
    // Sequence 1 is prefilled in two chunks, the others at once; then all decode together.
    auto p1 = random_tokens(this->rng, 37, V), p2 = random_tokens(this->rng, 5, V), p3 = random_tokens(this->rng, 100, V);
    std::vector<int32_t> ids(p1.begin(), p1.begin() + 20);
    ids.insert(ids.end(), p2.begin(), p2.end());
    ids.insert(ids.end(), p3.begin(), p3.end());
    step_both(*cpu, *gpu, {{1, 0, 20}, {2, 0, 5}, {3, 0, 100}}, ids, this->logit_tol(), "prefill");
    std::vector<int32_t> rest(p1.begin() + 20, p1.end());
    auto ref = step_both(*cpu, *gpu, {{1, 20, 17}}, rest, this->logit_tol(), "second chunk");
    EXPECT_EQ(gpu->cached_tokens(1), 37);
    EXPECT_EQ(gpu->cached_tokens(3), 100);
    int32_t next[3] = {top1(ref.data(), V).first, 11, 12};
    int32_t len[3] = {37, 5, 100};
    for (int step = 0; step < 5; ++step) {
      std::vector<SeqSlice> slices;
      for (int s = 0; s < 3; ++s) slices.push_back({uint64_t(s + 1), len[s], 1});
      auto out = step_both(*cpu, *gpu, slices, std::vector<int32_t>(next, next + 3), this->logit_tol(), "decode");
      for (int s = 0; s < 3; ++s) next[s] = top1(out.data() + s * V, V).first, ++len[s];
    }
    // A serving step: sequences 1 and 2 decode (first: the decode kernel), a new sequence's
    // prompt chunk and sequence 3's single token follow (the context kernel).
    auto p4 = random_tokens(this->rng, 9, V);
    std::vector<int32_t> mixed = {next[0], next[1]};
    mixed.insert(mixed.end(), p4.begin(), p4.end());
    mixed.push_back(next[2]);
    auto out = step_both(*cpu, *gpu, {{1, len[0], 1}, {2, len[1], 1}, {4, 0, 9}, {3, len[2], 1}}, mixed,
                         this->logit_tol(), "decode rows, a prompt chunk, a decode row");
    EXPECT_EQ(gpu->cached_tokens(4), 9);
    EXPECT_EQ(gpu->cached_tokens(3), len[2] + 1);
    const int32_t after[4] = {top1(out.data(), V).first, top1(out.data() + V, V).first, top1(out.data() + 3 * V, V).first,
                              top1(out.data() + 2 * V, V).first};
    step_both(*cpu, *gpu, {{1, len[0] + 1, 1}, {2, len[1] + 1, 1}, {3, len[2] + 1, 1}, {4, 9, 1}},
              std::vector<int32_t>(after, after + 4), this->logit_tol(), "decode after the mixed step");
  }
}

TYPED_TEST(GpuStageTest, GraphDecodeMatchesCpuGreedy) {
  SEED_TRACE();
  const ModelConfig cfg = small_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
  const int64_t V = cfg.vocab_size;
  for (int batch : {1, 3, 5}) {  // buckets 1, 4 (one padding row), 8 (three)
    auto cpu = CpuStage::create(w).value();
    auto gpu = GpuStage::create(w, options(this->dtype(), /*graphs=*/true)).value();
    std::vector<SeqSlice> prefill;
    std::vector<int32_t> ids;
    std::vector<int32_t> len(static_cast<size_t>(batch));
    for (int s = 0; s < batch; ++s) {
      len[static_cast<size_t>(s)] = 3 + 7 * s;
      prefill.push_back({uint64_t(100 + s), 0, len[static_cast<size_t>(s)]});
      auto p = random_tokens(this->rng, static_cast<size_t>(len[static_cast<size_t>(s)]), V);
      ids.insert(ids.end(), p.begin(), p.end());
    }
    auto ref = step_both(*cpu, *gpu, prefill, ids, this->logit_tol(), "prefill");
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int s = 0; s < batch; ++s) next[static_cast<size_t>(s)] = top1(ref.data() + s * V, V).first;
    SamplingParams greedy;
    greedy.temperature = 0;
    std::vector<cuda::SampleRow> rows(static_cast<size_t>(batch), cuda::SampleRow{&greedy, {}, {}, 0});
    int compared = 0;
    for (int step = 0; step < 6; ++step) {
      std::vector<SeqSlice> slices;
      for (int s = 0; s < batch; ++s) slices.push_back({uint64_t(100 + s), len[static_cast<size_t>(s)], 1});
      std::vector<int32_t> got(static_cast<size_t>(batch));
      Status st = gpu->decode(slices, next.data(), rows, got.data());
      ASSERT_TRUE(st.ok()) << st.message();
      // The CPU's logits for the same step.
      std::vector<float> hidden(static_cast<size_t>(batch) * static_cast<size_t>(cfg.n_embd)), logits(static_cast<size_t>(batch) * static_cast<size_t>(V));
      ASSERT_TRUE(cpu->embed(slices, next.data(), hidden.data()).ok());
      ASSERT_TRUE(cpu->forward(slices, hidden.data()).ok());
      ASSERT_TRUE(cpu->logits(slices, hidden.data(), false, logits.data()).ok());
      for (int s = 0; s < batch; ++s) {
        const auto [tok, gap] = top1(logits.data() + s * V, V);
        if (gap > 0.02f) {  // well above the logits' error (~1e-3)
          EXPECT_EQ(got[static_cast<size_t>(s)], tok) << "batch " << batch << " step " << step << " row " << s << " gap " << gap;
          ++compared;
        }
        next[static_cast<size_t>(s)] = tok;
        ++len[static_cast<size_t>(s)];
      }
    }
    EXPECT_GT(compared, 0);
    EXPECT_EQ(gpu->captured_graphs(), 1u) << "one bucket per batch size";
  }
}

TYPED_TEST(GpuStageTest, GraphAndEagerDecodeAgree) {
  SEED_TRACE();
  const ModelConfig cfg = small_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
  auto graph = GpuStage::create(w, options(this->dtype(), true)).value();
  auto eager = GpuStage::create(w, options(this->dtype(), false)).value();
  // Untimed GEMM plans: both stages pick the same algorithms, so the same bits.
  graph->gemm().set_tuning(false);
  eager->gemm().set_tuning(false);
  const int batch = 4;
  std::vector<SeqSlice> prefill;
  std::vector<int32_t> ids;
  for (int s = 0; s < batch; ++s) {
    prefill.push_back({uint64_t(s), 0, 9});
    auto p = random_tokens(this->rng, 9, cfg.vocab_size);
    ids.insert(ids.end(), p.begin(), p.end());
  }
  for (GpuStage* g : {graph.get(), eager.get()}) {
    ASSERT_TRUE(g->embed(prefill, ids.data()).ok());
    ASSERT_TRUE(g->forward(prefill).ok());
  }
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<cuda::SampleRow> rows(static_cast<size_t>(batch), cuda::SampleRow{&greedy, {}, {}, 0});
  std::vector<int32_t> next = {1, 2, 3, 4};
  for (int step = 0; step < 8; ++step) {
    std::vector<SeqSlice> slices;
    for (int s = 0; s < batch; ++s) slices.push_back({uint64_t(s), 9 + step, 1});
    std::vector<int32_t> a(static_cast<size_t>(batch)), b(static_cast<size_t>(batch));
    ASSERT_TRUE(graph->decode(slices, next.data(), rows, a.data()).ok());
    ASSERT_TRUE(eager->decode(slices, next.data(), rows, b.data()).ok());
    // Same kernels, same plans, same split counts: the same bits, so the same tokens.
    EXPECT_EQ(a, b) << "step " << step;
    next = a;
  }
  EXPECT_EQ(graph->captured_graphs(), 1u);
  EXPECT_EQ(eager->captured_graphs(), 0u);
}

TYPED_TEST(GpuStageTest, PipelineSplitMatchesCpu) {
  SEED_TRACE();
  const ModelConfig cfg = small_config();
  const StageWeights all = random_stage_weights(cfg, 0, 3, this->seed);
  auto cpu = CpuStage::create(all).value();
  auto first = GpuStage::create(random_stage_weights(cfg, 0, 2, this->seed), options(this->dtype())).value();
  auto last = GpuStage::create(random_stage_weights(cfg, 2, 3, this->seed), options(this->dtype())).value();
  EXPECT_TRUE(first->has_embedding() && !first->has_head());
  EXPECT_TRUE(!last->has_embedding() && last->has_head());
  const int64_t C = cfg.n_embd, V = cfg.vocab_size;
  std::vector<SeqSlice> slices = {{5, 0, 30}, {6, 0, 12}};
  auto ids = random_tokens(this->rng, 42, V);
  std::vector<float> hidden(static_cast<size_t>(42 * C)), ref(static_cast<size_t>(2 * V)), got(static_cast<size_t>(2 * V));
  ASSERT_TRUE(cpu->embed(slices, ids.data(), hidden.data()).ok());
  ASSERT_TRUE(cpu->forward(slices, hidden.data()).ok());
  ASSERT_TRUE(cpu->logits(slices, hidden.data(), false, ref.data()).ok());
  ASSERT_TRUE(first->embed(slices, ids.data()).ok());
  ASSERT_TRUE(first->forward(slices).ok());
  std::vector<float> handoff(static_cast<size_t>(42 * C));
  ASSERT_TRUE(first->download_hidden(handoff.data(), 42).ok());
  ASSERT_TRUE(last->upload_hidden(handoff.data(), 42).ok());
  ASSERT_TRUE(last->forward(slices).ok());
  ASSERT_TRUE(last->logits(slices, false, got.data()).ok());
  for (int i = 0; i < 2; ++i) EXPECT_LT(rel_err(got.data() + i * V, ref.data() + i * V, static_cast<size_t>(V)), this->logit_tol());

  // All positions.
  std::vector<float> ref_all(static_cast<size_t>(42 * V)), got_all(static_cast<size_t>(42 * V));
  ASSERT_TRUE(cpu->logits(slices, hidden.data(), true, ref_all.data()).ok());
  ASSERT_TRUE(last->logits(slices, true, got_all.data()).ok());
  EXPECT_LT(rel_err(got_all.data(), ref_all.data(), got_all.size()), this->logit_tol());

  // One decode step through both stages' graph path.
  std::vector<SeqSlice> dec = {{5, 30, 1}, {6, 12, 1}};
  int32_t next[2] = {7, 8};
  ASSERT_TRUE(first->decode(dec, next, {}, nullptr).ok());
  ASSERT_TRUE(first->download_hidden(handoff.data(), 2).ok());
  ASSERT_TRUE(last->upload_hidden(handoff.data(), 2).ok());
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<cuda::SampleRow> rows(2, cuda::SampleRow{&greedy, {}, {}, 0});
  int32_t tokens[2] = {-1, -1};
  ASSERT_TRUE(last->decode(dec, nullptr, rows, tokens).ok());
  std::vector<float> h2(static_cast<size_t>(2 * C)), l2(static_cast<size_t>(2 * V));
  ASSERT_TRUE(cpu->embed(dec, next, h2.data()).ok());
  ASSERT_TRUE(cpu->forward(dec, h2.data()).ok());
  ASSERT_TRUE(cpu->logits(dec, h2.data(), false, l2.data()).ok());
  for (int s = 0; s < 2; ++s) {
    const auto [tok, gap] = top1(l2.data() + s * V, V);
    if (gap > 0.02f) {
      EXPECT_EQ(tokens[s], tok) << "row " << s;
    }
  }
}

TYPED_TEST(GpuStageTest, SamplingMatchesCpuOnSameLogits) {
  SEED_TRACE();
  const ModelConfig cfg = small_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
  auto gpu = GpuStage::create(w, options(this->dtype())).value();
  const int64_t V = cfg.vocab_size;
  std::vector<SeqSlice> slices = {{1, 0, 6}, {2, 0, 3}, {3, 0, 11}};
  auto ids = random_tokens(this->rng, 20, V);
  ASSERT_TRUE(gpu->embed(slices, ids.data()).ok());
  ASSERT_TRUE(gpu->forward(slices).ok());
  std::vector<SamplingParams> params(3);
  params[0].temperature = 0.8f, params[0].top_k = 40, params[0].seed = this->seed;
  params[1].temperature = 1.0f, params[1].top_p = 0.9f, params[1].repetition_penalty = 1.2f, params[1].seed = 7;
  params[2].temperature = 0.f, params[2].presence_penalty = 0.4f, params[2].frequency_penalty = 0.1f;
  std::vector<int32_t> gen = {4, 4, 9};
  std::vector<cuda::SampleRow> rows;
  for (size_t i = 0; i < 3; ++i) rows.push_back({&params[i], std::span<const int32_t>(ids.data(), 6), gen, 0});
  for (int round = 0; round < 4; ++round) {
    std::vector<float> logits(static_cast<size_t>(3 * V));
    ASSERT_TRUE(gpu->logits(slices, false, logits.data()).ok());
    std::vector<int32_t> got(3);
    ASSERT_TRUE(gpu->sample(rows, got.data()).ok());
    for (size_t i = 0; i < 3; ++i) {
      std::vector<float> row(logits.begin() + int64_t(i) * V, logits.begin() + int64_t(i + 1) * V);
      EXPECT_EQ(got[i], sample_next(row, params[i], rows[i].prompt, gen, 0)) << "round " << round << " row " << i;
    }
    params[0].seed += 1, params[1].seed += 1;
  }
  // sample() needs fresh logits.
  std::vector<int32_t> got(3);
  EXPECT_FALSE(gpu->sample(rows, got.data()).ok());
}

TYPED_TEST(GpuStageTest, ErrorsChangeNothing) {
  SEED_TRACE();
  const ModelConfig cfg = small_config();
  const StageWeights w = random_stage_weights(cfg, 0, cfg.n_layer, this->seed);
  GpuStageOptions o = options(this->dtype());
  o.kv_cache_max_bytes = cuda::KvCache::page_bytes(cfg.n_layer, cfg.n_head, cfg.head_dim(), this->dtype()) * 10;  // 160 positions
  auto gpu = GpuStage::create(w, o).value();
  EXPECT_EQ(gpu->kv_capacity_tokens(), 160);
  auto ids = random_tokens(this->rng, 200, cfg.vocab_size);
  std::vector<SeqSlice> a = {{1, 0, 100}};
  ASSERT_TRUE(gpu->embed(a, ids.data()).ok());
  ASSERT_TRUE(gpu->forward(a).ok());
  // Wrong start position.
  Status s = gpu->forward(std::vector<SeqSlice>{{1, 50, 1}});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("cached"), std::string::npos) << s.message();
  // The cache is full: 100 + 70 positions > 160. Neither sequence changes.
  std::vector<SeqSlice> b = {{2, 0, 30}, {3, 0, 40}};
  ASSERT_TRUE(gpu->embed(b, ids.data()).ok());
  s = gpu->forward(b);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("KV cache full"), std::string::npos) << s.message();
  EXPECT_EQ(gpu->cached_tokens(2), -1);
  EXPECT_EQ(gpu->cached_tokens(3), -1);
  EXPECT_EQ(gpu->kv_free_tokens(), 160 - 112);
  // Freeing makes room.
  gpu->free_sequence(1);
  EXPECT_EQ(gpu->kv_free_tokens(), 160);
  EXPECT_TRUE(gpu->forward(b).ok());
  // Token ids outside the vocabulary, a repeated sequence, decode of two tokens.
  int32_t bad = int32_t(cfg.vocab_size);
  EXPECT_FALSE(gpu->embed(std::vector<SeqSlice>{{9, 0, 1}}, &bad).ok());
  EXPECT_FALSE(gpu->forward(std::vector<SeqSlice>{{2, 30, 1}, {2, 30, 1}}).ok());
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<cuda::SampleRow> rows(1, cuda::SampleRow{&greedy, {}, {}, 0});
  int32_t tok = 0, two[2] = {1, 2};
  EXPECT_FALSE(gpu->decode(std::vector<SeqSlice>{{2, 30, 2}}, two, rows, &tok).ok());
  EXPECT_EQ(gpu->cached_tokens(2), 30);
  // Beyond the context.
  EXPECT_FALSE(gpu->forward(std::vector<SeqSlice>{{2, 30, 300}}).ok());
}

TYPED_TEST(GpuStageTest, OutOfMemoryNamesStageAndSizes) {
  const ModelConfig cfg = small_config();
  GpuStageOptions o = options(this->dtype());
  o.name = "stage-7";
  o.max_tokens = int64_t(1) << 33;  // activations of 2^33 rows cannot fit
  auto gpu = GpuStage::create_synthetic(cfg, 0, cfg.n_layer, 1, o);
  ASSERT_FALSE(gpu.ok()) << "no error";
  const std::string& m = gpu.error();
  EXPECT_NE(m.find("stage-7"), std::string::npos) << m;
  EXPECT_NE(m.find("bytes asked"), std::string::npos) << m;
  EXPECT_NE(m.find("bytes free"), std::string::npos) << m;
}

TYPED_TEST(GpuStageTest, SyntheticWeightsDecode) {
  ModelConfig cfg = small_config();
  cfg.n_layer = 4;
  auto gpu = GpuStage::create_synthetic(cfg, 0, cfg.n_layer, 123, options(this->dtype())).value();
  EXPECT_GT(gpu->weight_bytes(), 0);
  EXPECT_FALSE(gpu->memory_report().empty());
  std::vector<SeqSlice> p = {{1, 0, 10}, {2, 0, 4}};
  auto ids = random_tokens(this->rng, 14, cfg.vocab_size);
  ASSERT_TRUE(gpu->embed(p, ids.data()).ok());
  ASSERT_TRUE(gpu->forward(p).ok());
  SamplingParams sp;
  sp.temperature = 0.9f, sp.top_k = 10;
  std::vector<cuda::SampleRow> rows(2, cuda::SampleRow{&sp, {}, {}, 0});
  int32_t next[2] = {3, 4};
  for (int step = 0; step < 4; ++step) {
    int32_t out[2] = {-1, -1};
    ASSERT_TRUE(gpu->decode(std::vector<SeqSlice>{{1, 10 + step, 1}, {2, 4 + step, 1}}, next, rows, out).ok());
    for (int s = 0; s < 2; ++s) EXPECT_TRUE(out[s] >= 0 && out[s] < cfg.vocab_size) << out[s];
    std::copy(out, out + 2, next);
  }
  EXPECT_EQ(gpu->cached_tokens(1), 14);
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

// The GPU stage's answers depend on the sequence alone (docs/ARCHITECTURE.md, "Determinism"):
// with deterministic mode on (the default), a sequence's logits, and the token and log-prob
// each decode step draws from them, are the same bits
//   - alone, and among 255 other sequences at random places in the micro-batches;
//   - with its prompt in one chunk or in several, beside other prompts;
//   - through one stage or two (the hidden state handed over as the pipeline does);
//   - rebuilt through prefill after N decode steps on a fresh stage (a failover's replay),
//     which also proves the K/V the prefill wrote: the step after it reads all of it;
// in fp16 and bf16, with fp16/bf16 or int8 weights, through the CUDA-graph decode path, at
// tensor parallel 1 and 2 (the two ranks share GPU 0 on a one-GPU machine; the custom
// all-reduce sums them in rank order). The prompt is longer than one attention piece
// (kDecodePiece), so the pieces' merge is exercised too.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuDeterminism, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/gemm.h"
#include "model/weights.h"
#include "stage/cuda/gpu_stage.h"
#include "stage/cuda/tp_stage.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

using cuda::GpuStageOptions;

struct Mode {
  DType dtype;
  bool int8;
  int tp;
  const char* name;
  bool fp8 = false;     // E4M3 layer matrices and activations (Hopper)
  bool kv_fp8 = false;  // the K/V cache in E4M3 with per-token scales
};

ModelConfig det_config() {
  ModelConfig c;
  c.n_layer = 4;
  c.n_embd = 256;
  c.n_head = 4;  // head_dim 64
  c.n_inner = 1024;
  c.n_positions = 1024;
  c.vocab_size = 2003;
  c.layer_norm_epsilon = 1e-5f;
  c.activation = Activation::GeluNew;
  c.tie_word_embeddings = true;
  return c;
}

constexpr int kPrompt = cuda::kDecodePiece + 45;  // two attention pieces
constexpr int kSteps = 6;
constexpr uint64_t kTarget = 1;

std::vector<int32_t> random_tokens(std::mt19937& rng, size_t n, int64_t V) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % uint32_t(V));
  return t;
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// The first index where two rows of floats differ in their bits, or -1.
int64_t first_difference(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) return int64_t(i);
  return -1;
}

// One pipeline of one or two stages (each a TpStage of mode.tp ranks) over the same
// weights, used the way a worker uses it.
class Pipe {
 public:
  Pipe(const ModelConfig& cfg, const Mode& mode, int stages, uint64_t seed) : cfg_(cfg) {
    GpuStageOptions o;
    o.dtype = mode.dtype;
    o.int8_weights = mode.int8;
    o.fp8 = mode.fp8;
    o.kv_fp8 = mode.kv_fp8;
    o.name = "det-stage";
    o.max_tokens = 2048;
    o.max_seqs = 256;
    o.kv_cache_max_bytes = int64_t(512) << 20;
    const int64_t split = stages == 1 ? cfg.n_layer : cfg.n_layer / 2;
    const int gpus = testing::gpu_count();
    std::vector<int> devices;
    for (int r = 0; r < mode.tp; ++r) devices.push_back(r % gpus);
    auto a = cuda::TpStage::create(random_stage_weights(cfg, 0, split, seed), devices, o);
    if (!a) throw std::runtime_error(a.status().message());
    stages_.push_back(std::move(a).value());
    if (stages == 2) {
      auto b = cuda::TpStage::create(random_stage_weights(cfg, split, cfg.n_layer, seed), devices, o);
      if (!b) throw std::runtime_error(b.status().message());
      stages_.push_back(std::move(b).value());
    }
    for (auto& s : stages_)
      for (int r = 0; r < s->ranks(); ++r)
        if (!s->rank(r).gemm().deterministic())
          throw std::runtime_error("deterministic mode is off (CONVEYOR_DETERMINISTIC=0?)");
  }

  // Prefill (or any forward) of `slices`: the last row of each slice's logits, [slices, V].
  std::vector<float> forward(const std::vector<SeqSlice>& slices, const std::vector<int32_t>& ids) {
    const int64_t n = total_tokens(slices);
    check(stages_[0]->embed(slices, ids.data()));
    check(stages_[0]->forward(slices));
    for (size_t i = 1; i < stages_.size(); ++i) {
      std::vector<float> h(size_t(n * cfg_.n_embd));
      check(stages_[i - 1]->download_hidden(h.data(), n));
      check(stages_[i]->upload_hidden(h.data(), n));
      check(stages_[i]->forward(slices));
    }
    std::vector<float> out(slices.size() * size_t(cfg_.vocab_size));
    check(stages_.back()->logits(slices, false, out.data()));
    return out;
  }

  // A greedy choice from the logits of the last forward (sample()): token and log-prob.
  void sample_last(size_t rows, std::vector<int32_t>& tokens, std::vector<float>& logprobs) {
    std::vector<SeqSlice> dummy;
    tokens.assign(rows, -1);
    logprobs.assign(rows, 0.f);
    std::vector<cuda::SampleRow> r(rows, cuda::SampleRow{&greedy_, {}, {}, 0});
    check(stages_.back()->sample(r, tokens.data(), logprobs.data()));
  }

  // One decode step (the fast path: graphs up to 128 rows): tokens and log-probs per slice.
  void decode(const std::vector<SeqSlice>& slices, const std::vector<int32_t>& ids, std::vector<int32_t>& tokens,
              std::vector<float>& logprobs) {
    const int64_t n = int64_t(slices.size());
    std::vector<cuda::SampleRow> rows(slices.size(), cuda::SampleRow{&greedy_, {}, {}, 0});
    tokens.assign(slices.size(), -1);
    logprobs.assign(slices.size(), 0.f);
    if (stages_.size() == 1) {
      check(stages_[0]->decode(slices, ids.data(), rows, tokens.data(), logprobs.data()));
      return;
    }
    check(stages_[0]->decode(slices, ids.data(), {}, nullptr));
    std::vector<float> h(size_t(n * cfg_.n_embd));
    check(stages_[0]->download_hidden(h.data(), n));
    check(stages_[1]->upload_hidden(h.data(), n));
    check(stages_[1]->decode(slices, nullptr, rows, tokens.data(), logprobs.data()));
  }

 private:
  static void check(const Status& s) {
    if (!s.ok()) throw std::runtime_error(s.message());
  }
  ModelConfig cfg_;
  std::vector<std::unique_ptr<cuda::TpStage>> stages_;
  SamplingParams greedy_ = [] {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }();
};

// What a run of the target sequence produced: its prompt's last logits, then per decode step
// the token and its log-prob.
struct Trace {
  std::vector<float> prompt_logits;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

class GpuDeterminism : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    if (!testing::have_gpu()) GTEST_SKIP() << "no GPU";
    // Ranks share GPUs round-robin (tests/test_util.h). Four ranks on one GPU hung inside the
    // all-reduce until its calls took at most a 2k-th of the SMs for k ranks on a GPU
    // (custom_all_reduce.h, max_blocks_; an H100, 2026-11-27).
    if (GetParam().fp8) {
      cuda::Gemm gemm;
      if (Status s = gemm.fp8_supported(); !s) GTEST_SKIP() << s.message();
    }
    rng_.seed(20261125);
    prompt_ = random_tokens(rng_, kPrompt, cfg_.vocab_size);
  }

  // The target alone: its prompt in one chunk, then kSteps greedy decode steps.
  Trace alone(int stages) {
    Pipe pipe(cfg_, GetParam(), stages, kSeed);
    Trace t;
    t.prompt_logits = pipe.forward({{kTarget, 0, kPrompt}}, prompt_);
    std::vector<int32_t> tok;
    std::vector<float> lp;
    pipe.sample_last(1, tok, lp);
    int32_t next = tok[0];
    for (int s = 0; s < kSteps; ++s) {
      t.tokens.push_back(next);
      t.logprobs.push_back(lp[0]);
      pipe.decode({{kTarget, kPrompt + s, 1}}, {next}, tok, lp);
      next = tok[0];
    }
    t.tokens.push_back(next);
    t.logprobs.push_back(lp[0]);
    return t;
  }

  void expect_same(const Trace& got, const Trace& want, const std::string& what) {
    const size_t V = size_t(cfg_.vocab_size);
    ASSERT_EQ(got.prompt_logits.size(), V) << what;
    EXPECT_EQ(first_difference(got.prompt_logits.data(), want.prompt_logits.data(), V), -1)
        << what << ": the prompt's logits differ (first differing vocabulary index shown)";
    ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
    for (size_t i = 0; i < got.tokens.size(); ++i) {
      EXPECT_EQ(got.tokens[i], want.tokens[i]) << what << ": token " << i;
      EXPECT_TRUE(same_bits(&got.logprobs[i], &want.logprobs[i], 1))
          << what << ": log-prob of token " << i << " " << got.logprobs[i] << " vs " << want.logprobs[i];
    }
  }

  static constexpr uint64_t kSeed = 77;
  ModelConfig cfg_ = det_config();
  std::mt19937 rng_;
  std::vector<int32_t> prompt_;
};

TEST_P(GpuDeterminism, AloneAndAmongOthers) {
  const Trace ref = alone(1);
  const int64_t V = cfg_.vocab_size;
  for (int others : {31, 255}) {  // the decode graphs of 32 and 256 rows
    SCOPED_TRACE(std::to_string(others) + " others");
    Pipe pipe(cfg_, GetParam(), 1, kSeed);
    // The others' prompts (1..40 tokens), then the target's at a random slot of the first
    // micro-batch, which takes at most 1,500 tokens; the rest follow in later micro-batches.
    std::vector<std::vector<int32_t>> prompts(size_t(others) + 1);
    std::vector<uint64_t> ids(size_t(others) + 1);
    for (int i = 0; i < others; ++i) {
      prompts[size_t(i) + 1] = random_tokens(rng_, 1 + rng_() % 40, V);
      ids[size_t(i) + 1] = 100 + uint64_t(i);
    }
    prompts[0] = prompt_;
    ids[0] = kTarget;
    std::vector<size_t> order(prompts.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin() + 1, order.end(), rng_);
    std::swap(order[0], order[rng_() % std::min<size_t>(order.size(), 20)]);  // target among the first 20
    std::vector<int32_t> len(prompts.size()), next(prompts.size());
    Trace got;
    for (size_t i = 0; i < order.size();) {
      std::vector<SeqSlice> slices;
      std::vector<int32_t> toks;
      int64_t n = 0;
      while (i < order.size() && n + int64_t(prompts[order[i]].size()) <= 1500) {
        const size_t k = order[i++];
        slices.push_back({ids[k], 0, int32_t(prompts[k].size())});
        toks.insert(toks.end(), prompts[k].begin(), prompts[k].end());
        n += int64_t(prompts[k].size());
      }
      const std::vector<float> logits = pipe.forward(slices, toks);
      std::vector<int32_t> tok;
      std::vector<float> lp;
      pipe.sample_last(slices.size(), tok, lp);
      for (size_t j = 0; j < slices.size(); ++j) {
        const size_t k = slices[j].seq_id == kTarget ? 0 : size_t(slices[j].seq_id - 99);
        len[k] = slices[j].num_tokens;
        next[k] = tok[j];
        if (k == 0) {
          got.prompt_logits.assign(logits.begin() + int64_t(j) * V, logits.begin() + int64_t(j + 1) * V);
          got.tokens.push_back(tok[j]);
          got.logprobs.push_back(lp[j]);
        }
      }
    }
    for (int s = 0; s < kSteps; ++s) {
      std::shuffle(order.begin(), order.end(), rng_);  // the target's row moves every step
      std::vector<SeqSlice> slices;
      std::vector<int32_t> toks;
      for (size_t k : order) {
        slices.push_back({ids[k], len[k], 1});
        toks.push_back(next[k]);
      }
      std::vector<int32_t> tok;
      std::vector<float> lp;
      pipe.decode(slices, toks, tok, lp);
      for (size_t j = 0; j < order.size(); ++j) {
        const size_t k = order[j];
        ++len[k];
        next[k] = tok[j];
        if (k == 0) got.tokens.push_back(tok[j]), got.logprobs.push_back(lp[j]);
      }
    }
    expect_same(got, ref, "among " + std::to_string(others) + " others");
  }
}

TEST_P(GpuDeterminism, PromptInChunks) {
  const Trace ref = alone(1);
  const int64_t V = cfg_.vocab_size;
  for (const std::vector<int>& chunks : {std::vector<int>{1, 7, 100}, std::vector<int>{cuda::kDecodePiece - 1, 2}}) {
    Pipe pipe(cfg_, GetParam(), 1, kSeed);
    // Each chunk travels with a short prompt of another sequence, which is placed first.
    int pos = 0;
    uint64_t other = 500;
    std::vector<int> sizes = chunks;
    sizes.push_back(kPrompt - std::accumulate(chunks.begin(), chunks.end(), 0));
    std::vector<float> last;
    for (int c : sizes) {
      auto extra = random_tokens(rng_, 5, V);
      std::vector<int32_t> toks = extra;
      toks.insert(toks.end(), prompt_.begin() + pos, prompt_.begin() + pos + c);
      const std::vector<float> logits = pipe.forward({{other++, 0, 5}, {kTarget, pos, c}}, toks);
      last.assign(logits.begin() + V, logits.end());
      pos += c;
    }
    Trace got;
    got.prompt_logits = last;
    std::vector<int32_t> tok;
    std::vector<float> lp;
    pipe.sample_last(2, tok, lp);
    int32_t next = tok[1];
    float next_lp = lp[1];
    for (int s = 0; s < kSteps; ++s) {
      got.tokens.push_back(next);
      got.logprobs.push_back(next_lp);
      pipe.decode({{kTarget, kPrompt + s, 1}}, {next}, tok, lp);
      next = tok[0], next_lp = lp[0];
    }
    got.tokens.push_back(next);
    got.logprobs.push_back(next_lp);
    std::string what = "chunks";
    for (int c : sizes) what += " " + std::to_string(c);
    expect_same(got, ref, what);
  }
}

TEST_P(GpuDeterminism, OneStageOrTwo) { expect_same(alone(2), alone(1), "two stages against one"); }

TEST_P(GpuDeterminism, ReplayAfterDecodeSteps) {
  const Trace ref = alone(1);
  const int64_t V = cfg_.vocab_size;
  // A fresh stage (the spare after a failover) rebuilds prompt + the first k generated tokens
  // through prefill; its next token and log-prob must be the original's, and so must the
  // step after, which reads every K/V position the prefill wrote.
  for (int k : {1, kSteps - 1}) {
    SCOPED_TRACE("replayed after " + std::to_string(k) + " decode steps");
    Pipe pipe(cfg_, GetParam(), 1, kSeed);
    std::vector<int32_t> toks = prompt_;
    toks.insert(toks.end(), ref.tokens.begin(), ref.tokens.begin() + k);
    const int32_t n = int32_t(toks.size());
    const std::vector<float> logits = pipe.forward({{kTarget, 0, n}}, toks);
    ASSERT_EQ(int64_t(logits.size()), V);
    std::vector<int32_t> tok;
    std::vector<float> lp;
    pipe.sample_last(1, tok, lp);
    EXPECT_EQ(tok[0], ref.tokens[size_t(k)]);
    EXPECT_TRUE(same_bits(&lp[0], &ref.logprobs[size_t(k)], 1)) << lp[0] << " vs " << ref.logprobs[size_t(k)];
    pipe.decode({{kTarget, n, 1}}, {ref.tokens[size_t(k)]}, tok, lp);
    EXPECT_EQ(tok[0], ref.tokens[size_t(k) + 1]);
    EXPECT_TRUE(same_bits(&lp[0], &ref.logprobs[size_t(k) + 1], 1))
        << lp[0] << " vs " << ref.logprobs[size_t(k) + 1];
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuDeterminism,
                         ::testing::Values(Mode{DType::F16, false, 1, "fp16"}, Mode{DType::BF16, false, 1, "bf16"},
                                           Mode{DType::F16, true, 1, "fp16_int8"},
                                           Mode{DType::BF16, true, 1, "bf16_int8"}, Mode{DType::F16, false, 2, "fp16_tp2"},
                                           Mode{DType::BF16, false, 2, "bf16_tp2"},
                                           Mode{DType::F16, true, 2, "fp16_int8_tp2"},
                                           Mode{DType::F16, false, 1, "fp16_fp8", true},
                                           Mode{DType::BF16, false, 1, "bf16_fp8", true},
                                           Mode{DType::F16, false, 2, "fp16_fp8_tp2", true},
                                           Mode{DType::F16, false, 1, "fp16_kvfp8", false, true},
                                           Mode{DType::BF16, false, 1, "bf16_kvfp8", false, true},
                                           Mode{DType::F16, false, 2, "fp16_kvfp8_tp2", false, true},
                                           Mode{DType::F16, false, 1, "fp16_fp8_kvfp8", true, true},
                                           Mode{DType::F16, false, 4, "fp16_tp4"}, Mode{DType::BF16, false, 4, "bf16_tp4"}),
                         [](const ::testing::TestParamInfo<Mode>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

// CpuStage against a naive double-precision GPT-2, its batch invariance (bit-exact: alone
// vs in a batch, one pass vs chunks vs token by token, one stage vs a pipeline split), its
// errors and KV figures; random_stage_weights; and the Engine built on it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <vector>

#include "stage/cpu/cpu_stage.h"
#include "stage/engine.h"
#include "kernels/cpu/sampling.h"
#include "model/weights.h"

namespace conveyor {
namespace {

ModelConfig tiny_config(Activation act = Activation::GeluNew, bool tied = true) {
  ModelConfig c;
  c.n_layer = 3;
  c.n_embd = 48;
  c.n_head = 4;
  c.n_inner = 100;  // odd on purpose (not 4 * n_embd)
  c.n_positions = 64;
  c.vocab_size = 97;
  c.layer_norm_epsilon = 1e-5f;
  c.activation = act;
  c.tie_word_embeddings = tied;
  c.eos_token_id = -1;
  return c;
}

std::vector<int32_t> random_tokens(size_t n, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % uint32_t(V));
  return t;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- Double-precision reference: the whole sequence at once, no cache. ----
using Mat = std::vector<double>;  // row-major

void ref_layernorm(Mat& x, int64_t T, int64_t C, const std::vector<float>& g, const std::vector<float>& b, double eps) {
  for (int64_t t = 0; t < T; ++t) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[size_t(t * C + c)];
    m /= double(C);
    for (int64_t c = 0; c < C; ++c) v += (x[size_t(t * C + c)] - m) * (x[size_t(t * C + c)] - m);
    v /= double(C);
    for (int64_t c = 0; c < C; ++c)
      x[size_t(t * C + c)] = (x[size_t(t * C + c)] - m) / std::sqrt(v + eps) * g[size_t(c)] + b[size_t(c)];
  }
}

Mat ref_linear(const Mat& x, int64_t T, int64_t K, int64_t N, const std::vector<float>& w, const std::vector<float>& b) {
  Mat y(size_t(T * N));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double s = b.empty() ? 0.0 : b[size_t(n)];
      for (int64_t k = 0; k < K; ++k) s += x[size_t(t * K + k)] * w[size_t(k * N + n)];
      y[size_t(t * N + n)] = s;
    }
  return y;
}

// Logits [T, V] of every position of `tokens`.
Mat reference_logits(const StageWeights& w, const std::vector<int32_t>& tokens) {
  const ModelConfig& c = w.config;
  const int64_t T = int64_t(tokens.size()), C = c.n_embd, H = c.n_head, D = c.head_dim(), I = c.n_inner,
                V = c.vocab_size;
  Mat x(size_t(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < C; ++i)
      x[size_t(t * C + i)] = double(w.wte[size_t(tokens[size_t(t)] * C + i)]) + w.wpe[size_t(t * C + i)];
  for (const LayerWeights& l : w.layers) {
    Mat h = x;
    ref_layernorm(h, T, C, l.ln_1_g, l.ln_1_b, c.layer_norm_epsilon);
    const Mat qkv = ref_linear(h, T, C, 3 * C, l.attn_qkv_w, l.attn_qkv_b);
    Mat y(size_t(T * C), 0.0);
    for (int64_t hd = 0; hd < H; ++hd)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(size_t(i + 1));
        double m = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t e = 0; e < D; ++e)
            d += qkv[size_t(i * 3 * C + hd * D + e)] * qkv[size_t(j * 3 * C + C + hd * D + e)];
          s[size_t(j)] = d / std::sqrt(double(D));
          m = std::max(m, s[size_t(j)]);
        }
        for (auto& v : s) sum += (v = std::exp(v - m));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t e = 0; e < D; ++e)
            y[size_t(i * C + hd * D + e)] += s[size_t(j)] / sum * qkv[size_t(j * 3 * C + 2 * C + hd * D + e)];
      }
    const Mat a = ref_linear(y, T, C, C, l.attn_proj_w, l.attn_proj_b);
    for (size_t i = 0; i < x.size(); ++i) x[i] += a[i];
    h = x;
    ref_layernorm(h, T, C, l.ln_2_g, l.ln_2_b, c.layer_norm_epsilon);
    Mat f = ref_linear(h, T, C, I, l.mlp_fc_w, l.mlp_fc_b);
    for (double& v : f)
      v = c.activation == Activation::GeluNew
              ? 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)))
              : 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    const Mat p = ref_linear(f, T, I, C, l.mlp_proj_w, l.mlp_proj_b);
    for (size_t i = 0; i < x.size(); ++i) x[i] += p[i];
  }
  ref_layernorm(x, T, C, w.ln_f_g, w.ln_f_b, c.layer_norm_epsilon);
  const std::vector<float>& head = w.head_matrix();
  Mat logits(size_t(T * V));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t i = 0; i < C; ++i) s += x[size_t(t * C + i)] * head[size_t(v * C + i)];
      logits[size_t(t * V + v)] = s;
    }
  return logits;
}

// Runs slices through embed + forward + logits; returns the logits (all positions or last).
std::vector<float> run(CpuStage& st, const std::vector<SeqSlice>& slices, const std::vector<int32_t>& ids,
                       bool all_positions) {
  const int64_t T = total_tokens(slices), C = st.config().n_embd, V = st.config().vocab_size;
  std::vector<float> hidden(size_t(T * C));
  Status s = st.embed(slices, ids.data(), hidden.data());
  EXPECT_TRUE(s.ok()) << s.message();
  s = st.forward(slices, hidden.data());
  EXPECT_TRUE(s.ok()) << s.message();
  std::vector<float> out(size_t((all_positions ? T : int64_t(slices.size())) * V));
  s = st.logits(slices, hidden.data(), all_positions, out.data());
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

TEST(CpuStage, MatchesDoubleReference) {
  for (Activation act : {Activation::GeluNew, Activation::Gelu}) {
    for (bool tied : {true, false}) {
      const ModelConfig c = tiny_config(act, tied);
      const StageWeights w = random_stage_weights(c, 0, c.n_layer, 7);
      const Mat ref_prompt = reference_logits(w, random_tokens(21, c.vocab_size, 1));
      auto st = CpuStage::create(w).value();
      const auto tokens = random_tokens(21, c.vocab_size, 1);
      const auto got = run(*st, {{1, 0, 21}}, tokens, true);
      double scale = 0;
      for (double v : ref_prompt) scale = std::max(scale, std::abs(v));
      ASSERT_GT(scale, 0.05);  // weights large enough that the check means something
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], ref_prompt[i], 1e-4 * scale) << "logit " << i << " tied=" << tied << " act=" << int(act);
    }
  }
}

// One sequence's logits, step by step: alone, and inside a micro-batch with 5 others
// (some prefilling in chunks, some decoding, arriving and leaving).
TEST(CpuStage, SequenceAloneEqualsSequenceInBatch) {
  const ModelConfig c = tiny_config();
  const StageWeights w = random_stage_weights(c, 0, c.n_layer, 3);
  const auto probe = random_tokens(30, c.vocab_size, 100);
  // Alone: prefill 10, then 20 single tokens.
  std::vector<std::vector<float>> alone;
  {
    auto st = CpuStage::create(w).value();
    alone.push_back(run(*st, {{7, 0, 10}}, {probe.begin(), probe.begin() + 10}, false));
    for (int p = 10; p < 30; ++p) alone.push_back(run(*st, {{7, p, 1}}, {probe[size_t(p)]}, false));
  }
  auto st = CpuStage::create(w).value();
  std::vector<std::vector<int32_t>> others;
  for (uint32_t i = 0; i < 5; ++i) others.push_back(random_tokens(60, c.vocab_size, 200 + i));
  std::vector<int32_t> pos(5, 0);
  std::mt19937 rng(5);
  for (int step = 0; step <= 20; ++step) {
    std::vector<SeqSlice> slices;
    std::vector<int32_t> ids;
    size_t probe_index = 0;
    // Others before the probe in some steps, after it in others.
    auto add_others = [&](size_t from, size_t to) {
      for (size_t i = from; i < to; ++i) {
        const int32_t n = int32_t(1 + rng() % 6);
        if (pos[i] + n > 60) continue;
        slices.push_back({100 + i, pos[i], n});
        ids.insert(ids.end(), others[i].begin() + pos[i], others[i].begin() + pos[i] + n);
        pos[i] += n;
      }
    };
    add_others(0, size_t(step % 6));
    probe_index = slices.size();
    const int32_t p0 = step == 0 ? 0 : 9 + step, n = step == 0 ? 10 : 1;
    slices.push_back({7, p0, n});
    ids.insert(ids.end(), probe.begin() + p0, probe.begin() + p0 + n);
    add_others(size_t(step % 6), 5);
    const auto out = run(*st, slices, ids, false);
    const std::vector<float> mine(out.begin() + int64_t(probe_index) * c.vocab_size,
                                  out.begin() + int64_t(probe_index + 1) * c.vocab_size);
    ASSERT_TRUE(same_bits(mine, alone[size_t(step)])) << "step " << step << " with " << slices.size() << " slices";
    if (step == 8) {  // a neighbour leaves; its id starts over as a new sequence
      st->free_sequence(102);
      pos[2] = 0;
    }
  }
}

TEST(CpuStage, ChunkedPrefillEqualsOnePassEqualsTokenByToken) {
  const ModelConfig c = tiny_config();
  const StageWeights w = random_stage_weights(c, 0, c.n_layer, 4);
  const auto tokens = random_tokens(40, c.vocab_size, 9);
  auto one = CpuStage::create(w).value();
  auto chunks = CpuStage::create(w).value();
  auto single = CpuStage::create(w).value();
  const auto whole = run(*one, {{1, 0, 40}}, tokens, true);
  std::vector<float> by_chunks, by_token;
  for (int32_t p = 0; p < 40; p += 3) {
    const int32_t n = std::min(3, 40 - p);
    const auto part = run(*chunks, {{1, p, n}}, {tokens.begin() + p, tokens.begin() + p + n}, true);
    by_chunks.insert(by_chunks.end(), part.begin(), part.end());
  }
  for (int32_t p = 0; p < 40; ++p) {
    const auto part = run(*single, {{1, p, 1}}, {tokens[size_t(p)]}, true);
    by_token.insert(by_token.end(), part.begin(), part.end());
  }
  EXPECT_TRUE(same_bits(whole, by_chunks));
  EXPECT_TRUE(same_bits(whole, by_token));
  // Last-token logits are the last row of the all-positions logits.
  auto last = CpuStage::create(w).value();
  const auto l = run(*last, {{1, 0, 40}}, tokens, false);
  EXPECT_TRUE(same_bits(l, std::vector<float>(whole.end() - c.vocab_size, whole.end())));
}

TEST(CpuStage, PipelineSplitEqualsOneStage) {
  const ModelConfig c = tiny_config();
  const auto tokens = random_tokens(17, c.vocab_size, 10);
  auto whole = CpuStage::create(random_stage_weights(c, 0, 3, 11)).value();
  const auto want = run(*whole, {{1, 0, 17}}, tokens, true);
  auto s0 = CpuStage::create(random_stage_weights(c, 0, 1, 11)).value();
  auto s1 = CpuStage::create(random_stage_weights(c, 1, 2, 11)).value();
  auto s2 = CpuStage::create(random_stage_weights(c, 2, 3, 11)).value();
  const std::vector<SeqSlice> slices = {{1, 0, 17}};
  std::vector<float> hidden(size_t(17 * c.n_embd)), got(size_t(17 * c.vocab_size));
  ASSERT_TRUE(s0->embed(slices, tokens.data(), hidden.data()).ok());
  ASSERT_TRUE(s0->forward(slices, hidden.data()).ok());
  ASSERT_TRUE(s1->forward(slices, hidden.data()).ok());
  ASSERT_TRUE(s2->forward(slices, hidden.data()).ok());
  ASSERT_TRUE(s2->logits(slices, hidden.data(), true, got.data()).ok());
  EXPECT_TRUE(same_bits(want, got));
  // Stage roles are enforced.
  EXPECT_FALSE(s1->embed(slices, tokens.data(), hidden.data()).ok());
  EXPECT_FALSE(s0->logits(slices, hidden.data(), true, got.data()).ok());
}

// Tensor parallel on 2 to 5 ranks against one (4 heads, 100 MLP units: 3 ranks split both
// unevenly, 5 leaves a rank without a head): the same logits up to the float rounding of
// the split sums, over steps that mix prefill chunks and decode steps of several
// sequences; still batch-invariant (a sequence alone = in a batch, bit for bit); a rank
// count beyond the MLP width is refused.
TEST(CpuStage, TensorParallelEqualsOneRank) {
  const ModelConfig c = tiny_config();
  const StageWeights w = random_stage_weights(c, 0, c.n_layer, 21);
  const auto t1 = random_tokens(20, c.vocab_size, 31), t2 = random_tokens(20, c.vocab_size, 32),
             t3 = random_tokens(20, c.vocab_size, 33);
  struct Step {
    std::vector<SeqSlice> slices;
    std::vector<int32_t> ids;
  };
  auto ids_of = [&](std::initializer_list<std::pair<const std::vector<int32_t>*, SeqSlice>> parts) {
    Step st;
    for (auto [t, sl] : parts) {
      st.slices.push_back(sl);
      st.ids.insert(st.ids.end(), t->begin() + sl.start_pos, t->begin() + sl.start_pos + sl.num_tokens);
    }
    return st;
  };
  const std::vector<Step> steps = {
      ids_of({{&t1, {1, 0, 12}}, {&t2, {2, 0, 5}}}),
      ids_of({{&t1, {1, 12, 1}}, {&t2, {2, 5, 7}}, {&t3, {3, 0, 3}}}),
      ids_of({{&t3, {3, 3, 1}}, {&t1, {1, 13, 1}}, {&t2, {2, 12, 1}}}),
  };
  std::vector<std::vector<float>> want;
  {
    auto one = CpuStage::create(w).value();
    for (const Step& st : steps) want.push_back(run(*one, st.slices, st.ids, false));
  }
  for (int tp : {2, 3, 4, 5}) {
    auto par = CpuStage::create(w, tp).value();
    ASSERT_EQ(par->tensor_parallel(), tp);
    for (size_t k = 0; k < steps.size(); ++k) {
      const auto got = run(*par, steps[k].slices, steps[k].ids, false);
      ASSERT_EQ(got.size(), want[k].size());
      double scale = 0;
      for (float v : want[k]) scale = std::max(scale, double(std::abs(v)));
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[k][i], 1e-5 * scale) << "tp " << tp << " step " << k << " logit " << i;
    }
    EXPECT_EQ(par->kv_bytes_used(), (14 + 13 + 4) * par->kv_bytes_per_token());
  }
  // Batch invariance at tp 3: sequence 1's last step alone equals it inside the batch.
  auto alone = CpuStage::create(w, 3).value();
  auto batch = CpuStage::create(w, 3).value();
  run(*alone, {{1, 0, 13}}, {t1.begin(), t1.begin() + 13}, false);
  const auto mine = run(*alone, {{1, 13, 1}}, {t1[13]}, false);
  run(*batch, steps[0].slices, steps[0].ids, false);
  run(*batch, steps[1].slices, steps[1].ids, false);
  const auto all = run(*batch, steps[2].slices, steps[2].ids, false);
  EXPECT_TRUE(same_bits(mine, std::vector<float>(all.begin() + c.vocab_size, all.begin() + 2 * c.vocab_size)));
  for (int bad : {0, int(c.n_inner) + 1}) {
    auto refused = CpuStage::create(w, bad);
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.error().find("tensor parallel " + std::to_string(bad)), std::string::npos) << refused.error();
  }
}

TEST(CpuStage, RejectsBadSlicesAndLeavesTheCacheUntouched) {
  const ModelConfig c = tiny_config();
  auto st = CpuStage::create(random_stage_weights(c, 0, c.n_layer, 12)).value();
  run(*st, {{5, 0, 4}}, random_tokens(4, c.vocab_size, 1), false);
  std::vector<float> hidden(size_t(70 * c.n_embd));
  // Wrong start position: names the sequence and both numbers.
  Status s = st->forward(std::vector<SeqSlice>{{6, 0, 2}, {5, 3, 1}}, hidden.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("sequence 5"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("4 tokens cached"), std::string::npos) << s.message();
  EXPECT_EQ(st->cached_tokens(6), -1);  // the valid slice in the same call did not run
  EXPECT_EQ(st->cached_tokens(5), 4);
  // A new sequence must start at 0.
  EXPECT_FALSE(st->forward(std::vector<SeqSlice>{{8, 2, 1}}, hidden.data()).ok());
  // Past the context.
  s = st->forward(std::vector<SeqSlice>{{5, 4, 61}}, hidden.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("context of 64"), std::string::npos) << s.message();
  std::vector<int32_t> ids(70, 1);
  EXPECT_FALSE(st->embed(std::vector<SeqSlice>{{9, 60, 5}}, ids.data(), hidden.data()).ok());
  // Twice in one batch; empty slice; bad token id.
  EXPECT_FALSE(st->forward(std::vector<SeqSlice>{{5, 4, 1}, {5, 4, 1}}, hidden.data()).ok());
  EXPECT_FALSE(st->forward(std::vector<SeqSlice>{{5, 4, 0}}, hidden.data()).ok());
  ids[0] = int32_t(c.vocab_size);
  EXPECT_FALSE(st->embed(std::vector<SeqSlice>{{5, 4, 1}}, ids.data(), hidden.data()).ok());
  EXPECT_EQ(st->cached_tokens(5), 4);
}

TEST(CpuStage, KvFigures) {
  const ModelConfig c = tiny_config();
  auto st = CpuStage::create(random_stage_weights(c, 0, c.n_layer, 13)).value();
  EXPECT_EQ(st->kv_bytes_per_token(), c.n_layer * 2 * c.n_embd * 4);
  run(*st, {{1, 0, 5}, {2, 0, 7}}, random_tokens(12, c.vocab_size, 2), false);
  EXPECT_EQ(st->num_sequences(), 2);
  EXPECT_EQ(st->kv_bytes_used(), 12 * st->kv_bytes_per_token());
  st->free_sequence(1);
  EXPECT_EQ(st->num_sequences(), 1);
  EXPECT_EQ(st->kv_bytes_used(), 7 * st->kv_bytes_per_token());
  st->clear();
  EXPECT_EQ(st->num_sequences(), 0);
  EXPECT_EQ(st->kv_bytes_used(), 0);
  // A freed id can start again at 0.
  run(*st, {{2, 0, 3}}, random_tokens(3, c.vocab_size, 3), false);
  EXPECT_EQ(st->cached_tokens(2), 3);
}

TEST(RandomWeights, DeterministicSplitConsistentAndPerturbed) {
  const ModelConfig c = tiny_config();
  const StageWeights a = random_stage_weights(c, 0, 3, 1), b = random_stage_weights(c, 1, 3, 1),
                     d = random_stage_weights(c, 0, 3, 2);
  EXPECT_EQ(a.layers[1].attn_qkv_w, b.layers[0].attn_qkv_w);
  EXPECT_EQ(a.layers[2].mlp_proj_b, b.layers[1].mlp_proj_b);
  EXPECT_EQ(a.wte, b.wte);  // tied: the last stage holds the same wte
  EXPECT_TRUE(b.wpe.empty());
  EXPECT_NE(a.layers[0].attn_qkv_w, d.layers[0].attn_qkv_w);
  EXPECT_NE(a.layers[0].attn_qkv_w, a.layers[1].attn_qkv_w);
  const StageWeights mid = random_stage_weights(c, 1, 2, 1);
  EXPECT_TRUE(mid.wte.empty() && mid.ln_f_g.empty() && mid.lm_head.empty());
  // N(0, 0.02) entries; LayerNorm gains near 1 but not all 1.
  double s = 0, s2 = 0;
  for (float v : a.layers[0].mlp_fc_w) s += v, s2 += double(v) * v;
  const double n = double(a.layers[0].mlp_fc_w.size());
  EXPECT_NEAR(s / n, 0.0, 0.002);
  EXPECT_NEAR(std::sqrt(s2 / n), 0.02, 0.001);
  for (float g : a.layers[0].ln_1_g) EXPECT_NEAR(g, 1.0f, 0.15f);
  EXPECT_NE(a.layers[0].ln_1_g[0], 1.0f);
  const StageWeights untied = random_stage_weights(tiny_config(Activation::GeluNew, false), 2, 3, 1);
  EXPECT_TRUE(untied.wte.empty());
  EXPECT_EQ(untied.lm_head.size(), size_t(c.vocab_size * c.n_embd));
}

// ---- Engine ----

std::vector<GenerationRequest> mixed_requests(const ModelConfig& c) {
  std::vector<GenerationRequest> rs(4);
  rs[0].prompt = random_tokens(5, c.vocab_size, 20);
  rs[0].max_new_tokens = 12;
  rs[0].sampling.temperature = 0;
  rs[1].prompt = random_tokens(17, c.vocab_size, 21);
  rs[1].max_new_tokens = 9;
  rs[1].sampling.seed = 42;
  rs[1].sampling.top_k = 20;
  rs[1].logprobs = 3;
  rs[2].prompt = random_tokens(1, c.vocab_size, 22);
  rs[2].max_new_tokens = 15;
  rs[2].sampling.seed = 43;
  rs[2].sampling.top_p = 0.9f;
  rs[2].sampling.temperature = 0.8f;
  rs[2].sampling.repetition_penalty = 1.3f;
  rs[2].echo_logprobs = true;
  rs[3].prompt = random_tokens(33, c.vocab_size, 23);
  rs[3].max_new_tokens = 6;
  rs[3].sampling.seed = 44;
  rs[3].sampling.presence_penalty = 0.5f;
  rs[3].sampling.frequency_penalty = 0.5f;
  rs[3].echo_logprobs = true;
  rs[3].logprobs = 2;
  return rs;
}

void expect_same_result(const GenerationResult& a, const GenerationResult& b, size_t i) {
  EXPECT_EQ(a.tokens, b.tokens) << "request " << i;
  EXPECT_TRUE(same_bits(a.token_logprobs, b.token_logprobs)) << "request " << i;
  EXPECT_EQ(a.top_logprobs, b.top_logprobs) << "request " << i;
  EXPECT_EQ(a.finish_reason, b.finish_reason) << "request " << i;
  EXPECT_TRUE(same_bits(a.prompt_logprobs, b.prompt_logprobs)) << "request " << i;
}

TEST(Engine, BatchedGenerationEqualsEachAlone) {
  const ModelConfig c = tiny_config();
  auto batched = Engine::create(random_stage_weights(c, 0, c.n_layer, 30)).value();
  const auto rs = mixed_requests(c);
  std::vector<std::pair<size_t, int32_t>> streamed;
  auto all = batched->generate(rs, [&](size_t r, int32_t t, float) { streamed.emplace_back(r, t); });
  ASSERT_TRUE(all.ok()) << all.error();
  EXPECT_EQ(batched->stage().num_sequences(), 0);  // everything freed
  size_t streamed_total = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    auto alone = Engine::create(random_stage_weights(c, 0, c.n_layer, 30)).value();
    auto one = alone->generate({rs[i]});
    ASSERT_TRUE(one.ok()) << one.error();
    expect_same_result((*all)[i], (*one)[0], i);
    EXPECT_EQ((*all)[i].tokens.size(), size_t(rs[i].max_new_tokens));
    EXPECT_EQ((*all)[i].finish_reason, "length");
    streamed_total += (*all)[i].tokens.size();
  }
  EXPECT_EQ(streamed.size(), streamed_total);
  EXPECT_EQ((*all)[1].top_logprobs.size(), 9u);
  EXPECT_EQ((*all)[1].top_logprobs[0].size(), 3u);
  EXPECT_EQ((*all)[3].prompt_logprobs.size(), 33u);
  EXPECT_TRUE(std::isnan((*all)[3].prompt_logprobs[0]));
  // Small prefill budget: prompts split over micro-batches, same results.
  EngineOptions small;
  small.max_batch_tokens = 5;
  auto chunked = Engine::create(random_stage_weights(c, 0, c.n_layer, 30), small).value();
  auto again = chunked->generate(rs);
  ASSERT_TRUE(again.ok()) << again.error();
  for (size_t i = 0; i < rs.size(); ++i) expect_same_result((*all)[i], (*again)[i], i);
}

TEST(Engine, StopTokensAndMinTokens) {
  const ModelConfig c = tiny_config();
  auto e = Engine::create(random_stage_weights(c, 0, c.n_layer, 31)).value();
  GenerationRequest r;
  r.prompt = random_tokens(6, c.vocab_size, 3);
  r.max_new_tokens = 20;
  r.sampling.temperature = 0;
  auto base = e->generate({r});
  ASSERT_TRUE(base.ok());
  const auto& free_run = (*base)[0].tokens;
  ASSERT_EQ(free_run.size(), 20u);
  // Stop at the token greedy draws at step 3 (its first occurrence).
  const int32_t stop = free_run[3];
  const size_t first = size_t(std::find(free_run.begin(), free_run.end(), stop) - free_run.begin());
  r.sampling.stop_token_ids = {stop};
  auto stopped = e->generate({r});
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ((*stopped)[0].finish_reason, "stop");
  EXPECT_EQ((*stopped)[0].tokens, std::vector<int32_t>(free_run.begin(), free_run.begin() + int64_t(first) + 1));
  // min_tokens: the stop id is masked for the first 8 steps, so it is not drawn there.
  r.sampling.min_tokens = 8;
  auto late = e->generate({r});
  ASSERT_TRUE(late.ok());
  const auto& lt = (*late)[0].tokens;
  for (size_t i = 0; i < std::min<size_t>(8, lt.size()); ++i) EXPECT_NE(lt[i], stop) << "step " << i;
  EXPECT_GE(lt.size(), 9u);
  EXPECT_TRUE((*late)[0].finish_reason == "length" || lt.back() == stop);
  // The model's eos_token_id stops too, unless ignore_eos.
  ModelConfig ce = c;
  ce.eos_token_id = stop;
  auto eos = Engine::create(random_stage_weights(ce, 0, ce.n_layer, 31)).value();
  r.sampling.stop_token_ids.clear();
  r.sampling.min_tokens = 0;
  auto by_eos = eos->generate({r});
  ASSERT_TRUE(by_eos.ok());
  EXPECT_EQ((*by_eos)[0].tokens, (*stopped)[0].tokens);
  r.ignore_eos = true;
  auto ignored = eos->generate({r});
  ASSERT_TRUE(ignored.ok());
  EXPECT_EQ((*ignored)[0].tokens, free_run);
}

TEST(Engine, ContextFullStopsWithLength) {
  const ModelConfig c = tiny_config();
  auto e = Engine::create(random_stage_weights(c, 0, c.n_layer, 32)).value();
  GenerationRequest r;
  r.prompt = random_tokens(60, c.vocab_size, 4);
  r.max_new_tokens = 100;
  auto res = e->generate({r});
  ASSERT_TRUE(res.ok()) << res.error();
  EXPECT_EQ((*res)[0].tokens.size(), 4u);  // 60 + 4 = n_positions
  EXPECT_EQ((*res)[0].finish_reason, "length");
  r.prompt = random_tokens(64, c.vocab_size, 4);
  EXPECT_FALSE(e->generate({r}).ok());
  r.prompt.clear();
  EXPECT_FALSE(e->generate({r}).ok());
  r.prompt = {int32_t(c.vocab_size)};
  EXPECT_FALSE(e->generate({r}).ok());
}

TEST(Engine, PerplexityMatchesEchoedPromptLogprobs) {
  const ModelConfig c = tiny_config();
  auto e = Engine::create(random_stage_weights(c, 0, c.n_layer, 33)).value();
  GenerationRequest r;
  r.prompt = random_tokens(50, c.vocab_size, 5);
  r.max_new_tokens = 0;
  r.echo_logprobs = true;
  auto res = e->generate({r});
  ASSERT_TRUE(res.ok());
  const auto& lp = (*res)[0].prompt_logprobs;
  ASSERT_EQ(lp.size(), 50u);
  double nll = 0;
  for (size_t i = 1; i < lp.size(); ++i) nll -= lp[i];
  nll /= 49.0;
  auto got = e->mean_nll(r.prompt);
  ASSERT_TRUE(got.ok());
  EXPECT_NEAR(*got, nll, 1e-5);
  // Random weights: near-uniform predictions, so the perplexity is close to the vocabulary.
  auto ppl = e->perplexity(r.prompt);
  ASSERT_TRUE(ppl.ok());
  EXPECT_NEAR(*ppl, double(c.vocab_size), 0.2 * double(c.vocab_size));
  // Longer than the context: disjoint windows of 64 (the second window's tokens alone).
  const auto longer = random_tokens(100, c.vocab_size, 6);
  auto w0 = e->mean_nll(std::span<const int32_t>(longer.data(), 64));
  auto w1 = e->mean_nll(std::span<const int32_t>(longer.data() + 64, 36));
  auto both = e->mean_nll(longer);
  ASSERT_TRUE(w0.ok() && w1.ok() && both.ok());
  EXPECT_NEAR(*both, (*w0 * 63 + *w1 * 35) / 98.0, 1e-9);
  EXPECT_EQ(e->stage().num_sequences(), 0);
}

}  // namespace
}  // namespace conveyor

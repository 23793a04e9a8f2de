// Philox known answers, and the sampling algorithm of model/sampling.h: greedy and ties,
// top-k/top-p limits, reproducibility in the seed, the empirical distribution, penalties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "common/philox.h"
#include "kernels/cpu/sampling.h"

namespace conveyor {
namespace {

std::vector<float> random_logits(size_t V, uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(V);
  for (float& x : v) x = nd(rng);
  return v;
}

int32_t draw(std::vector<float> logits, const SamplingParams& p, std::span<const int32_t> generated = {},
             uint64_t sample_index = 0, std::span<const int32_t> prompt = {}) {
  return sample_next(logits, p, prompt, generated, sample_index);
}

// Random123's kat_vectors for philox4x32_10.
TEST(Philox, KnownAnswers) {
  struct Kat { Philox4x32 ctr; uint32_t k0, k1; Philox4x32 want; };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{~0u, ~0u, ~0u, ~0u}}, ~0u, ~0u, {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 got = philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.want.v[i]) << "word " << i;
  }
}

TEST(Philox, UniformsAreInUnitInterval) {
  EXPECT_EQ(uniform_double(0, 0), 0.0);
  EXPECT_LT(uniform_double(~0u, ~0u), 1.0);
  EXPECT_EQ(uniform_float(0), 0.0f);
  EXPECT_LT(uniform_float(~0u), 1.0f);
}

TEST(Sampling, GreedyIsArgmaxWithLowestIdOnTies) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(draw({1, 5, 2, 5, 5}, p), 1);
  EXPECT_EQ(draw({-3, -1, -2}, p), 1);
  auto l = random_logits(1000, 1);
  EXPECT_EQ(draw(l, p), argmax_token(l));
  l[17] = l[900] = 100;
  EXPECT_EQ(draw(l, p), 17);
}

TEST(Sampling, TopKOneAndTinyTopPAreGreedy) {
  for (uint32_t s = 0; s < 50; ++s) {
    auto l = random_logits(777, s);
    if (s % 5 == 0) l[3] = l[500] = 50;  // a tie at the top: the lower id wins
    SamplingParams greedy;
    greedy.temperature = 0;
    const int32_t want = draw(l, greedy);
    SamplingParams k1;
    k1.top_k = 1;
    k1.seed = s;
    SamplingParams p_tiny;
    p_tiny.top_p = 1e-6f;
    p_tiny.seed = s;
    p_tiny.temperature = 1.7f;
    for (uint64_t step = 0; step < 4; ++step) {
      std::vector<int32_t> gen(step, 0);
      EXPECT_EQ(draw(l, k1, gen), want);
      EXPECT_EQ(draw(l, p_tiny, gen), want);
    }
  }
}

TEST(Sampling, SameSeedSameTokensDifferentSeedDifferentTokens) {
  const auto l = random_logits(500, 7, 1.0f);  // flat enough that draws vary
  SamplingParams a, b;
  a.seed = b.seed = 1234;
  SamplingParams c = a;
  c.seed = 1235;
  std::vector<int32_t> gen_a, gen_b, gen_c;
  for (int step = 0; step < 200; ++step) {
    gen_a.push_back(draw(l, a, gen_a));
    gen_b.push_back(draw(l, b, gen_b));
    gen_c.push_back(draw(l, c, gen_c));
  }
  EXPECT_EQ(gen_a, gen_b);
  int differ = 0;
  for (int i = 0; i < 200; ++i) differ += gen_a[size_t(i)] != gen_c[size_t(i)];
  EXPECT_GT(differ, 150);
  // The sample index is a separate counter word: choice 1 differs from choice 0.
  std::vector<int32_t> gen_a1;
  for (int step = 0; step < 200; ++step) gen_a1.push_back(draw(l, a, gen_a1, 1));
  differ = 0;
  for (int i = 0; i < 200; ++i) differ += gen_a[size_t(i)] != gen_a1[size_t(i)];
  EXPECT_GT(differ, 150);
}

// Counts of N draws (sample_index 0..N-1) against expected probabilities: every bin
// within 5 standard deviations, and a chi-square far below the 1e-6 tail.
void expect_distribution(const std::vector<float>& logits, const SamplingParams& p, const std::vector<double>& want) {
  const int N = 40000;
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < N; ++i) ++counts[size_t(draw(logits, p, {}, uint64_t(i)))];
  double chi2 = 0;
  int dof = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    const double e = want[t] * N;
    if (want[t] == 0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " has probability 0";
      continue;
    }
    const double sd = std::sqrt(N * want[t] * (1 - want[t]));
    EXPECT_NEAR(counts[t], e, 5 * sd + 1) << "token " << t;
    chi2 += (counts[t] - e) * (counts[t] - e) / e;
    ++dof;
  }
  EXPECT_LT(chi2, dof + 10 * std::sqrt(2.0 * dof) + 10) << "chi-square over " << dof << " bins";
}

std::vector<double> softmax(const std::vector<float>& l, double temperature = 1) {
  double m = -1e300, s = 0;
  for (float x : l) m = std::max(m, double(x) / temperature);
  std::vector<double> p(l.size());
  for (size_t i = 0; i < l.size(); ++i) s += (p[i] = std::exp(double(l[i]) / temperature - m));
  for (double& x : p) x /= s;
  return p;
}

TEST(Sampling, EmpiricalDistributionMatchesSoftmax) {
  const std::vector<float> l = {1.0f, 2.0f, 0.5f, -1.0f, 2.5f, 0.0f, -3.0f};
  SamplingParams p;
  p.seed = 99;
  expect_distribution(l, p, softmax(l));
  p.temperature = 2.0f;
  expect_distribution(l, p, softmax(l, 2.0));
  p.temperature = 0.5f;
  expect_distribution(l, p, softmax(l, 0.5));
}

TEST(Sampling, TopKAndTopPRenormaliseTheKeptTokens) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (ids permuted so order is not the id order).
  const std::vector<float> l = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  SamplingParams p;
  p.seed = 5;
  p.top_k = 2;  // ids 1 and 3: 0.5 / 0.8 and 0.3 / 0.8
  expect_distribution(l, p, {0, 0.625, 0, 0.375});
  p.top_k = 0;
  p.top_p = 0.7f;  // 0.5 < 0.7 <= 0.8: the same two
  expect_distribution(l, p, {0, 0.625, 0, 0.375});
  p.top_p = 0.85f;  // 0.8 < 0.85 <= 0.95: three
  expect_distribution(l, p, {0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95});
  p.top_p = 0.45f;  // below the first token's mass: just it
  expect_distribution(l, p, {0, 1, 0, 0});
}

TEST(Sampling, RepetitionPenaltyFollowsHf) {
  std::vector<float> l = {2.0f, -2.0f, 3.0f, -1.0f, 4.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt = {0, 1, 0}, gen = {1, 3};  // 0 and 1 repeat: penalised once
  apply_penalties(l, p, prompt, gen);
  EXPECT_EQ(l, (std::vector<float>{1.0f, -4.0f, 3.0f, -2.0f, 4.0f}));
}

TEST(Sampling, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  std::vector<float> l = {1.0f, 1.0f, 1.0f, 1.0f};
  SamplingParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  const std::vector<int32_t> prompt = {0, 0, 0}, gen = {1, 2, 2, 2};
  apply_penalties(l, p, prompt, gen);
  EXPECT_EQ(l[0], 1.0f);                 // prompt only: untouched
  EXPECT_EQ(l[1], 1.0f - 0.5f - 0.25f);  // once
  EXPECT_EQ(l[2], 1.0f - 0.5f - 0.75f);  // three times
  EXPECT_EQ(l[3], 1.0f);
}

TEST(Sampling, PenaltiesChangeTheGreedyChoice) {
  SamplingParams p;
  p.temperature = 0;
  p.frequency_penalty = 1.0f;
  const std::vector<int32_t> gen = {0};
  EXPECT_EQ(draw({2.0f, 1.5f}, p, gen), 1);
  EXPECT_EQ(draw({2.0f, 0.5f}, p, gen), 0);
}

TEST(Sampling, MinTokensMasksStopIdsUntilReached) {
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 3;
  p.stop_token_ids = {4};
  const std::vector<float> l = {0, 1, 2, 3, 10};
  std::vector<int32_t> gen;
  for (int step = 0; step < 3; ++step) {
    EXPECT_EQ(draw(l, p, gen), 3) << "step " << step;
    gen.push_back(3);
  }
  EXPECT_EQ(draw(l, p, gen), 4);
  // Sampling too: the masked id is never drawn.
  SamplingParams q = p;
  q.temperature = 1;
  for (uint64_t i = 0; i < 500; ++i) EXPECT_NE(draw(l, q, {}, i), 4);
}

// The algorithm exactly as model/sampling.h states it, written plainly (std::sort, no
// shortcuts): sample_next must draw the same token for every input.
int32_t reference_sample(std::vector<float> l, const SamplingParams& p, std::span<const int32_t> prompt,
                         std::span<const int32_t> gen, uint64_t sample_index) {
  apply_penalties(l, p, prompt, gen);
  if (p.temperature == 0) return argmax_token(l);
  for (float& x : l) x = x / p.temperature;
  std::vector<int32_t> order(l.size());
  for (size_t i = 0; i < l.size(); ++i) order[i] = int32_t(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return l[size_t(a)] != l[size_t(b)] ? l[size_t(a)] > l[size_t(b)] : a < b;
  });
  if (p.top_k > 0 && size_t(p.top_k) < order.size()) order.resize(size_t(p.top_k));
  const double m = l[size_t(order[0])];
  if (std::isinf(m) && m < 0) return order[0];
  std::vector<double> e, cum;
  double run = 0;
  for (int32_t id : order) {
    e.push_back(std::exp(double(l[size_t(id)]) - m));
    cum.push_back(run += e.back());
  }
  size_t n = order.size();
  if (p.top_p < 1) {
    n = 1;
    while (n < order.size() && cum[n - 1] < double(p.top_p) * cum.back()) ++n;
  }
  const double target = sampling_uniform(p.seed, gen.size(), sample_index) * cum[n - 1];
  for (size_t i = 0; i < n; ++i)
    if (cum[i] > target) return order[i];
  for (size_t i = n; i-- > 0;)
    if (i == 0 || cum[i] > cum[i - 1]) return order[i];
  return order[0];
}

TEST(Sampling, MatchesThePlainStatementOfTheAlgorithm) {
  std::mt19937 rng(17);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const size_t V = trial % 3 == 0 ? 50257 : size_t(2 + rng() % 3000);
    std::vector<float> l(V);
    std::uniform_int_distribution<int> q(-40, 40);
    for (float& x : l) x = float(q(rng)) * 0.25f;  // many exact ties
    l[0] = 0.0f, l[V - 1] = -0.0f;                   // +0 and -0 tie
    if (V > 10) l[5] = -std::numeric_limits<float>::infinity();
    SamplingParams p;
    p.seed = rng();
    p.temperature = std::vector<float>{1.0f, 0.7f, 1.9f}[size_t(trial % 3)];
    p.top_k = std::vector<int>{0, 1, 7, 100, int(V) - 1, 5000}[size_t(trial % 6)];
    p.top_p = std::vector<float>{1.0f, 0.9f, 0.3f, 0.999f}[size_t(trial % 4)];
    if (trial % 5 == 0) p.repetition_penalty = 1.2f;
    if (trial % 7 == 0) p.presence_penalty = 0.3f, p.frequency_penalty = 0.1f;
    const std::vector<int32_t> prompt = {1, 2, 2, 7}, gen = {int32_t(rng() % V), 3};
    for (uint64_t idx = 0; idx < 4; ++idx) {
      auto work = l;
      ASSERT_EQ(sample_next(work, p, prompt, gen, idx), reference_sample(l, p, prompt, gen, idx))
          << "trial " << trial << " V=" << V << " top_k=" << p.top_k << " top_p=" << p.top_p;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 1200);
  // -0 and +0 are a tie (the lower id first), whatever their sign bits.
  SamplingParams k1;
  k1.top_k = 1;
  EXPECT_EQ(draw({-0.0f, 0.0f}, k1), 0);
  EXPECT_EQ(draw({0.0f, -0.0f}, k1), 0);
}

TEST(Sampling, ValidateNamesTheField) {
  SamplingParams p;
  EXPECT_TRUE(validate_sampling_params(p, 10).ok());
  p.top_p = 0;
  EXPECT_NE(validate_sampling_params(p, 10).message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_NE(validate_sampling_params(p, 10).message().find("temperature"), std::string::npos);
  p = {};
  p.stop_token_ids = {10};
  EXPECT_NE(validate_sampling_params(p, 10).message().find("stop_token_ids"), std::string::npos);
}

TEST(Sampling, LogitBiasBansAndFavoursTokens) {
  auto l = random_logits(500, 21);
  const int32_t best = argmax_token(l);
  SamplingParams p;
  p.temperature = 0;
  // -100 bans the argmax: greedy takes the runner-up, whatever its distance.
  p.logit_bias = {{best, kLogitBiasBan}};
  std::vector<float> masked = l;
  masked[size_t(best)] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(draw(l, p), argmax_token(masked));
  std::vector<float> huge = l;
  huge[size_t(best)] = 1e30f;  // a ban is a ban, not a large negative number
  EXPECT_NE(draw(huge, p), best);
  // A ban holds under sampling too: no draw of many seeds picks it.
  p.temperature = 1.5f;
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    p.seed = seed;
    ASSERT_NE(draw(huge, p), best) << "seed " << seed;
  }
  // A positive bias makes a token greedy: bias = gap + 1 lifts the least likely token above all.
  const int32_t worst = int32_t(std::min_element(l.begin(), l.end()) - l.begin());
  p = {};
  p.temperature = 0;
  p.logit_bias = {{worst, l[size_t(best)] - l[size_t(worst)] + 1.0f}};
  EXPECT_EQ(draw(l, p), worst);
  // The bias is added before the penalties: repetition divides the biased logit (HF rule for
  // l > 0), so a bias of 4 on a logit of 2 with penalty 2 gives 3, above 2.9.
  std::vector<float> small = {2.0f, 2.9f, 0.0f};
  p = {};
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  p.logit_bias = {{0, 4.0f}};
  const std::vector<int32_t> prompt = {0};
  std::vector<float> row = small;
  apply_penalties(row, p, prompt, {});
  EXPECT_FLOAT_EQ(row[0], 3.0f);
  EXPECT_EQ(draw(small, p, {}, 0, prompt), 0);
  // Validation names the field.
  p = {};
  p.logit_bias = {{3, 1.f}, {3, 2.f}};
  EXPECT_NE(validate_sampling_params(p, 10).message().find("logit_bias"), std::string::npos);
  p.logit_bias = {{10, 1.f}};
  EXPECT_NE(validate_sampling_params(p, 10).message().find("logit_bias"), std::string::npos);
  p.logit_bias = {{1, 100.5f}};
  EXPECT_NE(validate_sampling_params(p, 10).message().find("logit_bias"), std::string::npos);
  p.logit_bias = {{1, -100.f}, {2, 100.f}};
  EXPECT_TRUE(validate_sampling_params(p, 10).ok());
}

TEST(Logprobs, TokenLogprobsUseTheRawDistribution) {
  const auto l = random_logits(301, 11);
  const double lse = log_sum_exp(l);
  const TokenLogprobs lp = token_logprobs(l, 42, 5);
  EXPECT_NEAR(lp.logprob, double(l[42]) - lse, 1e-5);
  ASSERT_EQ(lp.top.size(), 5u);
  EXPECT_EQ(lp.top[0].first, argmax_token(l));
  for (size_t i = 1; i < lp.top.size(); ++i) EXPECT_GE(lp.top[i - 1].second, lp.top[i].second);
  auto ls = l;
  log_softmax(ls);
  for (const auto& [id, v] : lp.top) EXPECT_FLOAT_EQ(v, ls[size_t(id)]);
  double total = 0;
  for (float x : ls) total += std::exp(double(x));
  EXPECT_NEAR(total, 1.0, 1e-6);
  // Ties: lower id first.
  const TokenLogprobs tie = token_logprobs(std::vector<float>{1, 3, 3, 0}, 0, 2);
  EXPECT_EQ(tie.top[0].first, 1);
  EXPECT_EQ(tie.top[1].first, 2);
}

}  // namespace
}  // namespace conveyor

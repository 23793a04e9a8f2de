#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "common/philox.h"

namespace conveyor {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool in_vocab(int32_t id, size_t V) { return id >= 0 && size_t(id) < V; }

// Sorted (id, count) pairs of the ids in `a` (and `b`).
std::vector<std::pair<int32_t, int32_t>> id_counts(std::span<const int32_t> a,
                                                   std::span<const int32_t> b = {}) {
  std::vector<int32_t> ids(a.begin(), a.end());
  ids.insert(ids.end(), b.begin(), b.end());
  std::sort(ids.begin(), ids.end());
  std::vector<std::pair<int32_t, int32_t>> counts;
  for (int32_t id : ids) {
    if (!counts.empty() && counts.back().first == id)
      ++counts.back().second;
    else
      counts.emplace_back(id, 1);
  }
  return counts;
}

// (logit descending, id ascending): the candidate order of steps 4-8.
struct ByLogitThenId {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const {
    if (logits[a] != logits[b]) return logits[a] > logits[b];
    return a < b;
  }
};

// Sorts ids 0..V-1 into (logit descending, id ascending) order: a stable LSD radix sort
// on an order-reversing image of the float bits, so ties keep id order. Same order as
// ByLogitThenId (-0 and +0 compare equal there, so both map to +0's key), in O(V).
void sort_candidates(std::span<const float> logits, std::vector<int32_t>& order) {
  const size_t V = logits.size();
  thread_local std::vector<uint32_t> keys, keys_tmp;
  thread_local std::vector<int32_t> ids_tmp;
  keys.resize(V), keys_tmp.resize(V), ids_tmp.resize(V);
  order.resize(V);
  for (size_t i = 0; i < V; ++i) {
    const float f = logits[i] == 0.0f ? 0.0f : logits[i];
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending in f
    keys[i] = ~u;                                      // ascending in -f
    order[i] = int32_t(i);
  }
  for (int shift = 0; shift < 32; shift += 8) {
    size_t count[257] = {};
    for (size_t i = 0; i < V; ++i) ++count[((keys[i] >> shift) & 0xffu) + 1];
    if (count[((keys[0] >> shift) & 0xffu) + 1] == V) continue;  // all share this byte
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (size_t i = 0; i < V; ++i) {
      const size_t dst = count[(keys[i] >> shift) & 0xffu]++;
      keys_tmp[dst] = keys[i];
      ids_tmp[dst] = order[i];
    }
    keys.swap(keys_tmp);
    order.swap(ids_tmp);
  }
}

}  // namespace

void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> generated) {
  const size_t V = logits.size();
  for (const auto& [id, bias] : p.logit_bias) {  // 0
    if (!in_vocab(id, V)) continue;
    float& l = logits[size_t(id)];
    l = bias <= kLogitBiasBan ? kNegInf : l + bias;
  }
  if (p.repetition_penalty != 1.0f) {
    for (auto [id, count] : id_counts(prompt, generated)) {
      if (!in_vocab(id, V)) continue;
      float& l = logits[size_t(id)];
      l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    for (auto [id, count] : id_counts(generated)) {
      if (!in_vocab(id, V)) continue;
      float& l = logits[size_t(id)];
      l = l - p.presence_penalty;
      l = l - p.frequency_penalty * float(count);
    }
  }
  if (generated.size() < size_t(std::max(p.min_tokens, 0)))
    for (int32_t id : p.stop_token_ids)
      if (in_vocab(id, V)) logits[size_t(id)] = kNegInf;
}

double sampling_uniform(uint64_t seed, uint64_t step, uint64_t sample_index) {
  const Philox4x32 r = philox_draw(seed, step, sample_index);
  return uniform_double(r.v[0], r.v[1]);
}

int32_t argmax_token(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[size_t(best)]) best = int32_t(i);
  return best;
}

int32_t sample_next(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                    std::span<const int32_t> generated, uint64_t sample_index) {
  const size_t V = logits.size();
  if (V == 0) return -1;
  apply_penalties(logits, p, prompt, generated);  // 0-1
  if (p.temperature == 0.0f) return argmax_token(logits);  // 2
  if (p.temperature != 1.0f)  // 3 (division by 1 is exact, skipping it changes nothing)
    for (float& l : logits) l = l / p.temperature;

  // 4: candidates in (logit desc, id asc) order; top-k needs only the first k sorted.
  thread_local std::vector<int32_t> order;
  thread_local std::vector<double> cum;
  size_t count = V;
  if (p.top_k > 0 && size_t(p.top_k) < V / 16) {
    count = size_t(p.top_k);
    order.resize(V);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + ptrdiff_t(count), order.end(), ByLogitThenId{logits.data()});
  } else {
    sort_candidates(logits, order);
    if (p.top_k > 0) count = std::min(V, size_t(p.top_k));
  }

  // 5: softmax numerators and running sums, left to right.
  const double m = double(logits[size_t(order[0])]);
  if (!(m > -std::numeric_limits<double>::infinity())) return order[0];  // everything masked
  cum.resize(count);
  double running = 0.0;
  for (size_t i = 0; i < count; ++i) {
    running += std::exp(double(logits[size_t(order[i])]) - m);
    cum[i] = running;
  }

  // 6-7: nucleus cut; total is the kept mass.
  size_t kept = count;
  if (p.top_p < 1.0f) {
    const double threshold = double(p.top_p) * cum[count - 1];
    kept = 1;
    while (kept < count && cum[kept - 1] < threshold) ++kept;
  }
  const double total = cum[kept - 1];

  // 8: inverse CDF.
  const double target = sampling_uniform(p.seed, generated.size(), sample_index) * total;
  for (size_t i = 0; i < kept; ++i)
    if (cum[i] > target) return order[i];
  for (size_t i = kept; i-- > 0;)
    if (i == 0 || cum[i] > cum[i - 1]) return order[i];
  return order[0];
}

double log_sum_exp(std::span<const float> logits) {
  float m = kNegInf;
  for (float l : logits) m = std::max(m, l);
  if (!(m > kNegInf)) return double(m);
  double sum = 0.0;
  for (float l : logits) sum += std::exp(double(l) - double(m));
  return double(m) + std::log(sum);
}

void log_softmax(std::span<float> logits) {
  const double lse = log_sum_exp(logits);
  for (float& l : logits) l = float(double(l) - lse);
}

TokenLogprobs token_logprobs(std::span<const float> raw_logits, int32_t token, int top_n) {
  TokenLogprobs out;
  const double lse = log_sum_exp(raw_logits);
  if (in_vocab(token, raw_logits.size())) out.logprob = float(double(raw_logits[size_t(token)]) - lse);
  const size_t n = std::min(size_t(std::max(top_n, 0)), raw_logits.size());
  if (n == 0) return out;
  thread_local std::vector<int32_t> order;
  order.resize(raw_logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + ptrdiff_t(n), order.end(), ByLogitThenId{raw_logits.data()});
  out.top.reserve(n);
  for (size_t i = 0; i < n; ++i)
    out.top.emplace_back(order[i], float(double(raw_logits[size_t(order[i])]) - lse));
  return out;
}

}  // namespace conveyor

// Choosing the next token from a row of logits, reproducibly, and reporting log-probs.
//
// THE ALGORITHM (sample_next). A CUDA twin replicates it step for step, so the same seed
// draws the same token on CPU and GPU wherever the two compute the same probabilities.
// V = logits.size(); s = generated.size() (the step); all arithmetic as stated.
//
//  0. logit_bias, in place on the fp32 logits: for each (id, b), l = -inf when b <= -100
//     (kLogitBiasBan: the token is banned), else l = l + b (fp32 addition).
//  1. Penalties, in place on the (biased) fp32 logits, in this order:
//     a. repetition_penalty p != 1 (HF RepetitionPenaltyLogitsProcessor): once for each
//        distinct id in prompt + generated, l = l > 0 ? l / p : l * p.
//     b. presence / frequency (OpenAI): for each distinct id with count c >= 1 in
//        `generated` only, l = l - presence_penalty - frequency_penalty * c (fp32, c as
//        float, presence subtracted first).
//     c. min_tokens: while s < min_tokens, l = -inf for every id in stop_token_ids.
//  2. temperature == 0: greedy. Return the id of the largest logit, the lowest id on ties.
//  3. Temperature: l = l / temperature (fp32 division).
//  4. Candidates: all V ids sorted by (logit descending, id ascending). top_k > 0 keeps
//     the first min(top_k, V) of them.
//  5. Softmax over the candidates, in double: m = the first candidate's logit,
//     e_i = exp(double(l_i) - double(m)), cum_i = e_0 + ... + e_i summed left to right.
//  6. top_p < 1: keep the smallest prefix 0..n-1 with cum_{n-1} >= double(top_p) *
//     cum_last (at least one token). Otherwise n = the candidate count.
//  7. Renormalise implicitly: total = cum_{n-1}.
//  8. Draw: r = philox4x32_10(counter = (s low, s high, sample_index low, sample_index
//     high), key = (seed low, seed high)); u = uniform_double(r.v[0], r.v[1]) in [0, 1)
//     (53 bits, see philox.h); target = u * total. Return the first candidate i < n with
//     cum_i > target; if rounding leaves none, the last candidate i < n that raised the
//     sum (i == 0 or cum_i > cum_{i-1}). If the first candidate's logit is -inf (all
//     masked), return it.
//
// LOG-PROBS (OpenAI `logprobs`) are reported under the model's raw distribution:
// log_softmax of the logits exactly as the LM head produced them, before logit_bias,
// penalties, temperature and top-k/top-p. Callers compute them before sample_next mutates the row.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/sampling_params.h"

namespace conveyor {

// Steps 0-8 above. `logits` is mutated (penalties, temperature). `sample_index` tells
// apart the n independent choices of one request.
int32_t sample_next(std::span<float> logits, const SamplingParams& params,
                    std::span<const int32_t> prompt, std::span<const int32_t> generated,
                    uint64_t sample_index);

// Steps 0 and 1 alone (what sample_next applies before choosing).
void apply_penalties(std::span<float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> generated);

// Step 8's uniform for (seed, step, sample_index).
double sampling_uniform(uint64_t seed, uint64_t step, uint64_t sample_index);

// Index of the largest value, the lowest index on ties.
int32_t argmax_token(std::span<const float> logits);

// log(sum(exp(logits))), computed in double with max subtraction.
double log_sum_exp(std::span<const float> logits);

// In place: x = log_softmax(x) (double for the sum).
void log_softmax(std::span<float> logits);

// The chosen token's log-prob and the top_n most likely tokens (log-prob descending, id
// ascending on ties) under the raw distribution of `raw_logits` (see LOG-PROBS above).
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs token_logprobs(std::span<const float> raw_logits, int32_t token, int top_n);

}  // namespace conveyor

// What a request asks of the choice of its next token: the parameters the coordinator
// validates and sends once to the last stage (protocol/seq_state.h), and that both samplers
// (kernels/cpu/sampling.h, the reference, and its CUDA twin) take. The algorithm they define
// is in kernels/cpu/sampling.h.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/status.h"

namespace conveyor {

struct SamplingParams {
  float temperature = 1.0f;        // 0 = greedy
  int top_k = 0;                   // 0 = off
  float top_p = 1.0f;              // 1 = off
  float repetition_penalty = 1.0f; // HF semantics, over prompt + generated; 1 = off
  float presence_penalty = 0.0f;   // OpenAI, over generated tokens
  float frequency_penalty = 0.0f;  // OpenAI, over generated tokens
  int min_tokens = 0;              // stop ids are masked until this many tokens are generated
  std::vector<int32_t> stop_token_ids;
  uint64_t seed = 0;
  // OpenAI logit_bias: (token id, bias) sorted by id, each id once. The bias is added to the
  // logit before the penalties; kLogitBiasBan (-100) bans the token (its logit becomes -inf).
  std::vector<std::pair<int32_t, float>> logit_bias;
  bool operator==(const SamplingParams&) const = default;
};

constexpr float kLogitBiasMax = 100.0f;        // biases lie in [-kLogitBiasMax, kLogitBiasMax]
constexpr float kLogitBiasBan = -kLogitBiasMax;
constexpr size_t kMaxLogitBiasEntries = 300;   // OpenAI's limit

// Checks ranges (temperature >= 0, top_k >= 0, 0 < top_p <= 1, repetition_penalty > 0,
// finite penalties, min_tokens >= 0, stop ids in [0, vocab_size); logit_bias: at most
// kMaxLogitBiasEntries, ids in [0, vocab_size), ascending and distinct, biases in [-100, 100]);
// the error names the field.
Status validate_sampling_params(const SamplingParams& params, int64_t vocab_size);

// One row of logits to choose from, with what sample_next would be given for it (a
// backend that samples where its logits are, e.g. the GPU, takes these).
struct SampleRow {
  const SamplingParams* params = nullptr;
  std::span<const int32_t> prompt;     // repetition penalty history (with generated)
  std::span<const int32_t> generated;  // its size is the step (the Philox counter)
  uint64_t sample_index = 0;
};

}  // namespace conveyor

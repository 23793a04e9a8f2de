// What the last stage must know of a sequence to choose its tokens, sent once: with the
// sequence's first step (its admission), again to a replacement last stage after a replay or
// failover (a new epoch), and by a fork from parent to child (beam search). Only the last
// stage reads it; the per-step header (microbatch.h) carries it as opaque bytes that the
// other stages hand on unread.
//
//   coordinator --MicroBatch{..., admissions: [SeqState of each new sequence]}--> ... --> last
//   last stage: keeps each sequence's SeqState beside its token history until it is freed
//
// Wire format of the admissions section (little-endian, inside the micro-batch header):
//   u32 count, then per admission:
//     u64 seq_id | i32 prompt_len | i32 top_logprobs | u64 sample_index
//     f32 temperature | i32 top_k | f32 top_p | f32 repetition_penalty | f32 presence_penalty
//     f32 frequency_penalty | i32 min_tokens | u64 seed
//     u32 n, i32 stop_token_ids[n] | u32 m, (i32 token, f32 bias)[m] logit_bias
// An empty section (no admissions) is zero bytes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/model_config.h"
#include "common/sampling_params.h"
#include "common/status.h"

namespace conveyor {

struct SeqState {
  int32_t prompt_len = 0;      // the prompt's tokens: the sampling step is history - prompt_len
  int32_t top_logprobs = 0;    // top-N alternatives reported with each token (0..20; beams: 2 x width)
  uint64_t sample_index = 0;   // which of the request's n choices (its Philox stream); 0 for beams
  SamplingParams sampling;     // temperature, penalties, stop ids, logit_bias, seed, ...
  bool operator==(const SeqState&) const = default;
};

struct Admission {
  uint64_t seq_id = 0;
  SeqState state;
  bool operator==(const Admission&) const = default;
};

std::vector<uint8_t> encode_admissions(std::span<const Admission> admissions);
// Every length is checked against the bytes; an error names the field.
Expected<std::vector<Admission>> decode_admissions(std::span<const uint8_t> bytes);

// Checks a state against a model: prompt_len within 0..n_positions, top_logprobs within
// 0..20, the sampling parameters (validate_sampling_params). The error names what is wrong.
Status validate(const SeqState& state, const ModelConfig& config);

}  // namespace conveyor

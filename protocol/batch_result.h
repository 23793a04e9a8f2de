// What the last stage sends the coordinator for each micro-batch: per sequence the token it
// chose and its log-probs, or the error that stopped the batch on some stage.
//
//   stage N-1 --BatchResult--> coordinator     (a header, no payload)
//
// Wire format (little-endian; tests/protocol/test_microbatch_wire.cc pins its bytes):
//   u32 magic "CRR1" | u64 batch_id | u32 pipeline | u32 epoch | f64 busy_seconds
//   u32 e, char error[e]
//   u32 n, then n x: u64 seq_id | i32 token | f32 logprob
//                    | u32 k, (i32 id, f32 logprob)[k] top
//                    | u32 p, f32 prompt_logprobs[p]
//                    | u32 q, q x (u32 k, (i32 id, f32 logprob)[k]) prompt_top
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace conveyor {

struct SeqResult {
  uint64_t seq_id = 0;
  int32_t token = -1;             // the sampled token, -1 when the slice did not sample
  float logprob = 0;              // its log-prob under the raw distribution
  std::vector<std::pair<int32_t, float>> top;  // its top-N alternatives
  // prompt_logprobs: one entry per prompt token the slice predicts, in order (the token at
  // start_pos+1 ... the lookahead), each with its top-N.
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> prompt_top;
  bool operator==(const SeqResult&) const = default;
};

struct BatchResult {
  uint64_t batch_id = 0;
  uint32_t pipeline = 0;
  uint32_t epoch = 0;
  std::vector<SeqResult> seqs;
  double busy_seconds = 0;        // compute time the last stage spent on this batch
  std::string error;              // non-empty: the batch failed on a stage (the message says where)
  bool operator==(const BatchResult&) const = default;
};

std::vector<uint8_t> encode(const BatchResult& result);
Expected<BatchResult> decode_batch_result(std::span<const uint8_t> bytes);

}  // namespace conveyor

// The unit of work that travels around the pipeline ring, and its wire format.
//
//   coordinator --MicroBatch(token ids)--> stage 0 --MicroBatch + hidden--> ... --> stage N-1
//   stage N-1 --BatchResult--> coordinator
//
// A MicroBatch header names, for each sequence, the slice of tokens this step runs
// (start_pos, num_tokens) and, for the last stage, how to sample and what to report. The
// header travels through every stage, changed only in `activation_dtype`; the tensor that
// goes with it is the activations [total_tokens, n_embd] between stages (fp32 from a CPU
// stage, the stage's fp16/bf16 from a GPU stage: half the bytes), nothing from the
// coordinator (stage 0 embeds the header's token ids). Sequences to free ride along in `free_seq_ids`
// so stages never need a separate message to release KV memory.
//
// Wire format: little-endian, a magic/version word first; decode() checks every length
// against the buffer and fails with a Status naming the field, never reading past it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "common/model_config.h"
#include "common/sampling_params.h"
#include "common/seq_slice.h"

namespace conveyor {

struct SeqWork {
  SeqSlice slice;                 // seq_id, start_pos, num_tokens
  int32_t prompt_len = 0;         // the sequence's prompt length (penalties, min_tokens, logprobs)
  bool sample = false;            // the slice ends the known tokens: sample the next one
  bool prompt_logprobs = false;   // report the log-prob of each prompt token this slice predicts
  int32_t lookahead_token = -1;   // the prompt token after the slice (scores the last row), or -1
  int32_t top_logprobs = 0;       // top-N alternatives to report (0..20)
  uint64_t sample_index = 0;      // which of the request's n choices
  SamplingParams sampling;
};

// Before a batch runs, every stage gives `child` a copy of the first num_tokens positions of
// `parent`'s K/V (beam search: a beam continues its parent's cache). Forks are applied in
// order, before the frees, so a parent freed in the same batch can still be forked from.
struct SeqFork {
  uint64_t parent = 0;
  uint64_t child = 0;
  int32_t num_tokens = 0;
  bool operator==(const SeqFork&) const = default;
};

struct MicroBatch {
  uint64_t batch_id = 0;
  uint32_t pipeline = 0;          // pipeline replica
  uint32_t epoch = 0;             // bumped on re-plan/failover: stages drop stale batches
  DType activation_dtype = DType::F32;  // of the activations sent with this header (F32, F16, BF16)
  std::vector<SeqWork> seqs;
  std::vector<int32_t> token_ids;        // every slice's tokens, concatenated in slice order
  std::vector<SeqFork> forks;            // applied first (see SeqFork)
  std::vector<uint64_t> free_seq_ids;    // free these sequences' KV before running (after the forks)

  std::vector<SeqSlice> slices() const;
  int64_t total_tokens() const;
};

struct SeqResult {
  uint64_t seq_id = 0;
  int32_t token = -1;             // the sampled token, -1 when the slice did not sample
  float logprob = 0;              // its log-prob under the raw distribution
  std::vector<std::pair<int32_t, float>> top;  // its top-N alternatives
  // prompt_logprobs: one entry per prompt token the slice predicts, in order (the token at
  // start_pos+1 ... the lookahead), each with its top-N.
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> prompt_top;
};

struct BatchResult {
  uint64_t batch_id = 0;
  uint32_t pipeline = 0;
  uint32_t epoch = 0;
  std::vector<SeqResult> seqs;
  double busy_seconds = 0;        // compute time the last stage spent on this batch
  std::string error;              // non-empty: the batch failed on a stage (the message says where)
};

std::vector<uint8_t> encode(const MicroBatch& batch);
Expected<MicroBatch> decode_microbatch(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode(const BatchResult& result);
Expected<BatchResult> decode_batch_result(std::span<const uint8_t> bytes);

// Checks a decoded micro-batch against a model: slice sizes and token count agree, token
// ids in [0, vocab), positions within n_positions, top_logprobs within 0..20; forks with a
// child other than the parent and 1 <= num_tokens <= n_positions.
Status validate(const MicroBatch& batch, const ModelConfig& config);

}  // namespace conveyor

// The unit of work that travels around the pipeline ring: one step of a pipeline.
//
//   coordinator --MicroBatch(token ids)--> stage 0 --MicroBatch + activations--> ... --> stage N-1
//   stage N-1 --BatchResult (batch_result.h)--> coordinator
//
// A step carries only what every stage needs to run it, or what changes every step: per
// sequence its slice (seq_id, start_pos, num_tokens) and the step's flags (sample it, report
// its prompt's log-probs), the token ids, the K/V forks and the frees. A request's state
// (sampling parameters, stop ids, logit_bias, seed, prompt length, log-prob settings: a
// SeqState, seq_state.h) is not here: it goes once, in the `admissions` section of the step
// that first carries the sequence (or the first after a replay), which the stages before the
// last hand on as opaque bytes without reading them.
//
// The header travels through every stage, changed only in `activation_dtype`
// (patch_activation_dtype rewrites that byte in place); the tensor that goes with it is the
// activations [total_tokens, n_embd] between stages (fp32 from a CPU stage, the stage's
// fp16/bf16 from a GPU stage), nothing from the coordinator (stage 0 embeds the token ids).
//
// Wire format (little-endian; tests/protocol/test_microbatch_wire.cc pins its bytes):
//   u32 magic "CMB4" | u64 batch_id | u32 pipeline | u32 epoch | u8 activation_dtype
//   u32 n, then n x: u64 seq_id | i32 start_pos | i32 num_tokens | u8 flags (1 sample,
//                    2 prompt log-probs, 4 prefill, 8 own token)
//                    [| i32 lookahead_token, only when flags has kStepPromptLogprobs]
//   u32 t, i32 token_ids[t]
//   u32 f, f x (u64 parent | u64 child | i32 num_tokens)
//   u32 r, u64 free_seq_ids[r]
//   u32 a, u8 admissions[a]          (seq_state.h's encode_admissions; 0 bytes: none)
// decode_microbatch checks every length against the buffer and fails with a Status naming
// the field, never reading past it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/seq_slice.h"
#include "common/status.h"

namespace conveyor {

// One sequence's part of a step.
struct SeqStep {
  SeqSlice slice;                 // seq_id, start_pos, num_tokens
  bool sample = false;            // the slice ends the known tokens: sample the next one
  bool prompt_logprobs = false;   // report the log-prob of each prompt token this slice predicts
  bool prefill = false;           // the slice starts inside the prompt (step traces count its rows so)
  int32_t lookahead_token = -1;   // with prompt_logprobs: the prompt token after the slice, or -1
  // A step ahead (a pipeline of one stage): the slice's one token is the one this stage sampled
  // for the sequence at its previous step, which the coordinator had not received when it sent
  // the batch. Its entry in token_ids is kOwnTokenPlaceholder; the stage puts its token there.
  bool own_token = false;
  bool operator==(const SeqStep&) const = default;
};
constexpr int32_t kOwnTokenPlaceholder = -1;

// Before a batch runs, every stage gives `child` a copy of the first num_tokens positions of
// `parent`'s K/V (beam search: a beam continues its parent's cache), and the last stage the
// parent's SeqState and its first num_tokens tokens of history. Forks are applied in order,
// before the frees, so a parent freed in the same batch can still be forked from; admissions
// come after both, so a sequence admitted with a fork (a prefix-cache hit) keeps its own state.
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
  std::vector<SeqStep> seqs;
  std::vector<int32_t> token_ids;        // every slice's tokens, concatenated in slice order
  std::vector<SeqFork> forks;            // applied first (see SeqFork)
  std::vector<uint64_t> free_seq_ids;    // free these sequences' KV before running (after the forks)
  // The SeqState of sequences the last stage does not know yet (encode_admissions). Opaque to
  // every other stage: decoding a step copies these bytes and reads nothing in them.
  std::vector<uint8_t> admissions;

  std::vector<SeqSlice> slices() const;
  int64_t total_tokens() const;
  bool operator==(const MicroBatch&) const = default;
};

std::vector<uint8_t> encode(const MicroBatch& batch);
Expected<MicroBatch> decode_microbatch(std::span<const uint8_t> bytes);

// Rewrites the activation dtype of an encoded micro-batch in place (a stage handing on
// activations of another dtype than it received); an error when the bytes are not one.
Status patch_activation_dtype(std::span<std::byte> header, DType dtype);

// Checks a decoded micro-batch against a model: positions within n_positions, lookahead
// tokens and token ids in [0, vocab) (an own-token slice: one token, the placeholder, and
// neither a prompt chunk nor asking for prompt log-probs); forks with a child other than the parent and
// 1 <= num_tokens <= n_positions. (The admissions are checked where they are read.)
Status validate(const MicroBatch& batch, const ModelConfig& config);

}  // namespace conveyor

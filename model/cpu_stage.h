// CpuStage: one pipeline stage (a contiguous layer range of a GPT-2 model) run on the CPU,
// with each sequence's KV cache. It is the reference the CUDA stage is checked against.
//
// A micro-batch is a list of SeqSlice, one per sequence, whose tokens are concatenated in
// slice order: the hidden state is [total_tokens, C] row-major. A slice continues its
// sequence: start_pos must equal the number of tokens the stage has cached for it (0 for
// a new sequence). Prefill chunks and decode steps are the same call; the results are
// batch-invariant (a sequence's bits do not depend on what else is in the micro-batch,
// nor on how its prompt was chunked), because every op in kernels/cpu is.
//
//   first stage:  embed(slices, ids, hidden); forward(slices, hidden); -> next stage
//   middle:       forward(slices, hidden);                             -> next stage
//   last stage:   forward(slices, hidden); logits(slices, hidden, all_positions, out)
//
// Not thread-safe: one caller at a time (the stage worker's engine thread).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/weights.h"

namespace conveyor {

struct SeqSlice {
  uint64_t seq_id = 0;
  int32_t start_pos = 0;   // position of the slice's first token in its sequence
  int32_t num_tokens = 0;  // >= 1
};

// Total tokens of a micro-batch (sum of num_tokens).
// (Inline: the GPU stage library uses it without linking model/.)
inline int64_t total_tokens(std::span<const SeqSlice> slices) {
  int64_t n = 0;
  for (const SeqSlice& s : slices) n += s.num_tokens;
  return n;
}

class CpuStage {
 public:
  explicit CpuStage(StageWeights weights);

  const ModelConfig& config() const { return weights_.config; }
  const StageWeights& weights() const { return weights_; }
  int64_t hidden_size() const { return weights_.config.n_embd; }

  // First stage only. hidden[t, :] = wte[token_ids[t]] + wpe[start_pos + offset]; token ids
  // and positions are checked (ids in [0, V), positions < n_positions).
  Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids, float* hidden);

  // Runs this stage's layers in place on hidden [total_tokens, C], appending each slice's
  // K/V to its sequence's cache. Checks every slice before touching any cache: start_pos
  // must equal the cached length, the slice must end at or before n_positions, a sequence
  // appears at most once. On error nothing has changed.
  Status forward(std::span<const SeqSlice> slices, float* hidden);

  // Last stage only. ln_f then the LM head. all_positions: out is [total_tokens, V];
  // otherwise out is [slices.size(), V], the logits of each slice's last token.
  // Reads no cache; the slices only give the row layout of `hidden`.
  Status logits(std::span<const SeqSlice> slices, const float* hidden, bool all_positions, float* out);

  void free_sequence(uint64_t seq_id);
  void clear();

  // KV figures. cached_tokens: -1 for a sequence the stage does not hold.
  int64_t cached_tokens(uint64_t seq_id) const;
  int64_t num_sequences() const { return int64_t(cache_.size()); }
  int64_t kv_bytes_used() const;       // bytes of K/V rows held (tokens x layers x 2C x 4)
  int64_t kv_bytes_per_token() const;  // layers x 2C x 4

 private:
  // Per layer one [length, 2C] buffer: row p = K of position p (C floats) then its V.
  struct SequenceCache {
    int32_t length = 0;
    std::vector<std::vector<float>> kv;  // one per layer of this stage
  };
  // The activation buffers, sized for the largest micro-batch seen and reused by every
  // layer and call.
  struct Activations {
    std::vector<float> ln;     // [T, C]   LayerNorm output (ln_1, ln_2, ln_f)
    std::vector<float> qkv;    // [T, 3C]
    std::vector<float> atty;   // [T, C]   attention output before the projection
    std::vector<float> proj;   // [T, C]   attention / MLP projection output
    std::vector<float> fch;    // [T, I]   MLP hidden
    std::vector<int32_t> pos;  // [T]      positions, for embed
  };

  Status check_slices(std::span<const SeqSlice> slices) const;
  void ensure_activations(int64_t num_tokens);
  void layer_forward(int64_t layer, std::span<const SeqSlice> slices,
                     std::span<SequenceCache* const> caches, float* hidden, int64_t T);

  StageWeights weights_;
  std::unordered_map<uint64_t, SequenceCache> cache_;
  Activations act_;
  int64_t act_tokens_ = 0;  // rows the activation buffers hold
  std::vector<SequenceCache*> slice_caches_;
};

}  // namespace conveyor

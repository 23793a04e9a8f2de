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
// Tensor parallel (tp > 1), Megatron style over `tp` threads (common/tp_group.h): each rank
// holds a slice of every layer, QKV and FC1 split by columns (whole attention heads and
// FC1 units, as evenly as they divide; a rank may get none when there are fewer heads than
// ranks), the attention and MLP output projections split by the matching rows, its heads'
// K/V cache. Each layer needs two all-reduces of the ranks' partial projections; the
// LayerNorms, the embedding and the LM head run on the calling thread. The results equal
// tp = 1 up to float rounding (the projections' sums are split), and stay batch-invariant.
//
// Not thread-safe: one caller at a time (the stage worker's engine thread).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/seq_slice.h"
#include "common/status.h"
#include "common/tp_group.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace conveyor {

class CpuStage {
 public:
  // tp: tensor-parallel ranks (threads), 1 to the MLP width. With tp > 1 the layers'
  // matrices move into the ranks' slices (weights().layers keeps the norms only). Errors
  // name a tensor whose size does not match the config, or a bad tp.
  static Expected<std::unique_ptr<CpuStage>> create(StageWeights weights, int tp = 1);
  CpuStage(const CpuStage&) = delete;
  CpuStage& operator=(const CpuStage&) = delete;

  int tensor_parallel() const { return tp_.ranks(); }

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

  // Gives `child` the first num_tokens positions of `parent`'s K/V. The CPU cache is one
  // contiguous buffer a sequence (its attention reads rows [0, length) in one span), so the
  // child gets its own copy of those rows. Fails, changing nothing, on an unknown parent, a
  // child that exists, or num_tokens outside 1..the parent's length.
  Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens);
  void free_sequence(uint64_t seq_id);
  void clear();

  // KV figures. cached_tokens: -1 for a sequence the stage does not hold.
  int64_t cached_tokens(uint64_t seq_id) const;
  int64_t num_sequences() const { return int64_t(cache_.size()); }
  int64_t kv_bytes_used() const;       // bytes of K/V rows held (tokens x layers x 2C x 4)
  int64_t kv_bytes_per_token() const;  // layers x 2C x 4

 private:
  CpuStage(StageWeights weights, int tp);

  // Per layer and rank one [length, 2 Cr] buffer (Cr: the rank's heads x head_dim): row p
  // = K of position p for the rank's heads, then their V.
  struct SequenceCache {
    int32_t length = 0;
    std::vector<std::vector<float>> kv;  // [layer * tp + rank]
  };
  // One rank's slice of a layer: QKV columns [C, 3 Cr] (q | k | v of its heads), the
  // attention projection's rows [Cr, C], FC1 columns [C, Ir] and FC2 rows [Ir, C]. With
  // tp = 1 the pointers are the layer's own matrices; otherwise into `owned` (shard_layer).
  struct ShardLayer {
    const float *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr, *fc_w = nullptr, *fc_b = nullptr,
                *fc2_w = nullptr;
    LayerWeights owned;
  };
  struct Shard {
    int64_t heads = 0, width = 0, inner = 0;  // its heads, their width (heads x head_dim), its FC1 units
    std::vector<ShardLayer> layers;
    std::vector<float> qkv, atty, fch, partial;  // [T, 3 Cr], [T, Cr], [T, Ir], [T, C]
  };
  // The calling thread's buffers, sized for the largest micro-batch seen and reused by
  // every layer and call.
  struct Activations {
    std::vector<float> ln;     // [T, C]   LayerNorm output (ln_1, ln_2, ln_f)
    std::vector<int32_t> pos;  // [T]      positions, for embed
  };

  Status check_slices(std::span<const SeqSlice> slices) const;
  void make_shards(int tp);
  void ensure_activations(int64_t num_tokens);
  void layer_forward(int64_t layer, std::span<const SeqSlice> slices,
                     std::span<SequenceCache* const> caches, float* hidden, int64_t T);

  StageWeights weights_;
  std::vector<Shard> shards_;
  TpGroup tp_;
  std::unordered_map<uint64_t, SequenceCache> cache_;
  Activations act_;
  int64_t act_tokens_ = 0;  // rows the activation buffers hold
  std::vector<SequenceCache*> slice_caches_;
  std::vector<const float*> partials_;  // per rank, its partial output (null: empty shard)
};

}  // namespace conveyor

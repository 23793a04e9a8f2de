// The Megatron split of a layer over the ranks of a tensor-parallel stage, as data: which
// heads and MLP units a rank holds, and its slices of the layer's tensors (the weight table's
// TpSplit says how each tensor is cut). The CPU stage's threads and the GPU stage's GPUs use
// the same split, so their results agree.
#pragma once

#include <array>
#include <cstdint>

#include "common/model_config.h"
#include "model/weights.h"

namespace conveyor {

// Rank `rank` of `ranks`: whole heads [head_begin, head_end) (their Q, K and V columns and
// the matching rows of the attention projection) and MLP units [inner_begin, inner_end) (FC1
// columns, FC2 rows). Shares differ by at most one; a rank may get no head when there are
// fewer heads than ranks.
struct TpShard {
  int64_t head_begin = 0, head_end = 0, inner_begin = 0, inner_end = 0;
  int64_t heads() const { return head_end - head_begin; }
  int64_t inner() const { return inner_end - inner_begin; }

  static TpShard of(const ModelConfig& c, int rank, int ranks) {
    return {c.n_head * rank / ranks, c.n_head * (rank + 1) / ranks, c.n_inner * rank / ranks,
            c.n_inner * (rank + 1) / ranks};
  }
};

// Where a rank's part of a layer tensor lies in the whole [in, out] tensor: rows
// [row_begin, row_begin + rows), and from each of them up to three runs of columns, packed side
// by side in the part (q | k | v of the rank's heads). A vector is one row [1, out]. Without a
// shard (or for a TpSplit::Whole tensor) it is the whole tensor: all rows, one run.
// shard_layer copies by it, and a GPU stage's direct load reads the checkpoint's bytes by it.
struct TpSlice {
  struct Run {
    int64_t first = 0, count = 0;  // columns of the whole tensor
  };
  int64_t row_begin = 0, rows = 0;
  int num_runs = 1;
  std::array<Run, 3> runs{};
  int64_t cols() const {
    int64_t n = 0;
    for (int i = 0; i < num_runs; ++i) n += runs[size_t(i)].count;
    return n;
  }
};
TpSlice tp_slice(const LayerTensorSpec& spec, const ModelConfig& config, const TpShard* shard);

// The shard's slices of a layer's split tensors, still [in, out] (layer_tensor_shape with the
// shard gives each size): attn_qkv_w [C, 3W] (q | k | v of its heads, W = heads x head_dim),
// attn_qkv_b [3W], attn_proj_w [W, C], mlp_fc_w [C, Ir], mlp_fc_b [Ir], mlp_proj_w [Ir, C].
// The TpSplit::Whole tensors (the LayerNorms, the two output biases) are left empty: they
// apply to the whole hidden state, after the all-reduce.
LayerWeights shard_layer(const LayerWeights& w, const ModelConfig& config, const TpShard& shard);

}  // namespace conveyor

// The fp32 weights of one pipeline stage (a contiguous layer range, plus the embedding
// on the first stage and the final LayerNorm + LM head on the last), loaded from a
// HuggingFace GPT-2 checkpoint or generated at random for tests and benchmarks.
//
// Matrix layouts follow HF's Conv1D: a weight is [in_features, out_features], row-major,
// so a projection is out[T, N] = in[T, K] @ w[K, N] + b[N].
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/status.h"

namespace conveyor {

struct LayerWeights {
  std::vector<float> ln_1_g, ln_1_b;  // [C]
  std::vector<float> attn_qkv_w;      // [C, 3C]: columns q | k | v, head h at h*D within each
  std::vector<float> attn_qkv_b;      // [3C]
  std::vector<float> attn_proj_w;     // [C, C]
  std::vector<float> attn_proj_b;     // [C]
  std::vector<float> ln_2_g, ln_2_b;  // [C]
  std::vector<float> mlp_fc_w;        // [C, I]
  std::vector<float> mlp_fc_b;        // [I]
  std::vector<float> mlp_proj_w;      // [I, C]
  std::vector<float> mlp_proj_b;      // [C]
};

struct StageWeights {
  ModelConfig config;
  int64_t layer_begin = 0, layer_end = 0;  // this stage runs layers [layer_begin, layer_end)
  bool has_embedding() const { return layer_begin == 0; }
  bool has_head() const { return layer_end == config.n_layer; }

  std::vector<float> wte;             // [V, C]: first stage, and last stage when tied
  std::vector<float> wpe;             // [P, C]: first stage
  std::vector<float> ln_f_g, ln_f_b;  // [C]: last stage
  std::vector<float> lm_head;         // [V, C]: last stage, only when not tied to wte
  std::vector<LayerWeights> layers;   // layer_end - layer_begin entries

  const std::vector<float>& head_matrix() const { return lm_head.empty() ? wte : lm_head; }
  int64_t checkpoint_bytes_read = 0;  // bytes of tensor data the load touched
};

// Rank `rank` of `ranks` in a Megatron split of a layer: whole heads [head_begin, head_end)
// (their Q, K and V columns and the matching rows of the attention projection) and MLP
// units [inner_begin, inner_end) (FC1 columns, FC2 rows). Shares differ by at most one; a
// rank may get no head when there are fewer heads than ranks.
struct TpShard {
  int64_t head_begin = 0, head_end = 0, inner_begin = 0, inner_end = 0;
  int64_t heads() const { return head_end - head_begin; }
  int64_t inner() const { return inner_end - inner_begin; }

  static TpShard of(const ModelConfig& c, int rank, int ranks) {
    return {c.n_head * rank / ranks, c.n_head * (rank + 1) / ranks, c.n_inner * rank / ranks,
            c.n_inner * (rank + 1) / ranks};
  }
};

// The shard's slices of a layer's matrices, still [in, out]: attn_qkv_w [C, 3W] (q | k | v
// of its heads, W = heads x head_dim), attn_qkv_b [3W], attn_proj_w [W, C], mlp_fc_w [C, Ir],
// mlp_fc_b [Ir], mlp_proj_w [Ir, C]. The LayerNorms and the two output biases are left
// empty: they apply to the whole hidden state, after the all-reduce.
// (Inline: the GPU stage library uses it without linking model/.)
inline LayerWeights shard_layer(const LayerWeights& w, const ModelConfig& c, const TpShard& s) {
  const int64_t C = c.n_embd, I = c.n_inner, D = c.head_dim();
  const int64_t W = s.heads() * D, c0 = s.head_begin * D, i0 = s.inner_begin, N = s.inner();
  LayerWeights out;
  out.attn_qkv_w.resize(size_t(C * 3 * W));
  out.attn_qkv_b.resize(size_t(3 * W));
  for (int64_t part = 0; part < 3; ++part) {  // q, k, v: the rank's heads of each
    for (int64_t row = 0; row < C; ++row)
      std::copy_n(w.attn_qkv_w.data() + row * 3 * C + part * C + c0, W, out.attn_qkv_w.data() + row * 3 * W + part * W);
    std::copy_n(w.attn_qkv_b.data() + part * C + c0, W, out.attn_qkv_b.data() + part * W);
  }
  out.attn_proj_w.assign(w.attn_proj_w.begin() + c0 * C, w.attn_proj_w.begin() + (c0 + W) * C);
  out.mlp_fc_w.resize(size_t(C * N));
  for (int64_t row = 0; row < C; ++row) std::copy_n(w.mlp_fc_w.data() + row * I + i0, N, out.mlp_fc_w.data() + row * N);
  out.mlp_fc_b.assign(w.mlp_fc_b.begin() + i0, w.mlp_fc_b.begin() + i0 + N);
  out.mlp_proj_w.assign(w.mlp_proj_w.begin() + i0 * C, w.mlp_proj_w.begin() + (i0 + N) * C);
  return out;
}

// Called after each tensor is converted: checkpoint bytes done so far, and in all.
using LoadProgress = std::function<void(int64_t bytes_done, int64_t bytes_total)>;

// Loads layers [layer_begin, layer_end) of the checkpoint in `model_dir` (config.json and
// model.safetensors or a sharded model.safetensors.index.json), converting fp16/bf16/fp32
// storage to fp32. Reads only the tensors this stage needs. Errors name file and tensor.
Expected<StageWeights> load_stage_weights(const std::string& model_dir, int64_t layer_begin,
                                          int64_t layer_end, const LoadProgress& progress = {});
Expected<StageWeights> load_stage_weights(const std::string& model_dir, const ModelConfig& config,
                                          int64_t layer_begin, int64_t layer_end,
                                          const LoadProgress& progress = {});

// Random weights of the given shape (GPT-2 initialisation: N(0, 0.02), LayerNorm gain 1),
// deterministic in `seed`; used by tests and CPU benchmarks.
StageWeights random_stage_weights(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                                  uint64_t seed);

}  // namespace conveyor

// The fp32 weights of one pipeline stage (a contiguous layer range, plus the embedding
// on the first stage and the final LayerNorm + LM head on the last), loaded from a
// HuggingFace GPT-2 checkpoint or generated at random for tests and benchmarks.
//
// Matrix layouts follow HF's Conv1D: a weight is [in_features, out_features], row-major,
// so a projection is out[T, N] = in[T, K] @ w[K, N] + b[N].
#pragma once

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

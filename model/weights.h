// The fp32 weights of one pipeline stage (a contiguous layer range, plus the embedding
// on the first stage and the final LayerNorm + LM head on the last), loaded from a
// HuggingFace GPT-2 checkpoint or generated at random for tests and benchmarks.
//
// Matrix layouts follow HF's Conv1D: a weight is [in_features, out_features], row-major,
// so a projection is out[T, N] = in[T, K] @ w[K, N] + b[N].
#pragma once

#include <algorithm>
#include <array>
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

// ---- The weight table: every tensor of a layer, described once. ----
//
// Loading (the HF name and shape), random weights, the shape checks of both stages, the
// tensor-parallel split (model/tp_shard.h) and the GPU's weight layout all walk this table;
// nothing else lists a layer's tensors. Host values are fp32 in HF's [in, out] layout; a GPU
// stage keeps the vectors in its fp16/bf16 and the matrices in fp16/bf16 [out, in], or int8
// with one fp32 scale per output row (int8 weight-only).

// A layer's tensors, in the order of the table (and of an HF GPT-2 checkpoint).
enum class LayerTensor : uint8_t {
  Ln1Gain, Ln1Bias, QkvWeight, QkvBias, ProjWeight, ProjBias,
  Ln2Gain, Ln2Bias, FcWeight, FcBias, Fc2Weight, Fc2Bias,
};
inline constexpr size_t kLayerTensorCount = 12;

// A dimension in the model's sizes: 1, n_embd (C), 3 x n_embd (q | k | v), n_inner (I).
enum class Dim : uint8_t { One, Embd, Embd3, Inner };

// Which ranks of a tensor-parallel stage hold what of a tensor (the Megatron split):
enum class TpSplit : uint8_t {
  Whole,         // every rank, all of it: the LayerNorms, and the output biases (added after the all-reduce)
  HeadColumns,   // the rank's heads' q, k and v columns (QKV weight and bias)
  HeadRows,      // the rows of the rank's heads (the attention projection)
  InnerColumns,  // the rank's MLP units (FC1 weight and bias)
  InnerRows,     // the rows of the rank's MLP units (FC2)
};

struct LayerTensorSpec {
  LayerTensor id;
  const char* hf_name;                      // after "h.<layer>." in an HF GPT-2 checkpoint
  std::vector<float> LayerWeights::*field;  // its fp32 values on the host
  Dim in, out;                              // shape [in, out]; a vector is [One, out]
  TpSplit split;
  bool gain;                                // a LayerNorm gain: initialised to 1

  bool matrix() const { return in != Dim::One; }
};

inline constexpr std::array<LayerTensorSpec, kLayerTensorCount> kLayerTensors = {{
    {LayerTensor::Ln1Gain, "ln_1.weight", &LayerWeights::ln_1_g, Dim::One, Dim::Embd, TpSplit::Whole, true},
    {LayerTensor::Ln1Bias, "ln_1.bias", &LayerWeights::ln_1_b, Dim::One, Dim::Embd, TpSplit::Whole, false},
    {LayerTensor::QkvWeight, "attn.c_attn.weight", &LayerWeights::attn_qkv_w, Dim::Embd, Dim::Embd3, TpSplit::HeadColumns, false},
    {LayerTensor::QkvBias, "attn.c_attn.bias", &LayerWeights::attn_qkv_b, Dim::One, Dim::Embd3, TpSplit::HeadColumns, false},
    {LayerTensor::ProjWeight, "attn.c_proj.weight", &LayerWeights::attn_proj_w, Dim::Embd, Dim::Embd, TpSplit::HeadRows, false},
    {LayerTensor::ProjBias, "attn.c_proj.bias", &LayerWeights::attn_proj_b, Dim::One, Dim::Embd, TpSplit::Whole, false},
    {LayerTensor::Ln2Gain, "ln_2.weight", &LayerWeights::ln_2_g, Dim::One, Dim::Embd, TpSplit::Whole, true},
    {LayerTensor::Ln2Bias, "ln_2.bias", &LayerWeights::ln_2_b, Dim::One, Dim::Embd, TpSplit::Whole, false},
    {LayerTensor::FcWeight, "mlp.c_fc.weight", &LayerWeights::mlp_fc_w, Dim::Embd, Dim::Inner, TpSplit::InnerColumns, false},
    {LayerTensor::FcBias, "mlp.c_fc.bias", &LayerWeights::mlp_fc_b, Dim::One, Dim::Inner, TpSplit::InnerColumns, false},
    {LayerTensor::Fc2Weight, "mlp.c_proj.weight", &LayerWeights::mlp_proj_w, Dim::Inner, Dim::Embd, TpSplit::InnerRows, false},
    {LayerTensor::Fc2Bias, "mlp.c_proj.bias", &LayerWeights::mlp_proj_b, Dim::One, Dim::Embd, TpSplit::Whole, false},
}};

constexpr bool layer_table_in_order() {
  for (size_t i = 0; i < kLayerTensors.size(); ++i)
    if (size_t(kLayerTensors[i].id) != i) return false;
  return true;
}
static_assert(layer_table_in_order(), "kLayerTensors[i] must describe LayerTensor(i)");

inline const LayerTensorSpec& layer_tensor(LayerTensor t) { return kLayerTensors[size_t(t)]; }

// The stage's tensors outside its layers. wte is the LM head too when the model ties them.
enum class StageTensor : uint8_t { Wte, Wpe, LnfGain, LnfBias, LmHead };
enum class StageDim : uint8_t { One, Embd, Vocab, Positions };
enum class HeldBy : uint8_t { FirstStage, LastStage };  // a tensor-parallel last stage: rank 0

struct StageTensorSpec {
  StageTensor id;
  const char* hf_name;  // "wte.weight" etc. ("lm_head.weight" has no "transformer." prefix)
  std::vector<float> StageWeights::*field;
  StageDim rows, cols;
  HeldBy held_by;
  bool gain;
};

inline constexpr std::array<StageTensorSpec, 5> kStageTensors = {{
    {StageTensor::Wte, "wte.weight", &StageWeights::wte, StageDim::Vocab, StageDim::Embd, HeldBy::FirstStage, false},
    {StageTensor::Wpe, "wpe.weight", &StageWeights::wpe, StageDim::Positions, StageDim::Embd, HeldBy::FirstStage, false},
    {StageTensor::LnfGain, "ln_f.weight", &StageWeights::ln_f_g, StageDim::One, StageDim::Embd, HeldBy::LastStage, true},
    {StageTensor::LnfBias, "ln_f.bias", &StageWeights::ln_f_b, StageDim::One, StageDim::Embd, HeldBy::LastStage, false},
    {StageTensor::LmHead, "lm_head.weight", &StageWeights::lm_head, StageDim::Vocab, StageDim::Embd, HeldBy::LastStage, false},
}};

// Elements of a dimension (with `shard`, a tensor-parallel rank's part of the split one).
struct TpShard;
int64_t dim_size(Dim d, const ModelConfig& config);
int64_t dim_size(StageDim d, const ModelConfig& config);
// [in, out] of a layer tensor: the whole tensor, or (shard given) a rank's part of it.
struct TensorShape {
  int64_t rows = 1, cols = 1;
  int64_t elements() const { return rows * cols; }
};
TensorShape layer_tensor_shape(const LayerTensorSpec& spec, const ModelConfig& config, const TpShard* shard = nullptr);
// "h.3.attn.c_attn.weight": the tensor's name in messages and in a checkpoint.
std::string layer_tensor_name(int64_t layer, const LayerTensorSpec& spec);
// "[n_embd, 3*n_embd]": what the config implies, for messages.
std::string layer_tensor_dims(const LayerTensorSpec& spec);

// Checks that every tensor the stage needs has the size its config implies (the error names
// the tensor, e.g. "h.3.mlp.c_fc.weight has 100 floats, expected 3072"); the stages call it
// before they use the weights.
Status check_weight_shapes(const StageWeights& weights);

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

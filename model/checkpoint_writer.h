// Writing safetensors files and whole HuggingFace GPT-2 checkpoint directories
// (config.json + model.safetensors, or N shards + model.safetensors.index.json), so that
// tests, benchmarks and the cluster tests can make real checkpoints on disk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/status.h"
#include "model/weights.h"

namespace conveyor {

struct NamedTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;    // elements per dimension; empty for a scalar
  std::vector<std::byte> bytes;  // num_elements * dtype_bytes(dtype), little-endian
};

// fp32 values stored as `storage` (F32, F16 or BF16; rounded to nearest even).
NamedTensor make_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values,
                        DType storage);

// Writes one safetensors file, tensors in the given order, header padded with spaces to a
// multiple of 8 bytes (as HF does). Written to a temporary file and renamed, so a reader
// never sees half a file. Checks names are unique and byte counts match shape and dtype.
Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// The HF GPT-2 tensors of a full model (layers [0, n_layer)) in HF order: wte, wpe, h.0.*,
// ..., ln_f, then lm_head.weight when full_model.lm_head is non-empty (untied). `prefix`
// is "transformer." (current HF) or "" (original OpenAI uploads). Errors name the tensor
// whose size does not match `config`.
Expected<std::vector<NamedTensor>> gpt2_named_tensors(const ModelConfig& config, const StageWeights& full_model,
                                                      DType storage, std::string_view prefix = "transformer.");

// config.json with HF's GPT-2 field names (n_inner is null when it is 4 * n_embd).
Status write_gpt2_config(const std::string& path, const ModelConfig& config);

// Writes DIR/config.json and the weights: model.safetensors when num_shards == 1, else
// model-0000K-of-0000N.safetensors + model.safetensors.index.json ({"metadata":
// {"total_size"}, "weight_map"}). Shards split on layer boundaries (a layer's tensors share
// a shard), balanced by bytes; 1 <= num_shards <= n_layer + 2. Removes a stale
// model.safetensors / index of the other layout so the directory is unambiguous.
Status write_gpt2_checkpoint(const std::string& dir, const ModelConfig& config, const StageWeights& full_model,
                             DType storage, int num_shards = 1, std::string_view prefix = "transformer.");

}  // namespace conveyor

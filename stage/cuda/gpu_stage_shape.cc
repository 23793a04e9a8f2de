// GpuStageShape (gpu_stage_shape.h): the option checks and the sizes derived from them.
#include "stage/cuda/gpu_stage_shape.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/paged_kv.h"
#include "stage/cuda/tp_all_reduce.h"

namespace conveyor::cuda {

Status GpuStageShape::validate(const ModelConfig& c, int64_t layer_begin, int64_t layer_end,
                               const GpuStageOptions& o) {
  const std::string& n = o.name;
  if (c.n_embd <= 0 || c.n_head <= 0 || c.n_embd % c.n_head != 0 || c.n_inner <= 0 || c.vocab_size <= 0 ||
      c.n_positions <= 0)
    return Status::error(n + ": invalid model shape");
  if (layer_begin < 0 || layer_end > c.n_layer || layer_begin > layer_end)
    return Status::error(n + ": layer range [" + std::to_string(layer_begin) + ", " + std::to_string(layer_end) +
                         ") outside a " + std::to_string(c.n_layer) + "-layer model");
  if (o.dtype != DType::F16 && o.dtype != DType::BF16)
    return Status::error(n + ": dtype must be F16 or BF16, got " + std::string(dtype_name(o.dtype)));
  if (o.max_tokens <= 0 || o.max_seqs <= 0) return Status::error(n + ": max_tokens and max_seqs must be positive");
  if (!(o.kv_cache_fraction > 0.0 && o.kv_cache_fraction <= 1.0))
    return Status::error(n + ": kv_cache_fraction must be in (0, 1]");
  if (c.n_embd % 8 != 0)
    return Status::error(n + ": n_embd must be a multiple of 8 on the GPU (got " + std::to_string(c.n_embd) + ")");
  if (o.kv_fp8 && !tile_order_head_dim(c.head_dim()))
    return Status::error(n + ": an FP8 K/V cache needs a head size that is a multiple of 16 and at most 128 (the "
                         "tile order of attention reads it); this model's is " + std::to_string(c.head_dim()));
  const int R = o.tp_ranks;
  if (R < 1 || R > c.n_head || R > c.n_inner || o.tp_rank < 0 || o.tp_rank >= R)
    return Status::error(n + ": tensor-parallel rank " + std::to_string(o.tp_rank) + " of " + std::to_string(R) +
                         " (ranks must be from 1 to the model's " + std::to_string(c.n_head) + " heads)");
  if (R > 1 && (o.all_reduce == nullptr || o.all_reduce->ranks() != R))
    return Status::error(n + ": a tensor-parallel stage needs an all-reduce over its " + std::to_string(R) + " ranks");
  return ok_status();
}

GpuStageShape GpuStageShape::of(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                                const GpuStageOptions& options) {
  GpuStageShape s;
  s.config = config;
  s.layer_begin = layer_begin;
  s.layer_end = layer_end;
  s.options = options;
  s.shard = TpShard::of(config, options.tp_rank, options.tp_ranks);
  s.heads = s.shard.heads();
  s.width = s.heads * config.head_dim();
  s.inner = s.shard.inner();

  CUDA_CHECK(cudaGetDevice(&s.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&s.num_sms, cudaDevAttrMultiProcessorCount, s.device));

  const int64_t largest_bucket = options.max_seqs <= kMaxGraphRows ? decode_bucket(options.max_seqs) : 0;
  s.max_pages = (config.n_positions + kPageTokens - 1) / kPageTokens;
  s.max_rows = activation_rows(options);
  s.max_step_seqs = std::max(options.max_seqs, largest_bucket);
  return s;
}

int64_t GpuStageShape::activation_rows(const GpuStageOptions& o) {
  const int64_t largest_bucket = o.max_seqs <= kMaxGraphRows ? decode_bucket(o.max_seqs) : 0;
  return std::max({o.max_tokens, o.max_seqs, largest_bucket});
}

}  // namespace conveyor::cuda

// GpuStageShape: what every part of a GpuStage is sized from, worked out once at creation:
// the model, the layer range and the options, this rank's TpShard, the device, and the row
// and sequence counts the buffers hold. GpuStage owns it; its parts (GpuWeights, StepBuffers,
// StepRunner) read it.
//
// The decode graphs' batch-size buckets are here too, since the buffers are sized for the
// largest: 1, 2, 4, ..., 128, then multiples of 64 up to kMaxGraphRows (at most 63 padding
// rows).
#pragma once

#include <cstdint>
#include <string>

#include "common/model_config.h"
#include "common/status.h"
#include "model/tp_shard.h"
#include "stage/cuda/gpu_stage_options.h"

namespace conveyor::cuda {

inline constexpr int64_t kMaxGraphRows = 512;  // largest decode bucket

// The decode bucket of `rows` rows (rows <= kMaxGraphRows).
inline int64_t decode_bucket(int64_t rows) {
  if (rows > 128) return (rows + 63) / 64 * 64;  // 192, 256, ...: at most 63 padding rows
  int64_t b = 1;
  while (b < rows) b *= 2;
  return b;
}

struct GpuStageShape {
  ModelConfig config;
  int64_t layer_begin = 0, layer_end = 0;
  GpuStageOptions options;  // deterministic: also as the Gemm allows (GpuStage's constructor)
  TpShard shard;            // this rank's heads and MLP units (all of them when tp_ranks == 1)
  int64_t heads = 0;        // shard.heads()
  int64_t width = 0;        // heads x head_dim: this rank's share of the attention width
  int64_t inner = 0;        // shard.inner()
  int device = 0;
  int num_sms = 0;
  int64_t max_pages = 0;      // block-table entries per sequence: ceil(n_positions / kPageTokens)
  int64_t max_rows = 0;       // activation rows: activation_rows(options)
  int64_t max_step_seqs = 0;  // sequence slots in the metadata: max(max_seqs, largest bucket)

  // The checks of shapes and options made before the device is touched (FP8's own:
  // GpuWeights::validate_fp8).
  static Status validate(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                         const GpuStageOptions& options);
  // After validate(), on the current device (its id and SM count: CUDA faults throw).
  static GpuStageShape of(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                          const GpuStageOptions& options);
  // The most tokens one call may carry: max(max_tokens, max_seqs, the largest decode bucket).
  static int64_t activation_rows(const GpuStageOptions& options);

  const std::string& name() const { return options.name; }
  int64_t num_layers() const { return layer_end - layer_begin; }
  bool has_embedding() const { return layer_begin == 0; }
  bool has_head() const { return layer_end == config.n_layer; }
  // The LM head is this stage's and this rank holds it (rank 0 of a tensor-parallel stage).
  bool holds_head() const { return has_head() && options.tp_rank == 0; }
};

}  // namespace conveyor::cuda

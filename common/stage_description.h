// What a worker's stage is, described by the stage's backend and read by the coordinator,
// which plans and batches from these figures alone (it knows no backend's formats or
// constants). A worker's `register` carries StageCapabilities, its answer to the welcome a
// StageFootprint (transport/control_messages.h); stage/ computes both (backend_factory.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/dtype.h"

namespace conveyor {

// A stage's activation dtype as the control protocol and /v1/cluster write it.
inline std::string_view activation_dtype_wire_name(DType t) {
  return t == DType::BF16 ? "bf16" : t == DType::F16 ? "f16" : "f32";
}
inline std::optional<DType> activation_dtype_from_wire(std::string_view s) {
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  return std::nullopt;
}

// What a stage is before it holds a model.
struct StageCapabilities {
  DType dtype = DType::F32;         // its activations and K/V elements (F32, F16 or BF16)
  std::string weight_format;        // how it stores its layer matrices ("f32", "f16", "int8", "fp8", ...): shown, never parsed
  int64_t weight_memory_bytes = 0;  // what its weights may take of its memory; 0: unknown
  int64_t kv_page_tokens = 1;       // positions per K/V page: prefix reuse shares whole pages
  int64_t max_rows_per_step = 0;    // rows one step may carry at most (the stage refuses more); 0: no limit
  // The batching a pipeline of it takes by default (the cluster file may set others): the
  // most sequences, and the most prompt rows (of one sequence, and per stage of a pipeline),
  // that a step should carry.
  int64_t max_sequences_per_step = 0;
  int64_t max_prompt_rows_per_step = 0;
  int extra_in_flight = 0;  // micro-batches in flight beyond one per stage, on a pipeline of several
  bool operator==(const StageCapabilities&) const = default;
};

// What one model takes in the stage's own format, over all of its ranks: a layer's bytes, the
// first stage's and the last stage's extras, a stage that is both (a tied head kept once), and
// the K/V bytes of one token in one layer. Layers [b, e) take (e - b) x layer_bytes plus the
// extras of the ends they hold (coordinator/planner.h, stage_weight_bytes).
struct StageFootprint {
  int64_t layer_bytes = 0;
  int64_t embedding_bytes = 0;           // token and position embeddings (the first stage)
  int64_t head_bytes = 0;                // final LayerNorm and LM head (the last stage)
  int64_t embedding_and_head_bytes = 0;  // a stage that is both first and last
  int64_t kv_bytes_per_token_per_layer = 0;
  bool operator==(const StageFootprint&) const = default;
};

}  // namespace conveyor

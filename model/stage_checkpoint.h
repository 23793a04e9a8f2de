// One stage's tensors in a checkpoint, found and checked before a byte of their data is read,
// and the pieces a loader copies them in. Both loads walk this one resolution: the fp32 host
// load (load_stage_weights, weights.h) and a GPU stage's direct load, which copies each
// tensor's bytes in their stored dtype (F32, F16, BF16), only its tensor-parallel rank's part
// (tp_shard.h), straight from the mapped file into its staging buffers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/status.h"
#include "model/safetensors.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace conveyor {

// A tensor of the stage, where the checkpoint keeps it.
struct TensorSource {
  std::string name;  // as the checkpoint names it ("transformer.h.3.attn.c_attn.weight")
  TensorRef ref;     // its file and header entry (shape and dtype already checked)
  DType dtype() const { return ref.info->dtype; }
  uint64_t bytes() const { return ref.info->size_bytes; }
};

struct StageCheckpoint {
  Checkpoint checkpoint;  // owns the mapped files the sources point into (stable across moves)
  ModelConfig config;
  int64_t layer_begin = 0, layer_end = 0;
  std::vector<std::array<TensorSource, kLayerTensorCount>> layers;  // layer_end - layer_begin
  // The stage tensors it needs, indexed by StageTensor: Wte on the first stage, and on the
  // last when the head is tied to it; LmHead only when the checkpoint has an untied head.
  std::array<std::optional<TensorSource>, kStageTensors.size()> stage;

  bool has_embedding() const { return layer_begin == 0; }
  bool has_head() const { return layer_end == config.n_layer; }
  const TensorSource& layer(int64_t l, LayerTensor t) const { return layers[size_t(l)][size_t(t)]; }
  // The LM head's matrix: lm_head.weight when untied, else wte; null off the last stage.
  const TensorSource* head() const;
  int64_t bytes() const;  // tensor data of the whole stage, in the stored dtypes
};

// Opens `model_dir`'s checkpoint and finds layers [layer_begin, layer_end) of `config` (and the
// embedding and head where the stage holds them). Every tensor must exist (tried with the
// "transformer." prefix first, then without), have the shape the config implies and be
// stored as F32, F16 or BF16. Errors name the file (or directory) and the tensor.
Expected<StageCheckpoint> open_stage_checkpoint(const std::string& model_dir, const ModelConfig& config,
                                                int64_t layer_begin, int64_t layer_end);

// Bytes of a tensor a loader copies in one go: `rows` rows `pitch` bytes apart, the first at
// `begin` bytes into the tensor's data, and from each row up to three runs of bytes, packed
// side by side in the destination (a rank's q | k | v columns). `first_row` says where the
// piece starts in the destination: its rows are [first_row, first_row + rows) of the part.
struct TensorPiece {
  struct Run {
    uint64_t offset = 0, bytes = 0;  // within a row
  };
  const TensorSource* source = nullptr;
  int64_t layer = -1;   // the tensor: the stage's layer (from 0) and its LayerTensor,
  uint8_t tensor = 0;   // or -1 and its StageTensor
  uint64_t begin = 0, pitch = 0;
  int64_t first_row = 0, rows = 0;
  int num_runs = 1;
  std::array<Run, 3> runs{};
  bool last = false;  // the tensor's last piece

  uint64_t row_bytes() const;
  uint64_t bytes() const { return row_bytes() * uint64_t(rows); }
};

// `slice` of the [rows, cols] tensor `source` (rows and cols as the model's config has them; a
// vector is [1, n]) in pieces of at most `max_bytes` (whole rows; at least one row per piece:
// the caller refuses a row wider than its buffers). Runs that touch are joined, so a whole
// tensor's rows are one run each, and gather copies whole rows as one block.
std::vector<TensorPiece> tensor_pieces(const TensorSource& source, int64_t cols, const TpSlice& slice,
                                       uint64_t max_bytes);
// The whole [rows, cols] tensor as pieces (stage tensors, and Whole layer tensors).
std::vector<TensorPiece> tensor_pieces(const TensorSource& source, int64_t rows, int64_t cols, uint64_t max_bytes);

// Every piece of the tensors a tensor-parallel rank holds, in the weight table's order: each
// layer's tensors (their TpSlice of `shard`), then the stage tensors `holds` says it keeps
// (whole; the LM head's from head()). An error when it holds one the checkpoint was not
// opened with.
Expected<std::vector<TensorPiece>> stage_pieces(const StageCheckpoint& checkpoint, const TpShard& shard,
                                                const std::function<bool(StageTensor)>& holds, uint64_t max_bytes);

// How gather copies a piece of whole rows (one block of the file): with pread, or from the
// mapping (its pages mapped in one call, copied, and dropped from the mapping after). A
// piece of a rank's columns (several runs a row) always goes through the mapping.
enum class PieceRead : uint8_t { Pread, Map };
// Copies the piece's bytes into `out` (piece.bytes() of them). Errors (a read failing, a file
// cut short since it was opened) name the file and the tensor.
Status gather(const TensorPiece& piece, std::byte* out, PieceRead read = PieceRead::Pread);

}  // namespace conveyor

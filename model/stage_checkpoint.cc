// open_stage_checkpoint: a stage's tensors found and checked; tensor_pieces and gather: how a
// loader copies them (stage_checkpoint.h).
//
// Names: "transformer.h.N.attn.c_attn.weight" etc.; the original OpenAI uploads drop the
// "transformer." prefix, so every name is tried with it first and then without. Buffers
// such as attn.bias / attn.masked_bias are never asked for, so they are ignored.
#include "model/stage_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace conveyor {
namespace {

// Finds `name` (HF name without the "transformer." prefix, or "lm_head.weight") and checks its
// shape against `shape` (what the config implies; `meaning` says it in the config's names).
Expected<TensorSource> find_tensor(Checkpoint& ckpt, const std::string& hf_name, const std::vector<int64_t>& shape,
                                   const std::string& meaning) {
  const std::string prefixed = "transformer." + hf_name;
  const bool top_level = hf_name.rfind("lm_head.", 0) == 0;
  std::string name = hf_name;
  if (!top_level && ckpt.contains(prefixed)) {
    name = prefixed;
  } else if (!ckpt.contains(hf_name)) {
    return Status::error(ckpt.dir() + ": tensor \"" + (top_level ? hf_name : prefixed) + "\" not found in checkpoint" +
                         (top_level ? std::string() : " (also tried \"" + hf_name + "\")"));
  }
  auto ref = ckpt.find(name);
  if (!ref) return ref.status();
  const TensorInfo& info = *ref->info;
  if (info.shape != shape)
    return Status::error(ref->file->path() + ": tensor \"" + name + "\" has shape " + shape_string(info.shape) +
                         ", but the model config implies " + shape_string(shape) + " " + meaning);
  if (info.dtype != DType::F32 && info.dtype != DType::F16 && info.dtype != DType::BF16)
    return Status::error(ref->file->path() + ": tensor \"" + name + "\" is stored as " +
                         std::string(dtype_name(info.dtype)) + "; weights must be F32, F16 or BF16");
  return TensorSource{std::move(name), *ref};
}

std::pair<int64_t, std::string> stage_dim(StageDim d, const ModelConfig& c) {
  switch (d) {
    case StageDim::Vocab: return {c.vocab_size, "vocab_size"};
    case StageDim::Positions: return {c.n_positions, "n_positions"};
    case StageDim::Embd: return {c.n_embd, "n_embd"};
    case StageDim::One: return {1, "1"};
  }
  return {0, "?"};
}

}  // namespace

const TensorSource* StageCheckpoint::head() const {
  if (!has_head()) return nullptr;
  const auto& lm_head = stage[size_t(StageTensor::LmHead)];
  return lm_head ? &*lm_head : &*stage[size_t(StageTensor::Wte)];
}

int64_t StageCheckpoint::bytes() const {
  int64_t n = 0;
  for (const auto& layer : layers)
    for (const TensorSource& t : layer) n += int64_t(t.bytes());
  for (const auto& t : stage)
    if (t) n += int64_t(t->bytes());
  return n;
}

Expected<StageCheckpoint> open_stage_checkpoint(const std::string& model_dir, const ModelConfig& config,
                                                int64_t layer_begin, int64_t layer_end) {
  if (!(0 <= layer_begin && layer_begin < layer_end && layer_end <= config.n_layer))
    return Status::error(model_dir + ": layer range [" + std::to_string(layer_begin) + ", " +
                         std::to_string(layer_end) + ") is invalid for a model with n_layer=" +
                         std::to_string(config.n_layer) + " (need 0 <= begin < end <= n_layer)");
  auto ckpt = Checkpoint::open(model_dir);
  if (!ckpt) return ckpt.status();
  StageCheckpoint s{std::move(ckpt).value(), config, layer_begin, layer_end, {}, {}};
  // The head is untied only when the config says so and the checkpoint has one; otherwise
  // the last stage multiplies by wte (HF ties them when lm_head.weight is absent).
  const bool untied_head = s.has_head() && !config.tie_word_embeddings && s.checkpoint.contains("lm_head.weight");
  for (const StageTensorSpec& spec : kStageTensors) {
    bool needed = spec.held_by == HeldBy::FirstStage ? s.has_embedding() : s.has_head();
    if (spec.id == StageTensor::Wte) needed = s.has_embedding() || (s.has_head() && !untied_head);
    if (spec.id == StageTensor::LmHead) needed = untied_head;
    if (!needed) continue;
    const auto [rows, row_name] = stage_dim(spec.rows, config);
    const auto [cols, col_name] = stage_dim(spec.cols, config);
    auto t = spec.rows == StageDim::One ? find_tensor(s.checkpoint, spec.hf_name, {cols}, "[" + col_name + "]")
                                        : find_tensor(s.checkpoint, spec.hf_name, {rows, cols},
                                                      "[" + row_name + ", " + col_name + "]");
    if (!t) return t.status();
    s.stage[size_t(spec.id)] = std::move(t).value();
  }
  s.layers.resize(size_t(layer_end - layer_begin));
  for (int64_t l = layer_begin; l < layer_end; ++l)
    for (const LayerTensorSpec& spec : kLayerTensors) {
      const TensorShape shape = layer_tensor_shape(spec, config);
      auto t = find_tensor(s.checkpoint, layer_tensor_name(l, spec),
                           spec.matrix() ? std::vector<int64_t>{shape.rows, shape.cols} : std::vector<int64_t>{shape.cols},
                           layer_tensor_dims(spec));
      if (!t) return t.status();
      s.layers[size_t(l - layer_begin)][size_t(spec.id)] = std::move(t).value();
    }
  return s;
}

uint64_t TensorPiece::row_bytes() const {
  uint64_t n = 0;
  for (int i = 0; i < num_runs; ++i) n += runs[size_t(i)].bytes;
  return n;
}

std::vector<TensorPiece> tensor_pieces(const TensorSource& source, int64_t cols, const TpSlice& slice,
                                       uint64_t max_bytes) {
  const uint64_t e = dtype_bytes(source.dtype());
  TensorPiece proto;
  proto.source = &source;
  proto.pitch = uint64_t(cols) * e;
  proto.num_runs = 0;
  for (int i = 0; i < slice.num_runs; ++i) {  // runs in bytes, joined where they touch
    const TpSlice::Run& r = slice.runs[size_t(i)];
    TensorPiece::Run run{uint64_t(r.first) * e, uint64_t(r.count) * e};
    TensorPiece::Run* prev = proto.num_runs > 0 ? &proto.runs[size_t(proto.num_runs - 1)] : nullptr;
    if (prev && prev->offset + prev->bytes == run.offset) prev->bytes += run.bytes;
    else proto.runs[size_t(proto.num_runs++)] = run;
  }
  const uint64_t row_bytes = proto.row_bytes();
  const int64_t rows_per_piece = std::max<int64_t>(1, int64_t(max_bytes / std::max<uint64_t>(row_bytes, 1)));
  std::vector<TensorPiece> pieces;
  for (int64_t r0 = 0; r0 < slice.rows; r0 += rows_per_piece) {
    TensorPiece p = proto;
    p.first_row = r0;
    p.rows = std::min(rows_per_piece, slice.rows - r0);
    p.begin = uint64_t(slice.row_begin + r0) * proto.pitch;
    pieces.push_back(p);
  }
  if (!pieces.empty()) pieces.back().last = true;
  return pieces;
}

std::vector<TensorPiece> tensor_pieces(const TensorSource& source, int64_t rows, int64_t cols, uint64_t max_bytes) {
  TpSlice whole;
  whole.rows = rows;
  whole.runs[0] = {0, cols};
  return tensor_pieces(source, cols, whole, max_bytes);
}

Expected<std::vector<TensorPiece>> stage_pieces(const StageCheckpoint& c, const TpShard& shard,
                                                const std::function<bool(StageTensor)>& holds, uint64_t max_bytes) {
  std::vector<TensorPiece> pieces;
  auto add = [&](std::vector<TensorPiece> more, int64_t layer, uint8_t tensor) {
    for (TensorPiece& p : more) {
      p.layer = layer;
      p.tensor = tensor;
      pieces.push_back(p);
    }
  };
  for (int64_t l = 0; l < int64_t(c.layers.size()); ++l)
    for (const LayerTensorSpec& spec : kLayerTensors)
      add(tensor_pieces(c.layer(l, spec.id), layer_tensor_shape(spec, c.config).cols,
                        tp_slice(spec, c.config, &shard), max_bytes),
          l, uint8_t(spec.id));
  for (const StageTensorSpec& spec : kStageTensors) {
    if (!holds(spec.id)) continue;
    const auto& own = c.stage[size_t(spec.id)];
    const TensorSource* source = spec.id == StageTensor::LmHead ? c.head() : own ? &*own : nullptr;
    if (!source)
      return Status::error(c.checkpoint.dir() + ": the stage was opened without " + spec.hf_name +
                           ", which this rank holds (layers [" + std::to_string(c.layer_begin) + ", " +
                           std::to_string(c.layer_end) + "))");
    add(tensor_pieces(*source, dim_size(spec.rows, c.config), dim_size(spec.cols, c.config), max_bytes), -1,
        uint8_t(spec.id));
  }
  return pieces;
}

Status gather(const TensorPiece& p, std::byte* out, PieceRead read) {
  const SafetensorsFile& file = *p.source->ref.file;
  const TensorInfo& info = *p.source->ref.info;
  const bool block = p.num_runs == 1 && p.runs[0].offset == 0 && p.runs[0].bytes == p.pitch;  // whole rows
  if (block && read == PieceRead::Pread) return file.read(info, p.begin, p.bytes(), out);
  const TensorPiece::Run& last = p.runs[size_t(p.num_runs - 1)];
  const uint64_t span = p.pitch * uint64_t(p.rows - 1) + last.offset + last.bytes;  // begin to the last byte read
  file.populate(info, p.begin, span);
  const std::byte* base = file.data(info).data() + p.begin;
  if (block) {
    std::memcpy(out, base, p.bytes());
  } else {
    for (int64_t r = 0; r < p.rows; ++r)
      for (int i = 0; i < p.num_runs; ++i) {
        const TensorPiece::Run& run = p.runs[size_t(i)];
        std::memcpy(out, base + uint64_t(r) * p.pitch + run.offset, run.bytes);
        out += run.bytes;
      }
  }
  file.release(info, p.begin, span);
  return ok_status();
}

}  // namespace conveyor

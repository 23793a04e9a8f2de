// The weight table's sizes, names and the shape check every stage makes (model/weights.h).
#include <string>

#include "model/tp_shard.h"
#include "model/weights.h"

namespace conveyor {

int64_t dim_size(Dim d, const ModelConfig& c) {
  switch (d) {
    case Dim::One: return 1;
    case Dim::Embd: return c.n_embd;
    case Dim::Embd3: return 3 * c.n_embd;
    case Dim::Inner: return c.n_inner;
  }
  return 0;
}

int64_t dim_size(StageDim d, const ModelConfig& c) {
  switch (d) {
    case StageDim::One: return 1;
    case StageDim::Embd: return c.n_embd;
    case StageDim::Vocab: return c.vocab_size;
    case StageDim::Positions: return c.n_positions;
  }
  return 0;
}

TensorShape layer_tensor_shape(const LayerTensorSpec& spec, const ModelConfig& c, const TpShard* shard) {
  TensorShape s{dim_size(spec.in, c), dim_size(spec.out, c)};
  if (!shard) return s;
  const int64_t width = shard->heads() * c.head_dim();  // the rank's share of n_embd
  switch (spec.split) {
    case TpSplit::Whole: break;
    case TpSplit::HeadColumns: s.cols = 3 * width; break;
    case TpSplit::HeadRows: s.rows = width; break;
    case TpSplit::InnerColumns: s.cols = shard->inner(); break;
    case TpSplit::InnerRows: s.rows = shard->inner(); break;
  }
  return s;
}

std::string layer_tensor_name(int64_t layer, const LayerTensorSpec& spec) {
  return "h." + std::to_string(layer) + "." + spec.hf_name;
}

std::string layer_tensor_dims(const LayerTensorSpec& spec) {
  auto name = [](Dim d) -> std::string {
    switch (d) {
      case Dim::One: return "1";
      case Dim::Embd: return "n_embd";
      case Dim::Embd3: return "3*n_embd";
      case Dim::Inner: return "n_inner";
    }
    return "?";
  };
  return spec.matrix() ? "[" + name(spec.in) + ", " + name(spec.out) + "]" : "[" + name(spec.out) + "]";
}

Status check_weight_shapes(const StageWeights& w) {
  const ModelConfig& c = w.config;
  if (w.layer_begin < 0 || w.layer_end > c.n_layer || w.layer_begin > w.layer_end ||
      int64_t(w.layers.size()) != w.layer_end - w.layer_begin)
    return Status::error("layer range [" + std::to_string(w.layer_begin) + ", " + std::to_string(w.layer_end) +
                         ") does not match " + std::to_string(w.layers.size()) + " layers of a " +
                         std::to_string(c.n_layer) + "-layer model");
  auto check = [](const std::vector<float>& v, int64_t expected, const std::string& name) {
    if (int64_t(v.size()) == expected) return ok_status();
    return Status::error("weight " + name + " has " + std::to_string(v.size()) + " floats, expected " +
                         std::to_string(expected));
  };
  for (const StageTensorSpec& spec : kStageTensors) {
    const bool needed = spec.held_by == HeldBy::FirstStage ? w.has_embedding() : w.has_head();
    if (!needed || spec.id == StageTensor::LmHead) continue;
    const int64_t n = dim_size(spec.rows, c) * dim_size(spec.cols, c);
    if (Status s = check(w.*spec.field, n, spec.hf_name); !s) return s;
  }
  if (w.has_head())
    if (Status s = check(w.head_matrix(), c.vocab_size * c.n_embd, "lm_head"); !s) return s;
  for (size_t i = 0; i < w.layers.size(); ++i)
    for (const LayerTensorSpec& spec : kLayerTensors)
      if (Status s = check(w.layers[i].*spec.field, layer_tensor_shape(spec, c).elements(),
                           layer_tensor_name(w.layer_begin + int64_t(i), spec));
          !s)
        return s;
  return ok_status();
}

}  // namespace conveyor

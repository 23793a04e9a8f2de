#include "model/tp_shard.h"

#include <algorithm>

namespace conveyor {

TpSlice tp_slice(const LayerTensorSpec& spec, const ModelConfig& c, const TpShard* s) {
  const TensorShape full = layer_tensor_shape(spec, c);
  TpSlice slice;
  slice.rows = full.rows;
  slice.runs[0] = {0, full.cols};
  if (!s) return slice;
  const int64_t D = c.head_dim();
  switch (spec.split) {
    case TpSplit::Whole: break;
    case TpSplit::HeadColumns: {  // q, k, v: the rank's heads of each third
      const int64_t group = full.cols / 3, width = s->heads() * D, first = s->head_begin * D;
      slice.num_runs = 3;
      for (int64_t part = 0; part < 3; ++part) slice.runs[size_t(part)] = {part * group + first, width};
      break;
    }
    case TpSplit::InnerColumns: slice.runs[0] = {s->inner_begin, s->inner()}; break;
    case TpSplit::HeadRows:
      slice.row_begin = s->head_begin * D;
      slice.rows = s->heads() * D;
      break;
    case TpSplit::InnerRows:
      slice.row_begin = s->inner_begin;
      slice.rows = s->inner();
      break;
  }
  return slice;
}

LayerWeights shard_layer(const LayerWeights& w, const ModelConfig& c, const TpShard& s) {
  LayerWeights out;
  for (const LayerTensorSpec& spec : kLayerTensors) {
    if (spec.split == TpSplit::Whole) continue;
    const int64_t full_cols = layer_tensor_shape(spec, c).cols;
    const TpSlice slice = tp_slice(spec, c, &s);
    const std::vector<float>& from = w.*spec.field;
    std::vector<float>& to = out.*spec.field;
    to.resize(size_t(slice.rows * slice.cols()));
    float* dst = to.data();
    for (int64_t row = slice.row_begin; row < slice.row_begin + slice.rows; ++row)
      for (int i = 0; i < slice.num_runs; ++i) {
        const TpSlice::Run& run = slice.runs[size_t(i)];
        dst = std::copy_n(from.data() + row * full_cols + run.first, run.count, dst);
      }
  }
  return out;
}

}  // namespace conveyor

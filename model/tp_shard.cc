#include "model/tp_shard.h"

#include <algorithm>

namespace conveyor {

LayerWeights shard_layer(const LayerWeights& w, const ModelConfig& c, const TpShard& s) {
  const int64_t D = c.head_dim();
  LayerWeights out;
  for (const LayerTensorSpec& spec : kLayerTensors) {
    if (spec.split == TpSplit::Whole) continue;
    const TensorShape full = layer_tensor_shape(spec, c), part = layer_tensor_shape(spec, c, &s);
    const std::vector<float>& from = w.*spec.field;
    std::vector<float>& to = out.*spec.field;
    to.resize(size_t(part.elements()));
    switch (spec.split) {
      case TpSplit::HeadColumns: {  // q, k, v: the rank's heads of each third
        const int64_t group = full.cols / 3, width = part.cols / 3, first = s.head_begin * D;
        for (int64_t row = 0; row < full.rows; ++row)
          for (int64_t part_i = 0; part_i < 3; ++part_i)
            std::copy_n(from.data() + row * full.cols + part_i * group + first, width,
                        to.data() + row * part.cols + part_i * width);
        break;
      }
      case TpSplit::InnerColumns:
        for (int64_t row = 0; row < full.rows; ++row)
          std::copy_n(from.data() + row * full.cols + s.inner_begin, part.cols, to.data() + row * part.cols);
        break;
      case TpSplit::HeadRows:
      case TpSplit::InnerRows: {
        const int64_t first = spec.split == TpSplit::HeadRows ? s.head_begin * D : s.inner_begin;
        std::copy_n(from.data() + first * full.cols, part.elements(), to.data());
        break;
      }
      case TpSplit::Whole: break;
    }
  }
  return out;
}

}  // namespace conveyor

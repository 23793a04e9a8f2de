// random_stage_weights: synthetic GPT-2 weights for tests and benchmarks.
//
// Every tensor has its own Philox stream keyed by (seed, global layer index, tensor kind),
// and element i of a tensor depends only on that stream and i. So the layers of a stage
// are the same numbers whatever the stage split (stage [0,2) + stage [2,4) is exactly the
// model [0,4)), and the tied wte of the first and the last stage is one matrix.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <thread>
#include <vector>

#include "common/philox.h"
#include "model/weights.h"

namespace conveyor {
namespace {

// Tensor kinds of the Philox stream ids: the stage's tensors 1.., a layer's 16 + its table index.
enum TensorKind : uint64_t { kWte = 1, kWpe, kLnFG, kLnFB, kLmHead, kFirstLayerTensor = 16 };

constexpr float kStd = 0.02f;

// Fills out[i] = mean + std * N(0,1)_i, N drawn by Box-Muller from Philox with
// key = seed and counter = (tensor id, i / 4); each block gives four normals.
void fill_normal(std::vector<float>& out, size_t n, uint64_t seed, uint64_t tensor_id, float mean,
                 float std) {
  out.resize(n);
  auto fill_range = [&](size_t block_begin, size_t block_end) {
    for (size_t b = block_begin; b < block_end; ++b) {
      const Philox4x32 r = philox_draw(seed, tensor_id, b);
      float z[4];
      for (int pair = 0; pair < 2; ++pair) {
        // u1 in (0, 1] so the log is finite; u2 in [0, 1).
        const double u1 = (double(r.v[2 * pair]) + 1.0) * (1.0 / 4294967296.0);
        const double u2 = double(r.v[2 * pair + 1]) * (1.0 / 4294967296.0);
        const double radius = std::sqrt(-2.0 * std::log(u1));
        z[2 * pair] = float(radius * std::cos(2.0 * std::numbers::pi * u2));
        z[2 * pair + 1] = float(radius * std::sin(2.0 * std::numbers::pi * u2));
      }
      for (size_t j = 0; j < 4 && 4 * b + j < n; ++j) out[4 * b + j] = mean + std * z[j];
    }
  };
  const size_t blocks = (n + 3) / 4;
  const size_t threads = std::clamp<size_t>(blocks / (1 << 18), 1, std::max(1u, std::thread::hardware_concurrency()));
  if (threads == 1) {
    fill_range(0, blocks);
    return;
  }
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back(fill_range, blocks * t / threads, blocks * (t + 1) / threads);
  for (auto& th : pool) th.join();
}

uint64_t tensor_id(int64_t layer, TensorKind kind) { return (uint64_t(layer + 1) << 8) | kind; }

}  // namespace

StageWeights random_stage_weights(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                                  uint64_t seed) {
  StageWeights w;
  w.config = config;
  w.layer_begin = layer_begin;
  w.layer_end = layer_end;
  const size_t C = size_t(config.n_embd), V = size_t(config.vocab_size),
               P = size_t(config.n_positions);
  const int64_t global = -1;  // tensors outside the layers

  if (w.has_embedding() || (w.has_head() && config.tie_word_embeddings))
    fill_normal(w.wte, V * C, seed, tensor_id(global, kWte), 0.0f, kStd);
  if (w.has_embedding()) fill_normal(w.wpe, P * C, seed, tensor_id(global, kWpe), 0.0f, kStd);
  if (w.has_head()) {
    fill_normal(w.ln_f_g, C, seed, tensor_id(global, kLnFG), 1.0f, kStd);
    fill_normal(w.ln_f_b, C, seed, tensor_id(global, kLnFB), 0.0f, kStd);
    if (!config.tie_word_embeddings) fill_normal(w.lm_head, V * C, seed, tensor_id(global, kLmHead), 0.0f, kStd);
  }
  for (int64_t l = layer_begin; l < layer_end; ++l) {
    LayerWeights& lw = w.layers.emplace_back();
    for (const LayerTensorSpec& spec : kLayerTensors)
      fill_normal(lw.*spec.field, size_t(layer_tensor_shape(spec, config).elements()), seed,
                  tensor_id(l, TensorKind(kFirstLayerTensor + uint64_t(spec.id))), spec.gain ? 1.0f : 0.0f, kStd);
  }
  return w;
}

}  // namespace conveyor

// A GPU stage's weights (gpu_weights.h): the layout from the weight table, the one
// allocation, the upload of HF fp32 weights and the synthetic fill. All three walk
// kLayerTensors / kStageTensors in table order, which fixes both the byte offsets and the
// synthetic tensor ids: a layer's tensors take ids from their own range of 64, in table order.
#include "stage/cuda/gpu_weights.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/cuda/fp8.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/synthetic.h"
#include "stage/cuda/dtype_dispatch.h"

namespace conveyor::cuda {
namespace {

constexpr bool stage_table_in_order() {
  for (size_t i = 0; i < kStageTensors.size(); ++i)
    if (size_t(kStageTensors[i].id) != i) return false;
  return true;
}
static_assert(stage_table_in_order(), "StageRefs is indexed by StageTensor");

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// How upload errors name the stage tensors.
const char* upload_name(StageTensor t) {
  switch (t) {
    case StageTensor::Wte: return "wte";
    case StageTensor::Wpe: return "wpe";
    case StageTensor::LnfGain: return "ln_f.weight";
    case StageTensor::LnfBias: return "ln_f.bias";
    case StageTensor::LmHead: return "lm_head";
  }
  return "?";
}

// GpuWeights::upload in element type T: each host tensor checked for size, then copied in
// chunks through the fp32 staging rows and converted (or quantised) into its place.
template <class T>
class WeightUpload {
 public:
  WeightUpload(const GpuWeights& weights, const GpuStageShape& shape, const WeightLoadScratch& scratch,
               cudaStream_t stream)
      : weights_(weights),
        shape_(shape),
        options_(shape.options),
        config_(shape.config),
        scratch_(scratch),
        staging_elems_(int64_t(scratch.staging_f32.bytes() / sizeof(float))),
        staging_(scratch.staging_f32.as<float>()),
        stream_(stream) {}

  Status check(const std::vector<float>& v, int64_t expected, const std::string& name) const {
    if (int64_t(v.size()) == expected) return ok_status();
    return Status::error(options_.name + ": weight " + name + " has " + std::to_string(v.size()) +
                         " floats, expected " + std::to_string(expected));
  }

  // A vector (or a stage tensor): same layout, converted in chunks through the fp32 staging buffer.
  Status put(void* dst, const std::vector<float>& src, int64_t elems, const std::string& name) {
    if (Status s = check(src, elems, name); !s) return s;
    for (int64_t i = 0; i < elems; i += staging_elems_) {
      const int64_t n = std::min(staging_elems_, elems - i);
      CUDA_CHECK(cudaMemcpyAsync(staging_, src.data() + i, size_t(n) * sizeof(float), cudaMemcpyHostToDevice, stream_));
      convert_from_float<T>(static_cast<T*>(dst) + i, staging_, n, stream_);
    }
    return ok_status();
  }

  // A layer matrix, [K, N] on the host -> [N, K] on the device. In dtype: chunks of K rows.
  // Int8 and FP8: chunks of output channels (host columns) through the staging buffer,
  // transposed to dtype in the scratch rows (the LayerNorm activations, free while loading),
  // then quantised.
  Status put_t(void* dst, float* scales, const std::vector<float>& src, TensorShape shape, const std::string& name) {
    const int64_t K = shape.rows, N = shape.cols;
    if (Status s = check(src, K * N, name); !s) return s;
    if (!options_.int8_weights && !options_.fp8) {
      const int64_t rows = std::max<int64_t>(1, staging_elems_ / N);
      for (int64_t k0 = 0; k0 < K; k0 += rows) {
        const int64_t kc = std::min(rows, K - k0);
        CUDA_CHECK(cudaMemcpyAsync(staging_, src.data() + k0 * N, size_t(kc * N) * sizeof(float),
                                   cudaMemcpyHostToDevice, stream_));
        convert_transpose_from_float<T>(static_cast<T*>(dst) + k0, staging_, kc, N, K, stream_);
      }
      return ok_status();
    }
    if (K > staging_elems_) return Status::error(options_.name + ": " + name + " is too wide for the load buffers");
    const int64_t cols = staging_elems_ / K;
    for (int64_t n0 = 0; n0 < N; n0 += cols) {
      const int64_t nc = std::min(cols, N - n0);
      CUDA_CHECK(cudaMemcpy2DAsync(staging_, size_t(nc) * sizeof(float), src.data() + n0, size_t(N) * sizeof(float),
                                   size_t(nc) * sizeof(float), size_t(K), cudaMemcpyHostToDevice, stream_));
      convert_transpose_from_float<T>(scratch_.rows.as<T>(), staging_, K, nc, K, stream_);
      quantize_matrix_rows<T>(options_, dst, scales, n0, scratch_.rows.as<T>(), nc, K, stream_);
    }
    return ok_status();
  }

  Status put_layer(int64_t l, const LayerWeights& lw) {
    const GpuLayer d = weights_.layer(l);
    const int64_t layer = shape_.layer_begin + l;
    const bool split = options_.tp_ranks > 1;
    if (split)  // the full tensors' sizes first, so a short tensor is named as such
      for (const LayerTensorSpec& spec : kLayerTensors)
        if (spec.split != TpSplit::Whole)
          if (Status s = check(lw.*spec.field, layer_tensor_shape(spec, config_).elements(),
                               layer_tensor_name(layer, spec));
              !s)
            return s;
    const LayerWeights sliced = split ? shard_layer(lw, config_, shape_.shard) : LayerWeights{};
    for (const LayerTensorSpec& spec : kLayerTensors) {
      // This rank's slice of a split tensor; the Whole ones (LayerNorms, output biases) as loaded.
      const std::vector<float>& src = (split && spec.split != TpSplit::Whole ? sliced : lw).*spec.field;
      const TensorRef& r = d.ref(spec.id);
      const std::string name = layer_tensor_name(layer, spec);
      const Status s = spec.matrix() ? put_t(d.at(spec.id), d.scales(spec.id), src, r.shape, name)
                                     : put(d.at(spec.id), src, r.shape.elements(), name);
      if (!s) return s;
    }
    return ok_status();
  }

 private:
  const GpuWeights& weights_;
  const GpuStageShape& shape_;
  const GpuStageOptions& options_;
  const ModelConfig& config_;
  const WeightLoadScratch& scratch_;
  const int64_t staging_elems_;
  float* staging_;
  cudaStream_t stream_;
};

}  // namespace

template <class T>
void quantize_matrix_rows(const GpuStageOptions& options, void* dst, float* scales, int64_t n0, const T* rows,
                          int64_t num_rows, int64_t K, cudaStream_t stream) {
  if (options.fp8)
    quantize_rows_fp8<T>(static_cast<uint8_t*>(dst) + n0 * K, scales + n0, rows, num_rows, K, stream);
  else
    quantize_rows_int8<T>(static_cast<int8_t*>(dst) + n0 * K, scales + n0, rows, num_rows, K, stream);
}
template void quantize_matrix_rows<__half>(const GpuStageOptions&, void*, float*, int64_t, const __half*, int64_t,
                                           int64_t, cudaStream_t);
template void quantize_matrix_rows<__nv_bfloat16>(const GpuStageOptions&, void*, float*, int64_t,
                                                  const __nv_bfloat16*, int64_t, int64_t, cudaStream_t);

GpuWeightLayout plan_weight_layout(const ModelConfig& c, const TpShard& shard, int64_t num_layers, bool has_embedding,
                                bool holds_head, DType dtype, bool byte_matrices) {
  const int64_t e = int64_t(dtype_bytes(dtype));
  GpuWeightLayout w;
  auto take = [&](int64_t bytes) {  // the next tensor's offset; the one after starts aligned
    const int64_t off = w.bytes;
    w.bytes = align_up(w.bytes + bytes, kWeightAlign);
    return off;
  };
  w.layers.resize(size_t(num_layers));
  for (LayerRefs& layer : w.layers) {
    const int64_t before = w.bytes;
    for (const LayerTensorSpec& spec : kLayerTensors) {
      TensorRef& r = layer[size_t(spec.id)];
      r.shape = layer_tensor_shape(spec, c, &shard);
      r.bytes = r.shape.elements() * (spec.matrix() && byte_matrices ? 1 : e);
      r.offset = take(r.bytes);
    }
    if (byte_matrices)  // after the layer's tensors: each matrix's scales, one per output row
      for (const LayerTensorSpec& spec : kLayerTensors)
        if (spec.matrix()) {
          TensorRef& r = layer[size_t(spec.id)];
          r.scale_offset = take(r.shape.cols * int64_t(sizeof(float)));
        }
    w.layer_bytes += w.bytes - before;
  }
  const bool head_is_wte = has_embedding && c.tie_word_embeddings;
  for (const StageTensorSpec& spec : kStageTensors) {
    if (!(spec.held_by == HeldBy::FirstStage ? has_embedding : holds_head)) continue;
    TensorRef& r = w.stage[size_t(spec.id)];
    if (spec.id == StageTensor::LmHead && head_is_wte) {
      r = w.stage[size_t(StageTensor::Wte)];
      continue;
    }
    r.shape = {dim_size(spec.rows, c), dim_size(spec.cols, c)};
    r.bytes = r.shape.elements() * e;
    // The vocabulary matrices keep room for their zero rows up to head_rows (above).
    if (spec.rows == StageDim::Vocab) r.zero_bytes = (head_rows(r.shape.rows) - r.shape.rows) * r.shape.cols * e;
    r.offset = take(r.bytes + r.zero_bytes);
  }
  return w;
}

GpuWeights GpuWeights::allocate(const GpuStageShape& shape) {
  const GpuStageOptions& options = shape.options;
  const int64_t C = shape.config.n_embd, V = shape.config.vocab_size;
  const int64_t e = int64_t(dtype_bytes(options.dtype));
  const int64_t L = shape.num_layers();
  const bool int8 = options.int8_weights, fp8 = options.fp8;
  GpuWeightLayout layout = plan_weight_layout(shape.config, shape.shard, L, shape.has_embedding(), shape.holds_head(),
                                              options.dtype, int8 || fp8);
  const char* matrices = int8 ? ", int8 matrices" : fp8 ? ", FP8 matrices" : "";
  GpuWeights g;
  g.buf_ = device_alloc(size_t(layout.bytes), options.name,
                        "weights (" + std::to_string(L) + " layers, " + std::string(dtype_name(options.dtype)) +
                            matrices + ")");
  g.layout_ = std::move(layout);
  // A decode step reads every layer, and on the head's rank ln_f and the head matrix.
  g.decode_bytes_ = g.layout_.layer_bytes + (shape.holds_head() ? (V * C + 2 * C) * e : 0);
  return g;
}

void GpuWeights::zero_vocab_padding(cudaStream_t stream) {
  for (const StageTensorSpec& spec : kStageTensors) {
    const TensorRef& r = ref(spec.id);
    if (!r.held() || r.zero_bytes == 0 || (spec.id == StageTensor::LmHead && head_is_wte())) continue;
    CUDA_CHECK(cudaMemsetAsync(buf_.as<char>() + r.offset + r.bytes, 0, size_t(r.zero_bytes), stream));
  }
}

Status GpuWeights::validate_fp8(const ModelConfig& c, const GpuStageOptions& o) {
  if (!o.fp8) return ok_status();
  const std::string& n = o.name;
  if (o.int8_weights) return Status::error(n + ": fp8 and int8 weights exclude each other (choose one)");
  // Deterministic mode keeps FP8: every T of a (K, N) shape runs one unsplit cuBLASLt
  // algorithm, and a row's bits then depend on that row alone (Gemm::run_fp8; measured on an
  // H100 for every row, T = 1..299, at the gpt3-6.7b shapes: tests/kernels/cuda/test_fp8.cc).
  // Every product of the layers, K x N, of this rank's shard: FP8 GEMMs need both % 16 == 0.
  const TpShard shard = TpShard::of(c, o.tp_rank, o.tp_ranks);
  const int64_t C = c.n_embd, W = shard.heads() * c.head_dim(), I = shard.inner();
  for (auto [K, N, what] : {std::tuple<int64_t, int64_t, const char*>{C, 3 * W, "QKV"},
                            {W, C, "attention projection"}, {C, I, "FC"}, {I, C, "FC2"}})
    if (K % 16 != 0 || N % 16 != 0)
      return Status::error(n + ": fp8 needs every layer matrix's sizes to be multiples of 16; the " + what + " is " +
                           std::to_string(N) + " x " + std::to_string(K) +
                           (o.tp_ranks > 1 ? " on tensor-parallel rank " + std::to_string(o.tp_rank) : ""));
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return Status::error(n + ": no CUDA device: " + cudaGetErrorString(e));
  if (Status s = fp8_device_check(device); !s) return Status::error(n + ": " + s.message());
  return ok_status();
}

Status GpuWeights::upload(const StageWeights& w, const GpuStageShape& shape, const WeightLoadScratch& scratch,
                          cudaStream_t stream) {
  DeviceGuard on(shape.device);
  zero_vocab_padding(stream);
  Status status;
  with_dtype(shape.options.dtype, [&](auto tag) {
    WeightUpload<decltype(tag)> up(*this, shape, scratch, stream);
    for (int64_t l = 0; l < num_layers() && status; ++l) status = up.put_layer(l, w.layers[size_t(l)]);
    for (const StageTensorSpec& spec : kStageTensors) {
      const TensorRef& r = ref(spec.id);
      if (!status || !r.held() || (spec.id == StageTensor::LmHead && head_is_wte())) continue;
      const std::vector<float>& src = spec.id == StageTensor::LmHead ? w.head_matrix() : w.*spec.field;
      status = up.put(at(spec.id), src, r.shape.elements(), upload_name(spec.id));
    }
  });
  if (!status) return status;
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return ok_status();
}

void GpuWeights::synthesize(uint64_t seed, const GpuStageShape& shape, const WeightLoadScratch& scratch,
                            cudaStream_t stream) {
  DeviceGuard on(shape.device);
  zero_vocab_padding(stream);
  const GpuStageOptions& options = shape.options;
  uint64_t tensor = 0;
  with_dtype(options.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto normal = [&](void* p, int64_t n) {
      fill_normal<T>(static_cast<T*>(p), n, 0.f, 0.02f, seed, tensor++, stream);
    };
    auto ones = [&](void* p, int64_t n) { fill_constant<T>(static_cast<T*>(p), n, 1.f, stream); };
    // A layer matrix [N, K]; int8 and FP8: drawn in chunks of rows into the scratch rows (the
    // LayerNorm activations, free while loading), then quantised.
    const int64_t tmp_elems = int64_t(scratch.rows.bytes() / sizeof(T));
    auto matrix = [&](void* p, float* scales, int64_t N, int64_t K) {
      if (!options.int8_weights && !options.fp8) return normal(p, N * K);
      const uint64_t id = tensor++;
      const int64_t rows = std::max<int64_t>(1, tmp_elems / K);
      for (int64_t n0 = 0; n0 < N; n0 += rows) {
        const int64_t nc = std::min(rows, N - n0);
        fill_normal<T>(scratch.rows.as<T>(), nc * K, 0.f, 0.02f, seed, (id << 20) + uint64_t(n0 / rows), stream);
        quantize_matrix_rows<T>(options, p, scales, n0, scratch.rows.as<T>(), nc, K, stream);
      }
    };
    for (int64_t l = 0; l < num_layers(); ++l) {
      const GpuLayer d = layer(l);
      tensor = (tensor / 64 + 1) * 64;  // each layer its own range of tensor ids
      for (const LayerTensorSpec& spec : kLayerTensors) {
        const TensorShape& s = d.ref(spec.id).shape;  // [in, out]: a matrix is N = out rows of K = in
        if (spec.gain) ones(d.at(spec.id), s.elements());
        else if (spec.matrix()) matrix(d.at(spec.id), d.scales(spec.id), s.cols, s.rows);
        else normal(d.at(spec.id), s.elements());
      }
    }
    tensor = 1 << 20;
    for (const StageTensorSpec& spec : kStageTensors) {
      const TensorRef& r = ref(spec.id);
      if (!r.held() || (spec.id == StageTensor::LmHead && head_is_wte())) continue;
      if (spec.gain) ones(at(spec.id), r.shape.elements());
      else normal(at(spec.id), r.shape.elements());
    }
  });
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace conveyor::cuda

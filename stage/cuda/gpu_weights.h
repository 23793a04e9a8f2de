// A GPU stage's weights: one device allocation, laid out by walking the weight table
// (model/weights.h: kLayerTensors for each layer, then kStageTensors) with the shapes of this
// rank's TpShard. Nothing else lists a layer's tensors: the forward pass reads
// layer.at(LayerTensor::QkvWeight), and the upload and the synthetic fill walk the same table.
// GpuWeights owns the allocation and everything done to it: the FP8 checks, the upload of HF
// fp32 weights (this rank's slices, converted, int8 or FP8 quantised), the direct load from a
// checkpoint's bytes (gpu_weight_load.cu: the same layout and conversions, without the fp32
// host copy), the synthetic fill and the byte counts (resident, and read by one decode step).
//
// On the device (e = the stage dtype's bytes):
//   vectors   [out] of dtype (LayerNorm gains and shifts, biases)
//   matrices  [out, in] of dtype (the "NK" layout: rows of the decode GEMV, cuBLASLt's TN), or
//             one byte per element [out, in] plus one fp32 scale per output row: int8
//             (int8 weight-only, quant.h) or E4M3 (FP8, fp8.h)
//   stage     wte [V, C] and wpe [P, C] (first stage), ln_f [C] x 2 and the LM head [V, C]
//             (last stage, rank 0); the head is wte itself when the model ties them and the
//             stage holds both.
// Every tensor starts on a kWeightAlign-byte boundary, in table order: a layer's twelve
// tensors, then (int8, FP8) its four matrices' scales, layer after layer, then the stage tensors.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/status.h"
#include "kernels/cuda/check.h"
#include "model/stage_checkpoint.h"
#include "model/tp_shard.h"
#include "model/weights.h"
#include "stage/cuda/gpu_stage_shape.h"

namespace conveyor::cuda {

inline constexpr int64_t kWeightAlign = 256;  // bytes: every weight tensor starts on this boundary

// The vocabulary matrices (wte, the LM head) hold their rows padded with zero rows to a
// multiple of kHeadRowAlign, and the LM head runs as a product of head_rows(V) rows into
// fp32 rows of that pitch. GPT-2's 50,257 rows give fp32 rows of 201,028 bytes, not a
// multiple of 16: cuBLASLt then offers only its older align-1 kernels, which keep a row's
// bits only in classes the sequential GEMV does not match and take 448 us at T = 1 and
// 947 us at T = 256 (deterministic) for gpt3-6.7b's head. Padded to 50,304, every
// algorithm it proposes is one row-invariant class that the GEMV matches: 141 and 182 us,
// the fast plan's speed (conveyor-bench-gemm-order --dtype f16-f32, one H100, 2026-11-26).
inline constexpr int64_t kHeadRowAlign = 64;
inline int64_t head_rows(int64_t vocab_size) { return (vocab_size + kHeadRowAlign - 1) / kHeadRowAlign * kHeadRowAlign; }

// Where one tensor lives in the weight allocation.
struct TensorRef {
  int64_t offset = -1;        // bytes from the allocation's start; -1: the stage does not hold it
  int64_t bytes = 0;          // bytes of its values (the padding to the next tensor not counted)
  int64_t scale_offset = -1;  // int8 or FP8 matrices: their fp32 scales, one per output row; else -1
  int64_t zero_bytes = 0;     // zeros right after the values that the stage reads (the vocabulary
                              // matrices' rows up to head_rows); every load writes them
  TensorShape shape;          // [in, out] elements of this rank's part, as on the host
  bool held() const { return offset >= 0; }
};

using LayerRefs = std::array<TensorRef, kLayerTensorCount>;     // indexed by LayerTensor
using StageRefs = std::array<TensorRef, kStageTensors.size()>;  // indexed by StageTensor

struct GpuWeightLayout {
  std::vector<LayerRefs> layers;  // the stage's layers, in order
  StageRefs stage;                // LmHead has Wte's offset when they are one tensor
  int64_t bytes = 0;              // the whole allocation
  int64_t layer_bytes = 0;        // the layers' share, padding and scales included
};

// The layout of `num_layers` layers of rank `shard`, with the embedding and/or the head.
// byte_matrices: the layer matrices take one byte an element plus a scale per row (int8, FP8).
GpuWeightLayout plan_weight_layout(const ModelConfig& config, const TpShard& shard, int64_t num_layers,
                                bool has_embedding, bool holds_head, DType dtype, bool byte_matrices);

// One layer's tensors in the allocation (a view: the GpuWeights owns the memory).
class GpuLayer {
 public:
  GpuLayer(char* base, const LayerRefs& refs) : base_(base), refs_(&refs) {}
  void* at(LayerTensor t) const { return base_ + (*refs_)[size_t(t)].offset; }
  template <class T>
  const T* as(LayerTensor t) const { return static_cast<const T*>(at(t)); }
  // An int8 or FP8 matrix's per-output-row scales; null for vectors and for dtype matrices.
  float* scales(LayerTensor t) const {
    const int64_t off = (*refs_)[size_t(t)].scale_offset;
    return off < 0 ? nullptr : reinterpret_cast<float*>(base_ + off);
  }
  const TensorRef& ref(LayerTensor t) const { return (*refs_)[size_t(t)]; }

 private:
  char* base_;
  const LayerRefs* refs_;
};

// Device memory a load borrows from the step buffers (StepBuffers), free until the first step:
// fp32 rows the host values pass through, and rows of the stage's dtype where int8 and FP8
// matrices wait to be quantised.
struct WeightLoadScratch {
  const DeviceBuffer& staging_f32;
  const DeviceBuffer& rows;
};

// How a direct load (GpuWeights::load) reads: `threads` threads copy pieces of at most
// `slot_bytes` from the checkpoint into `slots` page-locked buffers (whole rows by `read`,
// model/stage_checkpoint.h), while the stage's stream copies the filled ones to the GPU and
// converts them there. conveyor-bench-weight-load times other choices.
struct DirectLoadOptions {
  int threads = 4;
  int slots = 6;
  uint64_t slot_bytes = uint64_t(16) << 20;
  PieceRead read = PieceRead::Pread;
};

// Rows [n0, n0 + num_rows) of a byte matrix (int8 or FP8, per the options) and their scales,
// quantised from `rows` [num_rows, K] of T (__half or __nv_bfloat16): the one place the
// uploads, the direct load and the synthetic fill quantise.
template <class T>
void quantize_matrix_rows(const GpuStageOptions& options, void* dst, float* scales, int64_t n0, const T* rows,
                          int64_t num_rows, int64_t K, cudaStream_t stream);

// A stage's weights: the one allocation and its layout. Moves, never copies.
class GpuWeights {
 public:
  GpuWeights() = default;
  // GpuStageShape::validate's FP8 part: not with int8, every layer matrix of this rank K, N %
  // 16 == 0, a GPU of compute capability 8.9 or newer (the current device).
  static Status validate_fp8(const ModelConfig& config, const GpuStageOptions& options);
  // The layout of `shape`'s layers (and embedding and head) in its format, allocated:
  // device_alloc's out of memory throws, naming the stage (a CUDA fault, see guard.h).
  static GpuWeights allocate(const GpuStageShape& shape);

  // Fills the allocation from HF fp32 weights: this rank's slices, converted to the stage's
  // dtype (or quantised). Fails naming a tensor of the wrong size. Synchronous.
  Status upload(const StageWeights& w, const GpuStageShape& shape, const WeightLoadScratch& scratch,
                cudaStream_t stream);
  // Fills the allocation straight from the checkpoint's bytes (stage_checkpoint.h): this rank's
  // part of each tensor, in its stored dtype, through page-locked buffers to the GPU, where it
  // is widened to fp32 and converted (or quantised) as upload() does, so the bytes on the
  // device are upload()'s to the bit. Borrows no step buffer: its own scratch (the pieces,
  // their fp32, and for int8 and FP8 one matrix of the dtype) is freed before it returns.
  // `progress` gets this rank's checkpoint bytes done. Errors name the tensor. Synchronous.
  Status load(const StageCheckpoint& checkpoint, const GpuStageShape& shape, const DirectLoadOptions& options,
              cudaStream_t stream, const LoadProgress& progress = {});
  // Weights drawn on the GPU (kernels/cuda/synthetic.h): N(0, 0.02) matrices, biases and LN
  // shifts, LN gains 1, deterministic in `seed`. Synchronous.
  void synthesize(uint64_t seed, const GpuStageShape& shape, const WeightLoadScratch& scratch, cudaStream_t stream);

  int64_t num_layers() const { return int64_t(layout_.layers.size()); }
  GpuLayer layer(int64_t l) const { return GpuLayer(buf_.as<char>(), layout_.layers[size_t(l)]); }
  // A stage tensor's memory; null when the stage does not hold it.
  void* at(StageTensor t) const {
    const TensorRef& r = layout_.stage[size_t(t)];
    return r.held() ? buf_.as<char>() + r.offset : nullptr;
  }
  template <class T>
  const T* as(StageTensor t) const { return static_cast<const T*>(at(t)); }
  const TensorRef& ref(StageTensor t) const { return layout_.stage[size_t(t)]; }
  // The LM head is the embedding matrix itself (tied, and both on this stage).
  bool head_is_wte() const { return ref(StageTensor::LmHead).held() && at(StageTensor::LmHead) == at(StageTensor::Wte); }

  const void* data() const { return buf_.get(); }  // the allocation (device memory)
  const GpuWeightLayout& layout() const { return layout_; }
  int64_t bytes() const { return layout_.bytes; }
  int64_t layer_bytes() const { return layout_.layer_bytes; }
  // Bytes one decode step reads: every layer, and on the head's rank ln_f and the head matrix.
  int64_t decode_bytes() const { return decode_bytes_; }

 private:
  // Every stage tensor's zero_bytes (the vocabulary matrices' rows up to head_rows): zeros.
  void zero_vocab_padding(cudaStream_t stream);

  GpuWeightLayout layout_;
  DeviceBuffer buf_;
  int64_t decode_bytes_ = 0;
};

}  // namespace conveyor::cuda

// GpuStageOptions: how a GpuStage (gpu_stage.h) is built. A plain struct, filled by the
// backend factory or a test, read once at creation; every part of the stage is sized from it
// (GpuStageShape, gpu_stage_shape.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/kernel_options.h"
#include "kernels/cuda/custom_all_reduce.h"

namespace conveyor::cuda {

class TpAllReduce;  // tp_all_reduce.h

struct GpuStageOptions {
  DType dtype = DType::F16;         // F16 or BF16
  std::string name = "stage";       // names the stage in errors and reports
  int64_t max_tokens = 4096;        // tokens of one forward (prefill chunk): activation rows
  int64_t max_seqs = 128;           // sequences of one micro-batch
  double kv_cache_fraction = 0.90;  // of the device memory free after everything else
  int64_t kv_cache_max_bytes = 0;   // cap on the K/V cache (0: none)
  bool cuda_graphs = true;          // decode() replays graphs (false: runs the same kernels eagerly)
  // Int8 weight-only (quant.h): the four matrices of every layer stored as int8 with one fp32
  // scale per output channel, quantised at load; activations, embeddings and the LM head
  // stay in `dtype`.
  bool int8_weights = false;
  // FP8 (E4M3, fp8.h), compute capability 9.0: the four matrices of every layer stored as E4M3
  // with one fp32 scale per output channel, quantised at load, and their products' activations
  // quantised per row (per token) at every call; cuBLASLt's FP8 products apply both scales,
  // the bias and the GeLU. LayerNorm, attention, K/V, embeddings and the LM head stay in
  // `dtype`. Not with int8_weights.
  bool fp8 = false;
  // FP8 K/V cache (E4M3 bytes with an fp32 scale per position and head, kernels/cuda/paged_kv.h):
  // half the bytes of an fp16 cache, so twice the positions fit. Quantised per token at
  // append, never per batch, so answers keep their independence of the load. Needs a head_dim
  // the tile order of attention takes (a multiple of 16, at most 128).
  bool kv_fp8 = false;
  // Tensor parallel: this stage is rank tp_rank of tp_ranks (1 <= tp_ranks <= n_head, n_inner),
  // and all_reduce (rank tp_rank's GPU must be this stage's) joins the ranks' partial sums.
  int tp_rank = 0, tp_ranks = 1;
  TpAllReduce* all_reduce = nullptr;
  // Tensor parallel: messages up to this many bytes take the custom all-reduce's push call
  // (CustomAllReduce::Algo::Push; 0: never): by default its measured crossover; the benches
  // set it to compare the calls in one run.
  size_t all_reduce_push_max_bytes = CustomAllReduce::kPushMaxMeasured;
  // Deterministic (the default): every product takes the fixed-order tiles (fixed_gemm.h) and
  // prompts the fixed-order attention (attention.h), so a sequence's logits and K/V are the
  // same bits alone or in any batch, chunked any way, and rebuilt after a failover. Off
  // (gemm.deterministic off, CONVEYOR_DETERMINISTIC=0 in the worker's options, also turns it
  // off): the fastest kernels of each shape, whose summation order follows the batch.
  bool deterministic = true;
  // The stage's matrix products (common/kernel_options.h: timing, the deterministic order, the
  // GEMVs' forced splits), as the worker's options registry read them at start-up: the stage's
  // Gemm is made from them (GpuStage's constructor, the one place).
  GemmOptions gemm;
};

}  // namespace conveyor::cuda

// The kernels' tunables as plain values. The options registry (common/options.h) reads them
// from the environment once at start-up; kernels/ takes them as arguments (cuda::Gemm's
// constructor, cuda::set_pdl, cpu::set_threads) and never reads the environment itself. The
// defaults here are the registry's defaults: one place says them.
#pragma once

#include <algorithm>
#include <span>

namespace conveyor {

// The forced K splits the GEMVs take (0: each shape's own choice). Outside these a kernel
// would need a template instance it does not have.
inline constexpr int kGemvKSplits[] = {0, 1, 2, 4};
inline constexpr int kInt8GemvKSplits[] = {0, 1, 2, 4, 8};
// The L2 prefetch of the fp16/bf16 GEMV, bytes of each weight row: far beyond any row the
// stage has (a row of K = 65536 fp16 is 128 KiB), and safe from int overflow in the kernel.
inline constexpr int kMaxGemvL2PrefetchBytes = 1 << 20;

inline bool is_one_of(int value, std::span<const int> allowed) {
  return std::find(allowed.begin(), allowed.end(), value) != allowed.end();
}

// What a cuda::Gemm does (kernels/cuda/gemm.h says each in full).
struct GemmOptions {
  // Time each product shape's candidate kernels and keep the fastest; off: the heuristic's
  // first choice, untimed.
  bool tuning = true;
  // A row's bits are the same whatever the batch (fixed summation orders); off: the fastest
  // kernels, whose order follows the number of rows.
  bool deterministic = true;
  // Deterministic mode's order: the sequential order where a canonical unsplit cuBLASLt
  // algorithm exists (else the fixed-order tiles); off: the fixed-order tiles for every shape.
  bool sequential_order = true;
  // Int8 weight-only products in deterministic mode: the sequential order over the
  // dequantised weights (prefill at cuBLASLt's speed, decode slower) instead of the
  // fixed-order tiles (docs/PERFORMANCE.md measures both). Needs sequential_order.
  bool int8_sequential_order = false;
  // cuBLASLt's fast FP8 accumulation (no periodic promotion to fp32): faster, less exact.
  bool fp8_fast_accum = false;
  // Forced K slices of the fp16/bf16 GEMV (kGemvKSplits; 0: by N), for measurements.
  int gemv_k_split = 0;
  // Bytes of each weight row the GEMV prefetches into L2 before it waits on the kernel
  // before it (0: none).
  int gemv_l2_prefetch_bytes = 0;
  // Forced K slices of the int8 GEMV (kInt8GemvKSplits; 0: by shape and SM count).
  int int8_gemv_k_split = 0;
};

// The kernels' process-wide settings and the products' options, as a daemon applies them.
struct KernelOptions {
  GemmOptions gemm;
  // Programmatic Dependent Launch for the CUDA kernels that support it (kernels/cuda/launch.cuh).
  bool pdl = true;
  // Threads of the CPU ops' pool, the calling thread included (0: one per hardware thread).
  int cpu_threads = 0;
};

}  // namespace conveyor

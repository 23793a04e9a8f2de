// Internal: the device side of FP8 E4M3 quantisation, one definition for every kernel that
// quantises (fp8.cu: activations and weights by row; paged_kv.cu and attention_tiles.cuh: the
// K/V cache by (token, head)). A vector x of fp32 values gets the scale s = amax / 448
// (__fdiv_rn) and the bytes q = e4m3(x / s), saturating; s == 0 (all zeros) gives zeros. The
// value a byte stands for is dequant(q, s) = float(q) * s, rounded once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/fp8.h"

namespace conveyor::cuda::detail {

__device__ __forceinline__ uint8_t e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float fp8_scale(float amax) { return __fdiv_rn(amax, kFp8E4M3Max); }

// q = e4m3(x / s); s == 0 (an all-zero row, or one too small to scale) gives 0. The same
// operations as quantize_rows_fp8_reference (fp8.cc), in the same order.
__device__ __forceinline__ uint8_t quantize_one(float x, float s) { return s > 0.f ? e4m3(__fdiv_rn(x, s)) : 0; }

// Eight values quantised by quantize_one into q[0, 8) with one 8-byte store (q 8-byte aligned).
__device__ __forceinline__ void quantize8(uint8_t* q, const float (&f)[8], float s) {
  uint2 out;
  uint8_t* b = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) b[i] = quantize_one(f[i], s);
  *reinterpret_cast<uint2*>(q) = out;
}

// quantize_one for a power-of-two s (kv_fp8_scale's), given rcp = 1 / s (exact: s is a normal
// power of two): x * rcp and x / s are the same exact value, so the one rounding gives the
// same float, without a division's dozen instructions.
__device__ __forceinline__ uint8_t quantize_pow2(float x, float s, float rcp) {
  return s > 0.f ? e4m3(__fmul_rn(x, rcp)) : 0;
}

// Exact: every E4M3 value is an fp16.
__device__ __forceinline__ float e4m3_to_float(uint8_t q) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q), __NV_E4M3)));
}

__device__ __forceinline__ float dequant(uint8_t q, float s) { return __fmul_rn(e4m3_to_float(q), s); }

// The K/V cache's scale: the power of two at or above amax / 448 (0 for amax 0), so that
// q * s is exact in fp32, fp16 and bf16 alike, and the attention kernels may move s onto
// the scores (K) or onto P (V) without a rounding. A scale that rounds amax / 448 down to a power of two may put a
// value a rounding above 448, which e4m3() saturates.
__device__ __forceinline__ float kv_fp8_scale(float amax) {
  if (!(amax > 0.f)) return 0.f;
  const unsigned r = __float_as_uint(fp8_scale(amax));
  unsigned e = r >> 23;           // amax >= 0: no sign bit
  if (r & 0x7fffffu) ++e;         // not a power of two: the next one up
  return __uint_as_float(max(e, 1u) << 23);  // (below the smallest normal: the smallest normal)
}

// Output n of a product's row in fp32, from its fp16 sum: times unscale (2^e, exact), the
// row's and column n's scales, bias n (none when null), the activation (GemmAct's code). Every
// FP8 epilogue uses it: fp8_scale_epilogue, fp8_epilogue_quantize, and the LayerNorm that
// reads an Fp8Sums.
template <class T>
__device__ __forceinline__ float epilogue_value(float sum, float unscale, float row_scale, const float* cs,
                                                const T* bias, int64_t n, int act) {
  const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
  return activate(__fmul_rn(__fmul_rn(sum * unscale, row_scale), cs[n]) + b, act);
}

}  // namespace conveyor::cuda::detail

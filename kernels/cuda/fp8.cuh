// Internal: the device side of FP8 E4M3 quantisation, one definition for every kernel that
// quantises (fp8.cu: activations and weights by row; paged_kv.cu and attention_tiles.cuh: the
// K/V cache by (token, head)). A vector x of fp32 values gets the scale s = amax / 448
// (__fdiv_rn), its reciprocal r = 1 / s (__frcp_rn, once a vector) and the bytes
// q = e4m3(x * r), saturating; s == 0 (all zeros) gives r = 0 and zeros. The value a byte
// stands for is dequant(q, s) = float(q) * s, rounded once. (x * r, not x / s: a division an
// element was the largest part of the quantising kernels' arithmetic, and x * r differs from
// x / s by an ulp or two of fp32 at most, before the rounding to E4M3's 3 bits.)
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

// The reciprocal the bytes are made with: RN(1 / s); 0 for s == 0 (an all-zero row, or one
// too small to scale). For a power of two s (kv_fp8_scale's) it is exact, so x * r is x / s.
__device__ __forceinline__ float fp8_rcp(float s) { return s > 0.f ? __frcp_rn(s) : 0.f; }

// q = e4m3(x * r), r = fp8_rcp(s); r == 0 gives 0. The same operations as
// quantize_rows_fp8_reference (fp8.cc), in the same order.
__device__ __forceinline__ uint8_t quantize_one(float x, float r) { return r > 0.f ? e4m3(__fmul_rn(x, r)) : 0; }

// Eight values quantised by quantize_one into q[0, 8) with one 8-byte store (q 8-byte aligned).
__device__ __forceinline__ void quantize8(uint8_t* q, const float (&f)[8], float r) {
  uint2 out;
  uint8_t* b = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) b[i] = quantize_one(f[i], r);
  *reinterpret_cast<uint2*>(q) = out;
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

// One K or V head quantised for the cache, its values spread over the lanes of a group of
// kLanes neighbouring lanes (a whole warp by default; N a lane; zeros where a lane holds none):
// the head's scale (kv_fp8_scale of its largest magnitude, returned to every lane of the group)
// and each value's byte. Every lane of the warp takes part. The prefill's append (paged_kv.cu),
// the decode's new token (attention_tiles.cuh) and QKV's epilogue into the cache
// (fp8_scale_epilogue_kv) use it.
template <int N, int kLanes = 32>
__device__ __forceinline__ float quantize_kv_head(const float (&x)[N], uint8_t (&q)[N]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const float s = kv_fp8_scale(warp_max<kLanes>(amax));  // max is exact in any order
  const float r = fp8_rcp(s);
#pragma unroll
  for (int i = 0; i < N; ++i) q[i] = quantize_one(x[i], r);
  return s;
}

// Output n of a product's row in fp32, from its fp16 sum: times unscale (2^e, exact), the
// row's scale and column n's (col_scale), plus its bias (0 when none), then the activation
// (GemmAct's code). Every FP8 epilogue uses it: fp8_scale_epilogue, fp8_epilogue_quantize, the
// LayerNorm and the decode attention that read an Fp8Sums.
__device__ __forceinline__ float epilogue_value(float sum, float unscale, float row_scale, float col_scale, float bias,
                                                int act) {
  return activate(__fmul_rn(__fmul_rn(sum * unscale, row_scale), col_scale) + bias, act);
}
template <class T>
__device__ __forceinline__ float epilogue_value(float sum, float unscale, float row_scale, const float* cs,
                                                const T* bias, int64_t n, int act) {
  return epilogue_value(sum, unscale, row_scale, cs[n], bias != nullptr ? to_float(bias[n]) : 0.f, act);
}

// Columns n to n + 7's scales and biases (0 without one), for eight outputs at a time: two
// 16-byte loads of cs and one of bias (cs + n and bias + n 16-byte aligned).
template <class T>
__device__ __forceinline__ void epilogue_columns8(float (&c)[8], float (&b)[8], const float* cs, const T* bias,
                                                  int64_t n) {
  const float4 lo = *reinterpret_cast<const float4*>(cs + n), hi = *reinterpret_cast<const float4*>(cs + n + 4);
  c[0] = lo.x, c[1] = lo.y, c[2] = lo.z, c[3] = lo.w, c[4] = hi.x, c[5] = hi.y, c[6] = hi.z, c[7] = hi.w;
  if (bias != nullptr) {
    unpack8<T>(*reinterpret_cast<const uint4*>(bias + n), b);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = 0.f;
  }
}

}  // namespace conveyor::cuda::detail

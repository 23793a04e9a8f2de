// Device-side element helpers shared by the .cu files (not a public header): fp32 <->
// fp16/bf16 conversion, and 16-byte vectors of 8 elements (one uint4), the unit every
// memory-bound kernel here loads and stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace conveyor::cuda::detail {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ float from_float<float>(float f) { return f; }
template <>
__device__ __forceinline__ __half from_float<__half>(float f) { return __float2half_rn(f); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }

__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }

template <class T> struct Pair;
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

template <class T>
__device__ __forceinline__ typename Pair<T>::type from_float2(float2 f);
template <>
__device__ __forceinline__ __half2 from_float2<__half>(float2 f) { return __float22half2_rn(f); }
template <>
__device__ __forceinline__ __nv_bfloat162 from_float2<__nv_bfloat16>(float2 f) { return __float22bfloat162_rn(f); }

// 8 elements of T in one 16-byte word.
constexpr int kVec = 8;

template <class T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  using T2 = typename Pair<T>::type;
  const T2* p = reinterpret_cast<const T2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = to_float2(p[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <class T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  using T2 = typename Pair<T>::type;
  uint4 u;
  T2* p = reinterpret_cast<T2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = from_float2<T>(make_float2(f[2 * i], f[2 * i + 1]));
  return u;
}

template <class T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  unpack8<T>(*reinterpret_cast<const uint4*>(p), f);
}
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(p) = pack8<T>(f);
}

// True when p is 16-byte aligned (host or device).
__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// A warp's lanes' values combined by op over the butterflies 16, 8, 4, 2, 1: every lane gets
// the result. op(v, the other lane's v): a + b for warp_sum, fmaxf for warp_max. kWidth < 32:
// each group of kWidth neighbouring lanes on its own (butterflies kWidth / 2 .. 1); every
// lane of the warp still takes part.
template <int kWidth = 32, class Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "a power of two up to 32 lanes");
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, AddOp{}); }
template <int kWidth = 32>
__device__ __forceinline__ float warp_max(float v) {
  return warp_reduce<kWidth>(v, MaxOp{});
}

// The reduction of a block W times as wide, whose thread threadIdx.x + w * blockDim.x held
// v[w]: each warp's, then the warps' in its order (identity past the last), so the same bits
// as W = 1 in that block. Every thread gets the result; `scratch` holds >= 32 floats and may be
// reused right after the call returns (the trailing barrier protects it).
template <int W, class Op>
__device__ __forceinline__ float block_reduce_virtual(const float (&v)[W], float* scratch, float identity, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5, nwarps = warps * W;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float s = warp_reduce(v[w], op);
    if (lane == 0) scratch[warp + w * warps] = s;
  }
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : identity;
  t = warp_reduce(t, op);
  __syncthreads();
  return t;
}
template <int W>
__device__ __forceinline__ float block_sum_virtual(const float (&v)[W], float* scratch) {
  return block_reduce_virtual(v, scratch, 0.f, AddOp{});
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const float one[1] = {v};
  return block_sum_virtual(one, scratch);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const float one[1] = {v};
  return block_reduce_virtual(one, scratch, -INFINITY, MaxOp{});
}

// GeLU, tanh form (HF gelu_new) and erf form (HF gelu), in fp32.
//
// The tanh form as x * sigmoid(2u) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the
// same function as 0.5 x (1 + tanh(u)), without the cancellation of 1 + tanh(u) where x is
// negative, and with the hardware's exponential and reciprocal (a few fp32 units of relative
// error everywhere) in place of tanhf, whose branches and polynomial were most of FP8's FC1
// epilogue (a GeLU per element of 16,384 columns). Large negative x: e^(-2u) overflows to inf
// and the result is -0; large positive x: e^(-2u) is 0 and the result is x.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float k2 = -2.f * 0.7978845608028654f * 1.4426950408889634f;  // -2 sqrt(2/pi) log2(e)
  const float e = exp2f(k2 * (x + 0.044715f * x * x * x));
  return __fdividef(x, 1.f + e);
}
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.7071067811865476f)); }

// The fused epilogue activation of the matrix products; act is GemmAct's value (0 none,
// 1 GeLU tanh, 2 GeLU erf).
__device__ __forceinline__ float activate(float v, int act) {
  return act == 1 ? gelu_tanh(v) : act == 2 ? gelu_erf(v) : v;
}

}  // namespace conveyor::cuda::detail

// Int8 weight-only quantisation (as FasterTransformer's weight-only int8): a weight [N, K]
// (N output channels, each a row of K input values, the GPU stage's layout) is stored as int8
// q[n, k] with one fp32 scale s[n] per row, symmetric:
//
//   s[n] = max_k |w[n, k]| / 127,   q[n, k] = round_to_nearest_even(w[n, k] / s[n]) in [-127, 127]
//
// (an all-zero row gets s = 0 and q = 0; weights must be finite). The products that use it
// (Gemm::run_int8, gemm.h) compute out[t, n] = act(s[n] * sum_k in[t, k] q[n, k] + bias[n])
// with fp16/bf16 activations and fp32 accumulation, reading half the weight bytes of fp16.
//
// The GPU quantiser and the host reference perform the same IEEE fp32 operations (one
// division for s, one per element for q, ties to even), so they agree bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/gemm.h"

namespace conveyor::cuda {

// q [N, K] and scales [N] from w [N, K] (row-major, device pointers), asynchronous on
// `stream`, deterministic. T is __half, __nv_bfloat16 or float. Throws conveyor::Error for
// null pointers or N, K <= 0.
template <class T>
void quantize_rows_int8(int8_t* q, float* scales, const T* w, int64_t N, int64_t K, cudaStream_t stream);

// w [N, K] in T (__half or __nv_bfloat16) = q[n, k] * scales[n]: the weights back in the
// activations' type, for a GEMM that is compute-bound anyway (prefill: Gemm::run_int8's
// dequantising path). Asynchronous on `stream`, no allocation.
template <class T>
void dequantize_rows_int8(T* w, const int8_t* q, const float* scales, int64_t N, int64_t K, cudaStream_t stream);

// The same on the host (plain C++, quant.cc): the reference, and the loader's way when the
// weights are on the host anyway.
void quantize_rows_int8_reference(int8_t* q, float* scales, const float* w, int64_t N, int64_t K);

namespace detail {

// The kernels behind Gemm::run_int8 (quant.cu), which times the candidates of a shape once and
// keeps the fastest. Tests call them one by one.
//   Gemv: T <= 8 (decode). One warp per 16 rows (the MMA's M) and a slice of K; 16-byte
//     streaming loads of int8 weights, 8 in flight per lane plus the next 8; up to 8 tokens
//     in the MMA's N. Needs K % 16 == 0 and 16-byte aligned in and w.
//   Mma<BM>x<BN>: tensor-core tiles of BM tokens x BN rows, multi-buffered with cp.async, the
//     weights converted to T in registers. Any T, K, N; K % 16 != 0 or misaligned in or w
//     take a guarded element-wise tile loader (slower).
enum class Int8Kernel : int { Gemv = 0, Mma16x32, Mma32x64, Mma32x128, Mma64x64, Mma64x128, Mma128x64, Mma128x128 };
constexpr int kInt8Kernels = 8;

const char* int8_kernel_name(Int8Kernel k);
// True when kernel k can run this problem (an Mma kernel runs any T, K, N in [1, 2^30) with
// N / BN <= 65535 blocks).
bool int8_kernel_supported(Int8Kernel k, int64_t T_, int64_t K, int64_t N, const void* in, const void* w);
// The kernels worth timing for this shape, and the one to take untimed.
std::vector<Int8Kernel> int8_candidates(int64_t T_, int64_t K, int64_t N, const void* in, const void* w);
Int8Kernel int8_default_kernel(int64_t T_, int64_t K, int64_t N, const void* in, const void* w);

// Throws conveyor::Error naming the problem: a null out, in, w or scales (bias may be null), or
// T_, K, N outside [1, 2^30).
void int8_check_args(const void* out, const void* in, const void* w, const void* scales, int64_t T_, int64_t K,
                     int64_t N);

// One launch of kernel k (throws conveyor::Error when it cannot run the problem, or for a
// gemv_k_split other than 0, 1, 2, 4, 8). T is __half or __nv_bfloat16; OutT is T or float;
// bias may be null. gemv_k_split: the GEMV's K slices (GemmOptions::int8_gemv_k_split; 0:
// chosen by shape and SM count). No allocation, no synchronisation.
template <class T, class OutT>
void int8_matmul(Int8Kernel k, OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias,
                 int64_t T_, int64_t K, int64_t N, GemmAct act, cudaStream_t stream, int gemv_k_split = 0);

}  // namespace detail
}  // namespace conveyor::cuda

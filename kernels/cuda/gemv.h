// Internal to kernels/cuda: the GEMV kernel that Gemm times against cuBLASLt for small T.
// out[t, n] = act(sum_k in[t, k] * w[n, k] + bias[n]) for t < T <= kGemvMaxTokens, weights
// in the [N, K] layout. One warp per output row (two for T > 4), 16-byte streaming loads
// of the weights (evict-first: each weight byte is read once per step), fp32 accumulation,
// the bias and GeLU fused. Deterministic: no atomics, a fixed reduction tree per row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm.h"

namespace conveyor::cuda::detail {

constexpr int64_t kGemvMaxTokens = 8;

// True when the GEMV can run this problem: 1 <= T <= 8, K % 8 == 0, in and w 16-byte aligned,
// K and N within int range.
bool gemv_nk_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w);

// k_split: the K slices per row (GemmOptions::gemv_k_split: 0 chooses by N, or 1, 2, 4);
// l2_prefetch_bytes: of each weight row, prefetched into L2 before the wait on the kernel
// before (GemmOptions::gemv_l2_prefetch_bytes). Throws conveyor::Error for either out of range.
template <class T, class OutT>
void gemv_nk(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
             GemmAct act, cudaStream_t stream, int k_split = 0, int l2_prefetch_bytes = 0);

// The sequential-order GEMV (gemv_seq.cu): out[t, n] summed over K in increasing 16-element
// steps from zero on the tensor cores, as cuBLASLt's kernels without a split along K sum it,
// then rounded once to OutT. A bias alone is added to the fp32 sum before the rounding (as
// cuBLASLt's bias epilogue); with an activation the rounded product takes add_bias_gelu's
// arithmetic (as Gemm's cuBLASLt path does); neither with fp32 out. T <= kGemvMaxTokens, K % 8 == 0, in and w
// 16-byte aligned (gemv_seq_supported).
bool gemv_seq_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w);
template <class T, class OutT>
void gemv_seq(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N, GemmAct act,
              cudaStream_t stream);

// The same order over int8 weights q [N, K] with a scale per row (quant.h), dequantised in
// registers: each weight is T(q[n, k] * s[n]) rounded once, as dequantize_rows_int8 writes
// it, so a row's bits are those of gemv_seq (and of the sequential cuBLASLt kernels) over the
// dequantised matrix, while only the int8 bytes are read. Up to kGemvSeqInt8MaxTokens tokens:
// blocks of 8 tokens, the groups of one row block launched together so that they share the
// weights in L2. K % 16 == 0, in and w 16-byte aligned (gemv_seq_int8_supported).
constexpr int64_t kGemvSeqInt8MaxTokens = 64;
bool gemv_seq_int8_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w);
template <class T, class OutT>
void gemv_seq_int8(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int64_t T_, int64_t K,
                   int64_t N, GemmAct act, cudaStream_t stream);

}  // namespace conveyor::cuda::detail

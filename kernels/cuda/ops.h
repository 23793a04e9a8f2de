// The ops of a GPT decoder on the GPU, for fp16 (__half) and bf16 (__nv_bfloat16). Each op
// that kernels/cpu/ops.h has appears here with the same name and argument order, plus the
// stream last; the CPU one is the reference and tests/cuda/test_cuda_ops.cc holds them
// together. Arithmetic is fp32 inside every kernel; storage rounds to T once per op.
// Logits and log-probabilities are fp32, as on the CPU.
//
// All pointers are device pointers; all calls are asynchronous on `stream` and may be
// captured into a CUDA graph (matmul_forward/lm_head_forward: only once their shape has
// been tuned outside capture, see gemm.h). Matrices are row-major.
//
// Below the twins come the fused kernels the GPU stage uses (FasterTransformer-style):
// add-bias-residual + LayerNorm, add-bias + GeLU, and dtype conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/model_config.h"
#include "kernels/cuda/fp8.h"

namespace conveyor::cuda {

using half = __half;
using bf16 = __nv_bfloat16;

// ---- twins of kernels/cpu/ops.h ----------------------------------------------------------

// out[t, :] = wte[ids[t], :] + wpe[positions[t], :]. ids and positions are device arrays;
// the caller has checked their ranges (the kernel cannot know V or P).
template <class T>
void embedding_forward(T* out, const int32_t* ids, const int32_t* positions, int64_t num_tokens,
                       const T* wte, const T* wpe, int64_t C, cudaStream_t stream);

// out[t, :] = (in[t, :] - mean) / sqrt(var + eps) * gamma + beta (biased variance). out may
// alias in. C <= 32768 (C % 8 == 0 and 16-byte aligned rows) or C <= 8192 (otherwise).
// fp8 (optional): out's rows also quantised there, the bytes and scales quantize_rows_fp8
// gives those rows (the FP8 product after the LayerNorm reads them instead of quantising);
// with fp8, out may be null: the quantised rows are then the only output.
template <class T>
void layernorm_forward(T* out, const T* in, const T* gamma, const T* beta, int64_t num_tokens,
                       int64_t C, float eps, cudaStream_t stream, Fp8Rows fp8 = {});

// out[T, N] = in[T, K] @ w[K, N] + bias[N]; bias may be null. Through the calling thread's
// default Gemm (gemm.h): cuBLASLt, fp32 compute, algorithm timed once per shape.
template <class T>
void matmul_forward(T* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K,
                    int64_t N, cudaStream_t stream);

// logits[T, V] = in[T, C] @ head[V, C]^T, fp32 logits.
template <class T>
void lm_head_forward(float* logits, const T* in, const T* head, int64_t T_, int64_t C, int64_t V,
                     cudaStream_t stream);

// In place, x = gelu(x): tanh form (HF gelu_new) and erf form (HF gelu).
template <class T>
void gelu_forward(T* x, int64_t n, cudaStream_t stream);
template <class T>
void gelu_erf_forward(T* x, int64_t n, cudaStream_t stream);

// out[i] = a[i] + b[i]; out may alias a or b.
template <class T>
void residual_forward(T* out, const T* a, const T* b, int64_t n, cudaStream_t stream);

// Causal multi-head attention of one sequence, as cpu::attention_context: q_len query rows
// at stride q_stride elements, kv_len K/V rows at stride kv_stride, query row i at position
// kv_len - q_len + i. out is [q_len, n_head*head_dim]. Flash-attention tiling (64 queries x 64
// keys per step, online softmax, tensor cores through wmma); the score matrix is never
// materialised. head_dim <= 256. A query row's result does not depend on q_len.
template <class T>
void attention_context(T* out, const T* q, int64_t q_stride, const T* k, const T* v,
                       int64_t kv_stride, int64_t q_len, int64_t kv_len, int64_t n_head,
                       int64_t head_dim, cudaStream_t stream);

// One query row against kv_len cached rows (attention_context with q_len = 1), through the
// decode kernel (attention_decode.cu). head_dim <= 1024 (head_dim % 8 == 0) or <= 256.
template <class T>
void attention_decode(T* out, const T* q, const T* k, const T* v, int64_t kv_stride, int64_t kv_len,
                      int64_t n_head, int64_t head_dim, cudaStream_t stream);

// In place over rows of length n: x = log_softmax(x) (fp32; sums in fp32 per thread, then a
// tree, so the result differs from the CPU's double sum by rounding only).
void log_softmax_forward(float* x, int64_t rows, int64_t n, cudaStream_t stream);
// out[r] = log-softmax of row r of x [rows, n] at column tokens[r] (x unchanged).
void token_logprob(float* out, const float* x, const int32_t* tokens, int64_t rows, int64_t n, cudaStream_t stream);

// ---- fused kernels -------------------------------------------------------------------------

// residual[t, :] += x[t, :] + bias (bias may be null; the sum is rounded to T and stored), then,
// when gamma is not null, ln_out[t, :] = LayerNorm(residual[t, :]) with gamma/beta. One pass:
// the row stays in registers. ln_out may be null when gamma is null. fp8: as layernorm_forward's
// (needs gamma; ln_out may then be null). x_sums (FP8 stages): x is an FP8 product's deferred
// epilogue (Fp8Sums, fp8.h), each element rounded to T as fp8_scale_epilogue would have
// written it, so the bits are those of x = that product's output; x is then not read (may be
// null).
template <class T>
void add_bias_residual_layernorm(T* residual, T* ln_out, const T* x, const T* bias, const T* gamma,
                                 const T* beta, int64_t num_tokens, int64_t C, float eps,
                                 cudaStream_t stream, Fp8Rows fp8 = {}, Fp8Sums x_sums = {});

// x[t, n] = act(x[t, n] + bias[n]) over a [rows, N] matrix; bias may be null.
template <class T>
void add_bias_gelu(T* x, const T* bias, int64_t rows, int64_t N, Activation act, cudaStream_t stream);

// Element type conversion (tests, uploads, readback). Round to nearest even. convert()
// takes any pair of float, half and bf16 it is instantiated for (half <-> bf16 go through
// fp32); the two below are its fp32 cases.
template <class To, class From>
void convert(To* out, const From* in, int64_t n, cudaStream_t stream);
template <class T>
void convert_from_float(T* out, const float* in, int64_t n, cudaStream_t stream);
template <class T>
void convert_to_float(float* out, const T* in, int64_t n, cudaStream_t stream);

// out[n * ldo + k] = in[k, n] for a [K, N] fp32 matrix, converted to T: uploads [K, N] (HF
// Conv1D) weights, in row chunks if need be, into the [N, K] layout the GPU stage keeps.
template <class T>
void convert_transpose_from_float(T* out, const float* in, int64_t K, int64_t N, int64_t ldo,
                                  cudaStream_t stream);

// out[i, :] = in[rows[i], :] for i < num_rows; rows of `width` elements.
template <class T>
void gather_rows(T* out, const T* in, const int32_t* rows, int64_t num_rows, int64_t width,
                 cudaStream_t stream);

}  // namespace conveyor::cuda

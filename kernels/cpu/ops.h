// The ops of a GPT decoder on the CPU, in fp32. These are the reference: kernels/cuda/ops.h
// has the same names and argument order for fp16/bf16 on the GPU.
//
// Every op is batch-invariant: a row's result depends only on that row's inputs (and, for
// attention, on its own sequence's K/V), never on how many other rows share the call.
// Matrices are row-major; T = tokens, C = hidden, K/N = in/out features, V = vocabulary.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace conveyor::cpu {

// The threads the ops run on, the caller included: matrix row blocks and attention heads are
// split over a pool (results do not depend on its size). `threads` is KernelOptions::cpu_threads
// (0: one per hardware thread, the default). The pool starts at the first op that runs in
// parallel and keeps its size, so a daemon sets it at start-up; a different size after that is
// an error, as is a negative one.
Status set_threads(int threads);
// The pool's size: what it runs with, or will when it starts.
int threads();

// out[t, :] = wte[ids[t], :] + wpe[positions[t], :]
void embedding_forward(float* out, const int32_t* ids, const int32_t* positions, int64_t num_tokens,
                       const float* wte, const float* wpe, int64_t C);

// out[t, :] = (in[t, :] - mean) / sqrt(var + eps) * gamma + beta  (biased variance)
void layernorm_forward(float* out, const float* in, const float* gamma, const float* beta,
                       int64_t num_tokens, int64_t C, float eps);

// out[T, N] = in[T, K] @ w[K, N] + bias[N]; bias may be null. Through OpenBLAS, always in
// calls of the same fixed number of rows (the last block zero-padded), because OpenBLAS's
// own results for a row change with M (gemv at M = 1, edge kernels, thread split).
void matmul_forward(float* out, const float* in, const float* w, const float* bias, int64_t T,
                    int64_t K, int64_t N);

// logits[T, V] = in[T, C] @ head[V, C]^T (the tied or untied LM head).
void lm_head_forward(float* logits, const float* in, const float* head, int64_t T, int64_t C,
                     int64_t V);

// In place, x = gelu(x): tanh form (HF gelu_new) and erf form (HF gelu).
void gelu_forward(float* x, int64_t n);
void gelu_erf_forward(float* x, int64_t n);

// out[i] = a[i] + b[i]; out may alias a or b.
void residual_forward(float* out, const float* a, const float* b, int64_t n);

// Causal multi-head attention of one sequence. q holds q_len query rows (row i at stride
// q_stride floats; head h at columns h*head_dim); k and v hold kv_len cached rows at
// stride kv_stride, positions 0..kv_len-1, the new tokens' K/V already among them. Query
// row i sits at position kv_len - q_len + i and attends to positions <= its own.
// out is [q_len, n_head*head_dim], contiguous. Each query row is computed the same way
// whatever q_len is, so a prompt split into chunks gives the same bits as one pass.
void attention_context(float* out, const float* q, int64_t q_stride, const float* k, const float* v,
                       int64_t kv_stride, int64_t q_len, int64_t kv_len, int64_t n_head,
                       int64_t head_dim);

// One query row (decode) against kv_len cached rows: attention_context with q_len = 1.
void attention_decode(float* out, const float* q, const float* k, const float* v, int64_t kv_stride,
                      int64_t kv_len, int64_t n_head, int64_t head_dim);

// In place over rows of length n: x = log_softmax(x), computed in double for the sum.
void log_softmax_forward(float* x, int64_t rows, int64_t n);

}  // namespace conveyor::cpu

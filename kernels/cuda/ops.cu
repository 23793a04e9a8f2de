// Element-wise and row-wise ops: embedding, LayerNorm (plain and fused with the residual),
// GeLU (plain and fused with the bias), residual add, log-softmax, conversion, row gather.
// Every kernel has a 16-byte vector path (8 elements per thread per step) used when the
// row length is a multiple of 8 and the pointers are 16-byte aligned, and a scalar path
// for everything else (the odd sizes the tests use).
#include <algorithm>
#include <cmath>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/fp8.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace conveyor::cuda {
namespace {

using namespace detail;

int grid_for(int64_t work_items, int threads) {
  const int64_t blocks = (work_items + threads - 1) / threads;
  return int(std::clamp<int64_t>(blocks, 1, 65535LL * 8));
}

// ---- embedding ----

template <class T, bool VEC>
__global__ void embedding_kernel(T* __restrict__ out, const int32_t* __restrict__ ids,
                                 const int32_t* __restrict__ positions, const T* __restrict__ wte,
                                 const T* __restrict__ wpe, int64_t C) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t t = blockIdx.x;
  const T* a = wte + int64_t(ids[t]) * C;
  const T* b = wpe + int64_t(positions[t]) * C;
  T* o = out + t * C;
  if constexpr (VEC) {
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < C; i += int64_t(blockDim.x) * kVec) {
      float x[8], y[8];
      load8(a + i, x);
      load8(b + i, y);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] += y[j];
      store8(o + i, x);
    }
  } else {
    for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
      o[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
  }
}

// ---- LayerNorm, plain and fused ----
//
// One block per row; the row lives in registers (NPT items of V elements per thread), so the
// fused form reads x, bias and residual once and writes residual and ln_out once.

template <class T, int V>
__device__ __forceinline__ void load_items(const T* p, float (&f)[V]) {
  if constexpr (V == 8) {
    load8(p, f);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_float(p[j]);
  }
}
template <class T, int V>
__device__ __forceinline__ void store_items(T* p, const float (&f)[V]) {
  if constexpr (V == 8) {
    store8(p, f);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = from_float<T>(f[j]);
  }
}

// PRE: this thread's items of gamma, beta and (FUSED) bias, zero where absent or past the row.
template <class T, int V, int NPT, bool FUSED>
__device__ __forceinline__ void preload_ln_params(float (&g)[NPT][V], float (&b)[NPT][V], float (&bs)[NPT][V],
                                                  const T* gamma, const T* beta, const T* bias, int64_t items) {
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int64_t item = threadIdx.x + int64_t(k) * blockDim.x;
#pragma unroll
    for (int j = 0; j < V; ++j) g[k][j] = b[k][j] = bs[k][j] = 0.f;
    if (item < items) {
      if (gamma != nullptr) {
        load_items<T, V>(gamma + item * V, g[k]);
        load_items<T, V>(beta + item * V, b[k]);
      }
      if (FUSED && bias != nullptr) load_items<T, V>(bias + item * V, bs[k]);
    }
  }
}

// This thread's items of row `row` into v (fused: the residual added and stored back, see
// layernorm_kernel); sum[w]: the sum of those of its virtual thread w (items k with k % W == w,
// layernorm_kernel says why), in item order.
template <class T, int V, int NPT, bool FUSED, bool PRE, int P, int W>
__device__ __forceinline__ void load_ln_row(float (&v)[NPT][V], float (&sum)[W], const T* in, T* residual,
                                            const T* x, const Fp8Sums& xs, const T* bias, const float (&bs)[P][V],
                                            int64_t row, int64_t C, int64_t items) {
#pragma unroll
  for (int w = 0; w < W; ++w) sum[w] = 0.f;
  const float x_row_scale = FUSED && xs.sums != nullptr ? xs.row_scales[row] : 0.f;
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int64_t item = threadIdx.x + int64_t(k) * blockDim.x;
    if (item < items) {
      const int64_t col = item * V;
      if constexpr (FUSED) {
        float r[V], a[V];
        load_items<T, V>(residual + row * C + col, r);
        if (xs.sums != nullptr) {  // x as the FP8 product's epilogue would have stored it
          load_items<__half, V>(xs.sums + row * C + col, a);
          const T* xb = static_cast<const T*>(xs.bias);
          if constexpr (V == 8) {
            float c[8], b[8];
            detail::epilogue_columns8(c, b, xs.col_scales, xb, col);
#pragma unroll
            for (int j = 0; j < V; ++j)
              a[j] = to_float(from_float<T>(detail::epilogue_value(a[j], xs.unscale, x_row_scale, c[j], b[j], 0)));
          } else {
#pragma unroll
            for (int j = 0; j < V; ++j)
              a[j] = to_float(
                  from_float<T>(detail::epilogue_value<T>(a[j], xs.unscale, x_row_scale, xs.col_scales, xb, col + j, 0)));
          }
        } else {
          load_items<T, V>(x + row * C + col, a);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] += a[j];
        if constexpr (PRE) {
#pragma unroll
          for (int j = 0; j < V; ++j) r[j] += bs[k][j];
        } else if (bias) {
          load_items<T, V>(bias + col, a);
#pragma unroll
          for (int j = 0; j < V; ++j) r[j] += a[j];
        }
        // Round to T first: LN sees exactly the residual that is stored.
#pragma unroll
        for (int j = 0; j < V; ++j) v[k][j] = to_float(from_float<T>(r[j]));
        store_items<T, V>(residual + row * C + col, v[k]);
      } else {
        load_items<T, V>(in + row * C + col, v[k]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) sum[k % W] += v[k][j];
    }
  }
}

// The sums of (v - mean)^2 over this thread's items, by virtual thread as load_ln_row's.
template <int V, int NPT, int W>
__device__ __forceinline__ void sum_squared_deviations(float (&sq)[W], const float (&v)[NPT][V], float mean,
                                                       int64_t items) {
#pragma unroll
  for (int w = 0; w < W; ++w) sq[w] = 0.f;
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int64_t item = threadIdx.x + int64_t(k) * blockDim.x;
    if (item < items) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = v[k][j] - mean;
        sq[k % W] += d * d;
      }
    }
  }
}

// out[row] = (v - mean) * rstd * gamma + beta for this thread's items (gamma, beta preloaded
// in g, b with PRE); v then holds the values stored (rounded to T), for quantise_ln_row. out
// null: the values only (the FP8 rows are the output).
template <class T, int V, int NPT, bool PRE, int P>
__device__ __forceinline__ void write_ln_row(T* out, float (&v)[NPT][V], const float (&g)[P][V],
                                             const float (&b)[P][V], const T* gamma, const T* beta, float mean,
                                             float rstd, int64_t row, int64_t C, int64_t items) {
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int64_t item = threadIdx.x + int64_t(k) * blockDim.x;
    if (item < items) {
      const int64_t col = item * V;
      float o[V];
      if constexpr (PRE) {
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = (v[k][j] - mean) * rstd * g[k][j] + b[k][j];
      } else {
        float gg[V], bb[V];
        load_items<T, V>(gamma + col, gg);
        load_items<T, V>(beta + col, bb);
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = (v[k][j] - mean) * rstd * gg[j] + bb[j];
      }
      if (out != nullptr) store_items<T, V>(out + row * C + col, o);
#pragma unroll
      for (int j = 0; j < V; ++j) v[k][j] = to_float(from_float<T>(o[j]));
    }
  }
}

// The row just written (v: its stored values) quantised as quantize_rows_fp8 quantises a row:
// the scale of its largest magnitude (the maximum is exact in any order), then each value by
// quantize_one. The same operations on the same values: the same bytes and scale.
template <int V, int NPT>
__device__ __forceinline__ void quantise_ln_row(Fp8Rows fp8, const float (&v)[NPT][V], float* scratch, int64_t row,
                                                int64_t C, int64_t items) {
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < NPT; ++k)
    if (threadIdx.x + int64_t(k) * blockDim.x < items)
#pragma unroll
      for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(v[k][j]));
  const float s = detail::fp8_scale(block_max(amax, scratch)), rs = detail::fp8_rcp(s);
  if (threadIdx.x == 0) fp8.scales[row] = s;
#pragma unroll
  for (int k = 0; k < NPT; ++k) {
    const int64_t item = threadIdx.x + int64_t(k) * blockDim.x;
    if (item >= items) continue;
    uint8_t* q = fp8.q + row * C + item * V;
    if constexpr (V == 8) {
      detail::quantize8(q, v[k], rs);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) q[j] = detail::quantize_one(v[k][j], rs);
    }
  }
}

// fused == false: v = in[row]. fused == true: v = round(residual[row] + x[row] + bias), stored
// back to residual (x from xs when that is not empty). Then, when gamma != null, out[row] = LN(v).
//
// One block per row, one item (V elements) per thread where the row allows (NPT = 1), so a
// row of a decode step is spread over many warps: the kernel is latency-bound and a single
// warp walking the row serially is several times slower. With PRE (NPT = 1) the immutable
// gamma, beta and bias are loaded before grid_dependency_wait(), overlapping the kernel
// before. fp8 (when not empty): out's rows quantised there too (quantise_ln_row).
//
// W > 1 (many rows): a block of 1/W the threads, each thread W "virtual threads" of the
// block of the row's own width (its items k, k + W, ... are virtual thread k % W's), whose
// sums are reduced in that block's order (block_sum_virtual): the same bits for every W, so
// the block shape may follow the row count. A prefill chunk's 8,192 rows of 512 threads ran
// four blocks an SM at a time, latency-bound; a quarter of the threads holds more rows.
template <class T, int V, int NPT, bool FUSED, bool PRE, int W>
__global__ void __launch_bounds__(1024)
    layernorm_kernel(T* __restrict__ out, const T* in, const T* __restrict__ gamma, const T* __restrict__ beta,
                     int64_t C, float eps, T* residual, const T* __restrict__ x, const T* __restrict__ bias,
                     Fp8Rows fp8, Fp8Sums xs) {
  static_assert(NPT % W == 0, "whole virtual threads");
  __shared__ float scratch[32];
  grid_dependents_launch();
  const int64_t row = blockIdx.x;
  const int64_t items = C / V;
  constexpr int P = PRE ? NPT : 1;
  float g[P][V], b[P][V], bs[P][V];
  if constexpr (PRE) preload_ln_params<T, V, NPT, FUSED>(g, b, bs, gamma, beta, bias, items);
  grid_dependency_wait();
  float v[NPT][V], part[W];
  load_ln_row<T, V, NPT, FUSED, PRE, P, W>(v, part, in, residual, x, xs, bias, bs, row, C, items);
  if (gamma == nullptr) return;  // fused add only; uniform across the block
  const float mean = block_sum_virtual(part, scratch) / float(C);
  sum_squared_deviations<V, NPT, W>(part, v, mean, items);
  const float var = block_sum_virtual(part, scratch) / float(C);
  const float rstd = 1.f / sqrtf(var + eps);
  write_ln_row<T, V, NPT, PRE>(out, v, g, b, gamma, beta, mean, rstd, row, C, items);
  if (fp8.q != nullptr) quantise_ln_row<V, NPT>(fp8, v, scratch, row, C, items);  // uniform across the block
}

// From this many rows a LayerNorm of one item a thread runs blocks of a quarter of the
// threads (layernorm_kernel's W = 4). gpt3-6.7b FP8 decode on an H200, two rounds: at 512
// rows the step was 1.5% faster with W = 4 (15.76, 15.69 ms against 15.88, 16.04), at 64
// rows 5% slower (4.55 against 4.31).
constexpr int64_t kLnNarrowRows = 512;

// Threads: one item each up to 1024, then NPT items each (vector path: C <= 1024 * 4 * 8;
// scalar path: C <= 1024 * 8); W = 4 from kLnNarrowRows rows where a row is one item a thread.
template <class T, bool FUSED>
void launch_layernorm(T* out, const T* in, const T* gamma, const T* beta, int64_t rows, int64_t C,
                      float eps, T* residual, const T* x, const T* bias, cudaStream_t stream, Fp8Rows fp8,
                      Fp8Sums xs = {}) {
  if (rows <= 0 || C <= 0) return;
  if (fp8 && (fp8.scales == nullptr || gamma == nullptr))
    throw Error("layernorm: FP8 rows need their scales and a LayerNorm (gamma) to quantise");
  if (gamma != nullptr && out == nullptr && !fp8)
    throw Error("layernorm: no output: out is null and no FP8 rows are asked for");
  if (FUSED && !xs && x == nullptr) throw Error("add_bias_residual_layernorm: x is null and no FP8 sums stand for it");
  if (xs && (xs.row_scales == nullptr || xs.col_scales == nullptr))
    throw Error("add_bias_residual_layernorm: FP8 sums need their row and column scales");
  const bool vec = C % kVec == 0 && aligned16(out) && aligned16(in) && aligned16(gamma) && aligned16(beta) &&
                   aligned16(residual) && aligned16(x) && aligned16(bias) && aligned16(fp8.q) &&
                   aligned16(xs.sums) && aligned16(xs.col_scales) && aligned16(xs.bias);
  const int64_t items = vec ? C / kVec : C;
  const int threads = int(std::min<int64_t>(1024, (items + 31) / 32 * 32));
  const int64_t npt = (items + threads - 1) / threads;
  const dim3 grid{unsigned(rows)};
#define CONVEYOR_LN(VV, N, PRE, W)                                                                                  \
  LAUNCH_PDL("layernorm_kernel", layernorm_kernel<T, VV, N, FUSED, PRE, W>, grid, dim3(unsigned(threads / (W))), 0, \
             stream, out, in, gamma, beta, C, eps, residual, x, bias, fp8, xs)
  if (vec) {
    if (npt == 1 && rows >= kLnNarrowRows && threads % 128 == 0) CONVEYOR_LN(8, 4, false, 4);
    else if (npt == 1) CONVEYOR_LN(8, 1, true, 1);
    else if (npt == 2) CONVEYOR_LN(8, 2, false, 1);
    else if (npt <= 4) CONVEYOR_LN(8, 4, false, 1);
    else throw Error("layernorm: C = " + std::to_string(C) + " is larger than this kernel holds (32768)");
  } else {
    if (npt == 1) CONVEYOR_LN(1, 1, true, 1);
    else if (npt == 2) CONVEYOR_LN(1, 2, false, 1);
    else if (npt <= 4) CONVEYOR_LN(1, 4, false, 1);
    else if (npt <= 8) CONVEYOR_LN(1, 8, false, 1);
    else throw Error("layernorm: C = " + std::to_string(C) + " is larger than this kernel holds (8192 unaligned)");
  }
#undef CONVEYOR_LN
}

// ---- element-wise ----

enum class Pointwise : int { GeluTanh, GeluErf };

template <Pointwise P>
__device__ __forceinline__ float apply(float v) {
  if constexpr (P == Pointwise::GeluTanh) return gelu_tanh(v);
  else return gelu_erf(v);
}

// x[r, n] = act(x[r, n] + bias[n]) over rows*N elements (bias may be null; N = n for a flat array).
template <class T, Pointwise P, bool VEC>
__global__ void bias_act_kernel(T* __restrict__ x, const T* __restrict__ bias, int64_t total, int64_t N) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < total; i += stride * kVec) {
      float v[8];
      load8(x + i, v);
      if (bias) {
        float b[8];
        load8(bias + i % N, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] += b[j];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = apply<P>(v[j]);
      store8(x + i, v);
    }
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
      float v = to_float(x[i]);
      if (bias) v += to_float(bias[i % N]);
      x[i] = from_float<T>(apply<P>(v));
    }
  }
}

template <class T, Pointwise P>
void launch_bias_act(T* x, const T* bias, int64_t rows, int64_t N, cudaStream_t stream) {
  const int64_t total = rows * N;
  if (total <= 0) return;
  const bool vec = N % kVec == 0 && aligned16(x) && aligned16(bias);
  const int threads = 256;
  if (vec) {
    LAUNCH_PDL("bias_act_kernel", bias_act_kernel<T, P, true>, dim3(grid_for(total / kVec, threads)), dim3(threads), 0,
               stream, x, bias, total, N);
  } else {
    LAUNCH_PDL("bias_act_kernel", bias_act_kernel<T, P, false>, dim3(grid_for(total, threads)), dim3(threads), 0, stream,
               x, bias, total, N);
  }
}

template <class T, bool VEC>
__global__ void residual_kernel(T* out, const T* a, const T* b, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n; i += stride * kVec) {
      float x[8], y[8];
      load8(a + i, x);
      load8(b + i, y);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] += y[j];
      store8(out + i, x);
    }
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
      out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
  }
}

// ---- log-softmax over fp32 rows ----

// log(sum_i exp(r[i])) over a row of n, by the whole block (every thread gets it).
__device__ float row_logsumexp(const float* r, int64_t n, float* scratch) {
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, r[i]);
  m = block_max(m, scratch);
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += expf(r[i] - m);
  return m + logf(block_sum(s, scratch));
}

__global__ void log_softmax_kernel(float* x, int64_t n) {
  __shared__ float scratch[32];
  float* r = x + int64_t(blockIdx.x) * n;
  const float lse = row_logsumexp(r, n, scratch);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) r[i] -= lse;
}

__global__ void token_logprob_kernel(float* out, const float* x, const int32_t* tokens, int64_t n) {
  __shared__ float scratch[32];
  const float* r = x + int64_t(blockIdx.x) * n;
  const float lse = row_logsumexp(r, n, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = r[tokens[blockIdx.x]] - lse;
}

// ---- conversion and gather ----

template <class To, class From>
__global__ void convert_kernel(To* out, const From* in, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = from_float<To>(to_float(in[i]));
}

// 32 x 32 tiles through shared memory (+1 column against bank conflicts); block (32, 8).
template <class T>
__global__ void transpose_convert_kernel(T* __restrict__ out, const float* __restrict__ in, int64_t K, int64_t N,
                                         int64_t ldo) {
  __shared__ float tile[32][33];
  const int64_t n0 = int64_t(blockIdx.x) * 32, k0 = int64_t(blockIdx.y) * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t k = k0 + i, n = n0 + threadIdx.x;
    if (k < K && n < N) tile[i][threadIdx.x] = in[k * N + n];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t n = n0 + i, k = k0 + threadIdx.x;
    if (k < K && n < N) out[n * ldo + k] = from_float<T>(tile[threadIdx.x][i]);
  }
}

template <class T>
__global__ void gather_rows_kernel(T* __restrict__ out, const T* __restrict__ in,
                                   const int32_t* __restrict__ rows, int64_t width) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t i = blockIdx.x;
  const T* src = in + int64_t(rows[i]) * width;
  T* dst = out + i * width;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) dst[j] = src[j];
}

}  // namespace

// ---- public entry points ----

template <class T>
void embedding_forward(T* out, const int32_t* ids, const int32_t* positions, int64_t num_tokens,
                       const T* wte, const T* wpe, int64_t C, cudaStream_t stream) {
  if (num_tokens <= 0) return;
  const bool vec = C % kVec == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe);
  const int64_t work = vec ? C / kVec : C;
  const int threads = int(std::clamp<int64_t>((work + 31) / 32 * 32, 32, 256));
  if (vec)
    LAUNCH_PDL("embedding_kernel", embedding_kernel<T, true>, dim3(unsigned(num_tokens)), dim3(threads), 0, stream, out,
               ids, positions, wte, wpe, C);
  else
    LAUNCH_PDL("embedding_kernel", embedding_kernel<T, false>, dim3(unsigned(num_tokens)), dim3(threads), 0, stream,
               out, ids, positions, wte, wpe, C);
}

template <class T>
void layernorm_forward(T* out, const T* in, const T* gamma, const T* beta, int64_t num_tokens,
                       int64_t C, float eps, cudaStream_t stream, Fp8Rows fp8) {
  launch_layernorm<T, false>(out, in, gamma, beta, num_tokens, C, eps, nullptr, nullptr, nullptr, stream, fp8);
}

template <class T>
void add_bias_residual_layernorm(T* residual, T* ln_out, const T* x, const T* bias, const T* gamma,
                                 const T* beta, int64_t num_tokens, int64_t C, float eps,
                                 cudaStream_t stream, Fp8Rows fp8, Fp8Sums x_sums) {
  launch_layernorm<T, true>(ln_out, nullptr, gamma, beta, num_tokens, C, eps, residual, x, bias, stream, fp8, x_sums);
}

template <class T>
void gelu_forward(T* x, int64_t n, cudaStream_t stream) {
  launch_bias_act<T, Pointwise::GeluTanh>(x, nullptr, 1, n, stream);
}
template <class T>
void gelu_erf_forward(T* x, int64_t n, cudaStream_t stream) {
  launch_bias_act<T, Pointwise::GeluErf>(x, nullptr, 1, n, stream);
}
template <class T>
void add_bias_gelu(T* x, const T* bias, int64_t rows, int64_t N, Activation act, cudaStream_t stream) {
  if (act == Activation::GeluNew)
    launch_bias_act<T, Pointwise::GeluTanh>(x, bias, rows, N, stream);
  else
    launch_bias_act<T, Pointwise::GeluErf>(x, bias, rows, N, stream);
}

template <class T>
void residual_forward(T* out, const T* a, const T* b, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 256;
  if (n % kVec == 0 && aligned16(out) && aligned16(a) && aligned16(b))
    residual_kernel<T, true><<<grid_for(n / kVec, threads), threads, 0, stream>>>(out, a, b, n);
  else
    residual_kernel<T, false><<<grid_for(n, threads), threads, 0, stream>>>(out, a, b, n);
  CUDA_CHECK(cudaGetLastError());
}

void log_softmax_forward(float* x, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return;
  log_softmax_kernel<<<unsigned(rows), 512, 0, stream>>>(x, n);
  CUDA_CHECK(cudaGetLastError());
}

void token_logprob(float* out, const float* x, const int32_t* tokens, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return;
  token_logprob_kernel<<<unsigned(rows), 512, 0, stream>>>(out, x, tokens, n);
  CUDA_CHECK(cudaGetLastError());
}

template <class To, class From>
void convert(To* out, const From* in, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  convert_kernel<To, From><<<grid_for(n, 256), 256, 0, stream>>>(out, in, n);
  CUDA_CHECK(cudaGetLastError());
}
template <class T>
void convert_from_float(T* out, const float* in, int64_t n, cudaStream_t stream) {
  convert<T, float>(out, in, n, stream);
}
template <class T>
void convert_to_float(float* out, const T* in, int64_t n, cudaStream_t stream) {
  convert<float, T>(out, in, n, stream);
}

template <class T>
void gather_rows(T* out, const T* in, const int32_t* rows, int64_t num_rows, int64_t width,
                 cudaStream_t stream) {
  if (num_rows <= 0 || width <= 0) return;
  LAUNCH_PDL("gather_rows_kernel", gather_rows_kernel<T>, dim3(unsigned(num_rows)), dim3(256), 0, stream, out, in, rows,
             width);
}

template <class T>
void convert_transpose_from_float(T* out, const float* in, int64_t K, int64_t N, int64_t ldo,
                                  cudaStream_t stream) {
  if (K <= 0 || N <= 0) return;
  if ((K + 31) / 32 > 65535) throw Error("convert_transpose_from_float: K too large");
  const dim3 grid{unsigned((N + 31) / 32), unsigned((K + 31) / 32), 1u};
  transpose_convert_kernel<T><<<grid, dim3{32u, 8u, 1u}, 0, stream>>>(out, in, K, N, ldo);
  CUDA_CHECK(cudaGetLastError());
}

#define CONVEYOR_INSTANTIATE_OPS(T)                                                               \
  template void embedding_forward<T>(T*, const int32_t*, const int32_t*, int64_t, const T*,        \
                                     const T*, int64_t, cudaStream_t);                             \
  template void layernorm_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, float,    \
                                     cudaStream_t, Fp8Rows);                                       \
  template void add_bias_residual_layernorm<T>(T*, T*, const T*, const T*, const T*, const T*,     \
                                               int64_t, int64_t, float, cudaStream_t, Fp8Rows,     \
                                               Fp8Sums);                                           \
  template void gelu_forward<T>(T*, int64_t, cudaStream_t);                                        \
  template void gelu_erf_forward<T>(T*, int64_t, cudaStream_t);                                    \
  template void add_bias_gelu<T>(T*, const T*, int64_t, int64_t, Activation, cudaStream_t);        \
  template void residual_forward<T>(T*, const T*, const T*, int64_t, cudaStream_t);                \
  template void convert_from_float<T>(T*, const float*, int64_t, cudaStream_t);                    \
  template void convert_to_float<T>(float*, const T*, int64_t, cudaStream_t);                      \
  template void gather_rows<T>(T*, const T*, const int32_t*, int64_t, int64_t, cudaStream_t);        \
  template void convert_transpose_from_float<T>(T*, const float*, int64_t, int64_t, int64_t, cudaStream_t);

CONVEYOR_INSTANTIATE_OPS(half)
CONVEYOR_INSTANTIATE_OPS(bf16)
template void gather_rows<float>(float*, const float*, const int32_t*, int64_t, int64_t, cudaStream_t);
template void convert<half, bf16>(half*, const bf16*, int64_t, cudaStream_t);
template void convert<bf16, half>(bf16*, const half*, int64_t, cudaStream_t);

}  // namespace conveyor::cuda

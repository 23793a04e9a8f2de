// FP8 row quantisation (fp8.h) and run_fp8's epilogue (both scales, bias, activation, on
// cuBLASLt's fp16 sums). Both are memory-bound and per row: a row's bytes depend on that row
// alone.
#include "kernels/cuda/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/fp8.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda {
namespace detail {
namespace {

constexpr int kFp8QuantThreads = 256;


// Programmatic dependent launch (launch.cuh) pays where a step's kernels are short: at a few
// rows (measured, docs/PERFORMANCE.md: FP8 decode 1.5% faster at batch 1 and 1.8% slower at
// 512 with it). kPdl kernels start beside the kernel before, wait for it, and read what it
// wrote through L2 (ld.global.cg), never the non-coherent path; the others launch plainly.
constexpr int64_t kFp8PdlRows = 64;

template <bool kPdl, class V>
__device__ __forceinline__ V load(const V* p) {
  if constexpr (kPdl) return __ldcg(p);
  else return __ldg(p);
}

template <bool kPdl>
__device__ __forceinline__ void start() {
  if constexpr (kPdl) {
    grid_dependents_launch();
    grid_dependency_wait();  // the input is the kernel before's output
  }
}

// One block per row. kVec8: K % 8 == 0 and 16-byte aligned rows (T = half or bf16): 8
// elements per 16-byte load, 8 bytes per store.
template <class T, bool kVec8, bool kPdl>
__global__ void __launch_bounds__(kFp8QuantThreads)
    quantize_rows_fp8_kernel(uint8_t* __restrict__ q, float* __restrict__ scales, const T* x, int64_t K) {
  __shared__ float scratch[32];
  start<kPdl>();
  const int64_t r = blockIdx.x;
  const T* row = x + r * K;
  uint8_t* qrow = q + r * K;
  float amax = 0.f;
  if constexpr (kVec8) {
    for (int64_t k = int64_t(threadIdx.x) * 8; k < K; k += int64_t(kFp8QuantThreads) * 8) {
      float f[8];
      unpack8<T>(load<kPdl>(reinterpret_cast<const uint4*>(row + k)), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
    }
  } else {
    for (int64_t k = threadIdx.x; k < K; k += kFp8QuantThreads)
      amax = fmaxf(amax, fabsf(to_float(load<kPdl>(row + k))));
  }
  amax = block_max(amax, scratch);  // max is exact in any order
  const float s = fp8_scale(amax), rs = fp8_rcp(s);
  if (threadIdx.x == 0) scales[r] = s;
  if constexpr (kVec8) {
    for (int64_t k = int64_t(threadIdx.x) * 8; k < K; k += int64_t(kFp8QuantThreads) * 8) {
      float f[8];
      unpack8<T>(load<kPdl>(reinterpret_cast<const uint4*>(row + k)), f);
      quantize8(qrow + k, f, rs);
    }
  } else {
    for (int64_t k = threadIdx.x; k < K; k += kFp8QuantThreads)
      qrow[k] = quantize_one(to_float(load<kPdl>(row + k)), rs);
  }
}

constexpr int kFp8EpilogueThreads = 256;

// kVec8: N % 8 == 0, sums, out, cs and bias 16-byte aligned: eight columns a thread (one
// 16-byte load of sums, two of column scales, one of bias, one 16-byte store); else one
// element a thread. unscale = 2^e, exact.
template <class T, bool kVec8, bool kPdl>
__global__ void __launch_bounds__(kFp8EpilogueThreads)
    fp8_scale_epilogue_kernel(T* __restrict__ out, const __half* sums, float unscale, const float* rs,
                              const float* __restrict__ cs, const T* __restrict__ bias, int64_t rows, int64_t N,
                              int act) {
  constexpr int kW = kVec8 ? 8 : 1;
  start<kPdl>();  // the sums and row scales are the kernels before's output
  const int64_t groups = rows * (N / kW);
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = g * kW, r = i / N, n = i % N;
    const float row_scale = load<kPdl>(rs + r);
    if constexpr (kVec8) {
      float v[8], c[8], b[8];
      unpack8<__half>(load<kPdl>(reinterpret_cast<const uint4*>(sums + i)), v);
      epilogue_columns8(c, b, cs, bias, n);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = epilogue_value(v[j], unscale, row_scale, c[j], b[j], act);
      *reinterpret_cast<uint4*>(out + i) = pack8<T>(v);
    } else {
      out[i] = from_float<T>(epilogue_value(__half2float(load<kPdl>(sums + i)), unscale, row_scale, cs, bias, n, act));
    }
  }
}

// fp8_scale_epilogue_kv: QKV's epilogue over rows [q | k | v] (C = n_head * D columns each)
// whose K and V go straight into an FP8 K/V cache. Eight columns a thread, as the vectorised
// epilogue; a head's D columns are D / 8 neighbouring lanes (D / 8 divides 32). q's columns
// are written to out; a K or V head's values, rounded to T as the epilogue writes them, are
// quantised as kv_cache_append quantises them (quantize_kv_head: the head's largest magnitude,
// kv_fp8_scale, the bytes) and written to the cache. The loop runs whole warps (the shuffles).
template <class T, int D>
__global__ void __launch_bounds__(kFp8EpilogueThreads)
    fp8_scale_epilogue_kv_kernel(T* __restrict__ out, const __half* sums, float unscale, const float* rs,
                                 const float* __restrict__ cs, const T* __restrict__ bias, int64_t rows, int64_t C,
                                 KvLayerView kv, const int32_t* __restrict__ token_rows,
                                 const int32_t* __restrict__ token_pos) {
  constexpr int kLanes = D / 8;  // a head's lanes
  static_assert(D % 8 == 0 && 32 % kLanes == 0, "a head's columns are D / 8 lanes of one warp");
  const int64_t N = 3 * C, groups = rows * (N / 8);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < groups; base += stride) {
    const int64_t g = base + threadIdx.x;  // whole warps: groups and the stride are multiples of 32 apart
    const bool live = g < groups;
    const int64_t i = live ? g * 8 : 0, r = i / N, n = i % N;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (live) {
      float c[8], b[8];
      unpack8<__half>(__ldg(reinterpret_cast<const uint4*>(sums + i)), v);
      epilogue_columns8(c, b, cs, bias, n);
      const float row_scale = __ldg(rs + r);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = to_float(from_float<T>(epilogue_value(v[j], unscale, row_scale, c[j], b[j], 0)));
    }
    // q: as fp8_scale_epilogue writes it. K and V: a head's lanes agree on its scale (every
    // lane takes part in the group's reduction; q's lanes' results are not used).
    const bool kv_col = n >= C;
    if (live && !kv_col) *reinterpret_cast<uint4*>(out + i) = pack8<T>(v);
    __align__(8) uint8_t q[8];
    const float s = quantize_kv_head<8, kLanes>(v, q);
    if (!live || !kv_col) continue;
    const int row = token_rows[r], t = token_pos[r];
    if (row < 0 || t < 0) continue;  // padding token
    const int64_t j = n - C, which = j / C, h = (j % C) / D, d = j % D;
    const int64_t page = kv.block_tables[int64_t(row) * kv.max_pages + t / kPageTokens];
    uint8_t* dst = static_cast<uint8_t*>(which == 0 ? kv.k : kv.v) + page * kv.page_stride +
                   (h * kPageTokens + t % kPageTokens) * D + d;
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(q);
    if (d == 0) (which == 0 ? kv.k_scale : kv.v_scale)[page * kv.scale_page_stride + h * kPageTokens + t % kPageTokens] = s;
  }
}

constexpr int kFp8EpilogueQuantThreads = 512;

// fp8_scale_epilogue and quantize_rows_fp8 in one: block r computes row r's outputs as the
// epilogue does (rounded to T), keeps them in shared memory (N x sizeof(T) bytes), takes
// their largest magnitude, and quantises them as the quantiser does: the same operations in
// the same order, so the same bytes and scale as the two kernels with the T row between them.
// kVec8: N % 8 == 0, sums, cs and bias 16-byte aligned (epilogue_columns8).
template <class T, bool kVec8, bool kPdl>
__global__ void __launch_bounds__(kFp8EpilogueQuantThreads)
    fp8_epilogue_quantize_kernel(uint8_t* __restrict__ q, float* __restrict__ q_scales, const __half* sums,
                                 float unscale, const float* rs, const float* __restrict__ cs,
                                 const T* __restrict__ bias, int64_t N, int act) {
  extern __shared__ __align__(16) unsigned char fused_smem[];
  T* vals = reinterpret_cast<T*>(fused_smem);
  __shared__ float scratch[32];
  start<kPdl>();  // the sums and row scales are the kernels before's output
  const int64_t r = blockIdx.x;
  const __half* row = sums + r * N;
  const float row_scale = load<kPdl>(rs + r);
  float amax = 0.f;
  if constexpr (kVec8) {
    // kLoads of the thread's 16-byte loads of sums in flight at once, then their outputs: one
    // load at a time waited out a memory round trip per 8 columns (FC1's 16,384 are 4 a thread).
    constexpr int kLoads = 4;
    constexpr int64_t kStep = int64_t(kFp8EpilogueQuantThreads) * 8;
    for (int64_t n0 = int64_t(threadIdx.x) * 8; n0 < N; n0 += kLoads * kStep) {
      uint4 raw[kLoads];
#pragma unroll
      for (int i = 0; i < kLoads; ++i)
        if (n0 + i * kStep < N) raw[i] = load<kPdl>(reinterpret_cast<const uint4*>(row + n0 + i * kStep));
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int64_t n = n0 + i * kStep;
        if (n >= N) break;
        float v[8], c[8], b[8];
        unpack8<__half>(raw[i], v);
        epilogue_columns8(c, b, cs, bias, n);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const T t = from_float<T>(epilogue_value(v[j], unscale, row_scale, c[j], b[j], act));
          vals[n + j] = t;
          amax = fmaxf(amax, fabsf(to_float(t)));
        }
      }
    }
  } else {
    for (int64_t n = threadIdx.x; n < N; n += kFp8EpilogueQuantThreads) {
      const T t = from_float<T>(epilogue_value(__half2float(load<kPdl>(row + n)), unscale, row_scale, cs, bias, n, act));
      vals[n] = t;
      amax = fmaxf(amax, fabsf(to_float(t)));
    }
  }
  amax = block_max(amax, scratch);  // its barriers also order the shared writes before the reads
  const float s = fp8_scale(amax), rcp = fp8_rcp(s);
  if (threadIdx.x == 0) q_scales[r] = s;
  uint8_t* qrow = q + r * N;
  if constexpr (kVec8) {  // eight bytes a thread
    for (int64_t n = int64_t(threadIdx.x) * 8; n < N; n += int64_t(kFp8EpilogueQuantThreads) * 8) {
      float f[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(vals + n), f);
      quantize8(qrow + n, f, rcp);
    }
  } else {
    for (int64_t n = threadIdx.x; n < N; n += kFp8EpilogueQuantThreads) qrow[n] = quantize_one(to_float(vals[n]), rcp);
  }
}

// Launches kernel<..., true> with programmatic dependent launch up to kFp8PdlRows rows, else
// kernel<..., false> plainly (kFp8PdlRows says why).
template <class... KArgs, class... Args>
void launch_by_rows(const char* what, int64_t rows, void (*early)(KArgs...), void (*plain)(KArgs...), dim3 grid,
                    dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  if (rows <= kFp8PdlRows) {
    LAUNCH_PDL(what, early, grid, block, smem, stream, args...);
  } else {
    plain<<<grid, block, smem, stream>>>(args...);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace
}  // namespace detail

template <class T>
void quantize_rows_fp8(uint8_t* q, float* scales, const T* x, int64_t rows, int64_t K, cudaStream_t stream) {
  if (q == nullptr || scales == nullptr || x == nullptr)
    throw Error("quantize_rows_fp8: null pointer (q, scales and x are required)");
  if (rows <= 0 || K <= 0 || rows > int64_t(0x7fffffff))
    throw Error("quantize_rows_fp8: rows must be in [1, 2^31) and K positive (rows=" + std::to_string(rows) +
                " K=" + std::to_string(K) + ")");
  constexpr bool kHalfType = !std::is_same_v<T, float>;
  const bool vec = kHalfType && K % 8 == 0 && detail::aligned16(x) && reinterpret_cast<uintptr_t>(q) % 8 == 0;
  auto run = [&](auto vec8) {
    constexpr bool kVec8 = decltype(vec8)::value;
    detail::launch_by_rows("quantize_rows_fp8_kernel", rows, detail::quantize_rows_fp8_kernel<T, kVec8, true>,
                           detail::quantize_rows_fp8_kernel<T, kVec8, false>, dim3(unsigned(rows)),
                           dim3(detail::kFp8QuantThreads), 0, stream, q, scales, x, K);
  };
  if constexpr (kHalfType) {
    if (vec) return run(std::true_type{});
  }
  run(std::false_type{});
}

template void quantize_rows_fp8<__half>(uint8_t*, float*, const __half*, int64_t, int64_t, cudaStream_t);
template void quantize_rows_fp8<__nv_bfloat16>(uint8_t*, float*, const __nv_bfloat16*, int64_t, int64_t,
                                               cudaStream_t);
template void quantize_rows_fp8<float>(uint8_t*, float*, const float*, int64_t, int64_t, cudaStream_t);

template <class T>
void fp8_scale_epilogue(T* out, const __half* sums, int e, const float* row_scales, const float* col_scales,
                        const T* bias, int64_t rows, int64_t N, int act, cudaStream_t stream) {
  if (out == nullptr || sums == nullptr || row_scales == nullptr || col_scales == nullptr)
    throw Error("fp8_scale_epilogue: null pointer (out, sums, row_scales and col_scales are required)");
  if (e < 0 || e > 64) throw Error("fp8_scale_epilogue: exponent " + std::to_string(e) + " out of [0, 64]");
  if (rows <= 0 || N <= 0) return;
  const float unscale = std::ldexp(1.f, e);
  const bool vec = N % 8 == 0 && detail::aligned16(sums) && detail::aligned16(out) && detail::aligned16(col_scales) &&
                   detail::aligned16(bias);
  const int64_t groups = rows * (vec ? N / 8 : N);
  const unsigned blocks = unsigned(std::min<int64_t>((groups + detail::kFp8EpilogueThreads - 1) /
                                                         detail::kFp8EpilogueThreads,
                                                     int64_t(1) << 16));
  auto run = [&](auto vec8) {
    constexpr bool kVec8 = decltype(vec8)::value;
    detail::launch_by_rows("fp8_scale_epilogue_kernel", rows, detail::fp8_scale_epilogue_kernel<T, kVec8, true>,
                           detail::fp8_scale_epilogue_kernel<T, kVec8, false>, dim3(blocks),
                           dim3(detail::kFp8EpilogueThreads), 0, stream, out, sums, unscale, row_scales, col_scales,
                           bias, rows, N, act);
  };
  if (vec) run(std::true_type{});
  else run(std::false_type{});
}

template void fp8_scale_epilogue<__half>(__half*, const __half*, int, const float*, const float*, const __half*,
                                         int64_t, int64_t, int, cudaStream_t);
template void fp8_scale_epilogue<__nv_bfloat16>(__nv_bfloat16*, const __half*, int, const float*, const float*,
                                                const __nv_bfloat16*, int64_t, int64_t, int, cudaStream_t);

bool fp8_scale_epilogue_kv_supported(const KvLayerView& kv, int64_t head_dim) {
  return kv.fp8() && (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128);
}

template <class T>
void fp8_scale_epilogue_kv(T* out, const __half* sums, int e, const float* row_scales, const float* col_scales,
                           const T* bias, int64_t rows, int64_t n_head, int64_t head_dim, const KvLayerView& kv,
                           const int32_t* token_rows, const int32_t* token_pos, cudaStream_t stream) {
  if (out == nullptr || sums == nullptr || row_scales == nullptr || col_scales == nullptr || token_rows == nullptr ||
      token_pos == nullptr)
    throw Error("fp8_scale_epilogue_kv: null pointer (out, sums, row_scales, col_scales, token_rows and token_pos "
                "are required)");
  if (!fp8_scale_epilogue_kv_supported(kv, head_dim))
    throw Error("fp8_scale_epilogue_kv: an FP8 K/V cache and head_dim 16, 32, 64 or 128 are required (head_dim " +
                std::to_string(head_dim) + ")");
  if (e < 0 || e > 64) throw Error("fp8_scale_epilogue_kv: exponent " + std::to_string(e) + " out of [0, 64]");
  if (rows <= 0 || n_head <= 0) return;
  const int64_t C = n_head * head_dim;
  if (!detail::aligned16(sums) || !detail::aligned16(out) || !detail::aligned16(col_scales) ||
      !detail::aligned16(bias))
    throw Error("fp8_scale_epilogue_kv: sums, out, col_scales and bias must be 16-byte aligned");
  const float unscale = std::ldexp(1.f, e);
  const int64_t groups = rows * (3 * C / 8);
  const unsigned blocks = unsigned(std::min<int64_t>(
      (groups + detail::kFp8EpilogueThreads - 1) / detail::kFp8EpilogueThreads, int64_t(1) << 16));
  auto run = [&](auto d) {
    constexpr int D = decltype(d)::value;
    detail::fp8_scale_epilogue_kv_kernel<T, D><<<blocks, detail::kFp8EpilogueThreads, 0, stream>>>(
        out, sums, unscale, row_scales, col_scales, bias, rows, C, kv, token_rows, token_pos);
    CUDA_CHECK(cudaGetLastError());
  };
  switch (head_dim) {
    case 16: run(std::integral_constant<int, 16>{}); break;
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    default: run(std::integral_constant<int, 128>{}); break;
  }
}

template void fp8_scale_epilogue_kv<__half>(__half*, const __half*, int, const float*, const float*, const __half*,
                                            int64_t, int64_t, int64_t, const KvLayerView&, const int32_t*,
                                            const int32_t*, cudaStream_t);
template void fp8_scale_epilogue_kv<__nv_bfloat16>(__nv_bfloat16*, const __half*, int, const float*, const float*,
                                                   const __nv_bfloat16*, int64_t, int64_t, int64_t,
                                                   const KvLayerView&, const int32_t*, const int32_t*, cudaStream_t);

int64_t fp8_epilogue_quantize_max_n() { return int64_t(96 * 1024) / 2; }

template <class T>
void fp8_epilogue_quantize(uint8_t* q, float* q_scales, const __half* sums, int e, const float* row_scales,
                           const float* col_scales, const T* bias, int64_t rows, int64_t N, int act,
                           cudaStream_t stream) {
  if (q == nullptr || q_scales == nullptr || sums == nullptr || row_scales == nullptr || col_scales == nullptr)
    throw Error("fp8_epilogue_quantize: null pointer (q, q_scales, sums, row_scales and col_scales are required)");
  if (e < 0 || e > 64) throw Error("fp8_epilogue_quantize: exponent " + std::to_string(e) + " out of [0, 64]");
  if (N > fp8_epilogue_quantize_max_n() || rows > int64_t(0x7fffffff))
    throw Error("fp8_epilogue_quantize: a row of N=" + std::to_string(N) + " does not fit a block's shared memory (" +
                std::to_string(fp8_epilogue_quantize_max_n()) + " at most), or rows=" + std::to_string(rows) +
                " is 2^31 or more");
  if (rows <= 0 || N <= 0) return;
  const float unscale = std::ldexp(1.f, e);
  const size_t smem = size_t(N) * sizeof(T);
  const bool vec = N % 8 == 0 && detail::aligned16(sums) && detail::aligned16(q) && detail::aligned16(col_scales) &&
                   detail::aligned16(bias);
  auto run = [&](auto vec8) {
    constexpr bool kVec8 = decltype(vec8)::value;
    auto early = detail::fp8_epilogue_quantize_kernel<T, kVec8, true>;
    auto plain = detail::fp8_epilogue_quantize_kernel<T, kVec8, false>;
    const size_t most = size_t(fp8_epilogue_quantize_max_n()) * sizeof(T);
    for (auto kernel : {early, plain}) detail::allow_smem(kernel, most);
    detail::launch_by_rows("fp8_epilogue_quantize_kernel", rows, early, plain, dim3(unsigned(rows)),
                           dim3(detail::kFp8EpilogueQuantThreads), smem, stream, q, q_scales, sums, unscale,
                           row_scales, col_scales, bias, N, act);
  };
  if (vec) run(std::true_type{});
  else run(std::false_type{});
}

template void fp8_epilogue_quantize<__half>(uint8_t*, float*, const __half*, int, const float*, const float*,
                                            const __half*, int64_t, int64_t, int, cudaStream_t);
template void fp8_epilogue_quantize<__nv_bfloat16>(uint8_t*, float*, const __half*, int, const float*, const float*,
                                                   const __nv_bfloat16*, int64_t, int64_t, int, cudaStream_t);

}  // namespace conveyor::cuda

// GEMV for decode: see gemv.h. Memory-bound: each weight byte is read once, 16 bytes per lane
// per load, U independent loads per row in flight per lane before the first use. The
// activations (T x K, a few KB) are re-read by every warp and stay in L1/L2.

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda::detail {
namespace {

constexpr int kWarps = 8;  // warps per block

template <class T, class OutT, int TOK, int ROWS>
__device__ __forceinline__ void fma_chunk(float (&acc)[ROWS][TOK], const uint4 (&wv)[ROWS], const uint4* xv,
                                          int nchunk, int c) {
  float wf[ROWS][8];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) unpack8<T>(wv[r], wf[r]);
#pragma unroll
  for (int t = 0; t < TOK; ++t) {
    float xf[8];
    unpack8<T>(__ldg(xv + int64_t(t) * nchunk + c), xf);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r][t] = fmaf(wf[r][j], xf[j], acc[r][t]);
  }
}

// Block: kWarps warps = (kWarps / KS) row groups x KS slices of K. Warp (group, slice) owns
// ROWS output rows and the 32-chunk runs slice, slice + KS, slice + 2 KS, ... of them; with
// KS > 1 the slices' partial sums meet in shared memory and are added in slice order
// (deterministic). KS > 1 serves small N, where one warp per row leaves too few bytes in
// flight to reach the bandwidth.
//
// Each warp's first U runs are loaded before grid_dependency_wait() (weights never change),
// and up to l2_prefetch_bytes more of each row are prefetched into L2: the weight stream
// starts while the kernel before (attention, LayerNorm) still runs. After that the loop is
// software-pipelined: the next U runs are in flight while the current ones are used.
// Up to l2_prefetch_bytes of each weight row past this warp's first U runs, into L2.
template <class T, int ROWS, int KS, int U>
__device__ __forceinline__ void prefetch_rows_l2(const uint4* (&wr)[ROWS], int K, int lane, int slice,
                                                 int l2_prefetch_bytes) {
  constexpr int kStride = 32 * KS;
  const int row_bytes = K * int(sizeof(T));
  const int lo = kStride * U * 16, hi = min(row_bytes, lo + l2_prefetch_bytes);
  for (int off = lo + (lane + 32 * slice) * 128; off < hi; off += kStride * 128)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wr[r]) + off));
}

// This warp's runs of its rows into acc, from chunk c on, wv holding its first U runs when
// there are U: U runs at a time, the next U loading while the current ones are used, then
// the runs left one at a time.
template <class T, class OutT, int TOK, int ROWS, int KS, int U>
__device__ __forceinline__ void stream_rows(float (&acc)[ROWS][TOK], uint4 (&wv)[U][ROWS], const uint4* (&wr)[ROWS],
                                            const uint4* xv, int c, int nchunk) {
  constexpr int kStride = 32 * KS;
  for (; c + kStride * (U - 1) < nchunk; c += kStride * U) {
    const int cn = c + kStride * U;
    const bool more = cn + kStride * (U - 1) < nchunk;
    uint4 nx[U][ROWS];
    if (more) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) nx[u][r] = __ldcs(wr[r] + cn + kStride * u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) fma_chunk<T, OutT, TOK, ROWS>(acc, wv[u], xv, nchunk, c + kStride * u);
    if (more) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[u][r] = nx[u][r];
    }
  }
  for (; c < nchunk; c += kStride) {
    uint4 one[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) one[r] = __ldcs(wr[r] + c);
    fma_chunk<T, OutT, TOK, ROWS>(acc, one, xv, nchunk, c);
  }
}

// Each row's sums over the warp's lanes (warp_sum); with KS > 1, lane 0 shares them in
// `partial` for the slices' addition.
template <int TOK, int ROWS, int KS, int kRows>
__device__ __forceinline__ void sum_lanes(float (&acc)[ROWS][TOK], float (&partial)[kRows][ROWS][TOK], int warp,
                                          int lane) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOK; ++t) acc[r][t] = warp_sum(acc[r][t]);
  if constexpr (KS > 1) {
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOK; ++t) partial[warp][r][t] = acc[r][t];
  }
}

// Slice 0's warp: the KS slices' sums added in slice order from `partial`, into acc.
template <int TOK, int ROWS, int KS, int kRows>
__device__ __forceinline__ void add_slices(float (&acc)[ROWS][TOK], const float (&partial)[kRows][ROWS][TOK],
                                           int warp) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
      float sum = partial[warp][r][t];
#pragma unroll
      for (int k = 1; k < KS; ++k) sum += partial[warp + k][r][t];
      acc[r][t] = sum;
    }
}

// act(acc + bias) of rows [n0, n0 + ROWS) below N, each output stored by one lane.
template <class T, class OutT, int TOK, int ROWS>
__device__ __forceinline__ void write_rows(OutT* out, const float (&acc)[ROWS][TOK], const T* bias, int n0, int N,
                                           int lane, int act) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int n = n0 + r;
    const float b = (bias != nullptr && n < N) ? to_float(bias[n]) : 0.f;
#pragma unroll
    for (int t = 0; t < TOK; ++t) {
      const float v = activate(acc[r][t] + b, act);
      if (n < N && lane == ((r * TOK + t) & 31)) out[int64_t(t) * N + n] = from_float<OutT>(v);
    }
  }
}

template <class T, class OutT, int TOK, int ROWS, int KS>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_nk_kernel(OutT* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                   const T* __restrict__ bias, int K, int N, int act, int l2_prefetch_bytes) {
  constexpr int U = ROWS == 1 ? 4 : 2;  // loads in flight per row per lane
  constexpr int kGroups = kWarps / KS;
  __shared__ float partial[KS > 1 ? kWarps : 1][ROWS][TOK];
  grid_dependents_launch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp / KS, slice = warp % KS;
  const int n0 = (blockIdx.x * kGroups + group) * ROWS;
  const bool active = n0 < N;
  const int nchunk = K >> 3;  // 16-byte chunks per row

  const uint4* wr[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)  // rows past N re-read the last row; their sums are not stored
    wr[r] = reinterpret_cast<const uint4*>(w + int64_t(min(n0 + r, N - 1)) * K);
  const uint4* xv = reinterpret_cast<const uint4*>(x);

  // Chunk of run j for this lane: lane + 32 * j; this warp's runs: j = slice + KS * i.
  int c = lane + 32 * slice;
  constexpr int kStride = 32 * KS;  // chunks between this warp's consecutive runs
  uint4 wv[U][ROWS];
  if (active && c + kStride * (U - 1) < nchunk) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) wv[u][r] = __ldcs(wr[r] + c + kStride * u);
  }
  if (active && l2_prefetch_bytes > 0) prefetch_rows_l2<T, ROWS, KS, U>(wr, K, lane, slice, l2_prefetch_bytes);
  grid_dependency_wait();  // x is the previous kernel's output

  float acc[ROWS][TOK];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOK; ++t) acc[r][t] = 0.f;

  if (active) stream_rows<T, OutT, TOK, ROWS, KS, U>(acc, wv, wr, xv, c, nchunk);
  sum_lanes<TOK, ROWS, KS>(acc, partial, warp, lane);
  if constexpr (KS > 1) {
    __syncthreads();
    if (slice != 0) return;
    add_slices<TOK, ROWS, KS>(acc, partial, warp);
  }
  if (!active) return;
  write_rows<T, OutT>(out, acc, bias, n0, N, lane, act);
}

// K slices per row: enough warps in flight for small N (see the kernel). `forced` (1, 2 or 4;
// GemmOptions::gemv_k_split) overrides the choice, for measurements.
int k_slices(int64_t rows_of_warps, int forced) {
  if (forced == 1 || forced == 2 || forced == 4) return forced;
  return rows_of_warps < 2048 ? 4 : rows_of_warps < 6144 ? 2 : 1;
}

template <class T, class OutT, int TOK, int KS>
void launch_ks(OutT* out, const T* in, const T* w, const T* bias, int K, int N, int act, int l2_prefetch_bytes,
               cudaStream_t stream) {
  constexpr int ROWS = TOK > 4 ? 2 : 1;
  const int rows_per_block = kWarps / KS * ROWS;
  const unsigned blocks = unsigned((int64_t(N) + rows_per_block - 1) / rows_per_block);
  LAUNCH_PDL("gemv_nk_kernel", gemv_nk_kernel<T, OutT, TOK, ROWS, KS>, dim3(blocks), dim3(kWarps * 32), 0, stream, out,
             in, w, bias, K, N, act, l2_prefetch_bytes);
}

template <class T, class OutT, int TOK>
void launch(OutT* out, const T* in, const T* w, const T* bias, int K, int N, int act, int k_split,
            int l2_prefetch_bytes, cudaStream_t stream) {
  constexpr int ROWS = TOK > 4 ? 2 : 1;
  switch (k_slices((int64_t(N) + ROWS - 1) / ROWS, k_split)) {
    case 4: launch_ks<T, OutT, TOK, 4>(out, in, w, bias, K, N, act, l2_prefetch_bytes, stream); break;
    case 2: launch_ks<T, OutT, TOK, 2>(out, in, w, bias, K, N, act, l2_prefetch_bytes, stream); break;
    default: launch_ks<T, OutT, TOK, 1>(out, in, w, bias, K, N, act, l2_prefetch_bytes, stream); break;
  }
}

}  // namespace

bool gemv_nk_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  return T_ >= 1 && T_ <= kGemvMaxTokens && K > 0 && K % 8 == 0 && K < (int64_t(1) << 30) && N > 0 &&
         N < (int64_t(1) << 30) && aligned16(in) && aligned16(w);
}

template <class T, class OutT>
void gemv_nk(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
             GemmAct act, cudaStream_t stream, int k_split, int l2_prefetch_bytes) {
  if (!gemv_nk_supported(T_, K, N, in, w))
    throw Error("gemv_nk: unsupported problem T=" + std::to_string(T_) + " K=" + std::to_string(K) +
                " N=" + std::to_string(N));
  if (!is_one_of(k_split, kGemvKSplits))
    throw Error("gemv_nk: k_split " + std::to_string(k_split) + " (0: chosen by N, or 1, 2, 4)");
  if (l2_prefetch_bytes < 0 || l2_prefetch_bytes > kMaxGemvL2PrefetchBytes)
    throw Error("gemv_nk: l2_prefetch_bytes " + std::to_string(l2_prefetch_bytes) + " (0 to " +
                std::to_string(kMaxGemvL2PrefetchBytes) + ")");
  const int a = int(act);  // the code activate() takes (dtype.cuh)
  const int k = int(K), n = int(N), ks = k_split, l2 = l2_prefetch_bytes;
  switch (T_) {
    case 1: launch<T, OutT, 1>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    case 2: launch<T, OutT, 2>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    case 3: launch<T, OutT, 3>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    case 4: launch<T, OutT, 4>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    case 5: launch<T, OutT, 5>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    case 6: launch<T, OutT, 6>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    case 7: launch<T, OutT, 7>(out, in, w, bias, k, n, a, ks, l2, stream); break;
    default: launch<T, OutT, 8>(out, in, w, bias, k, n, a, ks, l2, stream); break;
  }
}

template void gemv_nk<__half, __half>(__half*, const __half*, const __half*, const __half*, int64_t,
                                      int64_t, int64_t, GemmAct, cudaStream_t, int, int);
template void gemv_nk<__half, float>(float*, const __half*, const __half*, const __half*, int64_t,
                                     int64_t, int64_t, GemmAct, cudaStream_t, int, int);
template void gemv_nk<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*,
                                                    const __nv_bfloat16*, const __nv_bfloat16*,
                                                    int64_t, int64_t, int64_t, GemmAct, cudaStream_t, int, int);
template void gemv_nk<__nv_bfloat16, float>(float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                            const __nv_bfloat16*, int64_t, int64_t, int64_t, GemmAct,
                                            cudaStream_t, int, int);

}  // namespace conveyor::cuda::detail

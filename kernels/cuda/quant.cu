// Int8 weight-only quantisation and products (quant.h): the quantiser, the decode GEMV, the
// tensor-core tiles, and their launchers. Both product kernels feed int8 rows to
// mma.m16n8k16 through the k permutation that int8_mma.cuh describes, convert the weights to
// T in registers (exact), accumulate in fp32, and end with the same fused epilogue
// act(s[n] * acc + bias[n]). No atomics: every sum has a fixed order, so results are bitwise
// reproducible for a given kernel and shape.
#include "kernels/cuda/quant.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/int8_mma.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_tile.cuh"

namespace conveyor::cuda {
namespace detail {
namespace {

__device__ __forceinline__ float int8_epilogue(float acc, float scale, float bias, int act) {
  return activate(fmaf(acc, scale, bias), act);
}

// ---- quantisation: one block per row --------------------------------------------------------

constexpr int kQuantThreads = 256;

// The same IEEE operations as quantize_rows_int8_reference (quant.cc), in the same order.
template <class T>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_rows_kernel(int8_t* __restrict__ q, float* __restrict__ scales, const T* __restrict__ w, int64_t K) {
  __shared__ float scratch[32];
  const int64_t n = blockIdx.x;
  const T* row = w + n * K;
  float amax = 0.f;
  for (int64_t k = threadIdx.x; k < K; k += kQuantThreads) amax = fmaxf(amax, fabsf(to_float(row[k])));
  amax = block_max(amax, scratch);  // max is exact in any order
  const float s = __fdiv_rn(amax, 127.f);
  if (threadIdx.x == 0) scales[n] = s;
  int8_t* qrow = q + n * K;
  for (int64_t k = threadIdx.x; k < K; k += kQuantThreads) {
    float v = amax > 0.f ? __fdiv_rn(to_float(row[k]), s) : 0.f;
    if (isnan(v)) v = 0.f;
    v = fminf(fmaxf(rintf(v), -127.f), 127.f);
    qrow[k] = static_cast<int8_t>(static_cast<int>(v));
  }
}

// ---- GEMV: T <= 8 ---------------------------------------------------------------------------
//
// Memory-bound: each weight byte is read once. The floor is the weight bytes over the HBM
// bandwidth: K = 4096, N = 12288 is 50.3 MB of int8 (+ 49 KB of scales), 15.0 us at the H100
// SXM's 3.35 TB/s (the fp16 GEMV moves 100.7 MB: 30 us); K = 16384, N = 4096 is 67.1 MB, 20 us.
// Target: >= 80% of it, i.e. about half the fp16 GEMV's time.
//
// Block: kGemvWarps warps = (kGemvWarps / KS) row groups x KS slices of K. Warp (group,
// slice) owns 16 rows (the MMA's M; lane (g, t) loads rows g and g + 8) and the runs of
// kGemvRun consecutive 64-wide chunks slice, slice + KS, ... of them: per run, each lane has
// 2 x kGemvRun 16-byte weight loads in flight, and the next run is loaded while this one is
// used. The tokens are the MMA's N (8 columns; those >= T are zeros). With KS > 1 the slices'
// partial sums meet in shared memory and are added in slice order. Per 32 weight bytes a lane
// spends about 40 (fp16) to 60 (bf16) instructions, far below what the bandwidth allows, so
// T = 1 and T = 8 cost the same.
//
// PDL: the first run of weights, the scales and the bias are loaded before
// grid_dependency_wait() (they never change); the activations after.
constexpr int kGemvWarps = 8;
constexpr int kGemvRun = 4;  // 64-wide chunks per run

// A run of U 64-wide chunks from c0 of weight rows w0, w1 (lane t's pieces 4c + t); zeros past K.
template <int U>
__device__ __forceinline__ void load_int8_run(uint4 (&dst)[U][2], const uint4* w0, const uint4* w1, int c0, int t,
                                              int pieces) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = 4 * (c0 + u) + t;
    if (p < pieces) {
      dst[u][0] = __ldcs(w0 + p);
      dst[u][1] = __ldcs(w1 + p);
    } else {
      dst[u][0] = dst[u][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// The MMAs of the run `cur` (chunks c0 ..) on the two chains of acc, the weights converted
// to T in registers, token g's activations (xr; zeros without a token) read per piece.
template <class T, int U>
__device__ __forceinline__ void mma_int8_run(float (&acc)[2][4], const uint4 (&cur)[U][2], const uint4* xr,
                                             bool has_token, int c0, int nchunk, int t, int pieces) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c0 + u < nchunk) {  // the same for the whole warp
      const int p = 4 * (c0 + u) + t;
      uint4 xa = make_uint4(0, 0, 0, 0), xb = xa;  // token g's k [16p, 16p + 16)
      if (has_token && p < pieces) {
        xa = __ldg(xr + 2 * p);
        xb = __ldg(xr + 2 * p + 1);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[4];
        int8x4_to_pairs<T>(word(cur[u][0], j), a[0], a[2]);
        int8x4_to_pairs<T>(word(cur[u][1], j), a[1], a[3]);
        const uint4& xv = j < 2 ? xa : xb;
        mma_m16n8k16<T>(acc[j & 1], a, word(xv, 2 * (j & 1)), word(xv, 2 * (j & 1) + 1));
      }
    }
  }
}

template <class T, class OutT, int KS>
__global__ void __launch_bounds__(kGemvWarps * 32)
    int8_gemv_kernel(OutT* __restrict__ out, const T* __restrict__ x, const int8_t* __restrict__ w,
                     const float* __restrict__ scales, const T* __restrict__ bias, int T_, int K, int N, int act) {
  constexpr int U = kGemvRun;
  constexpr int kGroups = kGemvWarps / KS;
  __shared__ float4 partial[KS > 1 ? kGemvWarps : 1][32];
  grid_dependents_launch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int group = warp / KS, slice = warp % KS;
  const int n0 = (blockIdx.x * kGroups + group) * 16;
  const bool active = n0 < N;
  // Rows past N re-read the last row; their sums are not stored.
  const int row0 = min(n0 + g, N - 1), row1 = min(n0 + g + 8, N - 1);
  const uint4* w0 = reinterpret_cast<const uint4*>(w + int64_t(row0) * K);
  const uint4* w1 = reinterpret_cast<const uint4*>(w + int64_t(row1) * K);
  const int pieces = K >> 4;            // 16-byte pieces per row (K % 16 == 0)
  const int nchunk = (pieces + 3) >> 2;  // chunk c = pieces 4c .. 4c + 3; lane t takes 4c + t

  uint4 cur[U][2];
  int c0 = slice * U;
  if (active) load_int8_run(cur, w0, w1, c0, t, pieces);
  const float s0 = scales[row0], s1 = scales[row1];
  const float b0 = bias != nullptr ? to_float(bias[row0]) : 0.f;
  const float b1 = bias != nullptr ? to_float(bias[row1]) : 0.f;
  grid_dependency_wait();  // x is the previous kernel's output

  float acc[2][4] = {};  // two chains (even and odd MMA steps), added at the end
  if (active) {
    const bool has_token = g < T_;
    const uint4* xr = reinterpret_cast<const uint4*>(x + int64_t(has_token ? g : 0) * K);
    for (; c0 < nchunk; c0 += KS * U) {  // the next run loads while this one is used
      const int cn = c0 + KS * U;
      uint4 nxt[U][2];
      if (cn < nchunk) load_int8_run(nxt, w0, w1, cn, t, pieces);
      mma_int8_run<T>(acc, cur, xr, has_token, c0, nchunk, t, pieces);
      if (cn < nchunk) {
#pragma unroll
        for (int u = 0; u < U; ++u) cur[u][0] = nxt[u][0], cur[u][1] = nxt[u][1];
      }
    }
  }

  float r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = acc[0][i] + acc[1][i];
  if constexpr (KS > 1) {  // the slices' sums added in slice order, into slice 0's warp
    partial[warp][lane] = make_float4(r[0], r[1], r[2], r[3]);
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int k = 1; k < KS; ++k) {
      const float4 p = partial[warp + k][lane];
      r[0] += p.x, r[1] += p.y, r[2] += p.z, r[3] += p.w;
    }
  }
  if (!active) return;
  // Accumulator layout: r[0], r[1] row n0 + g, tokens 2t, 2t + 1; r[2], r[3] row n0 + g + 8.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = n0 + g + 8 * (i >> 1), tok = 2 * t + (i & 1);
    if (n < N && tok < T_)
      out[int64_t(tok) * N + n] = from_float<OutT>(int8_epilogue(r[i], i < 2 ? s0 : s1, i < 2 ? b0 : b1, act));
  }
}

// K slices per row group: as many as keep the grid to one wave of resident blocks (two of
// 256 threads per SM at ~120 registers) while each warp still has two runs or more; more
// warps per row give small N the bytes in flight it needs. `forced` (1, 2, 4 or 8;
// GemmOptions::int8_gemv_k_split) overrides it, for measurements.
int gemv_k_slices(int64_t K, int64_t N, int sms, int forced) {
  if (forced == 1 || forced == 2 || forced == 4 || forced == 8) return forced;
  const int64_t groups = (N + 15) / 16, chunks = (K / 16 + 3) / 4, slots = int64_t(sms) * 2;
  auto blocks = [&](int ks) { return (groups * ks + kGemvWarps - 1) / kGemvWarps; };
  int ks = 1;
  while (ks < 8 && blocks(2 * ks) <= slots && chunks >= int64_t(2) * (2 * ks) * kGemvRun) ks *= 2;
  return ks;
}

template <class T, class OutT, int KS>
void launch_gemv_ks(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int T_, int K,
                    int N, int act, cudaStream_t stream) {
  constexpr int kGroups = kGemvWarps / KS;
  const int64_t groups = (int64_t(N) + 15) / 16;
  const unsigned blocks = unsigned((groups + kGroups - 1) / kGroups);
  LAUNCH_PDL("int8_gemv_kernel", int8_gemv_kernel<T, OutT, KS>, dim3(blocks), dim3(kGemvWarps * 32), 0, stream,
             out, in, w, scales, bias, T_, K, N, act);
}

template <class T, class OutT>
void launch_gemv(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int T_, int K, int N,
                 int act, int k_split, cudaStream_t stream) {
  switch (gemv_k_slices(K, N, sm_count(), k_split)) {
    case 8: launch_gemv_ks<T, OutT, 8>(out, in, w, scales, bias, T_, K, N, act, stream); break;
    case 4: launch_gemv_ks<T, OutT, 4>(out, in, w, scales, bias, T_, K, N, act, stream); break;
    case 2: launch_gemv_ks<T, OutT, 2>(out, in, w, scales, bias, T_, K, N, act, stream); break;
    default: launch_gemv_ks<T, OutT, 1>(out, in, w, scales, bias, T_, K, N, act, stream); break;
  }
}

// ---- tensor-core tiles: any T ---------------------------------------------------------------
//
// mma_tile.cuh's kernel with int8 weights. Expectations on an H100 (sm_90; mma.sync reaches
// about two thirds of wgmma's peak, ~600 of ~990 dense fp16 TFLOPS): for decode batches of 32
// to 128 the kernel is bound by the int8 weight stream plus the MMA time, and should beat fp16
// cuBLASLt, which streams twice the bytes (K = 4096, N = 12288: 50 MB int8 vs 100 MB fp16,
// floors 15 vs 30 us). Prefill (T = 2048, K = N = 4096, 68.7 GFLOP) is compute-bound: cuBLAS
// runs it on wgmma at ~600-700 TFLOPS (~100-115 us); these mma.sync tiles with in-register
// conversion should reach 250-350 TFLOPS, i.e. about 2x (up to 2.5x) the cuBLAS time.
//
// The shapes Gemm times against each other (quant.h's Int8Kernel). The activation tile is
// re-read from L2 by every block along N: 2T/BN bytes per weight byte, hence the wide-N tiles
// for decode batches. They differ in kWarpsK, hence in summation order: the fixed-order set is
// fixed_gemm.cu's.
//                              BM   BN  warps M N K  stages  blocks/SM     smem   warps
using Tile16x32 = TileConfig<16, 32, 1, 1, 4, 4, 3>;    //  65 KB  4
using Tile32x64 = TileConfig<32, 64, 1, 2, 4, 3, 2>;    //  98 KB  8
using Tile32x128 = TileConfig<32, 128, 1, 4, 2, 4, 2>;  //  98 KB  8
using Tile64x64 = TileConfig<64, 64, 2, 2, 2, 4, 2>;    // 100 KB  8
using Tile64x128 = TileConfig<64, 128, 2, 4, 1, 4, 2>;  //  68 KB  8
using Tile128x64 = TileConfig<128, 64, 2, 2, 1, 4, 2>;  //  88 KB  4
using Tile128x128 = TileConfig<128, 128, 2, 2, 1, 4, 2>;  // 104 KB  4

template <class T, class OutT, class Cfg>
void launch_tiles(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int T_, int K, int N,
                  int act, cudaStream_t stream) {
  launch_mma_tiles<T, int8_t, OutT, Cfg>(out, in, w, scales, bias, T_, K, N, act, stream);
}

// Indexed by Int8Kernel.
constexpr TileInfo kInfo[kInt8Kernels] = {
    {"gemv", 0, 0},
    tile_info<Tile16x32>("mma16x32"),
    tile_info<Tile32x64>("mma32x64"),
    tile_info<Tile32x128>("mma32x128"),
    tile_info<Tile64x64>("mma64x64"),
    tile_info<Tile64x128>("mma64x128"),
    tile_info<Tile128x64>("mma128x64"),
    tile_info<Tile128x128>("mma128x128"),
};

}  // namespace

const char* int8_kernel_name(Int8Kernel k) {
  const int i = int(k);
  return i >= 0 && i < kInt8Kernels ? kInfo[i].name : "?";
}

bool int8_kernel_supported(Int8Kernel k, int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  const int i = int(k);
  if (i < 0 || i >= kInt8Kernels || !tile_sizes_ok(T_, K, N)) return false;
  if (k == Int8Kernel::Gemv) return T_ <= 8 && K % 16 == 0 && aligned16(in) && aligned16(w);
  return kInfo[i].fits(N);
}

std::vector<Int8Kernel> int8_candidates(int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  std::vector<Int8Kernel> v;
  if (int8_kernel_supported(Int8Kernel::Gemv, T_, K, N, in, w)) v.push_back(Int8Kernel::Gemv);
  for (int i = 1; i < kInt8Kernels; ++i) {
    if (kInfo[i].worth_timing(T_) && int8_kernel_supported(Int8Kernel(i), T_, K, N, in, w))
      v.push_back(Int8Kernel(i));
  }
  if (v.empty()) v.push_back(int8_default_kernel(T_, K, N, in, w));
  return v;
}

Int8Kernel int8_default_kernel(int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  if (int8_kernel_supported(Int8Kernel::Gemv, T_, K, N, in, w)) return Int8Kernel::Gemv;
  if (T_ <= 16) return Int8Kernel::Mma16x32;
  if (T_ <= 32) return Int8Kernel::Mma32x64;
  if (T_ <= 64) return Int8Kernel::Mma64x64;
  if (T_ <= 128) return Int8Kernel::Mma128x64;
  return Int8Kernel::Mma128x128;
}

void int8_check_args(const void* out, const void* in, const void* w, const void* scales, int64_t T_, int64_t K,
                     int64_t N) {
  std::string missing;
  for (auto [p, name] : {std::pair<const void*, const char*>{out, "out"}, {in, "in"}, {w, "w"}, {scales, "scales"}})
    if (p == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
  if (!missing.empty()) throw Error("int8 matmul: null pointer (" + missing + ")");
  if (!tile_sizes_ok(T_, K, N))
    throw Error("int8 matmul: T, K and N must be positive and below 2^30 (" + tile_shape_text(T_, K, N) + ")");
}

template <class T, class OutT>
void int8_matmul(Int8Kernel k, OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias,
                 int64_t T_, int64_t K, int64_t N, GemmAct act, cudaStream_t stream, int gemv_k_split) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "T is __half or __nv_bfloat16");
  static_assert(std::is_same_v<OutT, T> || std::is_same_v<OutT, float>, "OutT is T or float");
  int8_check_args(out, in, w, scales, T_, K, N);
  if (!is_one_of(gemv_k_split, kInt8GemvKSplits))
    throw Error("int8 matmul: gemv_k_split " + std::to_string(gemv_k_split) + " (0: chosen by shape, or 1, 2, 4, 8)");
  if (!int8_kernel_supported(k, T_, K, N, in, w))
    throw Error(std::string("int8 matmul: kernel ") + int8_kernel_name(k) + " cannot run " + tile_shape_text(T_, K, N) +
                (k == Int8Kernel::Gemv ? " (needs T <= 8, K % 16 == 0, in and w 16-byte aligned)" : ""));
  const int t = int(T_), kk = int(K), n = int(N), a = int(act);
  switch (k) {
    case Int8Kernel::Gemv: launch_gemv<T, OutT>(out, in, w, scales, bias, t, kk, n, a, gemv_k_split, stream); return;
    case Int8Kernel::Mma16x32: return launch_tiles<T, OutT, Tile16x32>(out, in, w, scales, bias, t, kk, n, a, stream);
    case Int8Kernel::Mma32x64: return launch_tiles<T, OutT, Tile32x64>(out, in, w, scales, bias, t, kk, n, a, stream);
    case Int8Kernel::Mma32x128:
      return launch_tiles<T, OutT, Tile32x128>(out, in, w, scales, bias, t, kk, n, a, stream);
    case Int8Kernel::Mma64x64: return launch_tiles<T, OutT, Tile64x64>(out, in, w, scales, bias, t, kk, n, a, stream);
    case Int8Kernel::Mma64x128:
      return launch_tiles<T, OutT, Tile64x128>(out, in, w, scales, bias, t, kk, n, a, stream);
    case Int8Kernel::Mma128x64:
      return launch_tiles<T, OutT, Tile128x64>(out, in, w, scales, bias, t, kk, n, a, stream);
    case Int8Kernel::Mma128x128:
      return launch_tiles<T, OutT, Tile128x128>(out, in, w, scales, bias, t, kk, n, a, stream);
  }
}

template void int8_matmul<__half, __half>(Int8Kernel, __half*, const __half*, const int8_t*, const float*,
                                          const __half*, int64_t, int64_t, int64_t, GemmAct, cudaStream_t, int);
template void int8_matmul<__half, float>(Int8Kernel, float*, const __half*, const int8_t*, const float*,
                                         const __half*, int64_t, int64_t, int64_t, GemmAct, cudaStream_t, int);
template void int8_matmul<__nv_bfloat16, __nv_bfloat16>(Int8Kernel, __nv_bfloat16*, const __nv_bfloat16*,
                                                        const int8_t*, const float*, const __nv_bfloat16*, int64_t,
                                                        int64_t, int64_t, GemmAct, cudaStream_t, int);
template void int8_matmul<__nv_bfloat16, float>(Int8Kernel, float*, const __nv_bfloat16*, const int8_t*,
                                                const float*, const __nv_bfloat16*, int64_t, int64_t, int64_t,
                                                GemmAct, cudaStream_t, int);

}  // namespace detail

template <class T>
void quantize_rows_int8(int8_t* q, float* scales, const T* w, int64_t N, int64_t K, cudaStream_t stream) {
  if (q == nullptr || scales == nullptr || w == nullptr)
    throw Error("quantize_rows_int8: null pointer (q, scales and w are required)");
  if (N <= 0 || K <= 0 || N > int64_t(0x7fffffff))
    throw Error("quantize_rows_int8: N must be in [1, 2^31) and K positive (N=" + std::to_string(N) +
                " K=" + std::to_string(K) + ")");
  detail::quantize_rows_kernel<T><<<unsigned(N), detail::kQuantThreads, 0, stream>>>(q, scales, w, K);
  CUDA_CHECK(cudaGetLastError());
}

template void quantize_rows_int8<__half>(int8_t*, float*, const __half*, int64_t, int64_t, cudaStream_t);
template void quantize_rows_int8<__nv_bfloat16>(int8_t*, float*, const __nv_bfloat16*, int64_t, int64_t,
                                                cudaStream_t);
template void quantize_rows_int8<float>(int8_t*, float*, const float*, int64_t, int64_t, cudaStream_t);

namespace detail {
namespace {

// w[n, k] = T(q[n, k] * s[n]): 8 elements a thread (8-byte loads, 16-byte stores) when K % 8
// == 0, else one. Memory-bound: 3 bytes moved per weight.
template <class T, bool kVec8>
__global__ void dequantize_rows_kernel(T* __restrict__ w, const int8_t* __restrict__ q, const float* __restrict__ scales,
                                       int64_t N, int64_t K) {
  const int64_t per = kVec8 ? 8 : 1, units = N * K / per;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const float s = scales[u * per / K];
    if constexpr (kVec8) {
      const uint2 raw = reinterpret_cast<const uint2*>(q)[u];
      const int8_t* b = reinterpret_cast<const int8_t*>(&raw);
      float f[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = float(b[i]) * s;
      reinterpret_cast<uint4*>(w)[u] = pack8<T>(f);
    } else {
      w[u] = from_float<T>(float(q[u]) * s);
    }
  }
}

}  // namespace
}  // namespace detail

template <class T>
void dequantize_rows_int8(T* w, const int8_t* q, const float* scales, int64_t N, int64_t K, cudaStream_t stream) {
  if (w == nullptr || q == nullptr || scales == nullptr)
    throw Error("dequantize_rows_int8: null pointer (w, q and scales are required)");
  if (N <= 0 || K <= 0) throw Error("dequantize_rows_int8: N and K must be positive");
  const bool vec = K % 8 == 0 && detail::aligned16(w) && reinterpret_cast<uintptr_t>(q) % 8 == 0;
  const int64_t units = N * K / (vec ? 8 : 1);
  const unsigned blocks = unsigned(std::min<int64_t>((units + 255) / 256, 65535));
  if (vec) detail::dequantize_rows_kernel<T, true><<<blocks, 256, 0, stream>>>(w, q, scales, N, K);
  else detail::dequantize_rows_kernel<T, false><<<blocks, 256, 0, stream>>>(w, q, scales, N, K);
  CUDA_CHECK(cudaGetLastError());
}

template void dequantize_rows_int8<__half>(__half*, const int8_t*, const float*, int64_t, int64_t, cudaStream_t);
template void dequantize_rows_int8<__nv_bfloat16>(__nv_bfloat16*, const int8_t*, const float*, int64_t, int64_t,
                                                  cudaStream_t);

}  // namespace conveyor::cuda

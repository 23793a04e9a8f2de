// Internal (not a public header): the tensor-core tile kernel behind the int8 weight-only
// products (quant.cu) and the fixed-order products (fixed_gemm.cu), one template over the
// weight type W: int8_t (converted to T in registers, one fp32 scale per row) or T itself.
//
// A block computes BM tokens x BN rows of out. Its warps form kWarpsM x kWarpsN x kWarpsK: a
// warp owns (BM / kWarpsM) x (BN / kWarpsN) outputs as 16 x 8 MMA tiles and, of each stage's
// BK = 64 kWarpsK values of k, the 64 of its K slice. Stages of shared memory hold the
// activation tile (BM x BK of T, rows padded by 16 bytes) and the weight tile (BN x BK of W;
// T rows padded like the activations); cp.async fills kStages - 1 of them ahead of the one in
// use (one barrier per stage). A lane reads, per 64-wide slice, 16 values of k of a weight row
// and of each activation row (int8_mma.cuh's mapping), converts int8 weights in registers and
// issues the MMAs. The epilogue adds the K slices' partial tiles in slice order in shared
// memory (reusing the stages) and writes act(s * acc + bias) (int8) or act(acc + bias) (T)
// with coalesced stores.
//
// Summation order. Output (m, n) is ((P_0 + P_1) + ...) + P_{C-1} over C = kWarpsK x splits
// chains, where P_j is one fp32 chain over the 64-wide chunks c = j, j + C, j + 2C, ... in
// increasing order, four m16n8k16 MMAs per chunk (k 16-steps 0..3 of int8_mma.cuh's
// mapping). With one split the block adds its warps' chains in shared memory; with several
// (gridDim.z blocks along K, block z taking k-tiles z, z + splits, ...) every warp writes its
// chain to `chains` and add_chains_kernel adds them in order, with the same epilogue. The
// order depends on C and K and on nothing else: not on BM, BN, the warp layout, the stages,
// T, the row's place in the batch or whether the aligned loader ran. Configurations with the
// same C therefore give bitwise the same result for every row, whatever the token count:
// fixed_gemm.cu keeps kWarpsK = 2 for all of its tiles and takes the splits from (K, N).
//
// Bank conflicts: 16-byte loads go 8 lanes at a time (g in {2i, 2i+1}, t = 0..3). Padded rows
// are 16 bytes apart modulo 128, so the two rows meet no common bank. int8 weight rows of 64
// bytes interleave by themselves; when BK >= 128 their 16-byte chunks of odd rows are swizzled
// (chunk c stored at c ^ 4) so the two rows use the two 64-byte halves of the banks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/int8_mma.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda::detail {

// T, K and N below this: the kernels index with int.
constexpr int64_t kMaxTileDim = int64_t(1) << 30;
inline bool tile_sizes_ok(int64_t T_, int64_t K, int64_t N) {
  return T_ > 0 && K > 0 && N > 0 && T_ < kMaxTileDim && K < kMaxTileDim && N < kMaxTileDim;
}
inline std::string tile_shape_text(int64_t T_, int64_t K, int64_t N) {
  return "T=" + std::to_string(T_) + " K=" + std::to_string(K) + " N=" + std::to_string(N);
}

// A tile configuration as the planners see it (bm = bn = 0: not a tile, e.g. a GEMV).
struct TileInfo {
  const char* name;
  int bm, bn;
  // N in grid.y's range.
  bool fits(int64_t N) const { return bn == 0 || (N + bn - 1) / bn <= 65535; }
  // Worth timing for T tokens: at most twice T (rounded up to a power of two, 16 at least),
  // and no more than 16 blocks along T.
  bool worth_timing(int64_t T_) const {
    int64_t tp = 16;
    while (tp < T_) tp *= 2;
    return bm <= 2 * tp && 16 * int64_t(bm) >= T_;
  }
};

template <int BM_, int BN_, int WM, int WN, int WK, int STAGES, int MIN_BLOCKS>
struct TileConfig {
  static constexpr int BM = BM_, BN = BN_, kWarpsM = WM, kWarpsN = WN, kWarpsK = WK;
  static constexpr int kStages = STAGES, kMinBlocks = MIN_BLOCKS;
  static constexpr int kThreads = 32 * WM * WN * WK;
  static constexpr int BK = 64 * WK;
  static constexpr int kWarpM = BM / WM, kWarpN = BN / WN;  // a warp's outputs
  static constexpr int MT = kWarpM / 16, NT = kWarpN / 8;   // its MMA tiles
  static constexpr int kARow = BK + 8;                       // elements per activation row
  static constexpr int kABytes = BM * kARow * 2;
  static constexpr int kOutRow = BN + 8;  // floats per row of the epilogue tile
  static_assert(kWarpM % 16 == 0 && kWarpN % 8 == 0, "warp tile of whole MMA tiles");
  static_assert((BM * BK / 8) % kThreads == 0, "whole activation loads per thread");
  static_assert(kStages >= 2, "at least double buffering");
};

template <class Cfg>
constexpr TileInfo tile_info(const char* name) {
  return {name, Cfg::BM, Cfg::BN};
}

// The weight tile's layout for weight type W: int8 rows of BK bytes (swizzled when BK >= 128),
// or T rows of BK + 8 elements like the activations.
template <class Cfg, class W>
struct WeightTile {
  static constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  static constexpr int kRow = kInt8 ? Cfg::BK : Cfg::BK + 8;  // elements per row
  static constexpr int kBytes = Cfg::BN * kRow * int(sizeof(W));
  static constexpr int kElemsPerChunk = 16 / int(sizeof(W));
  static constexpr int kStageBytes = Cfg::kABytes + kBytes;
  static constexpr int kPipeBytes = Cfg::kStages * kStageBytes, kOutBytes = Cfg::BM * Cfg::kOutRow * 4;
  static constexpr int kSmemBytes = kPipeBytes > kOutBytes ? kPipeBytes : kOutBytes;
  static_assert((Cfg::BN * Cfg::BK / kElemsPerChunk) % Cfg::kThreads == 0, "whole weight loads per thread");
  // Where 16-byte chunk c of row r lives, in elements from the row's start.
  __device__ static __forceinline__ int chunk_at(int r, int c) {
    if constexpr (kInt8 && Cfg::BK >= 128) return 16 * (c ^ ((r & 1) << 2));
    else return kElemsPerChunk * c;
  }
};

// The 16-byte chunk of `row` (elements of 16 / E bytes: E = 8 for T, 16 for int8) that starts
// at element k, each element at or past K zero: the guarded loaders' chunk.
template <int E, class U>
__device__ __forceinline__ uint4 guarded_chunk(const U* row, int k, int K) {
  using Bits = std::conditional_t<E == 16, uint8_t, uint16_t>;
  static_assert(sizeof(U) == sizeof(Bits), "E elements of U fill 16 bytes");
  constexpr int kPerWord = E / 4, kShift = 32 / kPerWord;
  const Bits* src = reinterpret_cast<const Bits*>(row);
  uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (k + e < K) v[e / kPerWord] |= uint32_t(src[k + e]) << (kShift * (e % kPerWord));
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// kAligned: K % 16 == 0 and in, w 16-byte aligned, so every 16-byte chunk of a tile is either
// wholly inside the matrix or wholly outside (cp.async, zero-filled). Otherwise each element is
// loaded on its own with bounds checks (synchronous; the same sums, bit for bit).
// scales: one per weight row for W = int8_t; ignored (null) for W = T.
// The epilogue of one output: act(s * v + b) for int8 weights, act(v + b) for T weights.
template <class W>
__device__ __forceinline__ float tile_epilogue(float v, const float* scales, int n, float b, int act) {
  if constexpr (std::is_same_v<W, int8_t>) return activate(fmaf(v, scales[n], b), act);
  else return activate(__fadd_rn(v, b), act);
}

// A thread's place in the block: its warp's (wm, wn, wk) in the kWarpsM x kWarpsN x kWarpsK
// layout, and its lane's group g (accumulator rows g, g + 8) and t (columns 2t, 2t + 1).
struct TileLane {
  int wm, wn, wk, g, t;
};

// Weight rows [n0, n0 + BN) at k-tile kt into a stage (dst): cp.async when kAligned, else
// guarded chunks; zero outside the matrix.
template <class Cfg, class W, bool kAligned>
__device__ __forceinline__ void load_weight_tile(W* dst, const W* w, int tid, int n0, int kt, int K, int N) {
  using WT = WeightTile<Cfg, W>;
  constexpr int E = WT::kElemsPerChunk, kRowChunks = Cfg::BK / E;
#pragma unroll
  for (int i = 0; i < Cfg::BN * kRowChunks / Cfg::kThreads; ++i) {
    const int idx = tid + i * Cfg::kThreads, r = idx / kRowChunks, c = idx % kRowChunks;
    const int n = n0 + r, k = kt * Cfg::BK + E * c;
    W* d = dst + r * WT::kRow + WT::chunk_at(r, c);
    if constexpr (kAligned) {
      const bool inside = n < N && k < K;
      cp_async16(d, inside ? w + int64_t(n) * K + k : w, inside ? 16 : 0);
    } else {
      *reinterpret_cast<uint4*>(d) = n < N ? guarded_chunk<E>(w + int64_t(n) * K, k, K) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Activation rows [m0, m0 + BM) at k-tile kt into a stage (dst), as load_weight_tile.
template <class Cfg, class T, bool kAligned>
__device__ __forceinline__ void load_activation_tile(T* dst, const T* x, int tid, int m0, int kt, int K, int T_) {
  constexpr int kRowChunks = Cfg::BK / 8;
#pragma unroll
  for (int i = 0; i < Cfg::BM * kRowChunks / Cfg::kThreads; ++i) {
    const int idx = tid + i * Cfg::kThreads, r = idx / kRowChunks, c = idx % kRowChunks;
    const int m = m0 + r, k = kt * Cfg::BK + 8 * c;
    T* d = dst + r * Cfg::kARow + 8 * c;
    if constexpr (kAligned) {
      const bool inside = m < T_ && k < K;
      cp_async16(d, inside ? x + int64_t(m) * K + k : x, inside ? 16 : 0);
    } else {
      *reinterpret_cast<uint4*>(d) = m < T_ ? guarded_chunk<8>(x + int64_t(m) * K, k, K) : make_uint4(0, 0, 0, 0);
    }
  }
}

// One stage (as, bs) on this warp's accumulators: its 64-wide slice, MMA steps 2h + jj for
// h, jj in {0, 1}, in that order.
template <class Cfg, class T, class W>
__device__ __forceinline__ void mma_stage(float (&acc)[Cfg::MT][Cfg::NT][4], const T* as, const W* bs,
                                          const TileLane& l) {
  using WT = WeightTile<Cfg, W>;
  constexpr int MT = Cfg::MT, NT = Cfg::NT;
  [[maybe_unused]] uint4 bq[NT];  // int8: 16 weights of row (8j + g) at k [64 wk + 16t, +16)
  if constexpr (WT::kInt8) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r = l.wn * Cfg::kWarpN + 8 * j + l.g;
      bq[j] = *reinterpret_cast<const uint4*>(bs + r * WT::kRow + WT::chunk_at(r, 4 * l.wk + l.t));
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // steps 2h and 2h + 1
    uint32_t bc[NT][2][2];        // their weights as pairs of T
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if constexpr (WT::kInt8) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) int8x4_to_pairs<T>(word(bq[j], 2 * h + jj), bc[j][jj][0], bc[j][jj][1]);
      } else {  // 8 weights of row (8j + g) at k [64 wk + 16t + 8h, +8), as the activations
        const int r = l.wn * Cfg::kWarpN + 8 * j + l.g;
        const uint4 bw = *reinterpret_cast<const uint4*>(bs + r * WT::kRow + 64 * l.wk + 16 * l.t + 8 * h);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) bc[j][jj][0] = word(bw, 2 * jj), bc[j][jj][1] = word(bw, 2 * jj + 1);
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      uint4 av[2];  // rows g and g + 8 of MMA tile i at k [64 wk + 16t + 8h, +8)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = l.wm * Cfg::kWarpM + 16 * i + 8 * rr + l.g;
        av[rr] = *reinterpret_cast<const uint4*>(as + r * Cfg::kARow + 64 * l.wk + 16 * l.t + 8 * h);
      }
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const uint32_t a[4] = {word(av[0], 2 * jj), word(av[1], 2 * jj), word(av[0], 2 * jj + 1),
                               word(av[1], 2 * jj + 1)};
#pragma unroll
        for (int j = 0; j < NT; ++j) mma_m16n8k16<T>(acc[i][j], a, bc[j][jj][0], bc[j][jj][1]);
      }
    }
  }
}

// Several splits: this warp's chain (its accumulators, fp32) into its [T_][N] slice `mine` of
// chains, for add_chains_kernel to add.
template <class Cfg>
__device__ __forceinline__ void store_chain(float* mine, const float (&acc)[Cfg::MT][Cfg::NT][4], const TileLane& l,
                                            int m0, int n0, int T_, int N) {
#pragma unroll
  for (int i = 0; i < Cfg::MT; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // accumulator rows g, g + 8; columns 2t, 2t + 1
        const int m = m0 + l.wm * Cfg::kWarpM + 16 * i + 8 * (e >> 1) + l.g;
        const int n = n0 + l.wn * Cfg::kWarpN + 8 * j + 2 * l.t + (e & 1);
        if (m < T_ && n < N) mine[int64_t(m) * N + n] = acc[i][j][e];
      }
}

// One split: the K slices' tiles summed into `tile` (BM x kOutRow fp32 in shared memory) in
// slice order, one slice's warps at a time.
template <class Cfg>
__device__ __forceinline__ void sum_slices(float* tile, const float (&acc)[Cfg::MT][Cfg::NT][4], const TileLane& l) {
#pragma unroll 1
  for (int s = 0; s < Cfg::kWarpsK; ++s) {
    if (l.wk == s) {
#pragma unroll
      for (int i = 0; i < Cfg::MT; ++i)
#pragma unroll
        for (int j = 0; j < Cfg::NT; ++j)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {  // accumulator rows g and g + 8, columns 2t, 2t + 1
            const int r = l.wm * Cfg::kWarpM + 16 * i + 8 * hr + l.g, c = l.wn * Cfg::kWarpN + 8 * j + 2 * l.t;
            float2* p = reinterpret_cast<float2*>(tile + r * Cfg::kOutRow + c);
            float2 v = make_float2(acc[i][j][2 * hr], acc[i][j][2 * hr + 1]);
            if (s > 0) {
              const float2 o = *p;
              v.x = __fadd_rn(o.x, v.x), v.y = __fadd_rn(o.y, v.y);
            }
            *p = v;
          }
    }
    __syncthreads();
  }
}

// The summed tile out, with the bias and activation (tile_epilogue), in coalesced stores.
template <class Cfg, class T, class W, class OutT>
__device__ __forceinline__ void write_tile(OutT* out, const float* tile, const float* scales, const T* bias, int tid,
                                           int m0, int n0, int T_, int N, int act) {
  for (int idx = tid; idx < Cfg::BM * Cfg::BN; idx += Cfg::kThreads) {
    const int r = idx / Cfg::BN, c = idx % Cfg::BN, m = m0 + r, n = n0 + c;
    if (m < T_ && n < N) {
      const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
      out[int64_t(m) * N + n] = from_float<OutT>(tile_epilogue<W>(tile[r * Cfg::kOutRow + c], scales, n, b, act));
    }
  }
}

// chains: null for one split; else [gridDim.z * kWarpsK][T_][N] fp32 (out, scales, bias unused).
template <class T, class W, class OutT, class Cfg, bool kAligned>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    mma_tile_kernel(OutT* __restrict__ out, const T* __restrict__ x, const W* __restrict__ w,
                    const float* __restrict__ scales, const T* __restrict__ bias, int T_, int K, int N, int act,
                    float* __restrict__ chains) {
  using WT = WeightTile<Cfg, W>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::kStages;
  constexpr int MT = Cfg::MT, NT = Cfg::NT;
  extern __shared__ __align__(16) unsigned char smem[];
  grid_dependents_launch();
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wk = warp / (Cfg::kWarpsM * Cfg::kWarpsN);
  const int wm = (warp / Cfg::kWarpsN) % Cfg::kWarpsM, wn = warp % Cfg::kWarpsN;
  const TileLane l{.wm = wm, .wn = wn, .wk = wk, .g = g, .t = t};
  // This block's k-tiles: z, z + splits, ...; `ktiles` of them, local tile i being z + i splits.
  const int splits = gridDim.z, z = blockIdx.z;
  const int all_tiles = (K + Cfg::BK - 1) / Cfg::BK;
  const int ktiles = all_tiles > z ? (all_tiles - z + splits - 1) / splits : 0;

  auto a_stage = [&](int s) { return reinterpret_cast<T*>(smem + s * WT::kStageBytes); };
  auto b_stage = [&](int s) { return reinterpret_cast<W*>(smem + s * WT::kStageBytes + Cfg::kABytes); };
  auto load_b = [&](int s, int local) {
    const int kt = z + local * splits;
    load_weight_tile<Cfg, W, kAligned>(b_stage(s), w, tid, n0, kt, K, N);
  };
  auto load_a = [&](int s, int local) {
    const int kt = z + local * splits;
    load_activation_tile<Cfg, T, kAligned>(a_stage(s), x, tid, m0, kt, K, T_);
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // Prologue. Weights never change: their first tiles are requested before the wait for the
  // previous kernel (PDL); they join the first commit group with the first activation tile.
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (s < ktiles) load_b(s, s);
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < ktiles) load_a(s, s);
    cp_async_commit();
  }
  // Group i holds tile i. At iteration kt, S - 1 + kt groups are committed; waiting until at
  // most S - 2 are in flight completes tiles 0..kt. The barrier then also guarantees that every
  // warp is done with stage (kt - 1) % S, which the next load overwrites.
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const int next = kt + S - 1;
    if (next < ktiles) {
      load_b(next % S, next);
      load_a(next % S, next);
    }
    cp_async_commit();
    mma_stage<Cfg>(acc, a_stage(kt % S), b_stage(kt % S), l);
  }
  cp_async_wait<0>();
  __syncthreads();

  if (chains != nullptr) {  // several splits: each warp's chain out, added by add_chains_kernel
    store_chain<Cfg>(chains + int64_t(z * Cfg::kWarpsK + l.wk) * T_ * N, acc, l, m0, n0, T_, N);
    return;
  }
  // Epilogue: the K slices' tiles summed in slice order, then the bias and activation.
  float* tile = reinterpret_cast<float*>(smem);
  sum_slices<Cfg>(tile, acc, l);
  write_tile<Cfg, T, W>(out, tile, scales, bias, tid, m0, n0, T_, N, act);
}

template <class T, class W, class OutT, class Cfg, bool kAligned>
void launch_mma_tile_kernel(OutT* out, const T* in, const W* w, const float* scales, const T* bias, int T_, int K,
                            int N, int act, cudaStream_t stream, int splits, float* chains) {
  auto* kernel = mma_tile_kernel<T, W, OutT, Cfg, kAligned>;
  constexpr int kSmem = WeightTile<Cfg, W>::kSmemBytes;
  // Over 48 KB of dynamic shared memory needs an opt-in per kernel and device (a plain
  // attribute call, legal during graph capture), with all of the SM's carveout for it.
  detail::allow_smem(kernel, size_t(kSmem), /*max_carveout=*/true);
  const dim3 grid(unsigned((T_ + Cfg::BM - 1) / Cfg::BM), unsigned((N + Cfg::BN - 1) / Cfg::BN), unsigned(splits));
  LAUNCH_PDL("mma_tile_kernel", kernel, grid, dim3(Cfg::kThreads), size_t(kSmem), stream, out, in, w, scales, bias,
             T_, K, N, act, splits > 1 ? chains : nullptr);
}

// The aligned kernel when every 16-byte chunk is whole, else the guarded one. splits > 1:
// the chains go to `chains` ([splits * kWarpsK][T_][N] fp32), for add_chains_kernel.
template <class T, class W, class OutT, class Cfg>
void launch_mma_tiles(OutT* out, const T* in, const W* w, const float* scales, const T* bias, int T_, int K, int N,
                      int act, cudaStream_t stream, int splits = 1, float* chains = nullptr) {
  if (K % 16 == 0 && aligned16(in) && aligned16(w))
    launch_mma_tile_kernel<T, W, OutT, Cfg, true>(out, in, w, scales, bias, T_, K, N, act, stream, splits, chains);
  else
    launch_mma_tile_kernel<T, W, OutT, Cfg, false>(out, in, w, scales, bias, T_, K, N, act, stream, splits, chains);
}

// out[m, n] = epilogue(((chains[0] + chains[1]) + ...) + chains[C - 1]) at (m, n): the
// blocks' chains in order, then what mma_tile_kernel's own epilogue does.
template <class W, class T, class OutT>
__global__ void add_chains_kernel(OutT* __restrict__ out, const float* __restrict__ chains, int C,
                                  const float* __restrict__ scales, const T* __restrict__ bias, int64_t T_, int N,
                                  int act) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t total = T_ * N;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    float v = chains[i];
    for (int c = 1; c < C; ++c) v = __fadd_rn(v, chains[int64_t(c) * total + i]);
    const int n = int(i % N);
    const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
    out[i] = from_float<OutT>(tile_epilogue<W>(v, scales, n, b, act));
  }
}

}  // namespace conveyor::cuda::detail

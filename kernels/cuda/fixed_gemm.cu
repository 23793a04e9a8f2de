// The fixed-order tiles (fixed_gemm.h): mma_tile.cuh's kernel with kWarpsK = 2 throughout.
//
// Floors on an H100 SXM (3.35 TB/s, ~600 dense TFLOPS reachable by mma.sync): batch-1 decode
// is the weight stream (K = 4096, N = 12288 fp16: 100.7 MB, 30 us); the 16-token tiles keep
// 5 or 6 stages of 8-17 KB in flight per block and 128+ blocks along N to reach it without
// a GEMV. From about T = 256 (6.7B shapes) the product is compute-bound on mma.sync: T = 256,
// K = 4096, N = 16384 is 34.4 GFLOP, 57 us at 600 TFLOPS against 40 us of weight stream;
// cuBLASLt's wgmma kernels reach ~45 us there. That gap is the price of the fixed order at
// large batches, measured in docs/PERFORMANCE.md.
#include "kernels/cuda/fixed_gemm.h"

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/mma_tile.cuh"

namespace conveyor::cuda::detail {
namespace {

//                              BM   BN  warps M N K  stages  blocks/SM    smem (T / int8)
using F16x16 = TileConfig<16, 16, 1, 1, 2, 8, 3>;     //  70 / 51 KB   2 warps (decode, small N)
using F16x32 = TileConfig<16, 32, 1, 1, 2, 6, 2>;     //  78 / 50 KB   2 warps
using F16x64 = TileConfig<16, 64, 1, 2, 2, 5, 2>;     // 109 / 63 KB   4 warps
using F32x64 = TileConfig<32, 64, 1, 2, 2, 4, 2>;     // 104 / 67 KB   4 warps
using F64x64 = TileConfig<64, 64, 2, 2, 2, 3, 2>;     // 104 / 77 KB   8 warps
using F64x128 = TileConfig<64, 128, 2, 2, 2, 3, 1>;   // 157 / 101 KB  8 warps
using F128x64 = TileConfig<128, 64, 2, 2, 2, 3, 1>;   // 157 / 129 KB  8 warps
using F128x128 = TileConfig<128, 128, 2, 2, 2, 3, 1>; // 209 / 154 KB  8 warps

template <class Cfg>
constexpr bool kFixedOrder = Cfg::kWarpsK == 2;
static_assert(kFixedOrder<F16x16> && kFixedOrder<F16x32> && kFixedOrder<F16x64> && kFixedOrder<F32x64> && kFixedOrder<F64x64> &&
                  kFixedOrder<F64x128> && kFixedOrder<F128x64> && kFixedOrder<F128x128>,
              "every fixed-order tile sums K the same way: kWarpsK = 2");

constexpr TileInfo kInfo[kFixedTiles] = {
    tile_info<F16x32>("fixed16x32"),  tile_info<F16x64>("fixed16x64"),   tile_info<F32x64>("fixed32x64"),
    tile_info<F64x64>("fixed64x64"),  tile_info<F64x128>("fixed64x128"), tile_info<F128x64>("fixed128x64"),
    tile_info<F128x128>("fixed128x128"), tile_info<F16x16>("fixed16x16"),
};

}  // namespace

const char* fixed_tile_name(FixedTile k) {
  const int i = int(k);
  return i >= 0 && i < kFixedTiles ? kInfo[i].name : "?";
}

bool fixed_tile_supported(FixedTile k, int64_t T_, int64_t K, int64_t N) {
  const int i = int(k);
  if (i < 0 || i >= kFixedTiles || !tile_sizes_ok(T_, K, N)) return false;
  return kInfo[i].fits(N);
}

std::vector<FixedTile> fixed_tile_candidates(int64_t T_, int64_t K, int64_t N) {
  std::vector<FixedTile> v;
  for (int i = 0; i < kFixedTiles; ++i) {
    if (kInfo[i].worth_timing(T_) && fixed_tile_supported(FixedTile(i), T_, K, N)) v.push_back(FixedTile(i));
  }
  if (v.empty()) v.push_back(fixed_default_tile(T_, K, N));
  return v;
}

int fixed_k_splits(int64_t K, int64_t N) {
  const int64_t tiles = (N + 63) / 64, chunks = (K + 63) / 64;
  // Chunks a chain must keep: 16, or 6 where N is so narrow (under 64 tiles) that the chains'
  // round trip through memory is small whatever K.
  const int64_t min_chunks = tiles < 64 ? 6 : 16;
  int s = 1;
  while (s < 4 && tiles * s < 160 && chunks >= 2 * (2 * s) * min_chunks) s *= 2;  // the next s: 4s chains
  return s;
}

int64_t fixed_chain_floats(int64_t T_, int64_t K, int64_t N) {
  const int s = fixed_k_splits(K, N);
  return s > 1 ? int64_t(2 * s) * T_ * N : 0;
}

FixedTile fixed_default_tile(int64_t T_, int64_t, int64_t) {
  if (T_ <= 16) return FixedTile::F16x32;
  if (T_ <= 32) return FixedTile::F32x64;
  if (T_ <= 64) return FixedTile::F64x64;
  if (T_ <= 128) return FixedTile::F128x64;
  return FixedTile::F128x128;
}

template <class T, class W, class OutT>
void fixed_matmul(FixedTile k, OutT* out, const T* in, const W* w, const float* scales, const T* bias, int64_t T_,
                  int64_t K, int64_t N, GemmAct act, cudaStream_t stream, float* chains) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "T is __half or __nv_bfloat16");
  static_assert(std::is_same_v<W, T> || std::is_same_v<W, int8_t>, "W is T or int8_t");
  static_assert(std::is_same_v<OutT, T> || std::is_same_v<OutT, float>, "OutT is T or float");
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  if (out == nullptr || in == nullptr || w == nullptr || (kInt8 && scales == nullptr))
    throw Error(std::string("fixed-order matmul: null pointer (out, in, w") + (kInt8 ? ", scales" : "") +
                " are required)");
  if (!tile_sizes_ok(T_, K, N))
    throw Error("fixed-order matmul: T, K and N must be positive and below 2^30 (" + tile_shape_text(T_, K, N) + ")");
  if (!fixed_tile_supported(k, T_, K, N))
    throw Error(std::string("fixed-order matmul: tile ") + fixed_tile_name(k) + " cannot run " + tile_shape_text(T_, K, N));
  const float* s = kInt8 ? scales : nullptr;
  const int t = int(T_), kk = int(K), n = int(N), a = int(act);
  const int splits = fixed_k_splits(K, N);
  if (splits > 1 && chains == nullptr)
    throw Error("fixed-order matmul: " + tile_shape_text(T_, K, N) + " runs in " + std::to_string(splits) +
                " splits along K and needs a chain workspace");
  switch (k) {
    case FixedTile::F16x16: launch_mma_tiles<T, W, OutT, F16x16>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F16x32: launch_mma_tiles<T, W, OutT, F16x32>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F16x64: launch_mma_tiles<T, W, OutT, F16x64>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F32x64: launch_mma_tiles<T, W, OutT, F32x64>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F64x64: launch_mma_tiles<T, W, OutT, F64x64>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F64x128: launch_mma_tiles<T, W, OutT, F64x128>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F128x64: launch_mma_tiles<T, W, OutT, F128x64>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    case FixedTile::F128x128: launch_mma_tiles<T, W, OutT, F128x128>(out, in, w, s, bias, t, kk, n, a, stream, splits, chains); break;
    default: throw Error("fixed-order matmul: unknown tile " + std::to_string(int(k)));
  }
  if (splits > 1) {
    const int64_t total = T_ * N;
    const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 4096));
    LAUNCH_PDL("add_chains_kernel", add_chains_kernel<W, T, OutT>, dim3(blocks), dim3(256), 0, stream, out,
               static_cast<const float*>(chains), 2 * splits, s, bias, T_, n, a);
  }
}

#define CONVEYOR_FIXED_MATMUL(T, W, OutT)                                                                  \
  template void fixed_matmul<T, W, OutT>(FixedTile, OutT*, const T*, const W*, const float*, const T*, int64_t, \
                                         int64_t, int64_t, GemmAct, cudaStream_t, float*);
CONVEYOR_FIXED_MATMUL(__half, __half, __half)
CONVEYOR_FIXED_MATMUL(__half, __half, float)
CONVEYOR_FIXED_MATMUL(__half, int8_t, __half)
CONVEYOR_FIXED_MATMUL(__half, int8_t, float)
CONVEYOR_FIXED_MATMUL(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16)
CONVEYOR_FIXED_MATMUL(__nv_bfloat16, __nv_bfloat16, float)
CONVEYOR_FIXED_MATMUL(__nv_bfloat16, int8_t, __nv_bfloat16)
CONVEYOR_FIXED_MATMUL(__nv_bfloat16, int8_t, float)
#undef CONVEYOR_FIXED_MATMUL

}  // namespace conveyor::cuda::detail

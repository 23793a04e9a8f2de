// Fixed-order matrix products: out[t, n] = act(sum_k in[t, k] w[n, k] (* scale[n]) + bias[n])
// whose every output element is summed in one order that depends on K alone: never on the
// token count T, on the row's place among the tokens, or on which tile ran it. They are what
// makes a sequence's logits the same bits alone, in a batch of 255 others, with its prompt in
// one chunk or many, and rebuilt through prefill after a failover (docs/ARCHITECTURE.md,
// "Determinism"); Gemm::run and Gemm::run_int8 take them unless deterministic mode is off.
//
// The order (mma_tile.cuh): K in 64-wide chunks; chunk c goes to chain c % 2; each chain adds
// its chunks in increasing order through four m16n8k16 tensor-core MMAs (fp32 accumulation);
// the result is chain 0 + chain 1, then the epilogue. Every tile below has kWarpsK = 2, so
// they differ only in how many tokens and rows a block covers, which Gemm times per T bucket
// as it does cuBLASLt's algorithms.
//
// Weights are [N, K] (nn.Linear): W = T (the activations' type) or int8_t with one fp32 scale
// per row (quant.h). No workspace, no atomics, no allocation: every call is one launch,
// capturable in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/gemm.h"

namespace conveyor::cuda::detail {

enum class FixedTile : int { F16x32 = 0, F16x64, F32x64, F64x64, F64x128, F128x64, F128x128, F16x16 };
constexpr int kFixedTiles = 8;

const char* fixed_tile_name(FixedTile k);
// True when tile k can run this problem (T, K, N in [1, 2^30), N / BN <= 65535 blocks).
bool fixed_tile_supported(FixedTile k, int64_t T_, int64_t K, int64_t N);
// The tiles worth timing for T (BM up to twice T, and no more than 16 blocks along T), and
// the one to take untimed.
std::vector<FixedTile> fixed_tile_candidates(int64_t T_, int64_t K, int64_t N);
FixedTile fixed_default_tile(int64_t T_, int64_t K, int64_t N);

// One launch of tile k. T is __half or __nv_bfloat16; W is T or int8_t (then scales is
// required, else ignored); OutT is T or float; bias (length N, type T) may be null. Throws
// conveyor::Error naming the problem for a null pointer, sizes outside [1, 2^30), or a tile
// that cannot run the shape.
template <class T, class W, class OutT>
void fixed_matmul(FixedTile k, OutT* out, const T* in, const W* w, const float* scales, const T* bias, int64_t T_,
                  int64_t K, int64_t N, GemmAct act, cudaStream_t stream);

}  // namespace conveyor::cuda::detail

// Fixed-order matrix products: out[t, n] = act(sum_k in[t, k] w[n, k] (* scale[n]) + bias[n])
// whose every output element is summed in one order that depends on K alone: never on the
// token count T, on the row's place among the tokens, or on which tile ran it. They are what
// makes a sequence's logits the same bits alone, in a batch of 255 others, with its prompt in
// one chunk or many, and rebuilt through prefill after a failover (docs/ARCHITECTURE.md,
// "Determinism"); Gemm::run and Gemm::run_int8 take them unless deterministic mode is off.
//
// The order (mma_tile.cuh): K in 64-wide chunks; chunk c goes to chain c % C; each chain adds
// its chunks in increasing order through four m16n8k16 tensor-core MMAs (fp32 accumulation);
// the result is ((chain 0 + chain 1) + ...) + chain C-1, then the epilogue. C = 2 x
// fixed_k_splits(K, N): a function of the shape alone. With one split a block adds its two
// chains itself; with more, the splits run as blocks along K that write their chains to a
// workspace, and fixed_add_chains adds them in order (the narrow products, N <= ~8k, whose
// output tiles alone would not fill the GPU). Every tile below has kWarpsK = 2, so they
// differ only in how many tokens and rows a block covers, which Gemm times per T bucket as it
// does cuBLASLt's algorithms.
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

// Blocks along K (1, 2 or 4) for a [N, K] product: more where N alone makes few output tiles
// (under 160 of 64 rows) and K leaves each chain at least 16 chunks (6 under 64 tiles), so
// the chains' round trip through memory stays small beside the weights even at 256 rows. The same on every
// GPU: it fixes the order.
int fixed_k_splits(int64_t K, int64_t N);
// Floats of the chain workspace one call of T_ rows needs (0 for one split).
int64_t fixed_chain_floats(int64_t T_, int64_t K, int64_t N);

// The product with tile k: one launch, or (fixed_k_splits > 1) the split tiles writing their
// chains into `chains` (fixed_chain_floats(T_, K, N) floats) and then fixed_add_chains. T is
// __half or __nv_bfloat16; W is T or int8_t (then scales is required, else ignored); OutT is
// T or float; bias (length N, type T) may be null. Throws conveyor::Error naming the problem
// for a null pointer (chains included, when needed), sizes outside [1, 2^30), or a tile that
// cannot run the shape.
template <class T, class W, class OutT>
void fixed_matmul(FixedTile k, OutT* out, const T* in, const W* w, const float* scales, const T* bias, int64_t T_,
                  int64_t K, int64_t N, GemmAct act, cudaStream_t stream, float* chains = nullptr);

}  // namespace conveyor::cuda::detail

// Internal: the tile order of attention (attention_tiles.cuh and its two .cu files), which
// attention_decode_paged and attention_context_fixed_paged take for the head sizes it is
// built for. Which order a row gets depends on head_dim alone, so decode and its context
// twin always agree.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/fp8.h"

namespace conveyor::cuda {

constexpr int kTilePiece = 64;  // positions per piece of the tile order

// True when head_dim has a tile-order kernel (a multiple of 16, at most 128).
bool tile_order_head_dim(int64_t head_dim);
// Pieces of a row of max_kv_len positions in the tile order.
int64_t tile_pieces(int64_t max_kv_len);
// The floats of DecodeWorkspace::partial that let a decode launch spread every row.
int64_t tile_partial_floats(int64_t rows, int64_t n_head, int64_t head_dim, int64_t max_kv_len);
// The most rows tile_decode_splits spreads (more than one warp per (row, head)) on a GPU of
// num_sms SMs: a workspace of tile_partial_floats(min(max rows, this), ...) lets every launch
// that would spread do so.
int64_t tile_spread_rows(int64_t n_head, int num_sms);
// Warps per (row, head) a decode launch of `rows` rows spreads over: 1 when the workspace
// cannot hold every piece's state. It never changes a result.
int tile_decode_splits(int64_t rows, int64_t n_head, int64_t head_dim, const DecodeWorkspace& ws);

// As attention_decode_paged / attention_context_fixed_paged; every pointer 16-byte aligned.
template <class T>
void attention_decode_tiles(T* out, const T* qkv, const KvLayerView& kv, const int32_t* kv_lens, int64_t num_rows,
                            int64_t n_head, int64_t head_dim, const DecodeWorkspace& ws, cudaStream_t stream,
                            Fp8Sums qkv_sums = {});
template <class T>
void attention_context_tiles(T* out, const T* qkv, const KvLayerView& kv, const SeqArrays& seqs, int64_t max_q_len,
                             int64_t n_head, int64_t head_dim, cudaStream_t stream);

// The CUDA-core order (attention_decode.cu) whatever head_dim: the order of head sizes the
// tile order does not cover, and the benchmark's comparison.
template <class T>
void attention_decode_cores(T* out, const T* qkv, const KvLayerView& kv, const int32_t* kv_lens, int64_t num_rows,
                            int64_t n_head, int64_t head_dim, int num_splits, const DecodeWorkspace& ws,
                            cudaStream_t stream);
template <class T>
void attention_context_cores(T* out, const T* qkv, const KvLayerView& kv, const SeqArrays& seqs, int64_t max_q_len,
                             int64_t n_head, int64_t head_dim, cudaStream_t stream);

}  // namespace conveyor::cuda

// Batched attention over the paged K/V cache, as the GPU stage runs it. (The single-sequence
// twins of the CPU ops, on contiguous K/V, are in ops.h; both go through the same kernels.)
//
// Token rows of a step are laid out sequence after sequence; qkv is [tokens, 3C] with
// [q | k | v] per row (C = n_head * head_dim), out is [tokens, C].
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/fp8.h"
#include "kernels/cuda/paged_kv.h"

namespace conveyor::cuda {

// Decode (one new token per sequence, row s = sequence s = block-table row s):
//   - appends row s's K and V (from qkv) to the cache at position kv_lens[s] - 1,
//   - attends q over positions [0, kv_lens[s]); kv_lens[s] <= 0 marks a padding row (skipped,
//     out not written).
// A fixed order, one of two chosen by head_dim alone, so a row's result depends on its own
// kv_len, q and K/V and attention_context_fixed_paged computes the same bits for a prompt's
// rows:
//   - the tile order (attention_tiles.cuh), for head_dim a multiple of 16 up to 128: tensor
//     cores, pieces of kTilePiece (64) positions merged in piece order; a small batch spreads
//     a row's pieces over warps by itself (num_splits is not used), the workspace allowing;
//   - the CUDA-core order (attention_decode.cu) otherwise: pieces of kDecodePiece, each summed
//     by a fixed set of lane groups and merged in piece order; num_splits blocks share a
//     (row, head)'s pieces (flash-decoding, so a small batch still fills the GPU).
// Neither changes a result with the number of blocks or warps; a row whose pieces were
// spread keeps each piece's state in the workspace and the last to finish merges them.
constexpr int kDecodePiece = 256;
struct DecodeWorkspace {
  float* partial = nullptr;     // decode_partial_floats(rows, n_head, head_dim, max_kv_len) floats
  int32_t* counters = nullptr;  // rows * n_head, zero before first use; kernels leave them zero
  int64_t partial_floats = 0;   // capacity of `partial`
  int64_t counter_entries = 0;  // capacity of `counters`
  int64_t max_kv_len = 0;       // the longest row the workspace holds (a longer one gives NaN)
};
// Pieces of a row of max_kv_len positions, and the floats of `partial` one launch uses.
int64_t decode_pieces(int64_t max_kv_len);
int64_t decode_partial_floats(int64_t rows, int64_t n_head, int64_t head_dim, int64_t max_kv_len);

// Blocks per (row, head) that make rows * n_head * splits cover about two waves of `num_sms`,
// at most one per piece of max_kv_len; at most 16.
int decode_splits_for(int64_t rows, int64_t n_head, int64_t max_kv_len, int num_sms);

// qkv_sums (FP8 products): q and the new token's K and V come from the QKV product's deferred
// epilogue (Gemm::run_fp8's `defer`: every element as the epilogue would have stored it in
// qkv, so the same bits), and qkv is not read (may be null). Only where
// attention_decode_reads_sums(kv, head_dim); throws otherwise.
template <class T>
void attention_decode_paged(T* out, const T* qkv, const KvLayerView& kv, const int32_t* kv_lens,
                            int64_t num_rows, int64_t n_head, int64_t head_dim, int num_splits,
                            const DecodeWorkspace& ws, cudaStream_t stream, Fp8Sums qkv_sums = {});
// Whether attention_decode_paged takes a deferred QKV epilogue for this layer: an FP8 K/V
// cache (whose head sizes all take the tile order).
bool attention_decode_reads_sums(const KvLayerView& kv, int64_t head_dim);

// Context (prefill, chunked prefill, or any mix): sequence s has q_lens[s] query rows starting
// at row q_begins[s], at positions kv_lens[s] - q_lens[s] + i, causal; its K/V (this step's
// tokens included, written by kv_cache_append first) come from block-table row s. Sequences
// with q_lens[s] <= 0 are skipped. max_q_len bounds q_lens (sizes the grid).
struct SeqArrays {
  const int32_t* q_begins = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  int64_t num_seqs = 0;
};

// Fast mode's context attention. Where the tile order exists it is the tile order (the
// twin below, which is also the faster); otherwise the flash kernel (wmma tensor cores,
// attention_context.cu): a row's result does not depend on the chunking, but its order is
// not the decode kernel's, so a sequence rebuilt through it after a failover may continue
// differently. Deterministic mode takes the twin.
template <class T>
void attention_context_paged(T* out, const T* qkv, const KvLayerView& kv, const SeqArrays& seqs,
                             int64_t max_q_len, int64_t n_head, int64_t head_dim, cudaStream_t stream);

// The same attention in attention_decode_paged's order (the tile order where head_dim has
// it, else the CUDA-core order): every query row gets bitwise what decode would give it at
// that position, however the prompt was chunked.
template <class T>
void attention_context_fixed_paged(T* out, const T* qkv, const KvLayerView& kv, const SeqArrays& seqs,
                                   int64_t max_q_len, int64_t n_head, int64_t head_dim, cudaStream_t stream);

}  // namespace conveyor::cuda

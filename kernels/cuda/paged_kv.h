// The paged K/V layout the attention kernels read, and the kernel that appends new tokens'
// K and V to it. The pool and its page bookkeeping belong to the stage (stage/cuda/kv_cache.h).
//
// Layout (elements of the stage's dtype):
//   pool[layer][page][K|V][head][kPageTokens][head_dim]
// so one page of one head is kPageTokens * head_dim contiguous elements (4 KB for fp16 and
// head_dim 128): the decode kernel's groups of head_dim/8 lanes read one position each with
// 16-byte loads, fully coalesced, and the context kernel loads 64-position tiles as four
// such runs. Pages are the same ids in every layer, so a block table serves all layers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace conveyor::cuda {

constexpr int kPageTokens = 16;

// One layer of the paged cache as kernels see it. Position t of block-table row s, head h,
// element d lives at  k (or v) + page * page_stride + (h * kPageTokens + t % kPageTokens) * head_dim + d,
// with page = block_tables[s * max_pages + t / kPageTokens].
//
// FP8 K/V (E4M3, k_scale set): k and v hold bytes in the layout above, and each (position,
// head) of K and of V has an fp32 scale, at k_scale (v_scale) + page * scale_page_stride +
// h * kPageTokens + t % kPageTokens. Quantisation is per (token, head): s is the power of two
// at or above amax / 448 over the head's head_dim values, bytes e4m3(x / s)
// (kernels/cuda/fp8.cuh: kv_fp8_scale), so a token's bytes depend on that token alone. The
// attention kernels read the bytes into mma fragments and apply s in fp32 (K's on the
// scores, V's on P: attention_tiles.cuh); only the tile order reads FP8 K/V.
struct KvLayerView {
  void* k = nullptr;
  void* v = nullptr;
  int64_t page_stride = 0;                // elements from one page to the next
  const int32_t* block_tables = nullptr;  // device, [rows, max_pages]
  int32_t max_pages = 0;
  float* k_scale = nullptr;               // FP8 K/V only (null: K/V in the stage's dtype)
  float* v_scale = nullptr;
  int64_t scale_page_stride = 0;          // floats from one page's scales to the next (>= n_head * kPageTokens)
  bool fp8() const { return k_scale != nullptr; }
};

// Writes the K and V of new tokens into the cache: token r (row r of qkv, [q | k | v] of
// n_head*head_dim each, row stride qkv_stride elements) goes to block-table row
// token_rows[r] at position token_pos[r]. Device arrays of num_tokens entries.
template <class T>
void kv_cache_append(const KvLayerView& kv, const T* qkv, int64_t qkv_stride, const int32_t* token_rows,
                     const int32_t* token_pos, int64_t num_tokens, int64_t n_head, int64_t head_dim,
                     cudaStream_t stream);

// Copies page `src` to page `dst` (K and V, every head, all kPageTokens positions) in each of
// n_layer layers of a pool laid out as above: layer l's pages start at pool + l * layer_bytes,
// page p at + p * page_bytes. page_bytes must be a multiple of 16 and the pool 16-byte
// aligned. The fork of a sequence whose last page is partial copies that page this way.
void kv_copy_page(void* pool, int64_t layer_bytes, int64_t page_bytes, int64_t n_layer, int32_t src, int32_t dst,
                  cudaStream_t stream);

}  // namespace conveyor::cuda

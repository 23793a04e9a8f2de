// The K/V cache of one pipeline stage on one GPU: one allocation, made once at load, cut
// into pages of kPageTokens positions; each sequence owns a list of pages (its block table).
//
// Layout (elements of the stage's dtype):
//   pool[layer][page][K|V][head][kPageTokens][head_dim]
// so one page of one head is kPageTokens * head_dim contiguous elements (4 KB for fp16 and
// head_dim 128): the decode kernel's groups of head_dim/8 lanes read one position each with
// 16-byte loads, fully coalesced, and the context kernel loads 64-position tiles as four
// such runs. Pages are the same ids in every layer, so a block table serves all layers.
//
// Host-side bookkeeping (reserve/release) is single-threaded: the stage's engine thread.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cuda/check.h"

namespace conveyor::cuda {

constexpr int kPageTokens = 16;

// One layer of the paged cache as kernels see it. Position t of block-table row s, head h,
// element d lives at  k (or v) + page * page_stride + (h * kPageTokens + t % kPageTokens) * head_dim + d,
// with page = block_tables[s * max_pages + t / kPageTokens].
struct KvLayerView {
  void* k = nullptr;
  void* v = nullptr;
  int64_t page_stride = 0;                // elements from one page to the next
  const int32_t* block_tables = nullptr;  // device, [rows, max_pages]
  int32_t max_pages = 0;
};

class KvCache {
 public:
  // Bytes one page takes across all layers (K and V).
  static int64_t page_bytes(int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype);

  // Allocates num_pages pages (device_alloc: out of memory names `owner` and the sizes).
  KvCache(const std::string& owner, int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype,
          int64_t num_pages);

  // Makes sure seq_id owns pages for positions [0, num_tokens). Fails, changing nothing,
  // when the pool has too few free pages.
  Status reserve(uint64_t seq_id, int64_t num_tokens);
  void release(uint64_t seq_id);  // unknown ids are ignored
  void clear();                   // every sequence released
  bool contains(uint64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  const std::vector<int32_t>& pages(uint64_t seq_id) const;  // seq_id must be present
  int64_t capacity_tokens(uint64_t seq_id) const;             // 0 when absent

  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t bytes() const { return int64_t(pool_.bytes()); }
  int64_t num_sequences() const { return int64_t(seqs_.size()); }

  // Layer `layer`'s view with the given device block tables.
  KvLayerView layer(int64_t layer, const int32_t* block_tables, int32_t max_pages) const;

 private:
  int64_t n_layer_, n_head_, head_dim_, elem_bytes_, num_pages_;
  DeviceBuffer pool_;
  std::vector<int32_t> free_;  // a stack: the most recently freed page is reused first
  std::unordered_map<uint64_t, std::vector<int32_t>> seqs_;
};

// Writes the K and V of new tokens into the cache: token r (row r of qkv, [q | k | v] of
// n_head*head_dim each, row stride qkv_stride elements) goes to block-table row
// token_rows[r] at position token_pos[r]. Device arrays of num_tokens entries.
template <class T>
void kv_cache_append(const KvLayerView& kv, const T* qkv, int64_t qkv_stride, const int32_t* token_rows,
                     const int32_t* token_pos, int64_t num_tokens, int64_t n_head, int64_t head_dim,
                     cudaStream_t stream);

}  // namespace conveyor::cuda

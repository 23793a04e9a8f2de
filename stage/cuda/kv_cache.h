// The K/V cache of one pipeline stage on one GPU: one allocation, made once at load, cut
// into pages of kPageTokens positions (the layout of kernels/cuda/paged_kv.h); each sequence
// owns a list of pages (its block table), the same page ids in every layer.
//
// Host-side bookkeeping (reserve/release) is single-threaded: the stage's engine thread.
// Errors: create() and reserve() return them (guard.h); nothing here throws.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/paged_kv.h"

namespace conveyor::cuda {

class KvCache {
 public:
  // Bytes one page takes across all layers (K and V).
  static int64_t page_bytes(int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype);

  // Allocates num_pages pages. Fails on sizes that are not positive, a page count beyond
  // int32, or out of memory (the message names `owner`, the bytes asked and the bytes free).
  static Expected<std::unique_ptr<KvCache>> create(const std::string& owner, int64_t n_layer, int64_t n_head,
                                                   int64_t head_dim, DType dtype, int64_t num_pages);
  // What create() does for sizes it has checked: every size positive, num_pages < 2^31. Out of
  // memory throws (device_alloc). Kept public for the kernel tests, which build a cache of
  // known-good sizes directly; stage code uses create().
  KvCache(const std::string& owner, int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype,
          int64_t num_pages);

  // Makes sure seq_id owns pages for positions [0, num_tokens). Fails, changing nothing,
  // when the pool has too few free pages.
  Status reserve(uint64_t seq_id, int64_t num_tokens);
  void release(uint64_t seq_id);  // unknown ids are ignored
  void clear();                   // every sequence released
  bool contains(uint64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  std::span<const int32_t> pages(uint64_t seq_id) const;  // empty when absent
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

}  // namespace conveyor::cuda

// The K/V cache of one pipeline stage on one GPU: one allocation, made once at load, cut
// into pages of kPageTokens positions (the layout of kernels/cuda/paged_kv.h); each sequence
// holds a list of pages (its block table), the same page ids in every layer.
//
// Pages are reference counted: fork() gives a child its parent's full pages (one more
// holder each) and a copy of a partial last page, and a page returns to the free stack when
// its last holder releases it. Invariant: no page with two holders is ever written.
// Sequences only append, so a write goes to a sequence's last page; a fork never shares a
// partial page, so that page has one holder, and prepare_write() copies it first should a
// caller ever write into a shared one.
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
  // Bytes one page takes across all layers (K and V; with fp8, E4M3 bytes and a scale per
  // position and head, paged_kv.h).
  static int64_t page_bytes(int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype, bool fp8 = false);

  // Allocates num_pages pages. Fails on sizes that are not positive, a page count beyond
  // int32, or out of memory (the message names `owner`, the bytes asked and the bytes free).
  // fp8: the K/V in E4M3 with their scales (paged_kv.h) instead of `dtype`, the stage's dtype.
  static Expected<std::unique_ptr<KvCache>> create(const std::string& owner, int64_t n_layer, int64_t n_head,
                                                   int64_t head_dim, DType dtype, int64_t num_pages,
                                                   bool fp8 = false);
  // What create() does for sizes it has checked: every size positive, num_pages < 2^31. Out of
  // memory throws (device_alloc). Kept public for the kernel tests, which build a cache of
  // known-good sizes directly; stage code uses create().
  KvCache(const std::string& owner, int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype,
          int64_t num_pages, bool fp8 = false);

  // Makes sure seq_id owns pages for positions [0, num_tokens). Fails, changing nothing,
  // when the pool has too few free pages.
  Status reserve(uint64_t seq_id, int64_t num_tokens);
  // Gives `child` the pages holding `parent`'s positions [0, num_tokens): its full pages
  // shared, a partial last page copied on `stream`. Fails, changing nothing, on an unknown
  // parent, a child that exists, num_tokens outside 1..parent_tokens (the parent's cached
  // length, which the stage knows), or no free page for the copy.
  Status fork(uint64_t parent, uint64_t child, int64_t parent_tokens, int64_t num_tokens, cudaStream_t stream);
  // Before writing positions from `from_pos` on: any page of seq_id at or after it that is
  // shared is replaced by a private copy (copy-on-write). Fails, changing nothing, when no page
  // is free for a copy.
  Status prepare_write(uint64_t seq_id, int64_t from_pos, cudaStream_t stream);
  void release(uint64_t seq_id);  // unknown ids are ignored; pages still held elsewhere stay
  void clear();                   // every sequence released
  bool contains(uint64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  std::span<const int32_t> pages(uint64_t seq_id) const;  // empty when absent
  int64_t capacity_tokens(uint64_t seq_id) const;             // 0 when absent

  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return int64_t(free_.size()); }
  int32_t page_refs(int32_t page) const { return refs_[size_t(page)]; }  // holders of a page
  int64_t bytes() const { return int64_t(pool_.bytes()); }
  int64_t num_sequences() const { return int64_t(seqs_.size()); }

  // Layer `layer`'s view with the given device block tables.
  KvLayerView layer(int64_t layer, const int32_t* block_tables, int32_t max_pages) const;

 private:
  int64_t n_layer_, n_head_, head_dim_, elem_bytes_, num_pages_;
  bool fp8_ = false;
  DeviceBuffer pool_;
  // Copies page src to dst in every layer (K and V).
  void copy_page(int32_t src, int32_t dst, cudaStream_t stream);

  int64_t page_stride_bytes_ = 0;  // one page of one layer
  std::vector<int32_t> free_;  // a stack: the most recently freed page is reused first
  std::vector<int32_t> refs_;  // per page, the sequences holding it (0: free)
  std::unordered_map<uint64_t, std::vector<int32_t>> seqs_;
};

}  // namespace conveyor::cuda

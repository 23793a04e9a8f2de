#include "stage/cuda/kv_cache.h"

#include "stage/cuda/guard.h"

namespace conveyor::cuda {

int64_t KvCache::page_bytes(int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype) {
  return n_layer * 2 * n_head * kPageTokens * head_dim * int64_t(dtype_bytes(dtype));
}

// Faults come back unprefixed: device_alloc's message names the owner already.
Expected<std::unique_ptr<KvCache>> KvCache::create(const std::string& owner, int64_t n_layer, int64_t n_head,
                                                   int64_t head_dim, DType dtype, int64_t num_pages) {
  if (n_layer <= 0 || n_head <= 0 || head_dim <= 0 || num_pages <= 0)
    return Status::error(owner + ": KV cache needs positive sizes (layers " + std::to_string(n_layer) + ", pages " +
                         std::to_string(num_pages) + ")");
  if (num_pages > (int64_t(1) << 31) - 1) return Status::error(owner + ": KV cache page count overflows int32");
  return guard("", [&]() -> Expected<std::unique_ptr<KvCache>> {
    return std::make_unique<KvCache>(owner, n_layer, n_head, head_dim, dtype, num_pages);
  });
}

KvCache::KvCache(const std::string& owner, int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype,
                 int64_t num_pages)
    : n_layer_(n_layer),
      n_head_(n_head),
      head_dim_(head_dim),
      elem_bytes_(int64_t(dtype_bytes(dtype))),
      num_pages_(num_pages) {
  pool_ = device_alloc(size_t(num_pages * page_bytes(n_layer, n_head, head_dim, dtype)), owner,
                       "KV cache (" + std::to_string(num_pages) + " pages of " + std::to_string(kPageTokens) +
                           " positions)");
  clear();
}

void KvCache::clear() {
  seqs_.clear();
  free_.resize(size_t(num_pages_));
  for (int64_t i = 0; i < num_pages_; ++i) free_[size_t(i)] = int32_t(num_pages_ - 1 - i);  // page 0 on top
}

Status KvCache::reserve(uint64_t seq_id, int64_t num_tokens) {
  const int64_t need_pages = (num_tokens + kPageTokens - 1) / kPageTokens;
  auto it = seqs_.find(seq_id);
  const int64_t have = it == seqs_.end() ? 0 : int64_t(it->second.size());
  if (need_pages <= have) return ok_status();
  const int64_t more = need_pages - have;
  if (more > free_pages())
    return Status::error("KV cache full: sequence " + std::to_string(seq_id) + " needs " + std::to_string(more) +
                         " more pages of " + std::to_string(kPageTokens) + " positions, " +
                         std::to_string(free_pages()) + " of " + std::to_string(num_pages_) + " free");
  auto& pages = seqs_[seq_id];
  for (int64_t i = 0; i < more; ++i) {
    pages.push_back(free_.back());
    free_.pop_back();
  }
  return ok_status();
}

void KvCache::release(uint64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  for (auto p = it->second.rbegin(); p != it->second.rend(); ++p) free_.push_back(*p);
  seqs_.erase(it);
}

std::span<const int32_t> KvCache::pages(uint64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return {};
  return it->second;
}

int64_t KvCache::capacity_tokens(uint64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? 0 : int64_t(it->second.size()) * kPageTokens;
}

KvLayerView KvCache::layer(int64_t layer, const int32_t* block_tables, int32_t max_pages) const {
  const int64_t page_stride = 2 * n_head_ * kPageTokens * head_dim_;  // elements
  char* base = pool_.as<char>() + layer * num_pages_ * page_stride * elem_bytes_;
  KvLayerView v;
  v.k = base;
  v.v = base + n_head_ * kPageTokens * head_dim_ * elem_bytes_;
  v.page_stride = page_stride;
  v.block_tables = block_tables;
  v.max_pages = max_pages;
  return v;
}

}  // namespace conveyor::cuda

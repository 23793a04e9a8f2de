#include "stage/cuda/kv_cache.h"

#include <algorithm>

#include "stage/cuda/guard.h"

namespace conveyor::cuda {

// One page of one layer: K and V (2 * n_head * kPageTokens * head_dim elements), then for FP8
// their scales (2 * n_head * kPageTokens floats), so a page copy carries its scales.
static int64_t layer_page_bytes(int64_t n_head, int64_t head_dim, DType dtype, bool fp8) {
  const int64_t elems = 2 * n_head * kPageTokens * head_dim;
  return fp8 ? elems + 2 * n_head * kPageTokens * int64_t(sizeof(float)) : elems * int64_t(dtype_bytes(dtype));
}

int64_t KvCache::page_bytes(int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype, bool fp8) {
  return n_layer * layer_page_bytes(n_head, head_dim, dtype, fp8);
}

// Faults come back unprefixed: device_alloc's message names the owner already.
Expected<std::unique_ptr<KvCache>> KvCache::create(const std::string& owner, int64_t n_layer, int64_t n_head,
                                                   int64_t head_dim, DType dtype, int64_t num_pages, bool fp8) {
  if (n_layer <= 0 || n_head <= 0 || head_dim <= 0 || num_pages <= 0)
    return Status::error(owner + ": KV cache needs positive sizes (layers " + std::to_string(n_layer) + ", pages " +
                         std::to_string(num_pages) + ")");
  if (num_pages > (int64_t(1) << 31) - 1) return Status::error(owner + ": KV cache page count overflows int32");
  return guard("", [&]() -> Expected<std::unique_ptr<KvCache>> {
    return std::make_unique<KvCache>(owner, n_layer, n_head, head_dim, dtype, num_pages, fp8);
  });
}

KvCache::KvCache(const std::string& owner, int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype,
                 int64_t num_pages, bool fp8)
    : n_layer_(n_layer),
      n_head_(n_head),
      head_dim_(head_dim),
      elem_bytes_(fp8 ? 1 : int64_t(dtype_bytes(dtype))),
      num_pages_(num_pages),
      fp8_(fp8),
      page_stride_bytes_(layer_page_bytes(n_head, head_dim, dtype, fp8)) {
  pool_ = device_alloc(size_t(num_pages * page_bytes(n_layer, n_head, head_dim, dtype, fp8)), owner,
                       std::string(fp8 ? "FP8 " : "") + "KV cache (" + std::to_string(num_pages) + " pages of " +
                           std::to_string(kPageTokens) + " positions)");
  clear();
}

void KvCache::clear() {
  seqs_.clear();
  refs_.assign(size_t(num_pages_), 0);
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
    refs_[size_t(free_.back())] = 1;
    free_.pop_back();
  }
  return ok_status();
}

void KvCache::copy_page(int32_t src, int32_t dst, cudaStream_t stream) {
  kv_copy_page(pool_.get(), num_pages_ * page_stride_bytes_, page_stride_bytes_, n_layer_, src, dst, stream);
}

Status KvCache::fork(uint64_t parent, uint64_t child, int64_t parent_tokens, int64_t num_tokens, cudaStream_t stream) {
  auto it = seqs_.find(parent);
  if (it == seqs_.end())
    return Status::error("fork: sequence " + std::to_string(parent) + " holds no K/V pages (forking into " +
                         std::to_string(child) + ")");
  if (seqs_.count(child)) return Status::error("fork: sequence " + std::to_string(child) + " exists already");
  if (num_tokens < 1 || num_tokens > parent_tokens || num_tokens > int64_t(it->second.size()) * kPageTokens)
    return Status::error("fork: " + std::to_string(num_tokens) + " tokens of sequence " + std::to_string(parent) +
                         ", which has " + std::to_string(parent_tokens) + " cached (1.." +
                         std::to_string(parent_tokens) + " allowed)");
  const int64_t full = num_tokens / kPageTokens;
  const bool partial = num_tokens % kPageTokens != 0;
  if (partial && free_.empty())
    return Status::error("KV cache full: forking sequence " + std::to_string(parent) + " into " +
                         std::to_string(child) + " needs 1 page for its partial last page, 0 of " +
                         std::to_string(num_pages_) + " free");
  const std::vector<int32_t>& from = it->second;  // copied before seqs_ may rehash
  std::vector<int32_t> pages(from.begin(), from.begin() + full);
  for (int32_t p : pages) ++refs_[size_t(p)];
  if (partial) {
    const int32_t copy = free_.back();
    free_.pop_back();
    refs_[size_t(copy)] = 1;
    copy_page(from[size_t(full)], copy, stream);
    pages.push_back(copy);
  }
  seqs_.emplace(child, std::move(pages));
  return ok_status();
}

Status KvCache::prepare_write(uint64_t seq_id, int64_t from_pos, cudaStream_t stream) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return ok_status();
  std::vector<int32_t>& pages = it->second;
  const size_t first = size_t(std::max<int64_t>(0, from_pos) / kPageTokens);
  size_t shared = 0;
  for (size_t i = first; i < pages.size(); ++i) shared += refs_[size_t(pages[i])] > 1;
  if (shared > free_.size())
    return Status::error("KV cache full: sequence " + std::to_string(seq_id) + " needs " + std::to_string(shared) +
                         " pages to copy shared pages before writing, " + std::to_string(free_pages()) + " free");
  for (size_t i = first; i < pages.size(); ++i) {
    if (refs_[size_t(pages[i])] <= 1) continue;
    const int32_t copy = free_.back();
    free_.pop_back();
    refs_[size_t(copy)] = 1;
    copy_page(pages[i], copy, stream);
    --refs_[size_t(pages[i])];
    pages[i] = copy;
  }
  return ok_status();
}

void KvCache::release(uint64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  for (auto p = it->second.rbegin(); p != it->second.rend(); ++p)
    if (--refs_[size_t(*p)] == 0) free_.push_back(*p);
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
  char* base = pool_.as<char>() + layer * num_pages_ * page_stride_bytes_;
  KvLayerView v;
  v.k = base;
  v.v = base + n_head_ * kPageTokens * head_dim_ * elem_bytes_;
  v.page_stride = page_stride_bytes_ / elem_bytes_;  // elements
  v.block_tables = block_tables;
  v.max_pages = max_pages;
  if (fp8_) {
    v.k_scale = reinterpret_cast<float*>(base + 2 * n_head_ * kPageTokens * head_dim_);
    v.v_scale = v.k_scale + n_head_ * kPageTokens;
    v.scale_page_stride = page_stride_bytes_ / int64_t(sizeof(float));
  }
  return v;
}

}  // namespace conveyor::cuda

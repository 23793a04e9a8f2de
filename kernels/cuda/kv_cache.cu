#include "kernels/cuda/kv_cache.h"

#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda {
namespace {

using namespace detail;

// One block per token; threads cover the 2 * n_head * head_dim elements of its K and V.
template <class T, bool VEC>
__global__ void kv_append_kernel(T* __restrict__ kc, T* __restrict__ vc, int64_t page_stride,
                                 const int32_t* __restrict__ tables, int max_pages,
                                 const T* __restrict__ qkv, int64_t qkv_stride,
                                 const int32_t* __restrict__ token_rows, const int32_t* __restrict__ token_pos,
                                 int n_head, int D) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int64_t r = blockIdx.x;
  const int row = token_rows[r], t = token_pos[r];
  if (row < 0 || t < 0) return;  // padding token
  const int C = n_head * D;
  const int64_t page = tables[int64_t(row) * max_pages + t / kPageTokens];
  const int64_t base = page * page_stride + int64_t(t % kPageTokens) * D;  // + h * kPageTokens * D + d
  const T* src = qkv + r * qkv_stride + C;  // k then v
  const int step = VEC ? kVec : 1;
  for (int i = threadIdx.x * step; i < 2 * C; i += blockDim.x * step) {
    const int which = i / C, j = i % C, h = j / D, d = j % D;  // VEC: D % 8 == 0, so 8 never straddle
    T* dst = (which == 0 ? kc : vc) + base + int64_t(h) * kPageTokens * D + d;
    if constexpr (VEC) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src + i);
    } else {
      *dst = src[i];
    }
  }
}

}  // namespace

int64_t KvCache::page_bytes(int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype) {
  return n_layer * 2 * n_head * kPageTokens * head_dim * int64_t(dtype_bytes(dtype));
}

KvCache::KvCache(const std::string& owner, int64_t n_layer, int64_t n_head, int64_t head_dim, DType dtype,
                 int64_t num_pages)
    : n_layer_(n_layer),
      n_head_(n_head),
      head_dim_(head_dim),
      elem_bytes_(int64_t(dtype_bytes(dtype))),
      num_pages_(num_pages) {
  if (n_layer <= 0 || n_head <= 0 || head_dim <= 0 || num_pages <= 0)
    throw Error(owner + ": KV cache needs positive sizes (layers " + std::to_string(n_layer) + ", pages " +
                std::to_string(num_pages) + ")");
  if (num_pages > (int64_t(1) << 31) - 1) throw Error(owner + ": KV cache page count overflows int32");
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

const std::vector<int32_t>& KvCache::pages(uint64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw Error("KV cache: unknown sequence " + std::to_string(seq_id));
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

template <class T>
void kv_cache_append(const KvLayerView& kv, const T* qkv, int64_t qkv_stride, const int32_t* token_rows,
                     const int32_t* token_pos, int64_t num_tokens, int64_t n_head, int64_t head_dim,
                     cudaStream_t stream) {
  if (num_tokens <= 0) return;
  const bool vec = head_dim % kVec == 0 && qkv_stride % kVec == 0 && aligned16(qkv) && aligned16(kv.k) &&
                   aligned16(kv.v);
  const int64_t work = vec ? 2 * n_head * head_dim / kVec : 2 * n_head * head_dim;
  const int threads = int(std::min<int64_t>(256, (work + 31) / 32 * 32));
  T* k = static_cast<T*>(kv.k);
  T* v = static_cast<T*>(kv.v);
  if (vec)
    LAUNCH_PDL("kv_append_kernel", kv_append_kernel<T, true>, dim3(unsigned(num_tokens)), dim3(threads), 0, stream, k, v,
               kv.page_stride, kv.block_tables, kv.max_pages, qkv, qkv_stride, token_rows, token_pos, int(n_head),
               int(head_dim));
  else
    LAUNCH_PDL("kv_append_kernel", kv_append_kernel<T, false>, dim3(unsigned(num_tokens)), dim3(threads), 0, stream, k,
               v, kv.page_stride, kv.block_tables, kv.max_pages, qkv, qkv_stride, token_rows, token_pos, int(n_head),
               int(head_dim));
}

template void kv_cache_append<__half>(const KvLayerView&, const __half*, int64_t, const int32_t*, const int32_t*,
                                      int64_t, int64_t, int64_t, cudaStream_t);
template void kv_cache_append<__nv_bfloat16>(const KvLayerView&, const __nv_bfloat16*, int64_t, const int32_t*,
                                             const int32_t*, int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda

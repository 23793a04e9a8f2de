// Internal: how the attention kernels find position t of (sequence row s, head h). Two
// accessors with one interface, so the CPU-twin ops (contiguous K/V) and the stage (paged
// cache) run the same kernel code.
#pragma once

#include <cstdint>

#include "kernels/cuda/paged_kv.h"

namespace conveyor::cuda::detail {

template <class T>
struct ContiguousKv {  // one sequence: position t at k + t * stride + h * head_dim
  const T* k;
  const T* v;
  int64_t stride;
  int head_dim;
  __device__ __forceinline__ int64_t offset(int /*s*/, int h, int t) const {
    return int64_t(t) * stride + int64_t(h) * head_dim;
  }
  __device__ __forceinline__ const T* key(int s, int h, int t) const { return k + offset(s, h, t); }
  __device__ __forceinline__ const T* value(int s, int h, int t) const { return v + offset(s, h, t); }
};

template <class T>
struct PagedKv {  // see KvLayerView
  T* k;
  T* v;
  int64_t page_stride;
  const int32_t* tables;
  int max_pages;
  int head_dim;
  __device__ __forceinline__ int64_t offset(int s, int h, int t) const {
    const int64_t page = __ldg(tables + int64_t(s) * max_pages + (t / kPageTokens));
    return page * page_stride + (int64_t(h) * kPageTokens + (t % kPageTokens)) * head_dim;
  }
  __device__ __forceinline__ const T* key(int s, int h, int t) const { return k + offset(s, h, t); }
  __device__ __forceinline__ const T* value(int s, int h, int t) const { return v + offset(s, h, t); }
};

template <class T>
inline PagedKv<T> paged(const KvLayerView& view, int head_dim) {
  return PagedKv<T>{static_cast<T*>(view.k), static_cast<T*>(view.v), view.page_stride, view.block_tables,
                    view.max_pages, head_dim};
}

}  // namespace conveyor::cuda::detail

// BufferPool: recycles large receive buffers. A fresh multi-megabyte allocation comes from
// mmap and costs a page fault per 4 KiB page on first touch (in this project's VMs that
// alone caps a 64 MiB receive near 1 GB/s); a pipeline stage receives activations of the
// same few sizes over and over. Buffers the pool hands out are ordinary OwnedBuffers whose
// memory goes back to the pool when their owner frees them (on any thread, even after the
// pool's owner is gone), up to `max_cached_bytes` of idle capacity; beyond that, back to the
// system. Capacities are powers of two, so a buffer serves any size in its class; only the
// pages a message touched are ever resident (heap memory; page-locked memory from a
// HostAllocator is resident whole).
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "common/host_allocator.h"
#include "transport/channel.h"

namespace conveyor::transport {

// Where pooled buffers' memory comes from (common/host_allocator.h): aligned heap memory
// unless set. A GPU stage worker gives page-locked memory, so copies between its GPU and the
// received activations run as DMA.
using conveyor::HostAllocator;

namespace detail {
struct BufferCache {
  BufferCache(std::size_t max_bytes, HostAllocator alloc, std::size_t min_pooled)
      : max_cached_bytes(max_bytes), min_pooled_bytes(min_pooled), allocator(std::move(alloc)) {}
  ~BufferCache();
  void put(std::byte* p, std::size_t capacity);
  std::byte* take(std::size_t capacity);
  std::byte* allocate(std::size_t capacity);  // fresh memory; null when short
  void release(std::byte* p);                 // back to where it came from

  const std::size_t max_cached_bytes;
  const std::size_t min_pooled_bytes;
  const HostAllocator allocator;
  std::mutex mu;
  std::size_t cached_bytes = 0;                 // guarded by mu
  std::multimap<std::size_t, std::byte*> idle;  // capacity -> buffer; guarded by mu
};
}  // namespace detail

class BufferPool {
 public:
  static constexpr std::size_t kMinPooledBytes = 256 * 1024;  // smaller: plain allocation

  // `min_pooled_bytes`: smaller buffers come from the heap, not the pool. A pool of device
  // memory (the direct path's receive buffers) gives 0: every buffer from its allocator.
  explicit BufferPool(std::size_t max_cached_bytes, HostAllocator allocator = {},
                      std::size_t min_pooled_bytes = kMinPooledBytes)
      : cache_(std::make_shared<detail::BufferCache>(max_cached_bytes, std::move(allocator), min_pooled_bytes)) {}

  // Uninitialised storage of `bytes` bytes; throws std::bad_alloc when memory is short.
  OwnedBuffer allocate(std::size_t bytes);
  std::size_t cached_bytes() const;

 private:
  std::shared_ptr<detail::BufferCache> cache_;
};

}  // namespace conveyor::transport

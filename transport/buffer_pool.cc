#include "transport/buffer_pool.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <new>

namespace conveyor::transport {

namespace detail {

BufferCache::~BufferCache() {
  for (auto& [capacity, p] : idle) release(p);
}

std::byte* BufferCache::allocate(std::size_t capacity) {
  if (allocator.allocate) return static_cast<std::byte*>(allocator.allocate(capacity));
  return static_cast<std::byte*>(std::aligned_alloc(OwnedBuffer::kAlignment, capacity));
}

void BufferCache::release(std::byte* p) {
  if (allocator.release) allocator.release(p);
  else std::free(p);
}

void BufferCache::put(std::byte* p, std::size_t capacity) {
  {
    std::lock_guard lock(mu);
    if (cached_bytes + capacity <= max_cached_bytes) {
      cached_bytes += capacity;
      idle.emplace(capacity, p);
      return;
    }
  }
  release(p);
}

std::byte* BufferCache::take(std::size_t capacity) {
  std::lock_guard lock(mu);
  auto it = idle.find(capacity);
  if (it == idle.end()) return nullptr;
  std::byte* p = it->second;
  cached_bytes -= capacity;
  idle.erase(it);
  return p;
}

}  // namespace detail

OwnedBuffer BufferPool::allocate(std::size_t bytes) {
  if (bytes < cache_->min_pooled_bytes || (cache_->max_cached_bytes == 0 && !cache_->allocator.allocate))
    return OwnedBuffer::allocate(bytes);
  const std::size_t capacity = std::bit_ceil(std::max<std::size_t>(bytes, OwnedBuffer::kAlignment));
  std::byte* p = cache_->take(capacity);
  if (!p) p = cache_->allocate(capacity);
  if (!p) throw std::bad_alloc();
  OwnedBuffer b;
  b.data_ =
      std::unique_ptr<std::byte, OwnedBuffer::Release>(p, OwnedBuffer::Release{cache_, capacity});
  b.size_ = bytes;
  return b;
}

std::size_t BufferPool::cached_bytes() const {
  std::lock_guard lock(cache_->mu);
  return cache_->cached_bytes;
}

}  // namespace conveyor::transport

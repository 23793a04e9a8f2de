// Host memory from someone other than the heap: a GPU stage hands the data plane page-locked
// memory (cudaHostAlloc) for its receive buffers, so copies to its GPU run as DMA. Empty
// functions mean the heap.
#pragma once

#include <cstddef>
#include <functional>

namespace conveyor {

struct HostAllocator {
  std::function<void*(std::size_t)> allocate;  // null when the memory cannot be had
  std::function<void(void*)> release;
};

}  // namespace conveyor

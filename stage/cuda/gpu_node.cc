#include "stage/cuda/gpu_node.h"

#include <cuda_runtime.h>

#include <spdlog/spdlog.h>

#include "kernels/cuda/check.h"

namespace conveyor::cuda {

int usable_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error here, the CPU serves
    return 0;
  }
  return count;
}

int64_t total_memory_bytes(const std::vector<int>& gpus) {
  int64_t total = 0;
  for (int gpu : gpus) {
    size_t free_bytes = 0, total_bytes = 0;
    int previous = 0;
    cudaError_t e = cudaGetDevice(&previous);
    if (e == cudaSuccess) e = cudaSetDevice(gpu);
    if (e == cudaSuccess) e = cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaSetDevice(previous);
    if (e != cudaSuccess) {
      spdlog::warn("cannot read the memory of GPU {}: {}", gpu, cudaGetErrorString(e));
      cudaGetLastError();
      return 0;
    }
    total += int64_t(total_bytes);
  }
  return total;
}

HostAllocator pinned_host_allocator(int device) {
  return {[device](size_t n) -> void* { return cudaSetDevice(device) == cudaSuccess ? pinned_alloc(n) : nullptr; },
          [](void* p) { pinned_free(p); }};
}

void use_pdl(bool on) { set_pdl(on); }

}  // namespace conveyor::cuda

// What the GPU benchmarks measure their floors against.
#pragma once

#include <algorithm>

#include <cuda_runtime.h>

#include "kernels/cuda/check.h"

inline // Device-to-device copy bandwidth, bytes read + written per second: the best of 5 timings of
// 10 copies of 1 GiB (far above L2).
double measure_copy_bandwidth() {
  const size_t bytes = size_t(1) << 30;
  conveyor::cuda::DeviceBuffer a = conveyor::cuda::device_alloc(bytes, "bench", "bandwidth source");
  conveyor::cuda::DeviceBuffer b = conveyor::cuda::device_alloc(bytes, "bench", "bandwidth destination");
  CUDA_CHECK(cudaMemset(a.get(), 1, bytes));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));  // warm-up
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    CUDA_CHECK(cudaEventRecord(e0));
    for (int i = 0; i < 10; ++i) CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::max(best, 2.0 * double(bytes) * 10 / (double(ms) * 1e-3));
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return best;
}

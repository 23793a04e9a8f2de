// The GPU benchmarks' timing of kernels as a decode step runs them: inside a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "kernels/cuda/check.h"

struct GraphTimer {
  cudaStream_t stream;
  // Median µs of one launch: `launch(l)` for l in [0, n) captured in one graph, replayed.
  double time(int n, const std::function<void(int)>& launch) {
    for (int l = 0; l < n; ++l) launch(l);  // plans GEMMs outside capture, warms up
    CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t g = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < n; ++l) launch(l);
    CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    std::vector<double> us;
    for (int rep = 0; rep < 30; ++rep) {
      CUDA_CHECK(cudaEventRecord(a, stream));
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaEventRecord(b, stream));
      CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      us.push_back(double(ms) * 1e3 / n);
    }
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(g));
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }
};

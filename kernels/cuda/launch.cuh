// Internal: kernel launches with Programmatic Dependent Launch (PDL, sm_90).
//
// A kernel launched through launch() may start while the kernel before it in the stream is
// still running (cudaLaunchAttributeProgrammaticStreamSerialization; CUDA graphs capture it
// as a programmatic edge). The contract that keeps this correct, for every kernel launched
// here:
//   1. grid_dependents_launch() early: the next kernel may then be scheduled (its blocks
//      wait on their own step 2), which hides launch latency between dependent kernels;
//   2. before its first access to memory that an earlier kernel in the stream writes or
//      reads, grid_dependency_wait(): it returns once every earlier grid has completed and
//      its writes are visible. Before it, a kernel may only read immutable data (weights:
//      the GEMV starts streaming its rows there, overlapping the previous kernel).
// Kernels launched with <<<>>> (no attribute) are serialised as usual, so mixing is safe;
// cuBLAS kernels never trigger early, so the kernel after one starts when it ends.
// set_pdl(false) (check.h; CONVEYOR_PDL=0 for a daemon) launches everything without the attribute.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/check.h"

namespace conveyor::cuda::detail {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Checked launch: a failure names `what` and the caller's file:line (LAUNCH_PDL below).
template <class... KArgs, class... Args>
void launch_pdl(const char* what, const char* file, int line, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  check_result(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what, file, line);
}

// A value per kernel and device, made once (make() on the device current at the call): what a
// kernel sets up or asks belongs to the device's context, and several ranks of one process
// drive several devices. No lock is held across make(): ranks are threads whose kernels wait
// for each other (the custom all-reduce), and a rank blocked on a lock here while another sat
// in a CUDA call that waited on its device could never arrive. Two threads may both make it:
// harmless, the first stored wins.
class PerKernelDevice {
 public:
  template <class Make>
  int get(const void* kernel, Make&& make) {
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    const std::pair<const void*, int> key{kernel, dev};
    {
      std::lock_guard lk(mu_);
      if (auto it = known_.find(key); it != known_.end()) return it->second;
    }
    const int value = make();
    std::lock_guard lk(mu_);
    return known_.emplace(key, value).first->second;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<const void*, int>, int> known_;
};

// Raises a kernel's dynamic shared memory limit, once per kernel and device (PerKernelDevice).
// `max_carveout`: the SM's L1/shared split set to the most shared memory too (cuBLASLt-like
// tiles that want several blocks an SM).
template <class... A>
void allow_smem(void (*kernel)(A...), size_t bytes, bool max_carveout = false) {
  static PerKernelDevice done;
  done.get(reinterpret_cast<const void*>(kernel), [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    if (max_carveout)
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      int(cudaSharedmemCarveoutMaxShared)));
    return 1;
  });
}

// The blocks of `kernel` (`threads` a block, `smem` bytes of dynamic shared memory, its
// limit raised first where over 48 KB: allow_smem) an SM of the current device holds at once,
// at least 1; asked once per kernel and device (PerKernelDevice). A kernel is asked about one
// block shape.
template <class... A>
int blocks_per_sm(void (*kernel)(A...), int threads, size_t smem) {
  static PerKernelDevice known;
  return known.get(reinterpret_cast<const void*>(kernel), [&] {
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    return n > 0 ? n : 1;
  });
}

}  // namespace conveyor::cuda::detail

// LAUNCH_PDL("name", kernel, grid, block, smem, stream, args...)
#define LAUNCH_PDL(what, ...) ::conveyor::cuda::detail::launch_pdl(what, __FILE__, __LINE__, __VA_ARGS__)

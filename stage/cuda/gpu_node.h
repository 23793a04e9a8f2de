// What this node's GPUs offer a stage: how many there are, how much memory a stage's GPUs
// hold, and page-locked host memory for the activations that arrive for one of them.
#pragma once

#include <cstdint>
#include <vector>

#include "common/host_allocator.h"

namespace conveyor::cuda {

// CUDA devices the driver finds (0, not an error, without a driver or device).
int usable_gpus();

// The total memory of `gpus` (a tensor-parallel stage spreads its weights over all of them);
// 0 when one cannot be read (logged).
int64_t total_memory_bytes(const std::vector<int>& gpus);

// Page-locked host memory (cudaHostAlloc). It is allocated on whichever thread asks (the data
// plane's progress thread, which does no other CUDA work): `device` is made current there
// first, so no context is made on GPU 0 for a stage on another GPU.
HostAllocator pinned_host_allocator(int device);

// Programmatic Dependent Launch for the kernels that support it (KernelOptions::pdl), set once
// at start-up.
void use_pdl(bool on);

}  // namespace conveyor::cuda

// Synthetic weights generated on the GPU (benchmarks of any GPT shape without a checkpoint):
// each element is a pure function of (seed, tensor id, index) through Philox4x32-10, so a
// tensor's values do not depend on the order or the device it is generated on.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace conveyor::cuda {

// p[i] = mean + stddev * N(0, 1) (Box-Muller over one Philox draw per element).
template <class T>
void fill_normal(T* p, int64_t n, float mean, float stddev, uint64_t seed, uint64_t tensor_id,
                 cudaStream_t stream);

// p[i] = value.
template <class T>
void fill_constant(T* p, int64_t n, float value, cudaStream_t stream);

// p[i] = uniform integer in [0, bound): random token ids for tests and benchmarks.
void fill_uniform_ids(int32_t* p, int64_t n, int32_t bound, uint64_t seed, cudaStream_t stream);

}  // namespace conveyor::cuda

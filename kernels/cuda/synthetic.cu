#include "kernels/cuda/synthetic.h"

#include <algorithm>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "common/philox.h"

namespace conveyor::cuda {
namespace {

using namespace detail;

int blocks_for(int64_t n) { return int(std::clamp<int64_t>((n + 255) / 256, 1, 4096)); }

template <class T>
__global__ void fill_normal_kernel(T* p, int64_t n, float mean, float stddev, uint64_t seed, uint64_t tensor_id) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const Philox4x32 r = philox_draw(seed, tensor_id, uint64_t(i));
    const float u1 = (float(r.v[0] >> 8) + 1.f) * (1.f / 16777216.f);  // (0, 1]
    const float u2 = float(r.v[1] >> 8) * (1.f / 16777216.f);          // [0, 1)
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    p[i] = from_float<T>(mean + stddev * z);
  }
}

template <class T>
__global__ void fill_constant_kernel(T* p, int64_t n, float value) {
  const T v = from_float<T>(value);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

__global__ void fill_ids_kernel(int32_t* p, int64_t n, int32_t bound, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const Philox4x32 r = philox_draw(seed, 0x1d5ull, uint64_t(i));
    p[i] = int32_t(((uint64_t(r.v[0]) << 32 | r.v[1]) % uint64_t(bound)));
  }
}

}  // namespace

template <class T>
void fill_normal(T* p, int64_t n, float mean, float stddev, uint64_t seed, uint64_t tensor_id, cudaStream_t stream) {
  if (n <= 0) return;
  fill_normal_kernel<T><<<blocks_for(n), 256, 0, stream>>>(p, n, mean, stddev, seed, tensor_id);
  CUDA_CHECK(cudaGetLastError());
}

template <class T>
void fill_constant(T* p, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return;
  fill_constant_kernel<T><<<blocks_for(n), 256, 0, stream>>>(p, n, value);
  CUDA_CHECK(cudaGetLastError());
}

void fill_uniform_ids(int32_t* p, int64_t n, int32_t bound, uint64_t seed, cudaStream_t stream) {
  if (n <= 0 || bound <= 0) return;
  fill_ids_kernel<<<blocks_for(n), 256, 0, stream>>>(p, n, bound, seed);
  CUDA_CHECK(cudaGetLastError());
}

template void fill_normal<__half>(__half*, int64_t, float, float, uint64_t, uint64_t, cudaStream_t);
template void fill_normal<__nv_bfloat16>(__nv_bfloat16*, int64_t, float, float, uint64_t, uint64_t, cudaStream_t);
template void fill_normal<float>(float*, int64_t, float, float, uint64_t, uint64_t, cudaStream_t);
template void fill_constant<__half>(__half*, int64_t, float, cudaStream_t);
template void fill_constant<__nv_bfloat16>(__nv_bfloat16*, int64_t, float, cudaStream_t);
template void fill_constant<float>(float*, int64_t, float, cudaStream_t);

}  // namespace conveyor::cuda

// Helpers shared by the CUDA op test programs (test_cuda_ops*.cc), which check every CUDA op
// (kernels/cuda) against its CPU reference (kernels/cpu, fp32) on fresh random inputs of odd
// sizes, in fp16 and bf16: device arrays that round through the element type and are
// poisoned (NaN) when made, the relative error and its bound per dtype, a seeded Rng whose
// seed goes into failure messages, and the typed fixture (skips where no GPU is present).
// Include only where CONVEYOR_HAVE_CUDA is defined.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu_test_util.h"

namespace conveyor::cuda_ops_test {

using cuda::bf16;
using cuda::half;

using testing::have_gpu;

// ---- host <-> device in a given element type ----

using testing::from_bits;
using testing::to_bits;

template <class T>
float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  else return from_bits<T>(to_bits<T>(f));
}

template <class T>
void round_all(std::vector<float>& v) {
  for (float& x : v) x = round_to<T>(x);
}

// A device array of T (half, bf16, float or int32_t) with float/int transfers.
template <class T>
struct Dev {
  cuda::DeviceBuffer buf;
  int64_t n = 0;
  explicit Dev(int64_t count) : buf(cuda::device_alloc(static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T), "test", "buffer")), n(count) {
    poison();
  }
  Dev(const std::vector<float>& v) : Dev(int64_t(v.size())) { put(v); }  // NOLINT
  T* p() const { return buf.as<T>(); }
  void poison() { CUDA_CHECK(cudaMemset(buf.get(), 0xff, buf.bytes())); }  // NaN in every float type
  void put(const std::vector<float>& v) {
    if constexpr (std::is_same_v<T, float>) {
      CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
    } else {
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i) b[i] = to_bits<T>(v[i]);
      CUDA_CHECK(cudaMemcpy(buf.get(), b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    }
  }
  std::vector<float> get() const {
    std::vector<float> v(static_cast<size_t>(n));
    if constexpr (std::is_same_v<T, float>) {
      CUDA_CHECK(cudaMemcpy(v.data(), buf.get(), v.size() * sizeof(float), cudaMemcpyDeviceToHost));
    } else {
      std::vector<uint16_t> b(v.size());
      CUDA_CHECK(cudaMemcpy(b.data(), buf.get(), b.size() * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < v.size(); ++i) v[i] = from_bits<T>(b[i]);
    }
    return v;
  }
};

struct DevInts {
  cuda::DeviceBuffer buf;
  explicit DevInts(const std::vector<int32_t>& v)
      : buf(cuda::device_alloc(std::max<size_t>(v.size(), 1) * 4, "test", "ints")) {
    CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  }
  int32_t* p() const { return buf.as<int32_t>(); }
};

// ||a - ref|| / ||ref||; infinity when a holds NaN/inf or sizes differ.
inline double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

template <class T>
double tol(double fp16, double bf16_) {
  return std::is_same_v<T, half> ? fp16 : bf16_;
}

// Fresh randomness per test; the seed goes into the failure message.
struct Rng {
  uint32_t seed;
  std::mt19937 gen;
  Rng() : seed(std::random_device{}()), gen(seed) {}
  std::vector<float> normal(size_t n, float stddev = 1.f, float mean = 0.f) {
    std::normal_distribution<float> d(mean, stddev);
    std::vector<float> v(n);
    for (auto& x : v) x = d(gen);
    return v;
  }
  int pick(std::initializer_list<int> xs) {
    std::vector<int> v(xs);
    return v[gen() % v.size()];
  }
  int uniform(int lo, int hi) { return lo + int(gen() % uint32_t(hi - lo + 1)); }  // [lo, hi]
};
#define SEED_TRACE(rng) SCOPED_TRACE("seed " + std::to_string((rng).seed))

inline cudaStream_t s0 = nullptr;  // the default stream

template <class T>
class CudaOps : public testing::GpuTypedTest<T> {};
using ElemTypes = ::testing::Types<half, bf16>;

}  // namespace conveyor::cuda_ops_test

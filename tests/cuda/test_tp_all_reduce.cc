// TpAllReduce on every GPU of the machine (2 or more), one thread per GPU as a tensor-
// parallel stage drives it: exact integer sums below the NCCL crossover (the custom
// kernel), at it, and above it (NCCL), in one sequence of calls. Skips cleanly without
// CUDA or with fewer than two GPUs.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA
TEST(TpAllReduce, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#else

#include <thread>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/tp_all_reduce.h"

namespace conveyor::cuda {
namespace {

TEST(TpAllReduce, BothSidesOfTheCrossoverFromOneThreadPerGpu) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs two GPUs or more; this machine has " << n;
  std::vector<int> devices;
  for (int d = 0; d < n && d < 8; ++d) devices.push_back(d);
  auto tp = TpAllReduce::create(devices);
  ASSERT_TRUE(tp.ok()) << tp.error();
  const size_t crossover = CustomAllReduce::kNcclCrossoverBytes / 2;  // halves
  const std::vector<size_t> sizes = {1, 1000, crossover, crossover + 1, 3 * crossover + 7};
  std::vector<std::string> errors(devices.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < devices.size(); ++r)
    threads.emplace_back([&, r] {
      DeviceGuard on(devices[r]);
      DeviceBuffer buf = device_alloc(sizes.back() * sizeof(__half), "test", "data");
      cudaStream_t stream = nullptr;
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      for (size_t n : sizes) {
        std::vector<__half> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = __float2half(float(int((i * 7 + r * 13) % 61) - 30));
        CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), n * sizeof(__half), cudaMemcpyHostToDevice));
        if (Status s = (*tp)->all_reduce(int(r), buf.as<__half>(), n, stream); !s) {
          errors[r] = s.message();
          break;
        }
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaMemcpy(v.data(), buf.get(), n * sizeof(__half), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n && errors[r].empty(); ++i) {
          float want = 0;
          for (size_t p = 0; p < devices.size(); ++p) want += float(int((i * 7 + p * 13) % 61) - 30);
          if (__half2float(v[i]) != want)
            errors[r] = "n " + std::to_string(n) + " element " + std::to_string(i) + ": " +
                        std::to_string(__half2float(v[i])) + " want " + std::to_string(want);
        }
      }
      cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

}  // namespace
}  // namespace conveyor::cuda
#endif

// TpAllReduce on every GPU of the machine (2 or more), one thread per GPU as a tensor-
// parallel stage drives it: exact integer sums below the NCCL crossover (the custom
// kernel), at it, and above it (NCCL), in one sequence of calls. And ranks sharing one GPU
// (how a one-GPU machine tests a tensor-parallel stage): exact fp16 and bf16 sums at every
// size, eagerly and replayed from CUDA graphs. Skips cleanly without CUDA or GPUs.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA
TEST(TpAllReduce, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#else

#include <cmath>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>

#include "kernels/cuda/check.h"
#include "stage/cuda/tp_all_reduce.h"
#include "tests/test_util.h"

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

// Above the crossover two GPUs hand the message to NCCL: its sums must be the custom
// kernel's bits (fp32 sum in rank order, rounded once), on random values, or a row's sum
// would change with the size of the message around it.
TEST(TpAllReduce, TwoGpusSumTheSameBitsOnBothSidesOfTheCrossover) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs two GPUs or more; this machine has " << n;
  const std::vector<int> devices = {0, 1};
  auto tp = TpAllReduce::create(devices);
  ASSERT_TRUE(tp.ok()) << tp.error();
  ASSERT_TRUE((*tp)->uses_nccl());
  const size_t crossover = CustomAllReduce::kNcclCrossoverBytes / 2;  // halves
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  auto input = [](size_t i, size_t r) {
    const uint32_t h = uint32_t(i * 2654435761u) ^ uint32_t(r * 40503u);
    return __float2half(std::ldexp(float(h % 20011) - 10005.0f, -int(h % 13)));  // mixed magnitudes
  };
  for (size_t r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      DeviceGuard on(devices[r]);
      cudaStream_t stream = nullptr;
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      for (size_t count : {crossover, crossover + 1}) {
        DeviceBuffer buf = device_alloc(count * sizeof(__half), "test", "data");
        std::vector<__half> v(count);
        for (size_t i = 0; i < count; ++i) v[i] = input(i, r);
        CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), count * sizeof(__half), cudaMemcpyHostToDevice));
        if (Status s = (*tp)->all_reduce(int(r), buf.as<__half>(), count, stream); !s) {
          errors[r] = s.message();
          break;
        }
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaMemcpy(v.data(), buf.get(), count * sizeof(__half), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < count && errors[r].empty(); ++i) {
          const __half want = __float2half(__half2float(input(i, 0)) + __half2float(input(i, 1)));
          if (__half_as_ushort(v[i]) != __half_as_ushort(want))
            errors[r] = "count " + std::to_string(count) + " element " + std::to_string(i) + ": " +
                        std::to_string(__half2float(v[i])) + " want " + std::to_string(__half2float(want));
        }
      }
      cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

// Integer values small enough that every partial sum is exact in fp16 and bf16.
float value(size_t i, size_t rank) { return float(int((i * 7 + rank * 13) % 31) - 15); }

template <class T>
void sharing_one_gpu(int ranks) {
  std::vector<int> devices(size_t(ranks), 0);
  const std::vector<size_t> sizes = {1, 7, 8, 1000, 4099, 65536 + 3, (size_t(1) << 20) + 5};
  const size_t max_bytes = sizes.back() * sizeof(T);
  auto tp = TpAllReduce::create(devices, max_bytes);
  ASSERT_TRUE(tp.ok()) << tp.error();
  EXPECT_FALSE((*tp)->uses_nccl());
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        DeviceGuard on(0);
        DeviceBuffer buf = device_alloc(max_bytes, "test", "data");
        cudaStream_t stream = nullptr;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        auto fill = [&](size_t n) {
          std::vector<T> v(n);
          for (size_t i = 0; i < n; ++i) v[i] = T(value(i, size_t(r)));
          CUDA_CHECK(cudaMemcpyAsync(buf.get(), v.data(), n * sizeof(T), cudaMemcpyHostToDevice, stream));
          CUDA_CHECK(cudaStreamSynchronize(stream));
        };
        auto check = [&](size_t n, const char* how) {
          std::vector<T> v(n);
          CUDA_CHECK(cudaStreamSynchronize(stream));
          CUDA_CHECK(cudaMemcpy(v.data(), buf.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < n && errors[size_t(r)].empty(); ++i) {
            float want = 0;
            for (int p = 0; p < ranks; ++p) want += value(i, size_t(p));
            if (float(v[i]) != want)
              errors[size_t(r)] = std::string(how) + " n " + std::to_string(n) + " element " + std::to_string(i) + ": " +
                                  std::to_string(float(v[i])) + " want " + std::to_string(want);
          }
        };
        for (size_t n : sizes) {
          fill(n);
          if (Status s = (*tp)->all_reduce(r, buf.as<T>(), n, stream); !s) throw Error(s.message());
          check(n, "eager");
        }
        // The same call captured once and replayed twice (the call counter lives on the GPU).
        const size_t n = 4099;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        const Status captured = (*tp)->all_reduce(r, buf.as<T>(), n, stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        if (!captured) throw Error(captured.message());
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < 2; ++replay) {
          fill(n);
          CUDA_CHECK(cudaGraphLaunch(exec, stream));
          check(n, "graph");
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
}

TEST(TpAllReduce, RanksSharingOneGpuSumExactlyEagerAndInGraphs) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) GTEST_SKIP() << "no CUDA device on this host";
  if (!testing::gpu_sharing_ranks_allowed()) GTEST_SKIP() << "ranks sharing a GPU need CUDA_DEVICE_MAX_CONNECTIONS >= 16";
  for (int ranks : {2, 3}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    sharing_one_gpu<__half>(ranks);
    sharing_one_gpu<__nv_bfloat16>(ranks);
  }
}

}  // namespace
}  // namespace conveyor::cuda
#endif

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

// The fused decode step: hidden = T(hidden + T(sum of the ranks' partials) + bias), exact
// against the host's same roundings, and ln_out = LayerNorm(hidden) within a rounding; on
// every row count up to the buffers', eagerly and replayed from a CUDA graph (the call
// counter lives on the GPU), with and without the LayerNorm.
// The custom kernel directly: ranks may share a GPU here (TpAllReduce gives such groups no
// fused call; the kernel itself works wherever the ranks' kernels run side by side).
template <class T>
void fused_step(const std::vector<int>& devices) {
  const int ranks = int(devices.size());
  const int64_t width = 96, max_rows = 12;
  auto tp = CustomAllReduce::create(devices, size_t(max_rows * width) * sizeof(T), max_rows * width);
  ASSERT_TRUE(tp.ok()) << tp.error();
  ASSERT_EQ((*tp)->fused_max_elems(), max_rows * width);
  auto partial_value = [](int64_t i, int r) { return float(int((i * 5 + r * 11) % 17) - 8) * 0.25f; };
  auto hidden_value = [](int64_t i) { return float(int((i * 3) % 23) - 11) * 0.125f; };
  auto bias_value = [](int64_t c) { return float(int(c % 7) - 3) * 0.0625f; };
  auto gamma_value = [](int64_t c) { return 1.f + float(c % 5) * 0.125f; };
  auto beta_value = [](int64_t c) { return float(int(c % 3) - 1) * 0.25f; };
  std::vector<std::string> errors(devices.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        DeviceGuard on(devices[size_t(r)]);
        const size_t n = size_t(max_rows * width);
        DeviceBuffer part = device_alloc(n * sizeof(T), "test", "partial"), hid = device_alloc(n * sizeof(T), "test", "hidden"),
                     ln = device_alloc(n * sizeof(T), "test", "ln"), params = device_alloc(3 * size_t(width) * sizeof(T), "test", "params");
        cudaStream_t stream = nullptr;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        std::vector<T> host(n), p3(3 * size_t(width));
        for (int64_t c = 0; c < width; ++c)
          p3[size_t(c)] = T(bias_value(c)), p3[size_t(width + c)] = T(gamma_value(c)), p3[size_t(2 * width + c)] = T(beta_value(c));
        CUDA_CHECK(cudaMemcpy(params.get(), p3.data(), p3.size() * sizeof(T), cudaMemcpyHostToDevice));
        const T* bias = params.as<T>();
        const T* gamma = bias + width;
        const T* beta = gamma + width;
        auto fill = [&]() {
          for (size_t i = 0; i < n; ++i) host[i] = T(partial_value(int64_t(i), r));
          CUDA_CHECK(cudaMemcpy(part.get(), host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
          for (size_t i = 0; i < n; ++i) host[i] = T(hidden_value(int64_t(i)));
          CUDA_CHECK(cudaMemcpy(hid.get(), host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
        };
        auto check = [&](int64_t rows, bool with_ln, const std::string& how) {
          CUDA_CHECK(cudaStreamSynchronize(stream));
          std::vector<T> h(n), l(n);
          CUDA_CHECK(cudaMemcpy(h.data(), hid.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
          CUDA_CHECK(cudaMemcpy(l.data(), ln.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
          const float tol = std::is_same_v<T, __half> ? 0.01f : 0.05f;
          for (int64_t row = 0; row < rows && errors[size_t(r)].empty(); ++row) {
            std::vector<float> want(static_cast<size_t>(width));
            double mean = 0, var = 0;
            for (int64_t c = 0; c < width; ++c) {
              const int64_t i = row * width + c;
              float sum = 0;
              for (int q = 0; q < ranks; ++q) sum += partial_value(i, q);
              want[size_t(c)] = float(T(float(T(hidden_value(i))) + float(T(sum)) + float(T(bias_value(c)))));
              mean += want[size_t(c)];
              if (float(h[size_t(i)]) != want[size_t(c)])
                errors[size_t(r)] = how + " row " + std::to_string(row) + " col " + std::to_string(c) + ": hidden " +
                                    std::to_string(float(h[size_t(i)])) + " want " + std::to_string(want[size_t(c)]);
            }
            mean /= double(width);
            for (float v : want) var += (v - mean) * (v - mean);
            const double rstd = 1.0 / std::sqrt(var / double(width) + 1e-5);
            for (int64_t c = 0; c < width && with_ln && errors[size_t(r)].empty(); ++c) {
              const double ref = (want[size_t(c)] - mean) * rstd * float(T(gamma_value(c))) + float(T(beta_value(c)));
              if (std::abs(float(l[size_t(row * width + c)]) - ref) > tol * (1 + std::abs(ref)))
                errors[size_t(r)] = how + " row " + std::to_string(row) + " col " + std::to_string(c) + ": ln " +
                                    std::to_string(float(l[size_t(row * width + c)])) + " want " + std::to_string(ref);
            }
          }
        };
        for (int64_t rows = 1; rows <= max_rows && errors[size_t(r)].empty(); rows += 3) {
          for (bool with_ln : {true, false}) {
            fill();
            const Status st = (*tp)->all_reduce_residual_layernorm<T>(r, part.as<T>(), hid.as<T>(), bias, with_ln ? gamma : nullptr,
                                                                     with_ln ? beta : nullptr, with_ln ? ln.as<T>() : nullptr,
                                                                     rows, width, 1e-5f, stream);
            if (!st) throw Error(st.message());
            check(rows, with_ln, "eager rows " + std::to_string(rows));
          }
        }
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        const Status captured = (*tp)->all_reduce_residual_layernorm<T>(r, part.as<T>(), hid.as<T>(), bias, gamma, beta,
                                                                        ln.as<T>(), max_rows, width, 1e-5f, stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        if (!captured) throw Error(captured.message());
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < 3 && errors[size_t(r)].empty(); ++replay) {
          fill();
          CUDA_CHECK(cudaGraphLaunch(exec, stream));
          check(max_rows, true, "graph replay " + std::to_string(replay));
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        // Too many rows for the buffers: an error, nothing launched (on every rank alike).
        if ((*tp)->all_reduce_residual_layernorm<T>(r, part.as<T>(), hid.as<T>(), bias, nullptr, nullptr, nullptr,
                                                    max_rows + 1, width, 1e-5f, stream))
          throw Error("a fused step larger than the buffers was accepted");
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
}

TEST(TpAllReduce, FusedDecodeStepSumsAddsAndNormalises) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) GTEST_SKIP() << "no CUDA device on this host";
  for (int ranks : {2, 3}) {
    if (n < ranks && !testing::gpu_sharing_ranks_allowed()) continue;
    std::vector<int> devices;
    for (int r = 0; r < ranks; ++r) devices.push_back(n >= ranks ? r : 0);
    SCOPED_TRACE("ranks " + std::to_string(ranks) + (n >= ranks ? " on their own GPUs" : " sharing GPU 0"));
    fused_step<__half>(devices);
    fused_step<__nv_bfloat16>(devices);
  }
  auto shared = TpAllReduce::create({0, 0}, 4096, 1024);  // ranks sharing a GPU: no fused call
  ASSERT_TRUE(shared.ok()) << shared.error();
  EXPECT_EQ((*shared)->fused_max_elems(), 0);
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

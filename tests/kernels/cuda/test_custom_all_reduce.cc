// The custom all-reduce (kernels/cuda/custom_all_reduce.h) on every GPU of the machine (2
// or more): exact for integers, within one fp16 rounding of the exact sum for random data,
// for sizes from 1 element to 64 MiB including odd ones and unaligned pointers, in both
// algorithms, over repeated calls, and replayed from a CUDA graph with new data each time.
// Skips cleanly without CUDA or with fewer than two GPUs.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA
TEST(CustomAllReduce, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#else

#include <cmath>
#include <tuple>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/custom_all_reduce.h"
#include "tests/gpu_test_util.h"

namespace conveyor::cuda {
namespace {

using Algo = CustomAllReduce::Algo;
constexpr size_t kMaxBytes = size_t(64) << 20;

using testing::gpu_count;

// Per rank: its device buffer (with `offset` halves of slack in front, for unaligned
// pointers) and stream.
struct Rank {
  int device = 0;
  DeviceBuffer mem;
  cudaStream_t stream = nullptr;
  __half* data = nullptr;
};

class CustomAllReduceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int n = gpu_count();
    if (n < 2) GTEST_SKIP() << "needs two GPUs or more; this machine has " << n;
    std::vector<int> devices;
    for (int d = 0; d < n && d < 8; ++d) devices.push_back(d);
    auto ar = CustomAllReduce::create(devices, kMaxBytes);
    ASSERT_TRUE(ar.ok()) << ar.error();
    ar_ = std::move(ar).value();
    for (int d : devices) {
      DeviceGuard on(d);
      Rank r;
      r.device = d;
      r.mem = device_alloc(kMaxBytes + 64, "test", "all-reduce data");
      CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
      ranks_.push_back(std::move(r));
    }
  }
  void TearDown() override {
    for (Rank& r : ranks_) {
      DeviceGuard on(r.device);
      if (r.stream) cudaStreamDestroy(r.stream);
      r.mem.reset();
    }
  }

  // Rank r's input: integers in [-64, 64) (exact in fp16, and so are their sums) or halves of
  // mean 0 and variance 1 (the sum of four uniforms), from `seed`. A counter hash (splitmix64),
  // not std::mt19937 and std::normal_distribution: the largest sizes are 32 Mi elements a
  // rank, and generating them was most of this suite's two minutes on two GPUs.
  static std::vector<__half> input(size_t n, int rank, uint32_t seed, bool integers) {
    uint64_t x = (uint64_t(seed) << 32) ^ (uint64_t(rank) * 0x9E3779B97F4A7C15ull);
    std::vector<__half> v(n);
    for (size_t i = 0; i < n; ++i) {
      x += 0x9E3779B97F4A7C15ull;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      float f = 0.f;
      if (integers) {
        f = float(int(z % 128) - 64);
      } else {
        for (int k = 0; k < 4; ++k) f += (float((z >> (16 * k)) & 0xffff) * (1.f / 65536.f) - 0.5f) * 1.7320508f;
      }
      v[i] = __float2half(f);
    }
    return v;
  }

  // The ranks' inputs to the next call, kept for check() (which needs the same values).
  void upload(size_t n, size_t offset, uint32_t seed, bool integers) {
    uploaded_ = {n, seed, integers};
    inputs_.resize(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      DeviceGuard on(ranks_[r].device);
      ranks_[r].data = ranks_[r].mem.as<__half>() + offset;
      inputs_[r] = input(n, int(r), seed, integers);
      CUDA_CHECK(cudaMemcpy(ranks_[r].data, inputs_[r].data(), n * sizeof(__half), cudaMemcpyHostToDevice));
    }
  }

  void run(size_t n, Algo algo) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Status s = ar_->all_reduce(int(r), ranks_[r].data, n, ranks_[r].stream, algo);
      ASSERT_TRUE(s.ok()) << s.message();
    }
    sync();
  }
  void sync() {
    for (Rank& r : ranks_) {
      DeviceGuard on(r.device);
      CUDA_CHECK(cudaStreamSynchronize(r.stream));
    }
  }

  // Every rank holds the same bits, and they are the exact sum (integers) or within what the
  // kernel's sum allows: fp32 additions in rank order (each within 2^-24 of the magnitudes
  // summed: with three ranks or more, values that cancel can leave a partial sum inexact),
  // then one fp16 rounding.
  void check(size_t n, uint32_t seed, bool integers, const std::string& what) {
    std::vector<double> exact(n, 0.0), magnitude(n, 0.0);
    const bool kept = uploaded_ == std::tuple{n, seed, integers};
    for (size_t r = 0; r < ranks_.size(); ++r) {
      std::vector<__half> fresh;
      const std::vector<__half>& v = kept ? inputs_[r] : (fresh = input(n, int(r), seed, integers));
      for (size_t i = 0; i < n; ++i) {
        exact[i] += double(__half2float(v[i]));
        magnitude[i] += std::abs(double(__half2float(v[i])));
      }
    }
    const double adds = double(ranks_.size() - 1);
    std::vector<__half> first;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      std::vector<__half> got(n);
      DeviceGuard on(ranks_[r].device);
      CUDA_CHECK(cudaMemcpy(got.data(), ranks_[r].data, n * sizeof(__half), cudaMemcpyDeviceToHost));
      if (r == 0) first = got;
      for (size_t i = 0; i < n; ++i) {
        const double g = double(__half2float(got[i]));
        // The fp32 sums' error, then one fp16 rounding: half an ulp of the result (2^-11
        // relative; subnormals absolute).
        const double sum32 = adds * std::ldexp(magnitude[i], -24);
        const double tol =
            integers ? 0.0 : std::max((std::abs(exact[i]) + sum32) * std::ldexp(1.0, -11) + sum32, std::ldexp(1.0, -25));
        ASSERT_LE(std::abs(g - exact[i]), tol) << what << ": rank " << r << " element " << i << " of " << n;
        ASSERT_EQ(__half_as_ushort(got[i]), __half_as_ushort(first[i])) << what << ": ranks differ at " << i;
      }
    }
  }

  std::unique_ptr<CustomAllReduce> ar_;
  std::vector<Rank> ranks_;
  std::vector<std::vector<__half>> inputs_;  // upload()'s, per rank
  std::tuple<size_t, uint32_t, bool> uploaded_{0, 0, false};
};

TEST_F(CustomAllReduceTest, ExactForIntegersWithinRoundingForRandomEverySize) {
  const std::vector<size_t> sizes = {1, 2, 7, 8, 9, 31, 1000, 1024, 4095, 65536, 65537, 131072 + 3, (size_t(1) << 20) + 5,
                                     kMaxBytes / 2 - 1, kMaxBytes / 2};
  uint32_t seed = 1;
  for (size_t n : sizes)
    for (Algo algo : {Algo::Push, Algo::OneShot, Algo::TwoShot, Algo::Auto})
      for (bool integers : {true, false})
        for (size_t offset : {size_t(0), size_t(3)}) {
          if (offset && n * 2 + offset * 2 > kMaxBytes + 64) continue;
          if (algo == Algo::Push && n * 2 > ar_->push_max_bytes()) continue;
          const std::string what = "n " + std::to_string(n) + " algo " + std::to_string(int(algo)) +
                                   (integers ? " integers" : " random") + " offset " + std::to_string(offset);
          upload(n, offset, ++seed, integers);
          run(n, algo);
          check(n, seed, integers, what);
          if (::testing::Test::HasFatalFailure()) return;
        }
}

// Many calls in a row without a sync (the barriers' counters advance per call), sizes
// alternating between the two algorithms, then one check.
TEST_F(CustomAllReduceTest, RepeatedCallsStayInStep) {
  const size_t n = 300000;
  upload(n, 0, 7, true);
  // Summing integer data R times in place: x -> R x each call, so after k calls R^k x.
  // Stay exact: |x| < 64 and R^k * 64 < 2048 (fp16 integers) for k = 2 when R <= 4.
  const int R = int(ranks_.size());
  const int calls = R <= 4 ? 2 : 1;
  for (int k = 0; k < calls; ++k)
    for (size_t r = 0; r < ranks_.size(); ++r)
      ASSERT_TRUE(ar_->all_reduce(int(r), ranks_[r].data, n, ranks_[r].stream, k % 2 ? Algo::OneShot : Algo::TwoShot).ok());
  sync();
  std::vector<double> want(n, 0.0);
  for (int r = 0; r < R; ++r) {
    const auto v = input(n, r, 7, true);
    for (size_t i = 0; i < n; ++i) want[i] += double(__half2float(v[i]));
  }
  for (int k = 1; k < calls; ++k)
    for (double& w : want) w *= R;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    std::vector<__half> got(n);
    DeviceGuard on(ranks_[r].device);
    CUDA_CHECK(cudaMemcpy(got.data(), ranks_[r].data, n * sizeof(__half), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(double(__half2float(got[i])), want[i]) << "rank " << r << " element " << i;
  }
  // 200 more small calls back to back, then a checked one.
  for (int k = 0; k < 200; ++k)
    for (size_t r = 0; r < ranks_.size(); ++r) ASSERT_TRUE(ar_->all_reduce(int(r), ranks_[r].data, 4096, ranks_[r].stream).ok());
  upload(5000, 0, 8, false);
  run(5000, Algo::Auto);
  check(5000, 8, false, "after 200 calls");
}

// Auto picks by size, so a row's sum must not depend on the algorithm: every one sums the
// ranks in rank order in fp32 and rounds once. Then the three kinds of call interleave
// without a sync (they share one call counter and alternate halves) and stay in step.
TEST_F(CustomAllReduceTest, EveryAlgorithmGivesTheSameBitsAndTheyInterleave) {
  const size_t n = 5003;
  std::vector<std::vector<__half>> first;
  for (Algo algo : {Algo::Push, Algo::OneShot, Algo::TwoShot}) {
    upload(n, 0, 41, false);
    run(n, algo);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      std::vector<__half> got(n);
      DeviceGuard on(ranks_[r].device);
      CUDA_CHECK(cudaMemcpy(got.data(), ranks_[r].data, n * sizeof(__half), cudaMemcpyDeviceToHost));
      if (first.size() <= r) first.push_back(got);
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(__half_as_ushort(got[i]), __half_as_ushort(first[r][i])) << "algo " << int(algo) << " element " << i;
    }
  }
  for (int k = 0; k < 99; ++k)  // sums of sums: the values overflow, the protocol must not care
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const Algo algo = k % 3 == 0 ? Algo::Push : k % 3 == 1 ? Algo::OneShot : Algo::TwoShot;
      ASSERT_TRUE(ar_->all_reduce(int(r), ranks_[r].data, n, ranks_[r].stream, algo).ok());
    }
  for (Algo algo : {Algo::Push, Algo::OneShot, Algo::Push, Algo::TwoShot, Algo::Push}) {
    upload(n, 0, 42, false);
    run(n, algo);
    check(n, 42, false, "after interleaved calls, algo " + std::to_string(int(algo)));
  }
}

// One call per rank captured in a CUDA graph, replayed with new data each time.
TEST_F(CustomAllReduceTest, CudaGraphReplay) {
  for (size_t n : {size_t(2048), size_t(1) << 20}) {
    upload(n, 0, 100, false);
    std::vector<cudaGraphExec_t> execs;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      DeviceGuard on(ranks_[r].device);
      cudaGraph_t g = nullptr;
      CUDA_CHECK(cudaStreamBeginCapture(ranks_[r].stream, cudaStreamCaptureModeThreadLocal));
      const Status s = ar_->all_reduce(int(r), ranks_[r].data, n, ranks_[r].stream);
      CUDA_CHECK(cudaStreamEndCapture(ranks_[r].stream, &g));
      ASSERT_TRUE(s.ok()) << s.message();
      cudaGraphExec_t e = nullptr;
      CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
      execs.push_back(e);
    }
    for (uint32_t replay = 0; replay < 5; ++replay) {
      upload(n, 0, 200 + replay, false);
      for (size_t r = 0; r < ranks_.size(); ++r) {
        DeviceGuard on(ranks_[r].device);
        CUDA_CHECK(cudaGraphLaunch(execs[r], ranks_[r].stream));
      }
      sync();
      check(n, 200 + replay, false, "graph replay " + std::to_string(replay) + " n " + std::to_string(n));
    }
    for (size_t r = 0; r < ranks_.size(); ++r) {
      DeviceGuard on(ranks_[r].device);
      CUDA_CHECK(cudaGraphExecDestroy(execs[r]));
    }
  }
}

TEST_F(CustomAllReduceTest, RefusesWhatItCannotDo) {
  EXPECT_FALSE(ar_->all_reduce(0, ranks_[0].mem.as<__half>(), kMaxBytes / 2 + 1, ranks_[0].stream).ok());
  EXPECT_FALSE(ar_->all_reduce(int(ranks_.size()), ranks_[0].mem.as<__half>(), 8, ranks_[0].stream).ok());
  const size_t over = ar_->push_max_bytes() / 2 + 1;
  const Status push = ar_->all_reduce(0, ranks_[0].mem.as<__half>(), over, ranks_[0].stream, Algo::Push);
  ASSERT_FALSE(push.ok());
  EXPECT_NE(push.message().find("push call takes at most"), std::string::npos) << push.message();
  auto one = CustomAllReduce::create({0}, 1024);
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.error().find("needs 2 to 8"), std::string::npos) << one.error();
}

}  // namespace
}  // namespace conveyor::cuda
#endif

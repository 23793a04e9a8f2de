// The CUDA sampler (kernels/cuda/sampling.h) against the CPU's sample_next and argmax_token
// (kernels/cpu/sampling.h) on the same logits: the same token for every row, whatever the
// temperature, top-k, top-p and penalties; the top-k select kernels, ties included; and the
// argmax's lowest-id rule, split or not.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(CudaOps, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/sampling.h"

#include "tests/kernels/cuda/cuda_ops_test_util.h"

namespace conveyor {
namespace {

using namespace cuda_ops_test;

// ---- sampling: the same token as model/sampling.h's sample_next on the same logits ----

// The tokens `sampler` chooses for `rows` from host `logits` [rows, V].
std::vector<int32_t> sample_on_gpu(cuda::GpuSampler& sampler, const std::vector<float>& logits,
                                   const std::vector<cuda::SampleRow>& rows) {
  Dev<float> dlogits(logits);
  cuda::DeviceBuffer tokens = cuda::device_alloc(rows.size() * 4, "test", "tokens");
  sampler.sample(dlogits.p(), rows, tokens.as<int32_t>(), s0);
  std::vector<int32_t> got(rows.size());
  CUDA_CHECK(cudaMemcpy(got.data(), tokens.get(), got.size() * 4, cudaMemcpyDeviceToHost));
  return got;
}

TEST(CudaSampling, MatchesCpuSampleNext) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  const int V = 1013, rows = 24;
  cuda::GpuSampler sampler("test", rows, V);
  for (int round = 0; round < 8; ++round) {
    std::vector<SamplingParams> params(static_cast<size_t>(rows));
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(rows)), gens(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      SamplingParams& p = params[static_cast<size_t>(r)];
      p.seed = rng.gen();
      p.temperature = std::vector<float>{0.f, 0.7f, 1.f, 1.3f}[static_cast<size_t>(r % 4)];
      p.top_k = std::vector<int>{0, 1, 5, 50, 2000}[static_cast<size_t>(rng.uniform(0, 4))];
      p.top_p = std::vector<float>{1.f, 0.9f, 0.5f, 0.01f}[static_cast<size_t>(rng.uniform(0, 3))];
      if (rng.uniform(0, 2) == 0) p.repetition_penalty = 1.3f;
      if (rng.uniform(0, 2) == 0) p.presence_penalty = 0.5f, p.frequency_penalty = 0.25f;
      if (rng.uniform(0, 3) == 0) p.min_tokens = 5, p.stop_token_ids = {rng.uniform(0, V - 1), rng.uniform(0, V - 1)};
      for (int i = rng.uniform(0, 20); i > 0; --i) prompts[static_cast<size_t>(r)].push_back(rng.uniform(0, V - 1));
      for (int i = rng.uniform(0, 12); i > 0; --i) gens[static_cast<size_t>(r)].push_back(rng.uniform(0, 40));  // repeats
    }
    auto logits = rng.normal(static_cast<size_t>(rows) * V, 2.5f);
    std::vector<int32_t> expect(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      std::vector<float> row(logits.begin() + int64_t(r) * V, logits.begin() + int64_t(r + 1) * V);
      expect[static_cast<size_t>(r)] = sample_next(row, params[static_cast<size_t>(r)], prompts[static_cast<size_t>(r)], gens[static_cast<size_t>(r)], uint64_t(r % 3));
    }
    std::vector<cuda::SampleRow> srows(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r)
      srows[static_cast<size_t>(r)] = cuda::SampleRow{&params[static_cast<size_t>(r)], prompts[static_cast<size_t>(r)], gens[static_cast<size_t>(r)], uint64_t(r % 3)};
    const std::vector<int32_t> got = sample_on_gpu(sampler, logits, srows);
    for (int r = 0; r < rows; ++r)
      EXPECT_EQ(got[static_cast<size_t>(r)], expect[static_cast<size_t>(r)])
          << "round " << round << " row " << r << " T=" << params[static_cast<size_t>(r)].temperature << " k=" << params[static_cast<size_t>(r)].top_k
          << " p=" << params[static_cast<size_t>(r)].top_p;
  }
}

// Rows with a small top-k take the select kernels instead of the sort: the same tokens as
// sample_next, also where ties straddle the k-th candidate (logits on a coarse grid), with
// -0 and +0 among the best, a row masked but for a few ids, and rows of both kinds in one
// call; a row in one slice (1013), two (4097: 2,049 and 2,048 ids), 13 (GPT-2's 50257), 25,
// and the most slices, 32, of 9,375 ids each (300000).
TEST(CudaSampling, TopKRowsMatchCpuSampleNext) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  for (int V : {1013, 4097, 50257, 100000, 300000}) {
    const int rows = 16;
    cuda::GpuSampler sampler("test", rows, V);
    for (int round = 0; round < 4; ++round) {
      std::vector<SamplingParams> params(static_cast<size_t>(rows));
      auto logits = rng.normal(static_cast<size_t>(rows) * V, 2.f);
      for (int r = 0; r < rows; ++r) {
        SamplingParams& p = params[static_cast<size_t>(r)];
        p.seed = rng.gen();
        p.temperature = std::vector<float>{0.7f, 1.f, 1.3f}[static_cast<size_t>(r % 3)];
        p.top_k = std::vector<int>{1, 2, 40, 256}[static_cast<size_t>(r % 4)];
        if (round == 3 && r == 5) p.top_k = 0;  // this call also sorts a row whole
        if (r % 5 == 1) p.top_p = 0.8f;
        float* row = logits.data() + static_cast<size_t>(r) * V;
        if (r % 2 == 0)  // coarse: long runs of equal logits around the k-th
          for (int i = 0; i < V; ++i) row[i] = std::round(row[i] * 2.f) / 2.f;
        if (r == 3) row[10] = 9.f, row[20] = -0.f, row[30] = 0.f, row[40] = 9.f;
        if (r == 7)
          for (int i = 0; i < V; ++i) row[i] = i % 97 == 0 ? 1.f : -INFINITY;
      }
      std::vector<int32_t> expect(static_cast<size_t>(rows));
      std::vector<cuda::SampleRow> srows(static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        std::vector<float> row(logits.begin() + int64_t(r) * V, logits.begin() + int64_t(r + 1) * V);
        expect[static_cast<size_t>(r)] = sample_next(row, params[static_cast<size_t>(r)], {}, {}, 0);
        srows[static_cast<size_t>(r)] = cuda::SampleRow{&params[static_cast<size_t>(r)], {}, {}, 0};
      }
      const std::vector<int32_t> got = sample_on_gpu(sampler, logits, srows);
      for (int r = 0; r < rows; ++r)
        EXPECT_EQ(got[static_cast<size_t>(r)], expect[static_cast<size_t>(r)])
            << "V " << V << " round " << round << " row " << r << " k=" << params[static_cast<size_t>(r)].top_k
            << " p=" << params[static_cast<size_t>(r)].top_p;
    }
  }
}

// logit_bias (bans at -100, biases either way) before the penalties: the same tokens as
// sample_next, greedy rows included (a bias alone sends a greedy row to the full sampler), and
// a banned argmax is never chosen.
TEST(CudaSampling, LogitBiasMatchesCpuSampleNext) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  const int V = 50257, rows = 16;
  cuda::GpuSampler sampler("test", rows, V);
  for (int round = 0; round < 4; ++round) {
    std::vector<SamplingParams> params(static_cast<size_t>(rows));
    std::vector<std::vector<int32_t>> gens(static_cast<size_t>(rows));
    auto logits = rng.normal(static_cast<size_t>(rows) * V, 2.f);
    std::vector<int32_t> banned(static_cast<size_t>(rows), -1);
    for (int r = 0; r < rows; ++r) {
      SamplingParams& p = params[static_cast<size_t>(r)];
      p.seed = rng.gen();
      p.temperature = std::vector<float>{0.f, 0.8f, 1.f, 1.2f}[static_cast<size_t>(r % 4)];
      if (r % 3 == 1) p.top_k = 40;
      if (r % 5 == 2) p.repetition_penalty = 1.3f, p.presence_penalty = 0.4f;
      const float* row = logits.data() + static_cast<size_t>(r) * V;
      const int32_t best = int32_t(std::max_element(row, row + V) - row);
      banned[static_cast<size_t>(r)] = best;
      std::vector<std::pair<int32_t, float>> bias = {{best, kLogitBiasBan}};
      for (int i = rng.uniform(0, 30); i > 0; --i) bias.emplace_back(rng.uniform(0, V - 1), float(rng.uniform(-100, 100)));
      if (r % 4 == 3) bias.emplace_back(rng.uniform(0, V - 1), 100.f);
      std::sort(bias.begin(), bias.end(), [](auto a, auto b) { return a.first < b.first; });
      for (const auto& e : bias)  // distinct ids; the first of a repeated id stays (the ban)
        if (p.logit_bias.empty() || p.logit_bias.back().first != e.first) p.logit_bias.push_back(e);
      for (int i = rng.uniform(0, 8); i > 0; --i) gens[static_cast<size_t>(r)].push_back(rng.uniform(0, V - 1));
    }
    std::vector<int32_t> expect(static_cast<size_t>(rows));
    std::vector<cuda::SampleRow> srows(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      std::vector<float> row(logits.begin() + int64_t(r) * V, logits.begin() + int64_t(r + 1) * V);
      expect[static_cast<size_t>(r)] = sample_next(row, params[static_cast<size_t>(r)], {}, gens[static_cast<size_t>(r)], 0);
      srows[static_cast<size_t>(r)] = cuda::SampleRow{&params[static_cast<size_t>(r)], {}, gens[static_cast<size_t>(r)], 0};
      EXPECT_TRUE(cuda::GpuSampler::needs_sampler(params[static_cast<size_t>(r)], gens[static_cast<size_t>(r)].size()));
    }
    const std::vector<int32_t> got = sample_on_gpu(sampler, logits, srows);
    for (int r = 0; r < rows; ++r) {
      EXPECT_EQ(got[static_cast<size_t>(r)], expect[static_cast<size_t>(r)]) << "round " << round << " row " << r;
      EXPECT_NE(got[static_cast<size_t>(r)], banned[static_cast<size_t>(r)]) << "round " << round << " row " << r;
    }
  }
}

TEST(CudaSampling, ArgmaxLowestIdOnTies) {
  REQUIRE_GPU();
  const int V = 5000;
  std::vector<float> logits(static_cast<size_t>(2) * V, 1.f);
  logits[static_cast<size_t>(V) + 4321] = 3.f, logits[static_cast<size_t>(V) + 77] = 3.f;  // row 1: tie at 77 and 4321
  Dev<float> d(logits);
  cuda::DeviceBuffer tokens = cuda::device_alloc(8, "test", "tokens");
  cuda::argmax_rows(tokens.as<int32_t>(), d.p(), 2, V, s0);
  int32_t got[2];
  CUDA_CHECK(cudaMemcpy(got, tokens.get(), 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got[1], 77);
  // The split argmax (16 blocks a row, merged by the last): the same rule, twice in a row
  // (its counters must be left at zero), on random rows against argmax_token.
  Rng rng;
  SEED_TRACE(rng);
  cuda::GpuSampler sampler("test", 8, V);
  for (int rep = 0; rep < 2; ++rep) {
    auto r = rng.normal(static_cast<size_t>(8) * V);
    r[static_cast<size_t>(3) * V + 4000] = 9.f, r[static_cast<size_t>(3) * V + 10] = 9.f;    // tie across pieces
    r[static_cast<size_t>(5) * V + 301] = 9.f, r[static_cast<size_t>(5) * V + 300] = 9.f;    // tie in one piece
    for (int i = 0; i < V; ++i) r[static_cast<size_t>(6) * V + i] = -INFINITY;               // all masked
    Dev<float> dr(r);
    cuda::DeviceBuffer t8 = cuda::device_alloc(8 * 4, "test", "tokens");
    sampler.argmax(t8.as<int32_t>(), dr.p(), 8, s0);
    int32_t g8[8];
    CUDA_CHECK(cudaMemcpy(g8, t8.get(), sizeof g8, cudaMemcpyDeviceToHost));
    for (int row = 0; row < 8; ++row)
      EXPECT_EQ(g8[row], argmax_token(std::span<const float>(r.data() + static_cast<size_t>(row) * V, V))) << "row " << row;
    EXPECT_EQ(g8[3], 10);
    EXPECT_EQ(g8[5], 300);
    EXPECT_EQ(g8[6], 0);
  }
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

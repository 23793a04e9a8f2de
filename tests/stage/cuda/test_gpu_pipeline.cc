// The cluster on GPUs: a coordinator and GPU stage workers as real processes on loopback
// (tests/cluster/cluster_harness.h), the shipped model cut into two pipeline stages, one
// worker process per stage on its own GPU (both on GPU 0 where the machine has one); the
// activations cross between the processes over UCX. Greedy answers must be the same tokens
// as a one-stage cluster on one GPU gives, request by request.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuPipeline, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include "tests/cluster/cluster_harness.h"
#include "tests/gpu_test_util.h"

namespace conveyor::cluster_test {
namespace {

using conveyor::testing::gpu_count;

// Greedy completions of `prompts`, one request at a time (so every micro-batch has the same
// shape in both clusters): the generated token ids of each.
std::vector<std::vector<int>> greedy_answers(Cluster& cluster, const std::vector<std::string>& prompts) {
  std::vector<std::vector<int>> out;
  for (const std::string& p : prompts) {
    auto r = cluster.post("/v1/completions",
                          {{"prompt", p}, {"max_tokens", 40}, {"temperature", 0}, {"return_token_ids", true}});
    EXPECT_TRUE(r.ok() && r->status == 200) << (r.ok() ? r->body : r.error());
    if (!r.ok() || r->status != 200) return out;
    out.push_back(json::parse(r->body).at("choices").at(0).at("token_ids").get<std::vector<int>>());
  }
  return out;
}

TEST(GpuPipeline, TwoWorkerProcessesOnTwoGpusAnswerAsOneGpu) {
  const int gpus = gpu_count();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device on this host";
  const std::vector<std::string> prompts = {"The jury said", "It was a", "In the morning the", "He told the committee",
                                            "The city of", "Mrs. Smith", "The Fulton County", "After the war"};
  std::vector<std::vector<int>> one, two;
  {
    Cluster c;
    c.worker_args_for = [](int) { return std::vector<std::string>{"--backend", "cuda", "--gpus", "0"}; };
    ASSERT_TRUE(c.start("gpu-one", 1, 1));
    one = greedy_answers(c, prompts);
  }
  {
    Cluster c;
    c.worker_args_for = [gpus](int i) {
      return std::vector<std::string>{"--backend", "cuda", "--gpus", std::to_string(i % gpus)};
    };
    ASSERT_TRUE(c.start("gpu-two", 2, 2));
    const json info = c.info();
    std::cout << "[cluster] " << info.dump() << "\n";
    two = greedy_answers(c, prompts);
  }
  ASSERT_EQ(one.size(), prompts.size());
  ASSERT_EQ(two.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_FALSE(one[i].empty());
    EXPECT_EQ(two[i], one[i]) << "prompt '" << prompts[i] << "'";
  }
}

}  // namespace
}  // namespace conveyor::cluster_test

#endif  // CONVEYOR_HAVE_CUDA

// Prefix K/V reuse on GPU stages, through the coordinator's scheduler in one process
// (tests/coordinator/inproc_pipeline.h), fp16 and bf16 in deterministic mode: a request whose
// prompt starts like an earlier one forks that prefix's pages and computes only the rest, and
// its sampled tokens, log-probs and alternatives are bit for bit those of the same request
// computed whole, on one stage and on two, and after a replay. What the stages hold at the end
// is the cache's entries (shared pages), nothing else.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuPrefixReuse, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include "tests/coordinator/prefix_requests.h"
#include "tests/gpu_test_util.h"
#include "tests/stage/cuda/gpu_inproc.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using testing::InprocPipeline;
using testing::prompt;
using testing::request;
using testing::run;

std::string demo() { return testing::source_dir() + "/models/brown-gpt2"; }

class GpuPrefixReuse : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!testing::have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  }
};

TEST_P(GpuPrefixReuse, AForkedPrefixGivesTheBitsOfAComputedOne) {
  for (std::vector<int64_t> cuts : {std::vector<int64_t>{}, std::vector<int64_t>{3}}) {
    SCOPED_TRACE(cuts.empty() ? "one stage" : "two stages");
    InprocPipeline with(demo(), demo(), cuts, int64_t(64) << 20, testing::gpu_backend(GetParam()));
    InprocPipeline without(demo(), demo(), cuts, int64_t(64) << 20, testing::gpu_backend(GetParam()));
    without.cfg.prefix_cache = false;
    EXPECT_EQ(run(with, request(prompt(70, 3, 0), 6)), run(without, request(prompt(70, 3, 0), 6)));
    // 64 of the shared 70 tokens are whole pages: forked; the other 6 and its own 9 computed.
    const auto second = run(with, request(prompt(70, 9, 1), 12, 2));
    EXPECT_EQ(second[0].cached, 64);
    EXPECT_EQ(second, run(without, request(prompt(70, 9, 1), 12, 2)));
    // A replay (every stage drops its pages, entries too) in the middle of a third.
    int64_t replays = 0;
    const auto third = run(with, request(prompt(70, 20, 2), 10), [&](int64_t n) { return n == 1 && ++replays; });
    EXPECT_EQ(replays, 1);
    EXPECT_EQ(third, run(without, request(prompt(70, 20, 2), 10)));
    EXPECT_GE(with.scheduler->prefix_stats().hits, 3);
    const Scheduler::PrefixStats kept = with.scheduler->prefix_stats();
    for (auto& s : with.stages) {
      EXPECT_EQ(s->backend().num_sequences(), kept.entries);
      EXPECT_LE(s->backend().kv_used_tokens(), kept.cached_tokens) << "pages held beyond the entries";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuPrefixReuse, ::testing::Values(DType::F16, DType::BF16),
                         [](const auto& info) { return std::string(info.param == DType::F16 ? "F16" : "BF16"); });

}  // namespace
}  // namespace conveyor

#endif

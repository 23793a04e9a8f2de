// Beam search on GPU stages, through the coordinator's scheduler in one process
// (tests/coordinator/inproc_pipeline.h), in fp16 and bf16 (deterministic mode):
//   - the beams equal a reference that recomputes every live beam from scratch each step on
//     the same GPU stages (its top 2B tokens from a fresh prefill): the K/V forks (shared full
//     pages, copied partial pages) hold exactly the parents' K/V;
//   - a replay mid-search and a two-stage pipeline give the same beams;
//   - against HuggingFace: indirectly (see the note before the end of this file).
// Every page is free again at the end.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuBeamSearch, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "coordinator/beam_search.h"
#include "stage/cuda/gpu_stage_backend.h"
#include "tests/coordinator/inproc_pipeline.h"
#include "tests/gpu_test_util.h"
#include "tests/hf_fixtures.h"
#include "tests/stage/cuda/gpu_inproc.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::Collected;
using testing::InprocPipeline;

std::string demo() { return testing::source_dir() + "/models/brown-gpt2"; }

testing::BackendMaker gpu(DType dtype) { return testing::gpu_backend(dtype); }

std::shared_ptr<CompletionRequest> beam_request(const std::vector<int32_t>& prompt, int best_of, int n, int max_tokens,
                                                float lp, EarlyStopping early) {
  auto r = std::make_shared<CompletionRequest>();
  r->prompts = {prompt};
  r->use_beam_search = true;
  r->best_of = best_of;
  r->n = n;
  r->max_tokens = max_tokens;
  r->length_penalty = lp;
  r->early_stopping = early;
  r->sampling.temperature = 0;
  return r;
}

struct Beam {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::string finish;
  bool operator==(const Beam&) const = default;
};

std::vector<Beam> run_beams(InprocPipeline& p, std::shared_ptr<CompletionRequest> r,
                            const std::function<bool(int64_t)>& before = {}) {
  Collected c;
  EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle(before);
  EXPECT_EQ(c.done, std::vector<std::string>{""});
  std::vector<Beam> out(r->num_choices());
  for (const ChoiceUpdate& u : c.updates) {
    for (const TokenOut& t : u.tokens) out[u.choice].tokens.push_back(t.id), out[u.choice].logprobs.push_back(t.logprob);
    out[u.choice].finish = u.finish_reason.value_or("");
  }
  // What the stages still hold is the prefix cache's entries (whole 16-token pages), nothing else.
  const Scheduler::PrefixStats kept = p.scheduler->prefix_stats();
  for (auto& s : p.stages) EXPECT_EQ(s->backend().num_sequences(), kept.entries);
  for (auto& s : p.stages) EXPECT_LE(s->backend().kv_used_tokens(), kept.cached_tokens) << "pages still held";
  return out;
}

// The top-k next tokens of `ids` from a fresh prefill on `p`'s stages.
std::vector<std::pair<int32_t, float>> top_of(InprocPipeline& p, const std::vector<int32_t>& ids, int k) {
  auto r = std::make_shared<CompletionRequest>();
  r->prompts = {ids};
  r->max_tokens = 1;
  r->logprobs = k;
  r->ignore_eos = true;
  r->sampling.temperature = 0;
  Collected c;
  EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle();
  EXPECT_EQ(c.updates.size(), 1u);
  return c.updates.empty() || c.updates[0].tokens.empty() ? std::vector<std::pair<int32_t, float>>{}
                                                           : c.updates[0].tokens[0].top;
}

class GpuBeamSearch : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!testing::have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  }
};

TEST_P(GpuBeamSearch, BeamsEqualAReferenceThatRecomputesEveryBeam) {
  const std::vector<int32_t> prompt = {464, 1578, 531, 818, 262, 3329, 262, 1468, 11, 290, 339, 1110, 13, 383, 2010,
                                       257, 1244, 318, 7};  // 19 tokens: a full page and a partial one
  struct Case {
    int best_of, n, max_tokens;
    float lp;
    EarlyStopping early;
  };
  for (const Case& k : {Case{3, 3, 20, 1.0f, EarlyStopping::Heuristic}, Case{5, 2, 14, 0.5f, EarlyStopping::Never}}) {
    SCOPED_TRACE("best_of " + std::to_string(k.best_of));
    InprocPipeline p(demo(), demo(), {}, int64_t(64) << 20, gpu(GetParam()));
    const auto got = run_beams(p, beam_request(prompt, k.best_of, k.n, k.max_tokens, k.lp, k.early));
    EXPECT_GT(p.forks_sent, 0);
    InprocPipeline ref(demo(), demo(), {}, int64_t(64) << 20, gpu(GetParam()));
    BeamSearchOptions o;
    o.beam_width = k.best_of;
    o.max_new_tokens = k.max_tokens;
    o.length_penalty = k.lp;
    o.early_stopping = k.early;
    o.stop_ids = {int32_t(ref.cfg.model.eos_token_id)};
    BeamSearch search(o);
    while (!search.done()) {
      std::vector<std::vector<std::pair<int32_t, float>>> alts;
      for (const BeamSearch::Beam& b : search.live()) {
        std::vector<int32_t> ids = prompt;
        ids.insert(ids.end(), b.tokens.begin(), b.tokens.end());
        alts.push_back(top_of(ref, ids, search.alternatives_needed()));
      }
      auto step = search.step(alts);
      ASSERT_TRUE(step) << step.error();
    }
    const auto want = search.best(size_t(k.n));
    ASSERT_EQ(want.size(), got.size());
    for (size_t j = 0; j < want.size(); ++j) {
      EXPECT_EQ(got[j].tokens, want[j].tokens) << "beam " << j;
      EXPECT_EQ(got[j].logprobs, want[j].logprobs) << "beam " << j;
      EXPECT_EQ(got[j].finish, want[j].stopped ? "stop" : "length");
    }
  }
}

TEST_P(GpuBeamSearch, ReplaysAndStageSplitsChangeNothing) {
  const std::vector<int32_t> prompt = {464, 1578, 531, 818, 262, 3329, 262, 1468, 11, 290, 339, 1110, 13, 383, 2010,
                                       257, 1244, 318, 7, 42, 99};
  auto request = [&] { return beam_request(prompt, 4, 4, 24, 1.0f, EarlyStopping::Never); };
  InprocPipeline plain(demo(), demo(), {}, int64_t(64) << 20, gpu(GetParam()));
  const auto want = run_beams(plain, request());
  InprocPipeline replayed(demo(), demo(), {}, int64_t(64) << 20, gpu(GetParam()));
  EXPECT_EQ(run_beams(replayed, request(), [](int64_t n) { return n == 4 || n == 11; }), want);
  InprocPipeline split(demo(), demo(), {3}, int64_t(64) << 20, gpu(GetParam()));
  EXPECT_EQ(run_beams(split, request()), want);
}

// No test here compares GPU beams with HuggingFace's directly: fp16 moves log-probs by up to
// about 0.03 (test_gpu_hf_conformance), and no draw of the golden files, neither on the
// random fixtures nor on the trained demo model, has every decision that far apart. The chain
// instead: the CPU engine gives HuggingFace's beams (tests/coordinator/test_hf_beam_conformance),
// the GPU's beams equal a reference that recomputes every beam on the GPU (above), and the
// GPU's log-probs are within their bound of HuggingFace's (test_gpu_hf_conformance).
INSTANTIATE_TEST_SUITE_P(Dtypes, GpuBeamSearch, ::testing::Values(DType::F16, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

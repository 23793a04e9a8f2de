// The core's side of issue 29's completions fields, through the coordinator's scheduler and
// real CPU stages (tests/coordinator/inproc_pipeline.h):
//  - the scoring idiom (echo, max_tokens 0, logprobs 5): the prompt's log-probs and top-5
//    alternatives against HuggingFace transformers' (the HF fixtures, tests/hf_fixtures.h),
//    with the prompt computed in chunks, and nothing generated;
//  - best_of by sampling: the n samples of highest cumulative log-probability, sample k being
//    the request's k-th plain sample (the same Philox stream), best first;
//  - a cancelled request: ended at once, its sequences freed by the next micro-batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "tests/coordinator/greedy_request.h"
#include "tests/coordinator/inproc_pipeline.h"
#include "tests/hf_fixtures.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kLogprobTolerance = 1e-3;  // as the stage's HF conformance test

std::string brown() { return testing::source_dir() + "/models/brown-gpt2"; }

// One HF case scored: prompt + the golden greedy tokens, whose log-probs HF gives.
void score_case(const fs::path& dir, const json& cs, int64_t chunk) {
  const auto prompt = cs.at("prompt").get<std::vector<int32_t>>();
  const auto greedy = cs.at("greedy").get<std::vector<int32_t>>();
  const auto top_ids = cs.at("top5_ids").get<std::vector<std::vector<int32_t>>>();
  const auto top_lps = cs.at("top5_logprobs").get<std::vector<std::vector<double>>>();
  testing::InprocPipeline p(dir.string(), brown());  // the tokenizer is for text only; ids are compared
  p.pipelines[0].limits.prefill_chunk = chunk;
  p.pipelines[0].limits.prefill_tokens = chunk;
  const size_t scored = std::min<size_t>(greedy.size(), size_t(p.cfg.model.n_positions) - prompt.size());
  auto r = std::make_shared<CompletionRequest>();
  r->prompts = {prompt};
  r->prompts[0].insert(r->prompts[0].end(), greedy.begin(), greedy.begin() + int64_t(scored));
  r->echo = true, r->logprobs = 5, r->max_tokens = 0, r->sampling.temperature = 0;
  testing::Collected c;
  ASSERT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle();
  ASSERT_EQ(c.done, std::vector<std::string>{""});
  ASSERT_EQ(c.updates.size(), 1u);  // one update: the prompt, nothing generated
  const ChoiceUpdate& u = c.updates[0];
  EXPECT_TRUE(u.tokens.empty());
  EXPECT_EQ(u.finish_reason.value_or(""), "length");
  ASSERT_EQ(u.prompt_tokens.size(), r->prompts[0].size());
  EXPECT_TRUE(std::isnan(u.prompt_tokens[0].logprob));  // the first token has no distribution
  EXPECT_TRUE(u.prompt_tokens[0].top.empty());
  for (size_t t = 0; t < scored; ++t) {
    const TokenOut& got = u.prompt_tokens[prompt.size() + t];
    SCOPED_TRACE("step " + std::to_string(t));
    EXPECT_EQ(got.id, greedy[t]);
    EXPECT_NEAR(got.logprob, top_lps[t][0], kLogprobTolerance);  // greedy[t] is HF's argmax
    ASSERT_EQ(got.top.size(), 5u);
    EXPECT_EQ(got.top[0].first, top_ids[t][0]);
    int matched = 0;
    for (const auto& [id, lp] : got.top)
      for (size_t j = 0; j < 5; ++j)
        if (top_ids[t][j] == id) {
          ++matched;
          EXPECT_NEAR(lp, top_lps[t][j], kLogprobTolerance) << "alternative " << id;
        }
    EXPECT_GE(matched, 4) << "our top 5 and HF's share fewer than 4 tokens";  // the 5th may be a near tie
  }
}

TEST(Scoring, PromptLogprobsMatchTransformers) {
  const auto dirs = testing::hf_fixture_dirs();
  ASSERT_FALSE(dirs.empty()) << "no HF fixture found";
  for (const fs::path& dir : dirs) {
    std::ifstream in(dir / "golden.json");
    const json golden = json::parse(in);
    for (const json& cs : golden.at("cases"))
      for (int64_t chunk : {int64_t(7), int64_t(64)}) {
        SCOPED_TRACE(dir.filename().string() + ", prompt of " + std::to_string(cs.at("prompt").size()) +
                     ", chunks of " + std::to_string(chunk));
        score_case(dir, cs, chunk);
      }
  }
}

// Plain samples of `r` (n = count, no ranking): their tokens and summed log-probs, by choice.
std::vector<std::pair<std::vector<int32_t>, double>> run_samples(const CompletionRequest& base, int n, int best_of) {
  testing::InprocPipeline p(brown(), brown());
  auto r = std::make_shared<CompletionRequest>(base);
  r->n = n, r->best_of = best_of;
  testing::Collected c;
  EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle();
  EXPECT_EQ(c.done, std::vector<std::string>{""});
  std::vector<std::pair<std::vector<int32_t>, double>> out(static_cast<size_t>(n));
  for (const ChoiceUpdate& u : c.updates)
    for (const TokenOut& t : u.tokens) out.at(u.choice).first.push_back(t.id), out.at(u.choice).second += t.logprob;
  return out;
}

TEST(BestOf, ReturnsTheSamplesOfHighestCumulativeLogprob) {
  CompletionRequest base = *testing::greedy_request(6, 10);
  base.sampling.temperature = 1.2f, base.sampling.seed = 20261126;
  base.ignore_eos = true;
  const auto plain = run_samples(base, 6, 6);  // sample k: stream k
  std::vector<size_t> rank(plain.size());
  std::iota(rank.begin(), rank.end(), size_t(0));
  std::stable_sort(rank.begin(), rank.end(), [&](size_t a, size_t b) { return plain[a].second > plain[b].second; });
  ASSERT_GT(plain[rank[0]].second, plain[rank[5]].second);  // the samples differ
  const auto best = run_samples(base, 2, 6);
  ASSERT_EQ(best.size(), 2u);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_EQ(best[j].first, plain[rank[j]].first) << "choice " << j << " is not sample " << rank[j];
    EXPECT_NEAR(best[j].second, plain[rank[j]].second, 1e-4);
  }
  EXPECT_EQ(run_samples(base, 2, 6), best);  // the request alone decides it
  // best_of = n is n plain samples.
  EXPECT_EQ(run_samples(base, 3, 3)[2].first, plain[2].first);
}

TEST(Cancel, EndsTheRequestAndFreesItsSequencesOnTheNextMicroBatch) {
  testing::InprocPipeline p(brown(), brown());
  auto r = testing::greedy_request(10, 200);
  r->n = 3;
  testing::Collected c;
  ASSERT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.scheduler->admit([](const PipelineRun&) { return true; }, [](const PipelineRun&) { return int64_t(1) << 20; });
  PipelineRun& run = p.pipelines[0];
  std::vector<uint64_t> ids;
  for (int step = 0; step < 4; ++step) {  // the prompt, then three tokens each
    auto plan = p.scheduler->next_step(run, 1);
    ASSERT_TRUE(plan);
    if (step == 0)
      for (const SeqStep& s : plan->steps) ids.push_back(s.slice.seq_id);
    const MicroBatch batch = to_microbatch(*plan);
    Scheduler::sent(run, std::move(*plan));
    p.scheduler->on_result(p.run(batch));
    p.scheduler->deliver();
  }
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_GT(run.kv_reserved, 0);
  EXPECT_TRUE(p.scheduler->cancel(r.get()));
  EXPECT_FALSE(p.scheduler->cancel(r.get()));  // ended already
  EXPECT_EQ(c.done, std::vector<std::string>{"the client closed its connection"});
  EXPECT_EQ(p.scheduler->outstanding(), 0u);
  EXPECT_EQ(run.kv_reserved, 0);
  auto frees = p.scheduler->next_step(run, 1);  // nothing else to do: it carries the frees alone
  ASSERT_TRUE(frees);
  EXPECT_TRUE(frees->steps.empty());
  std::vector<uint64_t> freed = frees->frees;
  std::sort(freed.begin(), freed.end());
  EXPECT_EQ(freed, ids);
  EXPECT_EQ(c.updates.size(), 12u);  // four tokens each, nothing after the cancel
}

}  // namespace
}  // namespace conveyor

// Prefix K/V reuse through the coordinator's scheduler and real CPU stages (in one process,
// through the micro-batch wire format): a request whose prompt starts like an earlier one forks
// that prefix's K/V and computes only the rest, and its tokens and log-probs are bit for bit
// those of the same request computed from scratch, on one stage or two, across a replay, with
// sampling; usage counts the reused tokens; entries give way to running requests (LRU) and
// are freed on the stages; echo with logprobs computes its whole prompt.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

#include "tests/coordinator/inproc_pipeline.h"
#include "tests/coordinator/prefix_requests.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using testing::Collected;
using testing::InprocPipeline;

std::string demo() { return testing::source_dir() + "/models/brown-gpt2"; }

using testing::Answer;
using testing::prompt;
using testing::request;
using testing::run;

TEST(PrefixReuse, ASharedPrefixIsForkedAndGivesTheSameAnswer) {
  for (std::vector<int64_t> cuts : {std::vector<int64_t>{}, std::vector<int64_t>{2}}) {
    SCOPED_TRACE(cuts.empty() ? "one stage" : "two stages");
    InprocPipeline with(demo(), demo(), cuts);
    InprocPipeline without(demo(), demo(), cuts);
    without.cfg.prefix_cache = false;

    // The first request computes its prompt and leaves its 48 whole tokens as an entry.
    const auto first = run(with, request(prompt(50, 3, 0), 6));
    EXPECT_EQ(first[0].cached, 0);
    EXPECT_EQ(first, run(without, request(prompt(50, 3, 0), 6)));
    EXPECT_EQ(with.forks_sent, 1);  // the entry
    for (auto& s : with.stages) EXPECT_EQ(s->backend().num_sequences(), 1) << "the stage holds the entry";

    // The second shares 50 tokens: it forks 48 and computes 5.
    const auto second = run(with, request(prompt(50, 5, 1), 8));
    EXPECT_EQ(second[0].cached, 48);
    const auto alone = run(without, request(prompt(50, 5, 1), 8));
    EXPECT_EQ(alone[0].cached, 0);
    EXPECT_EQ(second, alone) << "a forked prefix must give the bits of a computed one";
    EXPECT_EQ(with.forks_sent, 2);  // + the fork from the entry (its own 48 whole tokens are the entry's)
    EXPECT_EQ(with.admissions_sent, 2);  // each request's state once: the entry's fork brings none

    const Scheduler::PrefixStats st = with.scheduler->prefix_stats();
    EXPECT_EQ(st.lookups, 2);
    EXPECT_EQ(st.hits, 1);
    EXPECT_EQ(st.reused_tokens, 48);
    EXPECT_EQ(st.computed_tokens, 53 + 55 - 48);
    EXPECT_EQ(st.entries, 1);  // the second's whole granules are the entry's: no second entry
    EXPECT_EQ(without.scheduler->prefix_stats().lookups, 0);
  }
}

TEST(PrefixReuse, ReplayAndSeveralChoicesGiveTheSameAnswer) {
  InprocPipeline with(demo(), demo(), {3});
  InprocPipeline without(demo(), demo(), {3});
  without.cfg.prefix_cache = false;
  run(with, request(prompt(40, 1, 0), 2));
  // n = 3 choices, a replay (the stages drop everything, entries included) after 2 batches.
  int64_t replays = 0;
  const auto got = run(with, request(prompt(40, 9, 2), 10, 3), [&](int64_t n) { return n == 2 && ++replays; });
  EXPECT_EQ(replays, 1);
  EXPECT_EQ(got, run(without, request(prompt(40, 9, 2), 10, 3)));
  // Each choice forked before the replay; after it, a choice whose prompt is fed after
  // another's was computed forks again (how many do depends on the batch limits).
  EXPECT_GE(with.scheduler->prefix_stats().hits, 3);
  EXPECT_EQ(got[0].cached, 0);  // and computed its whole prompt after it
  // After the replay the pipeline forgot its entries; the request's own is the only one now.
  EXPECT_EQ(with.scheduler->prefix_stats().entries, 1);
}

TEST(PrefixReuse, EchoWithLogprobsComputesItsWholePrompt) {
  InprocPipeline p(demo(), demo());
  run(p, request(prompt(40, 1, 0), 2));
  auto r = request(prompt(40, 4, 1), 3);
  r->echo = true;
  const auto got = run(p, r);
  EXPECT_EQ(got[0].cached, 0);
  EXPECT_EQ(p.scheduler->prefix_stats().hits, 0);
}

TEST(PrefixReuse, EntriesGiveWayToRunningRequestsLeastRecentlyUsedFirst) {
  InprocPipeline p(demo(), demo());
  PipelineRun& pipe = p.pipelines[0];
  auto drive = [&](std::shared_ptr<CompletionRequest> r, int64_t kv_budget) {
    Collected c;
    EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
    for (int i = 0; i < 1000 && p.scheduler->outstanding() > 0; ++i) {
      p.scheduler->admit([](const PipelineRun&) { return true; }, [&](const PipelineRun&) { return kv_budget; });
      auto f = p.scheduler->next_step(pipe, 1);
      ASSERT_TRUE(f);
      const MicroBatch b = to_microbatch(*f);
      Scheduler::sent(pipe, std::move(*f));
      p.scheduler->on_result(p.run(b));
      p.scheduler->deliver();
    }
    if (auto f = p.scheduler->next_step(pipe, 1)) {  // the last frees and forks
      const MicroBatch b = to_microbatch(*f);
      Scheduler::sent(pipe, std::move(*f));
      p.scheduler->on_result(p.run(b));
    }
    EXPECT_EQ(c.done, std::vector<std::string>{""});
  };
  // Budget 200 tokens: a 34-token prompt + 4 new reserves 38.
  drive(request(prompt(34, 0, 0), 4), 200);
  drive(request(prompt(0, 34, 1), 4), 200);
  drive(request(prompt(0, 34, 2), 4), 200);
  EXPECT_EQ(p.scheduler->prefix_stats().entries, 3);
  EXPECT_EQ(p.scheduler->prefix_stats().cached_tokens, 96);
  // One more use of the first makes the second the least recently used.
  drive(request(prompt(34, 1, 3), 4), 200);
  // 150 reserved beside 96 cached: 46 over a budget of 200, so the two least recently used go.
  // Its own 144 whole tokens do not fit beside it: not kept.
  drive(request(prompt(0, 146, 4), 4), 200);
  EXPECT_EQ(p.scheduler->prefix_stats().entries, 1);
  for (auto& s : p.stages) EXPECT_EQ(s->backend().num_sequences(), 1) << "evicted entries are freed on the stage";
  const auto st = p.scheduler->prefix_stats();
  EXPECT_EQ(st.hits, 1);
  EXPECT_EQ(st.cached_tokens, 32);
  // The first's prefix is still there.
  drive(request(prompt(34, 2, 5), 4), 200);
  EXPECT_EQ(p.scheduler->prefix_stats().hits, 2);
}

}  // namespace
}  // namespace conveyor

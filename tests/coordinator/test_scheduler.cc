// The scheduler without threads or sockets: its limits' automatic values, admission against
// the K/V budget and the admission limit (and why the queue waits), and how a micro-batch
// takes in prompt rows (prefill_chunk per sequence, prefill_tokens_per_batch in all).
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "coordinator/scheduler.h"
#include "tests/coordinator/greedy_request.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

struct Harness {
  ClusterConfig cfg;
  std::vector<PipelineRun> pipelines;
  std::unique_ptr<Scheduler> scheduler;
  std::vector<std::string> done;  // on_done messages, in order

  explicit Harness(BatchLimits limits) {
    const std::string model = testing::source_dir() + "/models/brown-gpt2";
    cfg.model = load_model_config(model).value();
    auto tok = Tokenizer::load(model);
    EXPECT_TRUE(tok.ok()) << tok.error();
    pipelines.resize(1);
    pipelines[0].limits = limits;
    pipelines[0].figures.kv_page_tokens = 16;  // its stages' K/V pages
    scheduler = std::make_unique<Scheduler>(cfg, std::make_shared<const Tokenizer>(std::move(tok).value()), pipelines);
  }

  // A request of one choice: `prompt_len` token ids, `max_tokens` to generate.
  void submit(int prompt_len, int max_tokens) {
    auto r = testing::greedy_request(prompt_len, max_tokens);
    CompletionSink sink;
    sink.on_update = [](ChoiceUpdate) {};
    sink.on_done = [this](const std::string& e) { done.push_back(e); };
    ASSERT_TRUE(scheduler->submit(r, sink).ok());
  }

  void admit(int64_t kv_capacity, bool open = true) {
    scheduler->admit([open](const PipelineRun&) { return open; }, [kv_capacity](const PipelineRun&) { return kv_capacity; });
  }
};

// The figures the pipeline's workers give in their register (a CPU stage's and a GPU
// stage's, as stage/ describes them today).
const StageFigures kCpuFigures{.max_rows = 0, .sequences = 64, .prompt_rows = 64, .extra_in_flight = 1,
                               .kv_page_tokens = 16, .backends = "cpu"};
const StageFigures kGpuFigures{.max_rows = 4096, .sequences = 256, .prompt_rows = 512, .extra_in_flight = 0,
                               .kv_page_tokens = 16, .backends = "cuda"};

TEST(Scheduler, AutomaticLimitsFollowTheWorkersFigures) {
  ClusterConfig cfg;  // every limit 0: auto
  const BatchLimits cpu = Scheduler::batch_limits(cfg, kCpuFigures, /*stages=*/3, /*depth=*/4);
  EXPECT_EQ(cpu.max_sequences, 64);
  EXPECT_EQ(cpu.prefill_chunk, 64);
  EXPECT_EQ(cpu.prefill_tokens, 48);  // a round of the ring takes in 3 micro-batches' worth
  EXPECT_EQ(cpu.max_rows, 64 + 48);
  EXPECT_EQ(cpu.max_running, 4 * 64);
  EXPECT_EQ(Scheduler::batch_limits(cfg, kCpuFigures, 1, 2).prefill_tokens, 32);
  EXPECT_EQ(Scheduler::batch_limits(cfg, kCpuFigures, 1, 8).prefill_tokens, 16);  // never below 16
  const BatchLimits gpu = Scheduler::batch_limits(cfg, kGpuFigures, /*stages=*/1, /*depth=*/1);
  EXPECT_EQ(gpu.max_sequences, 256);
  EXPECT_EQ(gpu.prefill_chunk, 512);
  EXPECT_EQ(gpu.prefill_tokens, 512);
  EXPECT_EQ(gpu.max_rows, 768);
  EXPECT_EQ(gpu.max_running, 256);
  // A stage's row limit caps the automatic rows (a step it would refuse is never formed).
  StageFigures tight = kGpuFigures;
  tight.max_rows = 600;
  EXPECT_EQ(Scheduler::batch_limits(cfg, tight, 1, 1).max_rows, 600);
  // What the cluster file sets wins over the automatic values, whatever the workers say.
  cfg.max_sequences_per_batch = 10, cfg.max_batch_tokens = 30, cfg.prefill_chunk = 7, cfg.prefill_tokens_per_batch = 9;
  cfg.max_running = 3;
  for (const StageFigures& f : {kCpuFigures, kGpuFigures, StageFigures{}}) {
    const BatchLimits l = Scheduler::batch_limits(cfg, f, 2, 3);
    EXPECT_EQ(l, (BatchLimits{.max_sequences = 10, .max_rows = 30, .prefill_chunk = 7, .prefill_tokens = 9,
                              .max_running = 3}));
  }
}

TEST(Scheduler, AdmissionStopsAtTheRunningLimitAndSaysWhy) {
  Harness h({.max_sequences = 64, .max_rows = 128, .prefill_chunk = 64, .prefill_tokens = 64, .max_running = 2});
  for (int i = 0; i < 3; ++i) h.submit(10, 5);
  h.admit(/*kv_capacity=*/10000);
  EXPECT_EQ(h.scheduler->running_on(0), 2);
  EXPECT_EQ(h.scheduler->queue_size(), 1u);
  EXPECT_EQ(h.scheduler->queue_wait(), QueueWait::RunningLimit);
  EXPECT_EQ(h.pipelines[0].kv_reserved, 2 * (10 + 5));
  EXPECT_TRUE(h.done.empty());
}

TEST(Scheduler, AdmissionFillsTheKvBudgetAndSaysWhy) {
  Harness h({.max_sequences = 64, .max_rows = 128, .prefill_chunk = 64, .prefill_tokens = 64, .max_running = 100});
  for (int i = 0; i < 4; ++i) h.submit(20, 10);  // 30 tokens each
  h.admit(/*kv_capacity=*/95);                     // room for three
  EXPECT_EQ(h.scheduler->running_on(0), 3);
  EXPECT_EQ(h.pipelines[0].kv_reserved, 90);
  EXPECT_EQ(h.scheduler->queue_wait(), QueueWait::KvCache);
  // No pipeline open: the queue says so, and admits nothing.
  Harness closed({});
  closed.submit(5, 5);
  closed.admit(1000, /*open=*/false);
  EXPECT_EQ(closed.scheduler->queue_wait(), QueueWait::NoPipeline);
  EXPECT_EQ(closed.scheduler->running_on(0), 0);
  // A request larger than any budget is refused with the figures (Invalid: a 400), not left
  // waiting; one is refused at submission once the largest budget is known.
  Harness small({});
  small.submit(50, 50);
  small.admit(60);
  ASSERT_EQ(small.done.size(), 1u);
  EXPECT_NE(small.done[0].find("needs 100 K/V-cache tokens"), std::string::npos) << small.done[0];
  EXPECT_NE(small.done[0].find("more than a pipeline holds (60 tokens)"), std::string::npos) << small.done[0];
  const CoreStatus refused = small.scheduler->submit(testing::greedy_request(50, 50), {}, /*kv_capacity=*/60);
  EXPECT_EQ(refused.error, CoreError::Invalid);
  EXPECT_EQ(refused.param, "max_tokens");
  EXPECT_NE(refused.message.find("needs 100 K/V-cache tokens"), std::string::npos) << refused.message;
  EXPECT_EQ(small.scheduler->queue_size(), 0u);
  EXPECT_EQ(small.scheduler->queue_wait(), QueueWait::None);
}

TEST(Scheduler, PromptRowsPerMicroBatchStayWithinTheirBudget) {
  Harness h({.max_sequences = 64, .max_rows = 200, .prefill_chunk = 48, .prefill_tokens = 64, .max_running = 64});
  for (int i = 0; i < 3; ++i) h.submit(100, 4);
  h.admit(10000);
  ASSERT_EQ(h.scheduler->running_on(0), 3);
  // Depth 2: two micro-batches in flight. The first takes a whole chunk of the first prompt
  // and what is left of the budget from the second; the next the rest of the budget.
  auto first = h.scheduler->next_step(h.pipelines[0], 2);
  ASSERT_TRUE(first.has_value());
  ASSERT_EQ(first->steps.size(), 2u);
  EXPECT_EQ(first->steps[0].slice.num_tokens, 48);
  EXPECT_EQ(first->steps[1].slice.num_tokens, 16);
  EXPECT_EQ(first->token_ids.size(), 64u);
  Scheduler::sent(h.pipelines[0], std::move(*first));
  auto second = h.scheduler->next_step(h.pipelines[0], 2);
  ASSERT_TRUE(second.has_value());
  ASSERT_EQ(second->steps.size(), 1u);  // the third sequence: the others are in flight
  EXPECT_EQ(second->steps[0].slice.start_pos, 0);
  EXPECT_EQ(second->steps[0].slice.num_tokens, 48);
  Scheduler::sent(h.pipelines[0], std::move(*second));
  EXPECT_EQ(h.pipelines[0].in_flight, 2);
  // Nothing left that is not in flight: no third micro-batch.
  EXPECT_FALSE(h.scheduler->next_step(h.pipelines[0], 2).has_value());
}

TEST(Scheduler, AMicroBatchHoldsAtMostMaxBatchTokensRows) {
  Harness h({.max_sequences = 64, .max_rows = 3, .prefill_chunk = 64, .prefill_tokens = 64, .max_running = 64});
  for (int i = 0; i < 5; ++i) h.submit(1, 4);  // one-token prompts: every slice is one row
  h.admit(10000);
  auto b = h.scheduler->next_step(h.pipelines[0], 1);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->token_ids.size(), 3u);  // max_tokens rows
  EXPECT_EQ(b->steps.size(), 3u);
}

// The result of `plan`: `token` for every sequence it steps.
BatchResult result_of(const StepPlan& plan, int32_t token) {
  BatchResult r;
  r.batch_id = plan.batch_id, r.pipeline = uint32_t(plan.pipeline), r.epoch = plan.epoch;
  for (const SeqStep& w : plan.steps) {
    SeqResult sr;
    sr.seq_id = w.slice.seq_id, sr.token = token;
    r.seqs.push_back(sr);
  }
  return r;
}

// Steps ahead on a pipeline of one stage: while a sequence's step is in flight, its next goes
// on the stage's own token (one beyond the depth), never past max_tokens; each result feeds
// the token the step ahead ran on. A sequence that a stop token ends had one step too many:
// its result is discarded and its free follows.
TEST(Scheduler, StepsAheadGoOnTheStagesOwnTokenAndStopAtMaxTokens) {
  Harness h({.max_sequences = 64, .max_rows = 128, .prefill_chunk = 64, .prefill_tokens = 64, .max_running = 64});
  PipelineRun& p = h.pipelines[0];
  p.view.step_ahead = true;
  h.submit(10, 4);
  h.admit(10000);
  auto send = [&] {
    auto plan = h.scheduler->next_step(p, 1);
    if (!plan) return std::optional<StepPlan>();
    StepPlan copy = *plan;
    Scheduler::sent(p, std::move(*plan));
    return std::optional<StepPlan>(copy);
  };
  const auto prefill = send();
  ASSERT_TRUE(prefill && prefill->steps.size() == 1u);
  EXPECT_FALSE(prefill->steps[0].own_token);
  const auto a1 = send();  // the prompt's step in flight samples: the next goes now
  ASSERT_TRUE(a1 && a1->steps.size() == 1u);
  EXPECT_TRUE(a1->steps[0].own_token);
  EXPECT_TRUE(a1->steps[0].sample);
  EXPECT_EQ(a1->steps[0].slice.start_pos, 10);
  EXPECT_EQ(a1->token_ids, std::vector<int32_t>{kOwnTokenPlaceholder});
  EXPECT_TRUE(a1->admissions.empty());  // the stage holds its state
  EXPECT_FALSE(send().has_value());     // one step ahead at most
  std::vector<std::optional<StepPlan>> plans = {prefill, a1};
  for (int k = 0; k < 4; ++k) {  // token k + 1 comes back
    EXPECT_EQ(h.scheduler->on_result(result_of(*plans[size_t(k)], 100 + k)), nullptr);
    h.scheduler->deliver();
    plans.push_back(send());
    if (k < 2) {  // tokens 3 and 4 go ahead; nothing past max_tokens
      ASSERT_TRUE(plans.back().has_value()) << k;
      EXPECT_EQ(plans.back()->steps[0].slice.start_pos, 11 + k);
      EXPECT_TRUE(plans.back()->steps[0].own_token);
    } else if (k == 2) {
      EXPECT_FALSE(plans.back().has_value());
    }
  }
  ASSERT_EQ(h.done.size(), 1u);  // the 4th token ended it
  ASSERT_TRUE(plans.back().has_value());
  EXPECT_EQ(plans.back()->frees, std::vector<uint64_t>{prefill->steps[0].slice.seq_id});
  EXPECT_EQ(h.scheduler->take_discarded_tokens(), 0);
  EXPECT_EQ(h.scheduler->on_result(result_of(*plans.back(), 0)), nullptr);  // the frees came back

  // A stop token: the step ahead in flight gives one token too many, discarded.
  h.submit(10, 50);
  h.admit(10000);
  const auto first = send();
  const auto ahead = send();
  ASSERT_TRUE(first && ahead && ahead->steps[0].own_token);
  EXPECT_EQ(h.scheduler->on_result(result_of(*first, int32_t(h.cfg.model.eos_token_id))), nullptr);
  h.scheduler->deliver();
  ASSERT_EQ(h.done.size(), 2u);
  const auto frees = send();  // the free waits for a slot: two are in flight
  EXPECT_FALSE(frees.has_value());
  EXPECT_EQ(h.scheduler->on_result(result_of(*ahead, 5)), nullptr);
  EXPECT_EQ(h.scheduler->take_discarded_tokens(), 1);
  const auto last = h.scheduler->next_step(p, 1);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->frees, std::vector<uint64_t>{first->steps[0].slice.seq_id});
}

// Prefix reuse between replicas: a request goes to the pipeline that holds a prefix of its
// prompt even when another is less reserved, and its first slice forks that prefix.
TEST(Scheduler, ARequestGoesToTheReplicaHoldingItsPrefix) {
  const BatchLimits limits{.max_sequences = 64, .max_rows = 256, .prefill_chunk = 64, .prefill_tokens = 64,
                           .max_running = 64};
  Harness h(limits);
  h.pipelines.resize(2);
  h.pipelines[1].index = 1;
  h.pipelines[1].limits = limits;
  h.pipelines[1].figures = h.pipelines[0].figures;
  h.submit(40, 8);  // prompt 1..40
  h.admit(10000);
  ASSERT_EQ(h.scheduler->running_on(0), 1);  // both empty: the first
  // Its prompt computed on pipeline 0: the result of its prefill makes 32 tokens an entry.
  auto b = h.scheduler->next_step(h.pipelines[0], 1);
  ASSERT_TRUE(b.has_value());
  ASSERT_EQ(b->steps.size(), 1u);
  ASSERT_TRUE(b->steps[0].sample);
  const uint64_t first = b->steps[0].slice.seq_id;
  BatchResult r;
  r.batch_id = b->batch_id, r.pipeline = 0, r.epoch = b->epoch;
  SeqResult token;
  token.seq_id = first, token.token = 7;
  r.seqs.push_back(token);
  Scheduler::sent(h.pipelines[0], std::move(*b));
  EXPECT_EQ(h.scheduler->on_result(r), nullptr);
  h.scheduler->deliver();
  EXPECT_EQ(h.scheduler->prefix_stats().entries, 1);
  // Pipeline 0 is the more reserved now (the first still runs), yet the same prompt goes there.
  h.submit(40, 8);
  h.admit(10000);
  EXPECT_EQ(h.scheduler->running_on(0), 2);
  EXPECT_EQ(h.scheduler->running_on(1), 0);
  auto next = h.scheduler->next_step(h.pipelines[0], 1);
  ASSERT_TRUE(next.has_value());
  ASSERT_EQ(next->forks.size(), 2u);  // the entry from the first, then the second from it
  EXPECT_EQ(next->forks[0].parent, first);
  EXPECT_EQ(next->forks[1].parent, next->forks[0].child);
  EXPECT_EQ(next->forks[1].num_tokens, 32);
  // With the cache off the second request would have gone to the empty pipeline.
  Harness off(limits);
  off.cfg.prefix_cache = false;
  off.pipelines.resize(2);
  off.pipelines[1].index = 1;
  off.pipelines[1].limits = limits;
  off.pipelines[1].figures = off.pipelines[0].figures;
  off.submit(40, 8);
  off.admit(10000);
  off.submit(40, 8);
  off.admit(10000);
  EXPECT_EQ(off.scheduler->running_on(1), 1);
}

}  // namespace
}  // namespace conveyor

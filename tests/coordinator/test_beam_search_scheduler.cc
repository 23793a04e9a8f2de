// Beam search through the coordinator's scheduler and real CPU stages (in one process,
// through the micro-batch wire format): the beams equal a reference that recomputes every
// live beam from scratch each step; width 1 is greedy; a replay (failover) mid-search and a
// two-stage pipeline change nothing; the stages hold no sequence afterwards.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "coordinator/beam_search.h"
#include "stage/engine.h"
#include "tests/coordinator/inproc_pipeline.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using testing::Collected;
using testing::InprocPipeline;

std::string demo() { return testing::source_dir() + "/models/brown-gpt2"; }

std::shared_ptr<CompletionRequest> beam_request(std::vector<std::vector<int32_t>> prompts, int best_of, int n,
                                                int max_tokens, float length_penalty = 1.0f,
                                                EarlyStopping early = EarlyStopping::Heuristic) {
  auto r = std::make_shared<CompletionRequest>();
  r->prompts = std::move(prompts);
  r->use_beam_search = true;
  r->best_of = best_of;
  r->n = n;
  r->max_tokens = max_tokens;
  r->length_penalty = length_penalty;
  r->early_stopping = early;
  r->sampling.temperature = 0;
  return r;
}

// Each choice's tokens and finish reason, by choice index.
struct Choice {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::string text, finish;
  bool operator==(const Choice&) const = default;
};
std::vector<Choice> choices_of(const Collected& c, size_t count) {
  std::vector<Choice> out(count);
  for (const ChoiceUpdate& u : c.updates) {
    EXPECT_LT(u.choice, count);
    if (u.choice >= count) continue;
    EXPECT_TRUE(out[u.choice].finish.empty()) << "choice " << u.choice << " updated twice";
    for (const TokenOut& t : u.tokens) out[u.choice].tokens.push_back(t.id), out[u.choice].logprobs.push_back(t.logprob);
    out[u.choice].text = u.text;
    out[u.choice].finish = u.finish_reason.value_or("");
  }
  return out;
}

std::vector<Choice> run_beams(InprocPipeline& p, std::shared_ptr<CompletionRequest> r,
                              const std::function<bool(int64_t)>& before_batch = {}) {
  Collected c;
  EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle(before_batch);
  EXPECT_EQ(c.done, std::vector<std::string>{""});
  // The stages hold the prefix cache's entries and nothing else.
  for (auto& s : p.stages)
    EXPECT_EQ(s->backend().num_sequences(), p.scheduler->prefix_stats().entries) << "a stage still holds sequences";
  return choices_of(c, r->num_choices());
}

// The reference: the same search, each step recomputing every live beam from scratch with the
// engine (its top 2B next tokens under the raw distribution).
std::vector<BeamSearch::Hypothesis> reference(Engine& engine, const std::vector<int32_t>& prompt, int best_of, int n,
                                              int max_tokens, float lp, EarlyStopping early) {
  BeamSearchOptions o;
  o.beam_width = best_of;
  o.max_new_tokens = max_tokens;
  o.length_penalty = lp;
  o.early_stopping = early;
  o.stop_ids = {int32_t(engine.config().eos_token_id)};
  BeamSearch search(o);
  while (!search.done()) {
    std::vector<std::vector<std::pair<int32_t, float>>> alts;
    for (const BeamSearch::Beam& b : search.live()) {
      GenerationRequest g;
      g.prompt = prompt;
      g.prompt.insert(g.prompt.end(), b.tokens.begin(), b.tokens.end());
      g.max_new_tokens = 1;
      g.sampling.temperature = 0;
      g.logprobs = search.alternatives_needed();
      g.ignore_eos = true;
      auto res = engine.generate({g});
      EXPECT_TRUE(res) << res.error();
      alts.push_back((*res)[0].top_logprobs[0]);
    }
    auto step = search.step(alts);
    EXPECT_TRUE(step) << step.error();
    if (!step) break;
  }
  return search.best(size_t(n));
}

std::unique_ptr<Engine> demo_engine() {
  auto w = load_stage_weights(demo(), 0, 6);
  EXPECT_TRUE(w) << w.error();
  return Engine::create(std::move(*w)).value();
}

TEST(BeamSearchScheduler, BeamsEqualAReferenceThatRecomputesEveryBeam) {
  auto engine = demo_engine();
  const std::vector<std::vector<int32_t>> prompts = {{464, 1578, 531, 818}, {262, 3329}};
  struct Case {
    int best_of, n, max_tokens;
    float lp;
    EarlyStopping early;
  };
  for (const Case& k : {Case{3, 3, 10, 1.0f, EarlyStopping::Heuristic}, Case{4, 2, 7, 0.5f, EarlyStopping::Never},
                        Case{2, 1, 12, 2.0f, EarlyStopping::Stop}}) {
    SCOPED_TRACE("best_of " + std::to_string(k.best_of) + " n " + std::to_string(k.n));
    InprocPipeline p(demo(), demo());
    const auto got = run_beams(p, beam_request(prompts, k.best_of, k.n, k.max_tokens, k.lp, k.early));
    EXPECT_GT(p.forks_sent, 0);
    for (size_t pi = 0; pi < prompts.size(); ++pi) {
      const auto want = reference(*engine, prompts[pi], k.best_of, k.n, k.max_tokens, k.lp, k.early);
      ASSERT_EQ(want.size(), size_t(k.n));
      double previous = 0;
      for (int j = 0; j < k.n; ++j) {
        const Choice& c = got[pi * size_t(k.n) + size_t(j)];
        EXPECT_EQ(c.tokens, want[size_t(j)].tokens) << "prompt " << pi << " beam " << j;
        EXPECT_EQ(c.logprobs, want[size_t(j)].logprobs) << "prompt " << pi << " beam " << j;
        EXPECT_EQ(c.finish, want[size_t(j)].stopped ? "stop" : "length");
        // Best first, by sum of log-probs over length^length_penalty.
        double sum = 0;
        for (float l : c.logprobs) sum += l;
        const double score = sum / std::pow(double(c.tokens.size()), double(k.lp));
        if (j > 0) {
          EXPECT_LE(score, previous + 1e-9);
        }
        previous = score;
      }
    }
  }
}

TEST(BeamSearchScheduler, WidthOneIsGreedy) {
  auto engine = demo_engine();
  const std::vector<int32_t> prompt = {464, 1578, 531};
  InprocPipeline p(demo(), demo());
  const auto got = run_beams(p, beam_request({prompt}, 1, 1, 12));
  GenerationRequest g;
  g.prompt = prompt;
  g.max_new_tokens = 12;
  g.sampling.temperature = 0;
  auto want = engine->generate({g});
  ASSERT_TRUE(want) << want.error();
  EXPECT_EQ(got[0].tokens, (*want)[0].tokens);
  EXPECT_EQ(got[0].finish, (*want)[0].finish_reason);
  EXPECT_EQ(p.forks_sent, 0);  // one beam: always its own continuation
  EXPECT_EQ(p.admissions_sent, 1);  // its state went to the last stage once
}

// A failover mid-search (the stages drop every cache; each beam is fed again from its first
// token, its state sent again) and a two-stage pipeline give the same beams as one
// uninterrupted stage. Without a replay a prompt's state goes to the last stage once: every
// other beam gets it by its fork.
TEST(BeamSearchScheduler, ReplaysAndStageSplitsChangeNothing) {
  const std::vector<std::vector<int32_t>> prompts = {{464, 1578, 531, 818}, {13}};
  auto request = [&] { return beam_request(prompts, 4, 3, 9, 1.0f, EarlyStopping::Never); };
  InprocPipeline plain(demo(), demo());
  const auto want = run_beams(plain, request());
  EXPECT_EQ(plain.admissions_sent, 2);
  InprocPipeline replayed(demo(), demo());
  int replays = 0;
  const auto got = run_beams(replayed, request(), [&](int64_t n) {
    const bool now = n == 3 || n == 6;
    replays += now;
    return now;
  });
  EXPECT_EQ(replays, 2);
  EXPECT_EQ(got, want);
  EXPECT_GT(replayed.admissions_sent, 2 + 2);  // at least the live beams again after each replay
  InprocPipeline split(demo(), demo(), {2, 4});
  EXPECT_EQ(run_beams(split, request()), want);
  EXPECT_GT(split.forks_sent, 0);
  EXPECT_EQ(split.admissions_sent, 2);
}

}  // namespace
}  // namespace conveyor

// Beam search bookkeeping (coordinator/beam_search.h) on small cases worked by hand: which
// candidates live on, which finish and with what length-penalised score, and when each
// early_stopping mode stops.
#include <gtest/gtest.h>

#include <vector>

#include "coordinator/beam_search.h"

namespace conveyor {
namespace {

using Alts = std::vector<std::pair<int32_t, float>>;

BeamSearchOptions opts(int width, int max_new, float length_penalty, EarlyStopping early) {
  BeamSearchOptions o;
  o.beam_width = width;
  o.max_new_tokens = max_new;
  o.length_penalty = length_penalty;
  o.early_stopping = early;
  o.stop_ids = {9};
  return o;
}

std::vector<BeamSearch::Continuation> step(BeamSearch& s, std::vector<Alts> alts) {
  auto r = s.step(alts);
  EXPECT_TRUE(r.ok()) << r.error();
  return r.ok() ? *r : std::vector<BeamSearch::Continuation>{};
}

TEST(BeamSearch, EndsAtMaxTokensWithTheBestFinishedFirst) {
  BeamSearch s(opts(2, 3, 1.0f, EarlyStopping::Heuristic));
  EXPECT_EQ(s.alternatives_needed(), 4);
  // Step 1: the stop token ranks third (>= B): it does not finish; 1 and 2 live on.
  auto c = step(s, {{{1, -0.1f}, {2, -0.5f}, {9, -1.0f}, {3, -2.0f}}});
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].parent, 0u);
  EXPECT_EQ(c[0].token, 1);
  EXPECT_EQ(c[1].parent, 0u);
  EXPECT_EQ(c[1].token, 2);
  EXPECT_TRUE(s.finished().empty());
  // Step 2: candidates -0.3 (beam 0, stop), -0.4 (beam 0, 4), -0.55 (beam 1, 7), -1.1.
  c = step(s, {{{9, -0.2f}, {4, -0.3f}, {5, -1.0f}, {6, -3.0f}}, {{7, -0.05f}, {9, -1.0f}, {8, -2.0f}, {6, -3.0f}}});
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].parent, 0u);
  EXPECT_EQ(c[0].token, 4);
  EXPECT_EQ(c[1].parent, 1u);
  EXPECT_EQ(c[1].token, 7);
  ASSERT_EQ(s.finished().size(), 1u);
  EXPECT_EQ(s.finished()[0].tokens, (std::vector<int32_t>{1, 9}));
  EXPECT_NEAR(s.finished()[0].score, -0.3 / 2, 1e-6);  // generated length 2, the stop token counted
  EXPECT_TRUE(s.finished()[0].stopped);
  EXPECT_FALSE(s.done());
  EXPECT_EQ(s.live()[1].tokens, (std::vector<int32_t>{2, 7}));
  // Step 3 reaches max_new_tokens: every candidate stops; the first B finish.
  c = step(s, {{{3, -0.1f}, {9, -0.2f}, {1, -2.f}, {2, -3.f}}, {{5, -0.06f}, {6, -0.5f}, {1, -2.f}, {2, -3.f}}});
  EXPECT_TRUE(c.empty());
  EXPECT_TRUE(s.done());
  const auto best = s.best(2);
  ASSERT_EQ(best.size(), 2u);
  EXPECT_EQ(best[0].tokens, (std::vector<int32_t>{1, 9}));
  EXPECT_NEAR(best[0].score, -0.15, 1e-6);
  EXPECT_EQ(best[1].tokens, (std::vector<int32_t>{1, 4, 3}));
  EXPECT_NEAR(best[1].score, -0.5 / 3, 1e-6);
  EXPECT_FALSE(best[1].stopped);
  EXPECT_NEAR(best[1].logprobs[2], -0.1f, 1e-7);
  EXPECT_EQ(s.best(1).size(), 1u);
  EXPECT_FALSE(s.step(std::vector<Alts>{}).ok());  // done: no more steps
}

// The three early_stopping modes on one search: true stops once B hypotheses are finished;
// false stops when the best running beam, penalised at its current length, cannot beat the
// worst finished; "never" (length_penalty > 0) judges it at max_new_tokens and goes on.
TEST(BeamSearch, EarlyStoppingModes) {
  const std::vector<std::vector<Alts>> steps = {
      {{{9, -0.1f}, {1, -0.2f}, {2, -0.3f}, {3, -5.f}}},
      {{{9, -0.3f}, {4, -1.0f}, {5, -2.f}, {6, -3.f}}, {{7, -0.1f}, {8, -0.25f}, {9, -3.f}, {6, -4.f}}},
      {{{1, -0.5f}, {2, -0.6f}, {9, -0.7f}, {3, -1.f}}, {{9, -0.29f}, {1, -1.f}, {2, -2.f}, {3, -3.f}}},
      {{{5, -0.01f}, {6, -0.02f}, {7, -1.f}, {8, -2.f}}, {{5, -0.5f}, {6, -0.6f}, {7, -0.7f}, {8, -0.8f}}},
  };
  auto run = [&](EarlyStopping e) {
    BeamSearch s(opts(2, 4, 1.0f, e));
    size_t n = 0;
    while (!s.done() && n < steps.size()) step(s, steps[n++]);
    EXPECT_TRUE(s.done());
    return std::pair(n, s.best(2));
  };
  // true: after step 2 the list holds [9] (-0.1) and [1, 9] (-0.5 / 2).
  auto [n_true, b_true] = run(EarlyStopping::Stop);
  EXPECT_EQ(n_true, 2u);
  ASSERT_EQ(b_true.size(), 2u);
  EXPECT_EQ(b_true[1].tokens, (std::vector<int32_t>{1, 9}));
  EXPECT_NEAR(b_true[1].score, -0.25, 1e-6);
  // false: after step 2 the best running beam (-0.4 / 2 = -0.2) can still beat -0.25; after
  // step 3 (-0.9 / 3 = -0.3) it cannot; [2, 8, 9] at -0.84 / 3 = -0.28 did not make the list.
  auto [n_false, b_false] = run(EarlyStopping::Heuristic);
  EXPECT_EQ(n_false, 3u);
  EXPECT_EQ(b_false[0].tokens, (std::vector<int32_t>{9}));
  EXPECT_EQ(b_false[1].tokens, (std::vector<int32_t>{1, 9}));
  // never: after step 3, -0.9 / 4 = -0.225 > -0.25 goes on; step 4 reaches max_new_tokens and
  // [2, 7, 1, 5] (-0.91 / 4) displaces [1, 9].
  auto [n_never, b_never] = run(EarlyStopping::Never);
  EXPECT_EQ(n_never, 4u);
  EXPECT_EQ(b_never[0].tokens, (std::vector<int32_t>{9}));
  EXPECT_EQ(b_never[1].tokens, (std::vector<int32_t>{2, 7, 1, 5}));
  EXPECT_NEAR(b_never[1].score, -0.91 / 4, 1e-6);
}

// length_penalty 0 ranks by the sum of log-probs; 2 favours the longer hypothesis.
TEST(BeamSearch, LengthPenaltyDividesByTheGeneratedLength) {
  auto run = [](float lp) {
    BeamSearch s(opts(1, 3, lp, EarlyStopping::Heuristic));
    step(s, {{{1, -0.5f}, {9, -0.6f}}});                    // 9 ranks second: not finished
    step(s, {{{9, -0.4f}, {2, -0.45f}}});                   // [1, 9] = -0.9 over 2 tokens
    if (!s.done()) step(s, {{{3, -0.1f}, {9, -0.2f}}});     // [1, 2, 3] = -1.05 over 3
    return s.best(1);
  };
  // lp 0: [1, 9] at -0.9 is full and the running -0.95 cannot beat it: done at step 2.
  EXPECT_EQ(run(0.0f)[0].tokens, (std::vector<int32_t>{1, 9}));
  EXPECT_NEAR(run(0.0f)[0].score, -0.9, 1e-6);
  // lp 2: -0.9 / 4 = -0.225; running -0.95 / 4 = -0.2375 cannot beat it either; done.
  EXPECT_NEAR(run(2.0f)[0].score, -0.225, 1e-6);
  // lp 2 with early_stopping never judges the runner at max length 3: -0.95 / 9 > -0.225, so
  // it goes on, and [1, 2, 3] at -1.05 / 9 wins.
  BeamSearch s(opts(1, 3, 2.0f, EarlyStopping::Never));
  step(s, {{{1, -0.5f}, {9, -0.6f}}});
  step(s, {{{9, -0.4f}, {2, -0.45f}}});
  ASSERT_FALSE(s.done());
  step(s, {{{3, -0.1f}, {9, -0.2f}}});
  ASSERT_TRUE(s.done());
  EXPECT_EQ(s.best(1)[0].tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_NEAR(s.best(1)[0].score, -1.05 / 9, 1e-6);
}

TEST(BeamSearch, RefusesInputThatDoesNotFitTheLiveBeams) {
  BeamSearch s(opts(2, 5, 1.0f, EarlyStopping::Heuristic));
  auto wrong = s.step(std::vector<Alts>{{{1, -1.f}}, {{2, -1.f}}});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.error().find("2 beams reported alternatives, 1 are live"), std::string::npos) << wrong.error();
  auto none = s.step(std::vector<Alts>{{}});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().find("no alternatives"), std::string::npos);
}

}  // namespace
}  // namespace conveyor

// The completions fields of issue 29 as parse_completion_request reads them: the scoring
// idiom (echo, max_tokens 0, logprobs: lm-evaluation-harness's loglikelihood request, prompts
// as token ids or text), and best_of by sampling (best_of >= n, not streamed when larger,
// 128 at most). What the core does with them: tests/coordinator/test_scoring_best_of.cc and
// tests/cluster/test_api_engine.cc.
#include "tests/coordinator/rest/openai_test_util.h"

namespace conveyor {
namespace {

using namespace openai_test;

TEST(ParseScoring, LmEvalLoglikelihoodRequests) {
  // lm-evaluation-harness's shape: a batch of token-id prompts, greedy, echo, top-1 or top-5.
  const json ids = json::array({ids_of_length(12), ids_of_length(5)});
  for (int logprobs : {1, 5}) {
    const json body = {{"model", kModel}, {"prompt", ids},   {"temperature", 0}, {"max_tokens", 0},
                       {"echo", true},    {"logprobs", logprobs}, {"seed", 1234}};
    const CompletionRequest r = ok(body);
    EXPECT_EQ(r.max_tokens, 0);
    EXPECT_TRUE(r.echo);
    EXPECT_EQ(r.logprobs, logprobs);
    ASSERT_EQ(r.prompts.size(), 2u);
    EXPECT_EQ(r.prompts[1].size(), 5u);
  }
  // Text prompts, and a prompt that fills the whole context (nothing to generate, so it fits).
  EXPECT_EQ(ok(with(with(with(kBase, "max_tokens", 0), "echo", true), "logprobs", 5)).prompts.size(), 1u);
  const json full = {{"model", kModel}, {"prompt", ids_of_length(size_t(cfg().n_positions))}, {"max_tokens", 0},
                     {"echo", true}, {"logprobs", 0}};
  EXPECT_EQ(ok(full).prompts[0].size(), size_t(cfg().n_positions));
  // Echo without logprobs returns the prompt alone; no echo is refused: it would return nothing.
  ok(with(with(kBase, "max_tokens", 0), "echo", true));
  EXPECT_NE(refused(with(with(kBase, "max_tokens", 0), "logprobs", 1), "max_tokens").find("needs echo"),
            std::string::npos);
  refused(with(with(with(kBase, "max_tokens", 0), "echo", true), "use_beam_search", true), "max_tokens");
  // Streamed too (one chunk, then [DONE]).
  ok(with(with(with(kBase, "max_tokens", 0), "echo", true), "stream", true));
}

TEST(ParseBestOf, SamplesRankedByLogprob) {
  const CompletionRequest r = ok(with(with(kBase, "best_of", 5), "n", 2));
  EXPECT_EQ(r.best_of, 5);
  EXPECT_EQ(r.n, 2);
  EXPECT_TRUE(r.ranks_samples());
  EXPECT_EQ(r.slots_per_prompt(), 5u);
  EXPECT_EQ(r.num_sequences(), 5u);
  EXPECT_EQ(r.num_choices(), 2u);
  // Default best_of = n: plain samples.
  const CompletionRequest plain = ok(with(kBase, "n", 3));
  EXPECT_EQ(plain.best_of, 3);
  EXPECT_FALSE(plain.ranks_samples());
  EXPECT_EQ(plain.num_sequences(), 3u);
  // best_of < n, streamed best_of > n (as OpenAI), and past the cap are refused.
  EXPECT_NE(refused(with(with(kBase, "best_of", 2), "n", 3), "best_of").find("at least n"), std::string::npos);
  EXPECT_NE(refused(with(with(kBase, "best_of", 3), "stream", true), "best_of").find("cannot be streamed"),
            std::string::npos);
  ok(with(with(with(kBase, "best_of", 3), "n", 3), "stream", true));
  ok(with(with(kBase, "best_of", 128), "n", 1));
  EXPECT_NE(refused(with(kBase, "best_of", 129), "best_of").find("between 1 and 128"), std::string::npos);
  refused(with(kBase, "best_of", 0), "best_of");
  // Beam search keeps its own width limit.
  refused(with(with(kBase, "use_beam_search", true), "best_of", 11), "best_of");
}

}  // namespace
}  // namespace conveyor

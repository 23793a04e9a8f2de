// Requests and answers for the prefix-reuse tests (tests/coordinator/test_prefix_reuse.cc on
// CPU stages, tests/stage/cuda/test_gpu_prefix_reuse.cc on GPU stages): prompts that share a
// first part, sampled requests with log-probs, and each choice's tokens, log-probs, top
// alternatives and reused prompt tokens as the scheduler delivered them.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/coordinator/inproc_pipeline.h"

namespace conveyor::testing {

// `shared` tokens every prompt has, then `own` tokens of its own (seeded by `which`).
inline std::vector<int32_t> prompt(int shared, int own, int which) {
  std::vector<int32_t> p(size_t(shared + own));
  for (int i = 0; i < shared; ++i) p[size_t(i)] = 100 + 7 * i;
  for (int i = 0; i < own; ++i) p[size_t(shared + i)] = 2000 + 31 * which + i;
  return p;
}

inline std::shared_ptr<CompletionRequest> request(std::vector<int32_t> p, int max_tokens, int n = 1) {
  auto r = std::make_shared<CompletionRequest>();
  r->prompts = {std::move(p)};
  r->n = n;
  r->max_tokens = max_tokens;
  r->ignore_eos = true;
  r->logprobs = 2;
  r->sampling.temperature = 0.9f;
  r->sampling.top_k = 50;
  r->sampling.seed = 1234;
  return r;
}

struct Answer {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> top;
  int64_t cached = -1;
  bool operator==(const Answer& o) const {  // cached is what differs between the runs
    return tokens == o.tokens && logprobs == o.logprobs && top == o.top;
  }
};

inline std::vector<Answer> answers(const Collected& c, size_t choices) {
  std::vector<Answer> out(choices);
  for (const ChoiceUpdate& u : c.updates) {
    for (const TokenOut& t : u.tokens) {
      out[u.choice].tokens.push_back(t.id);
      out[u.choice].logprobs.push_back(t.logprob);
      out[u.choice].top.push_back(t.top);
    }
    if (u.cached_prompt_tokens) out[u.choice].cached = *u.cached_prompt_tokens;
  }
  return out;
}

inline std::vector<Answer> run(InprocPipeline& p, std::shared_ptr<CompletionRequest> r,
                        const std::function<bool(int64_t)>& before_batch = {}) {
  Collected c;
  EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle(before_batch);
  EXPECT_EQ(c.done, std::vector<std::string>{""});
  return answers(c, r->num_choices());
}

}  // namespace conveyor::testing

// The plain request the scheduler and engine tests submit: one greedy choice of `max_tokens`
// over a prompt of token ids 1..prompt_len.
#pragma once

#include <memory>
#include <numeric>
#include <vector>

#include "coordinator/completion.h"

namespace conveyor::testing {

inline std::shared_ptr<CompletionRequest> greedy_request(int prompt_len, int max_tokens) {
  auto r = std::make_shared<CompletionRequest>();
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
  std::iota(prompt.begin(), prompt.end(), 1);
  r->prompts = {prompt};
  r->max_tokens = max_tokens;
  r->sampling.temperature = 0;
  return r;
}

}  // namespace conveyor::testing

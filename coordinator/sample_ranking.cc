// best_of by sampling (CompletionRequest::ranks_samples, OpenAI's legacy completions): a prompt
// runs best_of samples, sample k on Philox stream k (so a choice depends on the request and its
// seed alone), and returns the n whose tokens have the highest cumulative log-probability, best
// first; equal sums keep the lower stream first. A sample's updates are folded into one record
// until every sample of its prompt is done; then its prompt's n choices go out, one update each.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "coordinator/scheduler.h"

namespace conveyor {

void Scheduler::emit(Sequence& s, ChoiceUpdate u) {
  Request& r = *s.request;
  if (!r.req->ranks_samples()) return r.sink.on_update(std::move(u));
  Request::Sample& k = r.samples[s.choice];
  ChoiceUpdate& kept = k.update;
  for (const TokenOut& t : u.tokens) k.logprob += double(t.logprob);
  if (!u.prompt_tokens.empty()) kept.prompt_tokens = std::move(u.prompt_tokens);
  kept.tokens.insert(kept.tokens.end(), std::make_move_iterator(u.tokens.begin()), std::make_move_iterator(u.tokens.end()));
  kept.text += u.text;
  if (u.cached_prompt_tokens) kept.cached_prompt_tokens = u.cached_prompt_tokens;
  if (!u.finish_reason) return;
  kept.finish_reason = std::move(u.finish_reason);
  k.done = true;
  const size_t slots = r.req->slots_per_prompt(), prompt = s.choice / slots;
  for (size_t j = 0; j < slots; ++j)
    if (!r.samples[prompt * slots + j].done) return;
  send_best_samples(r, prompt);
}

void Scheduler::send_best_samples(Request& r, size_t prompt) {
  const size_t slots = r.req->slots_per_prompt(), n = size_t(r.req->n);
  Request::Sample* first = r.samples.data() + prompt * slots;
  auto score = [&](size_t k) { return std::isnan(first[k].logprob) ? -INFINITY : first[k].logprob; };
  std::vector<size_t> order(slots);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return score(a) > score(b); });
  for (size_t j = 0; j < n && j < slots; ++j) {
    ChoiceUpdate u = std::move(first[order[j]].update);
    u.choice = prompt * n + j;
    r.sink.on_update(std::move(u));
  }
}

}  // namespace conveyor

// The contract between the coordinator's REST layer (http_server, openai_api) and its
// core (the scheduler): a validated completion request in token ids, and the stream of
// updates the core produces for it.
//
// One request has prompts.size() * n choices; choice c is prompt c / n, sample c % n.
// Each choice is one sequence in the pipeline; with beam search, each prompt runs best_of
// beam sequences and its n choices are the best finished beams, sent once each at the end;
// with best_of > n (sampling), each prompt runs best_of samples and its n choices are the
// samples of highest cumulative log-probability, best first, sent once each at the end. A
// request with max_tokens 0 (echo: the scoring idiom) generates nothing: each choice's one
// update carries the prompt's log-probs and finish_reason "length". The core calls the
// request's sink from its own thread, in order for each choice: zero or more updates with generated tokens, the
// last of which carries finish_reason. Text deltas are final: stop strings have been
// applied (the text ends before the stop string; generation stops there) and no delta
// ends inside a UTF-8 character or inside a possible stop-string prefix (the core holds
// those bytes back until it knows).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/sampling_params.h"
#include "coordinator/beam_search.h"
#include "coordinator/core_status.h"

namespace conveyor {

struct CompletionRequest {
  // "cmpl-..."; set by the REST layer, which returns it in X-Request-Id; the request log
  // (coordinator/request_log.h) names the request by it.
  std::string id;
  std::string model;
  std::vector<std::vector<int32_t>> prompts;  // token ids, each non-empty
  int max_tokens = 16;                     // per choice; prompt + max_tokens <= n_positions; 0: echo only
  SamplingParams sampling;                 // seed filled in (random when the client gave none)
  std::vector<std::string> stop;           // stop strings (at most 4, non-empty)
  int n = 1;
  int logprobs = -1;                       // -1: not requested; else top-N alternatives (0..20)
  bool echo = false;                       // prepend the prompt (and its log-probs when requested)
  bool stream = false;
  bool return_token_ids = false;
  bool ignore_eos = false;                 // extension: do not stop at the model's eos token
  // Beam search (vLLM's use_beam_search): best_of beams per prompt, the best n returned as the
  // prompt's choices, each in one update at the end (tokens, text, finish_reason).
  bool use_beam_search = false;
  // The beam width when use_beam_search; otherwise the samples drawn per prompt, of which the
  // n with the highest cumulative log-probability are returned (best_of >= n; n when equal).
  int best_of = 1;
  float length_penalty = 1.0f;             // HuggingFace's meaning (coordinator/beam_search.h)
  EarlyStopping early_stopping = EarlyStopping::Heuristic;
  std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();

  size_t num_choices() const { return prompts.size() * size_t(n); }
  // Sampling best_of > n: samples are drawn, ranked, and only the best n returned.
  bool ranks_samples() const { return !use_beam_search && best_of > n; }
  // How the core numbers a prompt's sequences: prompt p's k-th is slot p * slots + k, and k is
  // the sample's Philox stream (a choice's draws depend on the request alone). Beam search
  // numbers its choices (n).
  size_t slots_per_prompt() const { return size_t(ranks_samples() ? best_of : n); }
  // Sequences the request runs at once: a sample each, or best_of beams per prompt.
  size_t num_sequences() const { return prompts.size() * size_t(use_beam_search ? best_of : int(slots_per_prompt())); }
};

struct TokenOut {
  int32_t id = -1;
  float logprob = 0;                                    // NaN for a prompt's first token
  std::vector<std::pair<int32_t, float>> top;           // when logprobs > 0
};

struct ChoiceUpdate {
  size_t choice = 0;
  std::vector<TokenOut> prompt_tokens;      // echo with logprobs: once, in the first update
  std::vector<TokenOut> tokens;             // tokens generated since the last update
  std::string text;                         // text delta (see above)
  std::optional<std::string> finish_reason; // "stop" or "length": the choice's last update
  // With the last update: how many of its prompt's tokens were forked from the prefix cache
  // rather than computed (usage.prompt_tokens_details.cached_tokens).
  std::optional<int64_t> cached_prompt_tokens;
};

// How the core talks back. Called from the core's thread; must not block for long (the
// REST layer posts to its own executor).
struct CompletionSink {
  std::function<void(ChoiceUpdate)> on_update;
  // Every choice finished (after the last on_update) or the request failed (`error` set:
  // the message says why; no further calls). Exactly once, unless on_refused is called.
  std::function<void(const std::string& error)> on_done;
  // Optional. The core accepted the request but refuses it before it ran a step (it waited
  // in the queue past scheduler.pipeline_wait_ms with no pipeline able to serve): `why`
  // is a refusal as submit() would have answered it (Unavailable, with a retry_after).
  // Called instead of on_done, and then nothing else; when unset, on_done gets the message.
  std::function<void(const CoreStatus& why)> on_refused;
};

// Ends an accepted request that never ran with a refusal (see CompletionSink::on_refused).
inline void refuse_accepted(CompletionSink& sink, const CoreStatus& why) {
  if (sink.on_refused) sink.on_refused(why);
  else sink.on_done(why.message);
}

// The core as the REST layer sees it (implemented by coordinator/coordinator.h).
class CompletionBackend {
 public:
  virtual ~CompletionBackend() = default;
  // Takes the request or says why not. Accepted requests always end in sink.on_done.
  virtual CoreStatus submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) = 0;
  // The client went away: stop `request` (the one submitted) at the next step, freeing its
  // sequences and K/V; its sink still gets on_done (with a message), and nothing after. A
  // request already finished is left alone. Any thread.
  virtual void cancel(const CompletionRequest& request) = 0;
};

}  // namespace conveyor

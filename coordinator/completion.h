// The contract between the coordinator's REST layer (http_server, openai_api) and its
// core (the scheduler): a validated completion request in token ids, and the stream of
// updates the core produces for it.
//
// One request has prompts.size() * n choices; choice c is prompt c / n, sample c % n.
// Each choice is one sequence in the pipeline; with beam search, each prompt runs best_of
// beam sequences and its n choices are the best finished beams, sent once each at the end. The core calls the request's sink from its
// own thread, in order for each choice: zero or more updates with generated tokens, the
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
  std::string id;                          // "cmpl-..."; set by the REST layer
  std::string model;
  std::vector<std::vector<int32_t>> prompts;  // token ids, each non-empty
  int max_tokens = 16;                     // per choice; prompt + max_tokens <= n_positions
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
  int best_of = 1;                         // the beam width when use_beam_search
  float length_penalty = 1.0f;             // HuggingFace's meaning (coordinator/beam_search.h)
  EarlyStopping early_stopping = EarlyStopping::Heuristic;
  std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();

  size_t num_choices() const { return prompts.size() * size_t(n); }
  // Sequences the request runs at once: a choice each, or best_of beams per prompt.
  size_t num_sequences() const { return prompts.size() * size_t(use_beam_search ? best_of : n); }
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
};

}  // namespace conveyor

// What the HTTP session asks of an answer in the making, whichever API the request came
// through: /v1/completions (openai_api.h, CompletionResponseBuilder) or /v1/chat/completions
// (chat_api.h, ChatResponseBuilder). Both fold the core's ChoiceUpdates into one JSON
// document, or turn each into an SSE event. Not thread-safe; the session drives it from its
// strand.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "coordinator/completion.h"

namespace conveyor {

// Prompt tokens of a request, each prompt counted once (not n times).
inline int64_t prompt_token_count(const CompletionRequest& request) {
  int64_t n = 0;
  for (const auto& p : request.prompts) n += int64_t(p.size());
  return n;
}

class ResponseBuilder {
 public:
  virtual ~ResponseBuilder() = default;
  // Folds one update in (the non-streaming answer).
  virtual void add(const ChoiceUpdate& update) = 0;
  // The whole answer, with usage.
  virtual nlohmann::json response() const = 0;
  // The events a stream opens with, before any update ("" for none).
  virtual std::string sse_start() { return {}; }
  // Folds `update` in and returns its SSE event ("" when it carries nothing to send).
  virtual std::string sse_chunk(const ChoiceUpdate& update) = 0;
  // After the last update: the usage chunk when asked for, then "data: [DONE]".
  virtual std::string sse_finish() = 0;
  // Prompt tokens, each prompt counted once (for /metrics).
  virtual int64_t prompt_tokens() const = 0;
};

}  // namespace conveyor

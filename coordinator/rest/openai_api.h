// OpenAI's legacy completions API (POST /v1/completions): request validation into a
// CompletionRequest, and the JSON the server sends back (one document, or SSE chunks).
// The field-by-field contract, with Conveyor's choices where OpenAI has no answer, is in
// docs/API.md; this header states only what code needs.
//
// Errors: every refusal is an ApiError that names the offending field (`param`), in the
// shape OpenAI clients parse: {"error": {"message", "type", "param", "code"}}.
//
// Token strings (logprobs `tokens`, `top_logprobs` keys): a token's bytes when they are
// valid UTF-8; otherwise OpenAI's convention "bytes:\xNN\xNN..." (every byte as a literal
// backslash-x escape, lowercase hex), so JSON output is always valid UTF-8 and no two ids
// share a string. Text fields (`text`) are UTF-8 with invalid bytes replaced by U+FFFD.
// `text_offset` counts BYTES of the choice's text up to the token (the echoed prompt
// included when echo is on).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "common/status.h"
#include "coordinator/completion.h"
#include "coordinator/rest/response_builder.h"
#include "model/tokenizer.h"

namespace conveyor {

struct ApiLimits {
  int max_n = 128;                           // choices per prompt, and best_of (sampling); K/V permitting
  int max_prompts = 64;                      // prompts in one request (batch prompt)
  int max_logprobs = 20;                     // `logprobs` upper bound
  int max_stop = 4;                          // stop strings
  int default_max_tokens = 16;               // when the client gives none (clamped to the context)
  size_t max_body_bytes = size_t(4) << 20;   // larger request bodies get 413
};

// One refusal, ready to be sent.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
};

ApiError api_error(int http_status, std::string message, std::string param = {},
                   std::string type = "invalid_request_error", std::string code = {});
nlohmann::json error_json(const ApiError& error);
// error_json(...) serialised (invalid UTF-8 in messages replaced).
std::string error_body(const ApiError& error);

// What shapes a request's answer but not its tokens (so the core never sees it).
struct ResponseOptions {
  bool include_usage = false;      // stream_options.include_usage: a final usage-only chunk
  std::string system_fingerprint;  // system_fingerprint() of the serving model; empty: null
};

// "fp_" and 12 hex digits: a hash of what decides a request's tokens besides the request
// itself: the served model's name, its config, the tokenizer's vocabulary size, and the
// Conveyor build (CONVEYOR_BUILD_ID: the git commit the build was configured at, see
// coordinator/CMakeLists.txt). The same for every request of one server.
std::string system_fingerprint(std::string_view served_model, const ModelConfig& config, const Tokenizer& tokenizer);

// Validates `body` (a parsed JSON value) and turns it into token ids and sampling
// parameters. `served_model`: the name clients must use in `model` (empty: any name is
// accepted). The request gets a fresh "cmpl-" id, its arrival time, and a random seed when
// the client gave none. On failure the result's message is `error->message`, and `*error`
// (when given) says the HTTP status, param and code. On success `*options` (when given)
// gets the answer's options: include_usage and the system fingerprint.
Expected<CompletionRequest> parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                                     const ModelConfig& config, const ApiLimits& limits,
                                                     std::string_view served_model = {},
                                                     ApiError* error = nullptr, ResponseOptions* options = nullptr);
// As above from the raw request body: malformed JSON and non-object bodies are refused too.
Expected<CompletionRequest> parse_completion_body(std::string_view body, const Tokenizer& tokenizer,
                                                  const ModelConfig& config, const ApiLimits& limits,
                                                  std::string_view served_model = {},
                                                  ApiError* error = nullptr, ResponseOptions* options = nullptr);

// Token text for logprobs (see the top of this file).
std::string token_display_string(const Tokenizer& tokenizer, int32_t id);
// JSON dump that never throws on invalid UTF-8 (replaces it with U+FFFD).
std::string dump_json(const nlohmann::json& value);

// Builds a request's answer from the core's ChoiceUpdates: the non-streaming document
// (add() every update, then response()) or one SSE event per update (sse_chunk()).
// Not thread-safe; the REST layer drives it from the request's strand.
class CompletionResponseBuilder : public ResponseBuilder {
 public:
  CompletionResponseBuilder(std::shared_ptr<const CompletionRequest> request, const Tokenizer& tokenizer,
                            int64_t created_unix_seconds, ResponseOptions options);

  // Folds one update in (text, tokens, log-probs, finish_reason). Updates for a choice
  // index out of range are ignored.
  void add(const ChoiceUpdate& update) override;
  // The full "text_completion" object with usage.
  nlohmann::json response() const override;

  // Folds `update` in and returns its SSE event: "data: {chunk}\n\n", the chunk holding
  // this update's part of one choice. With include_usage the chunk has "usage": null;
  // without it, no "usage" field (as OpenAI does).
  std::string sse_chunk(const ChoiceUpdate& update) override;
  // After the last update: with include_usage a usage-only chunk (empty choices), then
  // "data: [DONE]\n\n".
  std::string sse_finish() override;
  // A failure after streaming began: "data: {"error": {...}}\n\n" (the stream then ends).
  static std::string sse_error(const ApiError& error);

  bool all_finished() const { return finished_choices_ == choices_.size(); }
  int64_t prompt_tokens() const override;  // each prompt counted once (not n times)
  int64_t completion_tokens() const;  // generated tokens over all choices
  int64_t cached_tokens() const;      // prompt tokens reused from the prefix cache, each prompt once
  const CompletionRequest& request() const { return *request_; }

 private:
  struct Choice {
    std::string text;  // raw bytes as the core sent them (echoed prompt included)
    std::vector<int32_t> token_ids;
    bool started = false;  // the echo (text, and prompt ids) went out
    size_t text_offset = 0;  // bytes of this choice's token text so far (for text_offset)
    nlohmann::json lp_tokens = nlohmann::json::array(), lp_token_logprobs = nlohmann::json::array(),
                   lp_top = nlohmann::json::array(), lp_offsets = nlohmann::json::array();
    std::optional<std::string> finish_reason;
    int64_t completion_tokens = 0;
    int64_t cached_prompt_tokens = 0;  // of its prompt, forked from the prefix cache
  };
  // Applies `update` to its choice; returns the choice object for this delta (text, index,
  // logprobs, finish_reason, token_ids) as a chunk would carry it.
  nlohmann::json apply(const ChoiceUpdate& update);
  void append_logprobs(Choice& c, const std::vector<TokenOut>& tokens, bool prompt, nlohmann::json& delta);
  nlohmann::json usage() const;
  nlohmann::json envelope() const;

  std::shared_ptr<const CompletionRequest> request_;
  const Tokenizer& tokenizer_;
  int64_t created_;
  ResponseOptions options_;
  std::vector<Choice> choices_;
  size_t finished_choices_ = 0;
};

}  // namespace conveyor

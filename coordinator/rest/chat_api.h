// OpenAI's chat completions API (POST /v1/chat/completions): the conversation rendered into
// a prompt by the server's chat template (model/chat_template.h), the request validated into
// a CompletionRequest, and the answers in chat's shapes (chat.completion, or
// chat.completion.chunk events). docs/API.md has the field-by-field contract.
//
// Validation reuses /v1/completions': the chat-only fields (messages, logprobs as a boolean
// with top_logprobs, max_completion_tokens, add_generation_prompt) are read here, the rest
// (sampling, n, stop, seed, stream_options, ...) goes through parse_completion_request with
// the rendered prompt as token ids, so both APIs refuse and default alike.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/rest/openai_api.h"
#include "model/chat_template.h"

namespace conveyor {

// The server's chat set-up (RestContext::chat).
struct ChatSettings {
  std::optional<ChatTemplate> chat_template;  // none: chat requests get a 400 that says how to give one
  std::string bos_token = "<|endoftext|>";    // the template's bos_token / eos_token
  std::string eos_token = "<|endoftext|>";
};

// The chat set-up of a server of the model in `model_dir`: the template `spec` names (a
// built-in or a file; empty: the model's own, when its tokenizer_config.json has one) and the
// model's bos/eos texts. Errors name the file or the template's syntax error.
Expected<std::shared_ptr<const ChatSettings>> load_chat_settings(const std::string& model_dir, const std::string& spec);

// How a JSON value is described in "got ..." messages ("a string", "an array", ...).
std::string json_type_name(const nlohmann::ordered_json& v);

// Renders `messages` (the client's, validated: a non-empty array of {role, content, ...}
// with content a string, null or text parts) with the server's template. Errors (400, param
// "messages"): malformed messages, no template, the template refusing the conversation.
Expected<std::string> render_chat_prompt(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                         const ChatSettings& chat, ApiError* error);

// `text`'s token ids, where the bos and eos token texts (when the vocabulary has them) are
// those tokens rather than text, as HF tokenizers treat special tokens in a rendered chat.
std::vector<int32_t> encode_chat_prompt(const Tokenizer& tokenizer, std::string_view text, const ChatSettings& chat);

// Validates a chat request body into a CompletionRequest with one prompt (id "chatcmpl-...").
// As parse_completion_body for the rest: `*error` says the status and param on failure,
// `*options` gets include_usage and the system fingerprint on success.
Expected<CompletionRequest> parse_chat_body(std::string_view body, const ChatSettings& chat, const Tokenizer& tokenizer,
                                            const ModelConfig& config, const ApiLimits& limits,
                                            std::string_view served_model = {}, ApiError* error = nullptr,
                                            ResponseOptions* options = nullptr);

// A chat request's answer: "chat.completion" with choices[].message {role, content},
// finish_reason, logprobs.content when asked, usage; streamed as "chat.completion.chunk"
// events, each choice opening with a delta holding its role.
class ChatResponseBuilder : public ResponseBuilder {
 public:
  ChatResponseBuilder(std::shared_ptr<const CompletionRequest> request, const Tokenizer& tokenizer,
                      int64_t created_unix_seconds, ResponseOptions options);

  void add(const ChoiceUpdate& update) override;
  nlohmann::json response() const override;
  std::string sse_start() override;
  std::string sse_chunk(const ChoiceUpdate& update) override;
  std::string sse_finish() override;
  int64_t prompt_tokens() const override;

 private:
  struct Choice {
    std::string content;
    nlohmann::json logprobs = nlohmann::json::array();  // logprobs.content entries
    std::optional<std::string> finish_reason;
    int64_t completion_tokens = 0;
    int64_t cached_prompt_tokens = 0;
  };
  // Folds `update` into its choice; returns the logprobs.content entries of its tokens.
  nlohmann::json apply(const ChoiceUpdate& update);
  nlohmann::json token_logprob(int32_t id, float logprob) const;
  nlohmann::json chunk(nlohmann::json choice) const;
  nlohmann::json envelope(const char* object) const;
  nlohmann::json usage() const;

  std::shared_ptr<const CompletionRequest> request_;
  const Tokenizer& tokenizer_;
  int64_t created_;
  ResponseOptions options_;
  std::vector<Choice> choices_;
};

}  // namespace conveyor

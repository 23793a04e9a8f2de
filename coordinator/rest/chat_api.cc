// POST /v1/chat/completions: see chat_api.h.
#include "coordinator/rest/chat_api.h"

#include <cmath>
#include <set>

#include "common/json_limits.h"

namespace conveyor {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

constexpr size_t kMaxMessages = 4096;

// The fields /v1/chat/completions passes on to the completions parser as they are.
const std::set<std::string>& shared_fields() {
  static const std::set<std::string> k = {
      "model",          "temperature",      "top_p",          "top_k",          "n",
      "stream",         "stream_options",   "stop",           "seed",           "presence_penalty",
      "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",    "user",
      "ignore_eos",     "use_beam_search",  "best_of",        "length_penalty", "early_stopping"};
  return k;
}

// Chat's own fields, read here.
const std::set<std::string>& chat_fields() {
  static const std::set<std::string> k = {"messages", "max_tokens", "max_completion_tokens", "logprobs",
                                          "top_logprobs", "add_generation_prompt"};
  return k;
}

// OpenAI fields this server does not implement: refused by name rather than as unknown.
const std::set<std::string>& unsupported_fields() {
  static const std::set<std::string> k = {"tools", "tool_choice", "functions", "function_call", "response_format",
                                          "parallel_tool_calls", "audio", "modalities", "prediction"};
  return k;
}

Expected<CompletionRequest> refuse(ApiError e, ApiError* out) {
  if (out) *out = e;
  return Status::error(e.message);
}

bool bad_message(ApiError* error, std::string message) {
  if (error) *error = api_error(400, std::move(message), "messages");
  return false;
}

// One message, with its content made a string (text parts joined by "\n"; null: "").
bool normalise_message(const ordered_json& m, size_t i, ordered_json& out, ApiError* error) {
  const std::string where = "'messages'[" + std::to_string(i) + "]";
  if (!m.is_object()) return bad_message(error, where + " must be an object, got " + json_type_name(m));
  auto role = m.find("role");
  if (role == m.end() || !role->is_string() || role->get<std::string>().empty())
    return bad_message(error, where + ".role must be a non-empty string");
  out = m;
  auto content = m.find("content");
  if (content == m.end() || content->is_null()) {
    out["content"] = "";
  } else if (content->is_array()) {
    std::string text;
    for (size_t k = 0; k < content->size(); ++k) {
      const ordered_json& part = (*content)[k];
      const std::string at = where + ".content[" + std::to_string(k) + "]";
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
        return bad_message(error, at + " must be a text part {\"type\": \"text\", \"text\": ...}; this server takes text only");
      text += (k ? "\n" : "") + part["text"].get<std::string>();
    }
    out["content"] = text;
  } else if (!content->is_string()) {
    return bad_message(error, where + ".content must be a string, an array of text parts or null, got " + json_type_name(*content));
  }
  return true;
}

// The completions body the rest of the request becomes: the shared fields, the prompt as
// token ids, logprobs as the completions API counts them, max_tokens.
json completion_body(const ordered_json& body, std::vector<int32_t> prompt, int logprobs) {
  json out = json::object();
  for (const auto& [key, value] : body.items())
    if (shared_fields().count(key)) out[key] = json::parse(value.dump());
  out["prompt"] = std::move(prompt);
  if (logprobs >= 0) out["logprobs"] = logprobs;
  if (auto it = body.find("max_completion_tokens"); it != body.end() && !it->is_null()) out["max_tokens"] = json::parse(it->dump());
  else if (auto m = body.find("max_tokens"); m != body.end() && !m->is_null()) out["max_tokens"] = json::parse(m->dump());
  return out;
}

// logprobs (a boolean) and top_logprobs (0..max, only with logprobs): the completions
// API's `logprobs` count, -1 for none.
bool read_logprobs(const ordered_json& body, const ApiLimits& limits, int& logprobs, ApiError* error) {
  logprobs = -1;
  const auto lp = body.find("logprobs");
  const auto top = body.find("top_logprobs");
  const bool on = lp != body.end() && lp->is_boolean() && lp->get<bool>();
  if (lp != body.end() && !lp->is_null() && !lp->is_boolean()) {
    if (error) *error = api_error(400, "'logprobs' must be a boolean, got " + json_type_name(*lp), "logprobs");
    return false;
  }
  if (top != body.end() && !top->is_null()) {
    if (!top->is_number_integer() || top->get<int64_t>() < 0 || top->get<int64_t>() > limits.max_logprobs) {
      if (error)
        *error = api_error(400, "'top_logprobs' must be an integer between 0 and " + std::to_string(limits.max_logprobs) +
                                    ", got " + top->dump(), "top_logprobs");
      return false;
    }
    if (!on) {
      if (error) *error = api_error(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs");
      return false;
    }
  }
  if (on) logprobs = top != body.end() && top->is_number_integer() ? int(top->get<int64_t>()) : 0;
  return true;
}

// Every field is known; the unsupported are refused by name; both max_tokens names agree.
bool check_fields(const ordered_json& body, ApiError* error) {
  for (const auto& [key, value] : body.items()) {
    if (unsupported_fields().count(key) && !value.is_null()) {
      const bool harmless = key == "tool_choice" && value == "none";
      if (harmless) continue;
      if (error) *error = api_error(400, "'" + key + "' is not supported by this server", key);
      return false;
    }
    if (!shared_fields().count(key) && !chat_fields().count(key) && !unsupported_fields().count(key)) {
      if (error)
        *error = api_error(400, "unknown field '" + key + "' (see docs/API.md for the fields /v1/chat/completions accepts)", key);
      return false;
    }
  }
  const auto a = body.find("max_tokens"), b = body.find("max_completion_tokens");
  if (a != body.end() && b != body.end() && !a->is_null() && !b->is_null() && *a != *b) {
    if (error) *error = api_error(400, "'max_tokens' and 'max_completion_tokens' differ; give one", "max_completion_tokens");
    return false;
  }
  return true;
}

}  // namespace

std::string json_type_name(const ordered_json& v) {
  if (v.is_string()) return "a string";
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a non-integer number";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  return "an object";
}

Expected<std::shared_ptr<const ChatSettings>> load_chat_settings(const std::string& model_dir, const std::string& spec) {
  Expected<ModelChatConfig> model = load_model_chat_config(model_dir);
  if (!model.ok()) return model.status();
  Expected<std::optional<ChatTemplate>> chosen = choose_chat_template(spec, model.value());
  if (!chosen.ok()) return chosen.status();
  auto out = std::make_shared<ChatSettings>();
  out->chat_template = std::move(chosen).value();
  out->bos_token = model.value().bos_token;
  out->eos_token = model.value().eos_token;
  return std::shared_ptr<const ChatSettings>(std::move(out));
}

Expected<std::string> render_chat_prompt(const ordered_json& messages, bool add_generation_prompt,
                                         const ChatSettings& chat, ApiError* error) {
  auto fail = [&](ApiError e) -> Expected<std::string> {
    if (error) *error = e;
    return Status::error(e.message);
  };
  if (!messages.is_array()) return fail(api_error(400, "'messages' must be an array of messages, got " + json_type_name(messages), "messages"));
  if (messages.empty()) return fail(api_error(400, "'messages' is empty", "messages"));
  if (messages.size() > kMaxMessages)
    return fail(api_error(400, "'messages' holds " + std::to_string(messages.size()) + " messages; at most " +
                                   std::to_string(kMaxMessages) + " are allowed", "messages"));
  ordered_json normalised = ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    ordered_json m;
    ApiError e;
    if (!normalise_message(messages[i], i, m, &e)) return fail(e);
    normalised.push_back(std::move(m));
  }
  if (!chat.chat_template)
    return fail(api_error(400,
                          "this model has no chat template (no 'chat_template' in its tokenizer_config.json); start the "
                          "server with one: conveyor-coordinator --chat-template FILE|NAME, 'model.chat_template' in the "
                          "cluster file, or conveyor local --chat-template FILE|NAME (built-in names: chatml, llama2, "
                          "llama3, mistral, zephyr, gemma), or use /v1/completions",
                          "messages", "invalid_request_error", "chat_template_missing"));
  const ordered_json variables = {{"messages", std::move(normalised)}, {"tools", nullptr}, {"documents", nullptr},
                                  {"add_generation_prompt", add_generation_prompt},
                                  {"bos_token", chat.bos_token}, {"eos_token", chat.eos_token}};
  ChatTemplateError template_error;
  std::optional<std::string> text = chat.chat_template->render(variables, &template_error);
  if (!text) return fail(api_error(400, template_error.message, "messages"));
  return std::move(*text);
}

std::vector<int32_t> encode_chat_prompt(const Tokenizer& tokenizer, std::string_view text, const ChatSettings& chat) {
  std::vector<std::pair<std::string, int32_t>> specials;
  for (const std::string& t : {chat.bos_token, chat.eos_token})
    if (auto id = t.empty() ? std::nullopt : tokenizer.token_id(t)) specials.emplace_back(t, *id);
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t hit = std::string_view::npos;
    const std::pair<std::string, int32_t>* which = nullptr;
    for (const auto& s : specials)
      if (size_t h = text.find(s.first, pos); h < hit) hit = h, which = &s;
    const std::vector<int32_t> part = tokenizer.encode(text.substr(pos, hit == std::string_view::npos ? hit : hit - pos));
    ids.insert(ids.end(), part.begin(), part.end());
    if (!which) break;
    ids.push_back(which->second);
    pos = hit + which->first.size();
  }
  return ids;
}

Expected<CompletionRequest> parse_chat_body(std::string_view body_text, const ChatSettings& chat,
                                            const Tokenizer& tokenizer, const ModelConfig& config,
                                            const ApiLimits& limits, std::string_view served_model, ApiError* error,
                                            ResponseOptions* options) {
  ordered_json body;
  try {
    body = ordered_json::parse(body_text.begin(), body_text.end());
  } catch (const ordered_json::exception& e) {
    return refuse(api_error(400, std::string("the request body is not valid JSON: ") + e.what()), error);
  }
  if (!body.is_object()) return refuse(api_error(400, "the request body must be a JSON object, got " + json_type_name(body)), error);
  if (json_deeper_than(json::parse(body_text.begin(), body_text.end()), kMaxJsonDepth))
    return refuse(api_error(400, "the request body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels"), error);
  ApiError e;
  int logprobs = -1;
  if (!check_fields(body, &e) || !read_logprobs(body, limits, logprobs, &e)) return refuse(e, error);
  auto messages = body.find("messages");
  if (messages == body.end() || messages->is_null()) return refuse(api_error(400, "'messages' is required", "messages"), error);
  bool add_generation_prompt = true;
  if (auto agp = body.find("add_generation_prompt"); agp != body.end() && !agp->is_null()) {
    if (!agp->is_boolean())
      return refuse(api_error(400, "'add_generation_prompt' must be a boolean, got " + json_type_name(*agp), "add_generation_prompt"), error);
    add_generation_prompt = agp->get<bool>();
  }
  Expected<std::string> prompt = render_chat_prompt(*messages, add_generation_prompt, chat, &e);
  if (!prompt.ok()) return refuse(e, error);
  std::vector<int32_t> ids = encode_chat_prompt(tokenizer, prompt.value(), chat);
  if (ids.empty()) return refuse(api_error(400, "the conversation renders to an empty prompt", "messages"), error);
  if (config.n_positions > 0 && int64_t(ids.size()) >= config.n_positions)
    return refuse(api_error(400, "this model's maximum context length is " + std::to_string(config.n_positions) +
                                     " tokens, however the conversation renders to " + std::to_string(ids.size()) +
                                     " tokens, which leaves no room for a reply; shorten the messages", "messages"),
                  error);
  Expected<CompletionRequest> req = parse_completion_request(completion_body(body, std::move(ids), logprobs), tokenizer,
                                                             config, limits, served_model, &e, options);
  if (!req.ok()) {
    if (e.param == "max_tokens" && body.contains("max_completion_tokens")) e.param = "max_completion_tokens";
    if (e.param == "logprobs") e.param = "top_logprobs";
    return refuse(e, error);
  }
  CompletionRequest out = std::move(req).value();
  if (out.id.starts_with("cmpl-")) out.id = "chatcmpl-" + out.id.substr(5);
  return out;
}

// ---------------------------------------------------------------------------------------
// Answers

ChatResponseBuilder::ChatResponseBuilder(std::shared_ptr<const CompletionRequest> request, const Tokenizer& tokenizer,
                                         int64_t created_unix_seconds, ResponseOptions options)
    : request_(std::move(request)), tokenizer_(tokenizer), created_(created_unix_seconds),
      options_(std::move(options)), choices_(request_->num_choices()) {}

int64_t ChatResponseBuilder::prompt_tokens() const { return prompt_token_count(*request_); }

json ChatResponseBuilder::usage() const {
  int64_t completion = 0, cached = 0;
  for (const Choice& c : choices_) completion += c.completion_tokens;
  for (size_t i = 0; i < choices_.size(); i += size_t(request_->n)) cached += choices_[i].cached_prompt_tokens;
  const int64_t prompt = prompt_tokens();
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

json ChatResponseBuilder::envelope(const char* object) const {
  json e = {{"id", request_->id}, {"object", object}, {"created", created_}, {"model", request_->model},
            {"system_fingerprint", nullptr}};
  if (!options_.system_fingerprint.empty()) e["system_fingerprint"] = options_.system_fingerprint;
  return e;
}

json ChatResponseBuilder::token_logprob(int32_t id, float logprob) const {
  const std::string bytes = tokenizer_.token_bytes(id);
  json b = json::array();
  for (unsigned char c : bytes) b.push_back(int(c));
  return {{"token", token_display_string(tokenizer_, id)},
          {"logprob", std::isnan(logprob) ? json(nullptr) : json(double(logprob))},
          {"bytes", std::move(b)}};
}

json ChatResponseBuilder::apply(const ChoiceUpdate& update) {
  Choice& c = choices_[update.choice];
  if (update.cached_prompt_tokens) c.cached_prompt_tokens = *update.cached_prompt_tokens;
  c.content += update.text;
  c.completion_tokens += int64_t(update.tokens.size());
  if (update.finish_reason && !c.finish_reason) c.finish_reason = update.finish_reason;
  json entries = json::array();
  if (request_->logprobs < 0) return entries;
  for (const TokenOut& t : update.tokens) {
    json entry = token_logprob(t.id, t.logprob);
    json top = json::array();
    for (const auto& [id, lp] : t.top)
      if (top.size() < size_t(request_->logprobs)) top.push_back(token_logprob(id, lp));
    entry["top_logprobs"] = std::move(top);
    c.logprobs.push_back(entry);
    entries.push_back(std::move(entry));
  }
  return entries;
}

void ChatResponseBuilder::add(const ChoiceUpdate& update) {
  if (update.choice < choices_.size()) apply(update);
}

json ChatResponseBuilder::response() const {
  json doc = envelope("chat.completion");
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    choices.push_back({{"index", i},
                       {"message", {{"role", "assistant"}, {"content", c.content}}},
                       {"logprobs", request_->logprobs >= 0 ? json{{"content", c.logprobs}} : json(nullptr)},
                       {"finish_reason", c.finish_reason ? json(*c.finish_reason) : json(nullptr)}});
  }
  doc["choices"] = std::move(choices);
  doc["usage"] = usage();
  return doc;
}

json ChatResponseBuilder::chunk(json choice) const {
  json out = envelope("chat.completion.chunk");
  out["choices"] = json::array({std::move(choice)});
  if (options_.include_usage) out["usage"] = nullptr;
  return out;
}

std::string ChatResponseBuilder::sse_start() {
  std::string out;
  for (size_t i = 0; i < choices_.size(); ++i)
    out += "data: " +
           dump_json(chunk({{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                            {"finish_reason", nullptr}})) +
           "\n\n";
  return out;
}

std::string ChatResponseBuilder::sse_chunk(const ChoiceUpdate& update) {
  if (update.choice >= choices_.size()) return {};
  json entries = apply(update);
  if (update.text.empty() && entries.empty() && !update.finish_reason) return {};
  json delta = json::object();
  if (!update.text.empty()) delta["content"] = update.text;
  return "data: " +
         dump_json(chunk({{"index", update.choice},
                          {"delta", std::move(delta)},
                          {"logprobs", request_->logprobs >= 0 ? json{{"content", std::move(entries)}} : json(nullptr)},
                          {"finish_reason", update.finish_reason ? json(*update.finish_reason) : json(nullptr)}})) +
         "\n\n";
}

std::string ChatResponseBuilder::sse_finish() {
  std::string out;
  if (options_.include_usage) {
    json last = envelope("chat.completion.chunk");
    last["choices"] = json::array();
    last["usage"] = usage();
    out = "data: " + dump_json(last) + "\n\n";
  }
  return out + "data: [DONE]\n\n";
}

}  // namespace conveyor

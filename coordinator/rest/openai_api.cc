// OpenAI's completions API: its errors, the system fingerprint and the answers built from
// the core's updates. Request validation is in completion_request.cc.
#include "coordinator/rest/openai_api.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace conveyor {

using nlohmann::json;

ApiError api_error(int http_status, std::string message, std::string param, std::string type, std::string code) {
  return ApiError{http_status, std::move(message), std::move(type), std::move(param), std::move(code)};
}

nlohmann::json error_json(const ApiError& error) {
  json e = {{"message", error.message}, {"type", error.type}, {"param", nullptr}, {"code", nullptr}};
  if (!error.param.empty()) e["param"] = error.param;
  if (!error.code.empty()) e["code"] = error.code;
  return json{{"error", std::move(e)}};
}

std::string error_body(const ApiError& error) { return dump_json(error_json(error)); }

std::string dump_json(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

#ifdef CONVEYOR_BUILD_ID
constexpr const char* kBuildId = CONVEYOR_BUILD_ID;  // the commit the build was configured at
#else
constexpr const char* kBuildId = "unversioned";
#endif

uint64_t fnv1a_64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

std::string system_fingerprint(std::string_view served_model, const ModelConfig& config, const Tokenizer& tokenizer) {
  // Every input is written with its name, so no two different settings give one string.
  const json identity = {{"model", served_model},
                         {"n_embd", config.n_embd},
                         {"n_head", config.n_head},
                         {"n_layer", config.n_layer},
                         {"n_inner", config.n_inner},
                         {"n_positions", config.n_positions},
                         {"vocab_size", config.vocab_size},
                         {"layer_norm_epsilon", config.layer_norm_epsilon},
                         {"activation", int(config.activation)},
                         {"tie_word_embeddings", config.tie_word_embeddings},
                         {"eos_token_id", config.eos_token_id},
                         {"tokenizer_vocab", tokenizer.vocab_size()},
                         {"build", kBuildId}};
  char buf[24];
  std::snprintf(buf, sizeof buf, "fp_%012llx",
                static_cast<unsigned long long>(fnv1a_64(dump_json(identity)) >> 16));
  return buf;
}

// ---------------------------------------------------------------------------------------
// Responses

namespace {

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07;
    else return false;
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid.
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n;
  }
  return true;
}

json logprob_value(float lp) { return std::isnan(lp) ? json(nullptr) : json(double(lp)); }

}  // namespace

std::string token_display_string(const Tokenizer& tokenizer, int32_t id) {
  std::string bytes = tokenizer.token_bytes(id);
  if (valid_utf8(bytes)) return bytes;
  std::string out = "bytes:";
  char buf[8];
  for (unsigned char b : bytes) {
    std::snprintf(buf, sizeof buf, "\\x%02x", b);
    out += buf;
  }
  return out;
}

CompletionResponseBuilder::CompletionResponseBuilder(std::shared_ptr<const CompletionRequest> request,
                                                     const Tokenizer& tokenizer, int64_t created_unix_seconds,
                                                     ResponseOptions options)
    : request_(std::move(request)), tokenizer_(tokenizer), created_(created_unix_seconds),
      options_(std::move(options)), choices_(request_->num_choices()) {}

int64_t CompletionResponseBuilder::prompt_tokens() const { return prompt_token_count(*request_); }

int64_t CompletionResponseBuilder::completion_tokens() const {
  int64_t n = 0;
  for (const Choice& c : choices_) n += c.completion_tokens;
  return n;
}

int64_t CompletionResponseBuilder::cached_tokens() const {
  int64_t n = 0;
  for (size_t i = 0; i < choices_.size(); i += size_t(request_->n)) n += choices_[i].cached_prompt_tokens;
  return n;
}

json CompletionResponseBuilder::usage() const {
  const int64_t p = prompt_tokens(), c = completion_tokens();
  return {{"prompt_tokens", p},
          {"completion_tokens", c},
          {"total_tokens", p + c},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens()}}}};
}

json CompletionResponseBuilder::envelope() const {
  json e = {{"id", request_->id}, {"object", "text_completion"}, {"created", created_}, {"model", request_->model},
            {"system_fingerprint", nullptr}};
  if (!options_.system_fingerprint.empty()) e["system_fingerprint"] = options_.system_fingerprint;
  return e;
}

void CompletionResponseBuilder::append_logprobs(Choice& c, const std::vector<TokenOut>& tokens, bool prompt,
                                                json& delta) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const TokenOut& t = tokens[i];
    const std::string name = token_display_string(tokenizer_, t.id);
    json top = nullptr;
    if (!(prompt && std::isnan(t.logprob))) {  // a prompt's first token has no distribution
      top = json::object();
      for (const auto& [id, lp] : t.top) top[token_display_string(tokenizer_, id)] = logprob_value(lp);
      if (!top.contains(name)) top[name] = logprob_value(t.logprob);  // the chosen token is always listed
    }
    for (json* target : {&c.lp_tokens, &delta["tokens"]}) target->push_back(name);
    for (json* target : {&c.lp_token_logprobs, &delta["token_logprobs"]}) target->push_back(logprob_value(t.logprob));
    for (json* target : {&c.lp_top, &delta["top_logprobs"]}) target->push_back(top);
    for (json* target : {&c.lp_offsets, &delta["text_offset"]}) target->push_back(c.text_offset);
    c.text_offset += tokenizer_.token_bytes(t.id).size();
  }
}

json CompletionResponseBuilder::apply(const ChoiceUpdate& update) {
  Choice& c = choices_[update.choice];
  if (update.cached_prompt_tokens) c.cached_prompt_tokens = *update.cached_prompt_tokens;
  const std::vector<int32_t>& prompt = request_->prompts[update.choice / size_t(request_->n)];
  const bool want_logprobs = request_->logprobs >= 0;
  json lp_delta = {{"tokens", json::array()}, {"token_logprobs", json::array()},
                   {"top_logprobs", json::array()}, {"text_offset", json::array()}};
  std::string text;
  json out = {{"index", update.choice}};
  if (!c.started) {
    c.started = true;
    if (request_->echo) {
      text = tokenizer_.decode(prompt);
      if (!want_logprobs || update.prompt_tokens.empty()) c.text_offset += text.size();
    }
    if (request_->return_token_ids) out["prompt_token_ids"] = prompt;
  }
  if (want_logprobs && request_->echo && !update.prompt_tokens.empty())
    append_logprobs(c, update.prompt_tokens, /*prompt=*/true, lp_delta);
  if (want_logprobs) append_logprobs(c, update.tokens, /*prompt=*/false, lp_delta);
  else for (const TokenOut& t : update.tokens) c.text_offset += tokenizer_.token_bytes(t.id).size();

  text += update.text;
  c.text += text;
  json ids = json::array();
  for (const TokenOut& t : update.tokens) {
    c.token_ids.push_back(t.id);
    ids.push_back(t.id);
  }
  c.completion_tokens += int64_t(update.tokens.size());
  if (update.finish_reason && !c.finish_reason) {
    c.finish_reason = update.finish_reason;
    ++finished_choices_;
  }
  out["text"] = std::move(text);
  out["logprobs"] = want_logprobs ? std::move(lp_delta) : json(nullptr);
  out["finish_reason"] = update.finish_reason ? json(*update.finish_reason) : json(nullptr);
  if (request_->return_token_ids) out["token_ids"] = std::move(ids);
  return out;
}

void CompletionResponseBuilder::add(const ChoiceUpdate& update) {
  if (update.choice >= choices_.size()) return;
  apply(update);
}

json CompletionResponseBuilder::response() const {
  json doc = envelope();
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    std::string text = c.text;
    if (!c.started && request_->echo) text = tokenizer_.decode(request_->prompts[i / size_t(request_->n)]);
    json choice = {{"text", text}, {"index", i}, {"logprobs", nullptr},
                   {"finish_reason", c.finish_reason ? json(*c.finish_reason) : json(nullptr)}};
    if (request_->logprobs >= 0)
      choice["logprobs"] = {{"tokens", c.lp_tokens}, {"token_logprobs", c.lp_token_logprobs},
                            {"top_logprobs", c.lp_top}, {"text_offset", c.lp_offsets}};
    if (request_->return_token_ids) {
      choice["token_ids"] = c.token_ids;
      choice["prompt_token_ids"] = request_->prompts[i / size_t(request_->n)];
    }
    choices.push_back(std::move(choice));
  }
  doc["choices"] = std::move(choices);
  doc["usage"] = usage();
  return doc;
}

std::string CompletionResponseBuilder::sse_chunk(const ChoiceUpdate& update) {
  if (update.choice >= choices_.size()) return {};
  json chunk = envelope();
  chunk["choices"] = json::array({apply(update)});
  if (options_.include_usage) chunk["usage"] = nullptr;
  return "data: " + dump_json(chunk) + "\n\n";
}

std::string CompletionResponseBuilder::sse_finish() {
  std::string out;
  if (options_.include_usage) {
    json chunk = envelope();
    chunk["choices"] = json::array();
    chunk["usage"] = usage();
    out = "data: " + dump_json(chunk) + "\n\n";
  }
  return out + "data: [DONE]\n\n";
}

std::string CompletionResponseBuilder::sse_error(const ApiError& error) {
  return "data: " + error_body(error) + "\n\n";
}

}  // namespace conveyor

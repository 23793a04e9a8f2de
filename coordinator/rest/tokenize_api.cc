// /tokenize and /detokenize: see tokenize_api.h.
#include "coordinator/rest/tokenize_api.h"

#include <set>

namespace conveyor {

using nlohmann::ordered_json;

namespace {

bool fail(ApiError* error, std::string message, std::string param = {}, int status = 400, std::string code = {}) {
  if (error) *error = api_error(status, std::move(message), std::move(param), "invalid_request_error", std::move(code));
  return false;
}

// The body as a JSON object whose fields are all in `known`, and whose `model` (when given)
// names the served model.
bool read_body(std::string_view text, const std::set<std::string>& known, const RestContext& ctx, ordered_json& body,
               ApiError* error) {
  try {
    body = ordered_json::parse(text.begin(), text.end());
  } catch (const ordered_json::exception& e) {
    return fail(error, std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!body.is_object()) return fail(error, "the request body must be a JSON object, got " + json_type_name(body));
  for (const auto& [key, value] : body.items())
    if (!known.count(key)) {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      return fail(error, "unknown field '" + key + "' (known: " + list + ")", key);
    }
  if (auto m = body.find("model"); m != body.end() && !m->is_null()) {
    if (!m->is_string()) return fail(error, "'model' must be a string, got " + json_type_name(*m), "model");
    if (!ctx.model_name.empty() && m->get<std::string>() != ctx.model_name)
      return fail(error, "the model '" + m->get<std::string>() + "' does not exist; this server serves '" + ctx.model_name + "'",
                  "model", 404, "model_not_found");
  }
  return true;
}

bool read_flag(const ordered_json& body, const char* name, bool& out, ApiError* error) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return true;
  if (!it->is_boolean()) return fail(error, std::string("'") + name + "' must be a boolean, got " + json_type_name(*it), name);
  out = it->get<bool>();
  return true;
}

}  // namespace

bool tokenize_request(std::string_view text, const RestContext& ctx, nlohmann::json* out, ApiError* error) {
  ordered_json body;
  if (!read_body(text, {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"},
                 ctx, body, error))
    return false;
  bool add_generation_prompt = true, add_special_tokens = true, return_strs = false;
  if (!read_flag(body, "add_generation_prompt", add_generation_prompt, error) ||
      !read_flag(body, "add_special_tokens", add_special_tokens, error) ||
      !read_flag(body, "return_token_strs", return_strs, error))
    return false;
  const bool has_prompt = body.contains("prompt") && !body["prompt"].is_null();
  const bool has_messages = body.contains("messages") && !body["messages"].is_null();
  if (has_prompt == has_messages) return fail(error, "give exactly one of 'prompt' (a string) and 'messages' (a chat)", "prompt");
  std::vector<int32_t> ids;
  if (has_prompt) {
    if (!body["prompt"].is_string()) return fail(error, "'prompt' must be a string, got " + json_type_name(body["prompt"]), "prompt");
    ids = ctx.tokenizer->encode(body["prompt"].get<std::string>());
  } else {
    const ChatSettings none;
    const ChatSettings& chat = ctx.chat ? *ctx.chat : none;
    Expected<std::string> rendered = render_chat_prompt(body["messages"], add_generation_prompt, chat, error);
    if (!rendered.ok()) return false;
    ids = encode_chat_prompt(*ctx.tokenizer, rendered.value(), chat);
  }
  nlohmann::json strs = nullptr;
  if (return_strs) {
    strs = nlohmann::json::array();
    for (int32_t id : ids) strs.push_back(token_display_string(*ctx.tokenizer, id));
  }
  *out = {{"count", ids.size()}, {"max_model_len", ctx.config.n_positions}, {"tokens", ids}, {"token_strs", strs}};
  return true;
}

bool detokenize_request(std::string_view text, const RestContext& ctx, nlohmann::json* out, ApiError* error) {
  ordered_json body;
  if (!read_body(text, {"model", "tokens"}, ctx, body, error)) return false;
  auto tokens = body.find("tokens");
  if (tokens == body.end() || tokens->is_null()) return fail(error, "'tokens' is required", "tokens");
  if (!tokens->is_array()) return fail(error, "'tokens' must be an array of token ids, got " + json_type_name(*tokens), "tokens");
  const int64_t vocab = ctx.config.vocab_size > 0 ? ctx.config.vocab_size : ctx.tokenizer->vocab_size();
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const ordered_json& t = (*tokens)[i];
    const std::string where = "'tokens'[" + std::to_string(i) + "]";
    if (!t.is_number_integer()) return fail(error, where + " must be a token id (an integer), got " + json_type_name(t), "tokens");
    const bool too_big = t.is_number_unsigned() && t.get<uint64_t>() >= uint64_t(vocab);
    if (too_big || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
      return fail(error, where + " = " + t.dump() + " is not a token id of this model (valid: 0.." + std::to_string(vocab - 1) + ")",
                  "tokens");
    ids.push_back(int32_t(t.get<int64_t>()));
  }
  Expected<std::string> decoded = ctx.tokenizer->decode_checked(ids);
  if (!decoded.ok()) return fail(error, decoded.error(), "tokens");
  *out = {{"prompt", decoded.value()}};
  return true;
}

}  // namespace conveyor

// Request validation for POST /v1/completions (openai_api.h): one reader per idea (the
// prompts, the sampling fields, the seed, stream_options, beam search or independent
// samples, the context that max_tokens must fit), each recording the first error it meets.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <set>

#include "common/json_limits.h"
#include "coordinator/rest/openai_api.h"

namespace conveyor {

using nlohmann::json;

namespace {

uint64_t random_u64() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return rng();
}

std::string new_completion_id() {
  char buf[40];
  std::snprintf(buf, sizeof buf, "cmpl-%016llx%016llx", static_cast<unsigned long long>(random_u64()),
                static_cast<unsigned long long>(random_u64()));
  return buf;
}

// How a JSON value is described in "got ..." messages.
std::string describe(const json& v) {
  if (v.is_number_float()) return "a non-integer number";
  if (v.is_number()) return "an integer";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  return "an object";
}

// Reads the fields of one request body, remembering the first error. Every getter
// returns false once an error is recorded; absent and null fields leave `out` untouched
// (the default applies).
class FieldReader {
 public:
  explicit FieldReader(const json& body) : body_(body) {}

  const json* find(const char* name) const {
    auto it = body_.find(name);
    return it == body_.end() || it->is_null() ? nullptr : &*it;
  }

  bool fail(std::string param, std::string message, int status = 400, std::string code = {}) {
    if (!error_) error_ = api_error(status, std::move(message), std::move(param), "invalid_request_error", std::move(code));
    return false;
  }
  bool wrong_type(const char* name, const char* expected, const json& got) {
    return fail(name, std::string("'") + name + "' must be " + expected + ", got " + describe(got));
  }

  bool get_bool(const char* name, bool& out) {
    const json* v = find(name);
    if (!v) return true;
    if (!v->is_boolean()) return wrong_type(name, "a boolean", *v);
    out = v->get<bool>();
    return true;
  }

  bool get_int(const char* name, int64_t min, int64_t max, int64_t& out) {
    const json* v = find(name);
    if (!v) return true;
    if (!v->is_number_integer()) return wrong_type(name, "an integer", *v);
    const bool too_big = v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(max);
    const int64_t x = too_big ? max : v->get<int64_t>();
    if (too_big || x < min || x > max)
      return fail(name, std::string("'") + name + "' must be between " + std::to_string(min) + " and " +
                            std::to_string(max) + ", got " + v->dump());
    out = x;
    return true;
  }
  bool get_int(const char* name, int64_t min, int64_t max, int& out) {
    int64_t x = out;
    if (!get_int(name, min, max, x)) return false;
    out = int(x);
    return true;
  }

  // A number in [min, max] (min excluded when min_open).
  bool get_number(const char* name, double min, double max, bool min_open, float& out) {
    const json* v = find(name);
    if (!v) return true;
    if (!v->is_number()) return wrong_type(name, "a number", *v);
    const double x = v->get<double>();
    if (!std::isfinite(x) || (min_open ? x <= min : x < min) || x > max) {
      std::string range = min_open ? "greater than " + json(min).dump() : "at least " + json(min).dump();
      if (std::isfinite(max)) range = "between " + json(min).dump() + (min_open ? " (exclusive)" : "") + " and " + json(max).dump();
      return fail(name, std::string("'") + name + "' must be " + range + ", got " + v->dump());
    }
    out = float(x);
    return true;
  }

  const std::optional<ApiError>& error() const { return error_; }

 private:
  const json& body_;
  std::optional<ApiError> error_;
};

const std::set<std::string>& known_fields() {
  static const std::set<std::string> k = {
      "model",       "prompt",         "max_tokens",        "temperature", "top_p",
      "top_k",       "n",              "stream",            "stream_options", "logprobs",
      "echo",        "stop",           "seed",              "presence_penalty", "frequency_penalty",
      "repetition_penalty", "min_tokens", "return_token_ids", "ignore_eos", "user",
      "best_of",     "logit_bias",     "suffix",            "use_beam_search", "length_penalty",
      "early_stopping"};
  return k;
}

constexpr const char* kPromptTypes =
    "a string, an array of strings, an array of token ids or an array of arrays of token ids";

// Reads `prompt` into token-id lists. `vocab` bounds token ids.
bool read_prompts(FieldReader& r, const json& body, const Tokenizer& tokenizer, int64_t vocab,
                  int64_t n_positions, const ApiLimits& limits, std::vector<std::vector<int32_t>>& out) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return r.fail("prompt", "'prompt' is required");
  const json& p = *it;

  auto check_ids = [&](const json& arr, const std::string& where, std::vector<int32_t>& ids) {
    ids.reserve(arr.size());
    for (size_t i = 0; i < arr.size(); ++i) {
      const json& t = arr[i];
      if (!t.is_number_integer())
        return r.fail("prompt", where + "[" + std::to_string(i) + "] must be a token id (an integer), got " + describe(t));
      const bool too_big = t.is_number_unsigned() && t.get<uint64_t>() >= uint64_t(vocab);
      if (too_big || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
        return r.fail("prompt", where + "[" + std::to_string(i) + "] = " + t.dump() +
                                    " is not a token id of this model (valid: 0.." + std::to_string(vocab - 1) + ")");
      ids.push_back(int32_t(t.get<int64_t>()));
    }
    return true;
  };
  auto add = [&](std::vector<int32_t> ids, const std::string& where) {
    if (ids.empty()) return r.fail("prompt", where + " is empty");
    if (n_positions > 0 && int64_t(ids.size()) > n_positions)
      return r.fail("prompt", where + " has " + std::to_string(ids.size()) +
                                  " tokens, more than the model's context of " + std::to_string(n_positions) + " tokens");
    out.push_back(std::move(ids));
    return true;
  };

  if (p.is_string()) return add(tokenizer.encode(p.get<std::string>()), "'prompt'");
  if (!p.is_array()) return r.wrong_type("prompt", kPromptTypes, p);
  if (p.empty()) return r.fail("prompt", "'prompt' is empty");
  if (p[0].is_number()) {  // one prompt as token ids
    std::vector<int32_t> ids;
    return check_ids(p, "'prompt'", ids) && add(std::move(ids), "'prompt'");
  }
  if (p.size() > size_t(limits.max_prompts))
    return r.fail("prompt", "'prompt' holds " + std::to_string(p.size()) + " prompts; at most " +
                                std::to_string(limits.max_prompts) + " are allowed in one request");
  const bool strings = p[0].is_string();
  if (!strings && !p[0].is_array()) return r.wrong_type("prompt", kPromptTypes, p);
  for (size_t i = 0; i < p.size(); ++i) {
    const std::string where = "'prompt'[" + std::to_string(i) + "]";
    const json& e = p[i];
    if (strings ? !e.is_string() : !e.is_array())
      return r.fail("prompt", std::string("'prompt' must be ") + kPromptTypes + "; " + where + " is " + describe(e) +
                                  " but " + "'prompt'[0] is " + describe(p[0]));
    std::vector<int32_t> ids;
    if (strings) ids = tokenizer.encode(e.get<std::string>());
    else if (!check_ids(e, where, ids)) return false;
    if (!add(std::move(ids), where)) return false;
  }
  return true;
}

bool read_stop(FieldReader& r, const ApiLimits& limits, std::vector<std::string>& out) {
  const json* v = r.find("stop");
  if (!v) return true;
  if (v->is_string()) {
    if (v->get<std::string>().empty()) return r.fail("stop", "'stop' must not be an empty string");
    out.push_back(v->get<std::string>());
    return true;
  }
  if (!v->is_array()) return r.wrong_type("stop", "a string or an array of strings", *v);
  if (v->size() > size_t(limits.max_stop))
    return r.fail("stop", "'stop' holds " + std::to_string(v->size()) + " strings; at most " +
                              std::to_string(limits.max_stop) + " are allowed");
  for (size_t i = 0; i < v->size(); ++i) {
    const json& s = (*v)[i];
    if (!s.is_string())
      return r.fail("stop", "'stop'[" + std::to_string(i) + "] must be a string, got " + describe(s));
    if (s.get<std::string>().empty())
      return r.fail("stop", "'stop'[" + std::to_string(i) + "] must not be empty");
    out.push_back(s.get<std::string>());
  }
  return true;
}

// `logit_bias`: an object from token ids (decimal strings) to biases in [-100, 100], at most
// kMaxLogitBiasEntries of them; into (id, bias) pairs sorted by id.
bool read_logit_bias(FieldReader& r, int64_t vocab, std::vector<std::pair<int32_t, float>>& out) {
  const json* v = r.find("logit_bias");
  if (!v) return true;
  if (!v->is_object()) return r.wrong_type("logit_bias", "an object mapping token ids to biases", *v);
  if (v->size() > kMaxLogitBiasEntries)
    return r.fail("logit_bias", "'logit_bias' holds " + std::to_string(v->size()) + " entries; at most " +
                                    std::to_string(kMaxLogitBiasEntries) + " are allowed");
  for (const auto& [key, value] : v->items()) {
    const std::string where = "'logit_bias'[\"" + key + "\"]";
    const bool digits = !key.empty() && key.size() <= 10 &&
                        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    const int64_t id = digits ? std::stoll(key) : -1;
    if (!digits || id >= vocab)
      return r.fail("logit_bias", where + ": the key must be a token id of this model (a decimal integer, valid: 0.." +
                                      std::to_string(vocab - 1) + ")");
    if (!value.is_number()) return r.fail("logit_bias", where + " must be a number, got " + describe(value));
    const double bias = value.get<double>();
    if (!std::isfinite(bias) || bias < -kLogitBiasMax || bias > kLogitBiasMax)
      return r.fail("logit_bias", where + " must be between -100 and 100, got " + value.dump());
    out.emplace_back(int32_t(id), float(bias));
  }
  std::sort(out.begin(), out.end());
  for (size_t i = 1; i < out.size(); ++i)  // "7" and "007" name one token
    if (out[i].first == out[i - 1].first)
      return r.fail("logit_bias", "'logit_bias' names token " + std::to_string(out[i].first) + " twice");
  return true;
}

// The beam search fields (use_beam_search is true): best_of (the width, default n), n <= best_of,
// length_penalty, early_stopping; and the refusal of every field that would make the beams
// differ from HuggingFace's deterministic search (docs/API.md, "Beam search").
bool read_beam_search(FieldReader& r, CompletionRequest& req, bool logprobs_given) {
  req.best_of = req.n;
  if (!r.get_int("best_of", 1, kMaxBeamWidth, req.best_of)) return false;
  if (req.n > req.best_of)
    return r.fail("n", "'n' (" + std::to_string(req.n) + ") must not exceed best_of (" + std::to_string(req.best_of) +
                           "), the number of beams");
  if (const json* v = r.find("length_penalty")) {
    if (!v->is_number()) return r.wrong_type("length_penalty", "a number", *v);
    const double x = v->get<double>();
    if (!std::isfinite(x) || std::fabs(x) > 100)
      return r.fail("length_penalty", "'length_penalty' must be between -100 and 100, got " + v->dump());
    req.length_penalty = float(x);
  }
  if (const json* v = r.find("early_stopping")) {
    if (v->is_boolean()) req.early_stopping = v->get<bool>() ? EarlyStopping::Stop : EarlyStopping::Heuristic;
    else if (v->is_string() && v->get<std::string>() == "never") req.early_stopping = EarlyStopping::Never;
    else return r.wrong_type("early_stopping", "true, false or \"never\"", *v);
  }
  const SamplingParams& s = req.sampling;
  const SamplingParams defaults;
  auto refuse = [&](const char* field, const std::string& why) {
    return r.fail(field, std::string("'") + field + "' cannot be used with use_beam_search: " + why);
  };
  constexpr const char* kScores = "beams are ranked by the model's raw log-probs, as HuggingFace's beam search does";
  // temperature: absent means 0 here (beam search is deterministic); a given one must be 0.
  if (r.find("temperature") && s.temperature != 0.0f) return refuse("temperature", "it needs temperature 0 (or none)");
  req.sampling.temperature = 0.0f;
  if (s.top_p != defaults.top_p) return refuse("top_p", "it keeps the best candidates, not a nucleus");
  if (s.top_k != defaults.top_k) return refuse("top_k", "it keeps 2 x best_of candidates a step");
  if (s.presence_penalty != 0.0f) return refuse("presence_penalty", kScores);
  if (s.frequency_penalty != 0.0f) return refuse("frequency_penalty", kScores);
  if (s.repetition_penalty != 1.0f) return refuse("repetition_penalty", kScores);
  if (!s.logit_bias.empty()) return refuse("logit_bias", kScores);
  if (s.min_tokens != 0) return refuse("min_tokens", "not supported");
  if (!req.stop.empty()) return refuse("stop", "stop strings are not supported (the end-of-text token still ends a beam)");
  if (logprobs_given) return refuse("logprobs", "not supported");
  return true;
}

Expected<CompletionRequest> failed(const ApiError& e, ApiError* out) {
  if (out) *out = e;
  return Status::error(e.message);
}

// "the longest prompt" (a batch) or "the prompt", for context-length messages.
const char* prompt_noun(const CompletionRequest& req) {
  return req.prompts.size() > 1 ? "the longest prompt" : "the prompt";
}

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

// Every field is one /v1/completions knows.
bool read_known_fields(FieldReader& r, const json& body) {
  for (const auto& [key, value] : body.items()) {
    (void)value;
    if (!known_fields().count(key))
      return r.fail(key, "unknown field '" + key + "'" + " (see docs/API.md for the fields /v1/completions accepts)");
  }
  return true;
}

// `model`: a string naming the served model (any name when the server names none).
bool read_model(FieldReader& r, std::string_view served_model, CompletionRequest& req) {
  req.model = std::string(served_model);
  const json* m = r.find("model");
  if (!m) return true;
  if (!m->is_string()) return r.wrong_type("model", "a string", *m);
  const std::string name = m->get<std::string>();
  if (!served_model.empty() && name != served_model)
    return r.fail("model", "the model '" + name + "' does not exist; this server serves '" + std::string(served_model) + "'",
                  404, "model_not_found");
  if (served_model.empty()) req.model = name;
  return true;
}

// The plain fields: numbers and flags, each in its range.
bool read_plain_fields(FieldReader& r, const ApiLimits& limits, CompletionRequest& req, int& max_tokens,
                       int64_t& logprobs) {
  SamplingParams& s = req.sampling;
  return r.get_int("max_tokens", 0, kIntMax, max_tokens) &&
         r.get_number("temperature", 0.0, 2.0, false, s.temperature) &&
         r.get_number("top_p", 0.0, 1.0, true, s.top_p) && r.get_int("top_k", 0, kIntMax, s.top_k) &&
         r.get_int("n", 1, limits.max_n, req.n) && r.get_bool("stream", req.stream) &&
         r.get_int("logprobs", 0, limits.max_logprobs, logprobs) && r.get_bool("echo", req.echo) &&
         read_stop(r, limits, req.stop) &&
         r.get_number("presence_penalty", -2.0, 2.0, false, s.presence_penalty) &&
         r.get_number("frequency_penalty", -2.0, 2.0, false, s.frequency_penalty) &&
         r.get_number("repetition_penalty", 0.0, std::numeric_limits<double>::infinity(), true,
                      s.repetition_penalty) &&
         r.get_int("min_tokens", 0, kIntMax, s.min_tokens) && r.get_bool("return_token_ids", req.return_token_ids) &&
         r.get_bool("ignore_eos", req.ignore_eos);
}

// seed: any integer that fits 64 bits, signed or unsigned. The sampler keys on a uint64_t:
// negative values are taken modulo 2^64 (-1 and 2^64-1 are one seed). None: a random one.
bool read_seed(FieldReader& r, uint64_t& seed) {
  const json* v = r.find("seed");
  if (!v) {
    seed = random_u64();
    return true;
  }
  if (!v->is_number_integer()) {
    constexpr const char* kSeedRange = "'seed' must be an integer from -2^63 to 2^64-1";
    // The JSON parser keeps integers that fit 64 bits as integers; a whole number this
    // large arrived as a float because it does not fit.
    const bool too_large = v->is_number_float() && std::isfinite(v->get<double>()) &&
                           std::trunc(v->get<double>()) == v->get<double>() && std::fabs(v->get<double>()) >= 0x1p63;
    if (too_large) return r.fail("seed", std::string(kSeedRange) + "; " + v->dump() + " does not fit in 64 bits");
    return r.fail("seed", std::string(kSeedRange) + ", got " + describe(*v));
  }
  seed = v->is_number_unsigned() ? v->get<uint64_t>() : uint64_t(v->get<int64_t>());
  return true;
}

// stream_options: {"include_usage": bool}, only with stream.
bool read_stream_options(FieldReader& r, bool stream, bool& include_usage) {
  const json* v = r.find("stream_options");
  if (!v) return true;
  if (!v->is_object()) return r.wrong_type("stream_options", "an object", *v);
  if (!stream) return r.fail("stream_options", "'stream_options' is only allowed when 'stream' is true");
  for (const auto& [key, value] : v->items()) {
    if (key != "include_usage") return r.fail("stream_options", "unknown field 'stream_options." + key + "'");
    if (!value.is_boolean() && !value.is_null())
      return r.fail("stream_options.include_usage",
                    "'stream_options.include_usage' must be a boolean, got " + describe(value));
    include_usage = value.is_boolean() && value.get<bool>();
  }
  return true;
}

// Beam search and its fields, or samples: best_of (default n, at least n) drawn per prompt,
// the n of highest cumulative log-probability returned, never streamed when best_of > n (as
// OpenAI); the beam-only fields are refused.
bool read_choice_mode(FieldReader& r, const ApiLimits& limits, CompletionRequest& req, bool logprobs_given) {
  if (!r.get_bool("use_beam_search", req.use_beam_search)) return false;
  if (req.use_beam_search) return read_beam_search(r, req, logprobs_given);
  req.best_of = req.n;
  if (!r.get_int("best_of", 1, limits.max_n, req.best_of)) return false;
  if (req.best_of < req.n)
    return r.fail("best_of", "'best_of' (" + std::to_string(req.best_of) + ") must be at least n (" +
                                 std::to_string(req.n) + "): the n best of best_of samples are returned");
  if (req.best_of > req.n && req.stream)
    return r.fail("best_of", "'best_of' greater than n cannot be streamed (the best samples are known only at the end); "
                             "set stream to false or best_of to n");
  for (const char* beam_only : {"length_penalty", "early_stopping"})
    if (r.find(beam_only))
      return r.fail(beam_only, std::string("'") + beam_only + "' applies to beam search only (set use_beam_search)");
  return true;
}

// `user`: a string (unused).
bool read_user(FieldReader& r) {
  if (const json* v = r.find("user"); v && !v->is_string()) return r.wrong_type("user", "a string", *v);
  return true;
}

// `suffix`: only empty (insertion is not supported).
bool read_suffix(FieldReader& r) {
  const json* v = r.find("suffix");
  if (!v) return true;
  if (!v->is_string()) return r.wrong_type("suffix", "a string", *v);
  if (!v->get<std::string>().empty()) return r.fail("suffix", "'suffix' (insertion) is not supported by this server");
  return true;
}

// The context: the longest prompt plus max_tokens must fit in n_positions. Without an
// explicit max_tokens the default shrinks to what fits. Sets req.max_tokens.
bool fit_context(FieldReader& r, int64_t n_positions, bool max_tokens_given, int max_tokens, CompletionRequest& req) {
  size_t longest = 0;
  for (const auto& p : req.prompts) longest = std::max(longest, p.size());
  if (n_positions > 0) {
    const int64_t room = n_positions - int64_t(longest);
    if (!max_tokens_given && room <= 0)  // not the client's max_tokens: the prompt leaves no room
      return r.fail("prompt", "this model's maximum context length is " + std::to_string(n_positions) +
                                  " tokens, however " + prompt_noun(req) + " has " + std::to_string(longest) +
                                  " tokens, which leaves no room for a completion; reduce the prompt");
    if (!max_tokens_given) max_tokens = int(std::min<int64_t>(max_tokens, room));
    if (int64_t(longest) + max_tokens > n_positions)
      return r.fail("max_tokens", "this model's maximum context length is " + std::to_string(n_positions) +
                                      " tokens, however you requested " + std::to_string(longest + size_t(max_tokens)) +
                                      " tokens (" + std::to_string(longest) + " in your prompt; " +
                                      std::to_string(max_tokens) + " for the completion); reduce the prompt or max_tokens");
  }
  req.max_tokens = max_tokens;
  // max_tokens 0: the scoring idiom (lm-evaluation-harness's loglikelihood): the prompt
  // echoed with its log-probs, nothing generated.
  if (max_tokens == 0 && !req.echo)
    return r.fail("max_tokens", "'max_tokens' 0 generates nothing; it needs echo (the prompt, with its log-probs when "
                                "logprobs is set)");
  if (max_tokens == 0 && req.use_beam_search)
    return r.fail("max_tokens", "'max_tokens' 0 cannot be used with use_beam_search");
  if (req.sampling.min_tokens > req.max_tokens)
    return r.fail("min_tokens", "'min_tokens' (" + std::to_string(req.sampling.min_tokens) +
                                    ") must not exceed max_tokens (" + std::to_string(req.max_tokens) + ")");
  return true;
}

}  // namespace

Expected<CompletionRequest> parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                                     const ModelConfig& config, const ApiLimits& limits,
                                                     std::string_view served_model, ApiError* error,
                                                     ResponseOptions* options) {
  if (!body.is_object())
    return failed(api_error(400, "the request body must be a JSON object, got " + describe(body)), error);
  // Before any value is dump()ed into a message: that recurses once per level.
  if (json_deeper_than(body, kMaxJsonDepth))
    return failed(api_error(400, "the request body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels"),
                  error);
  FieldReader r(body);
  CompletionRequest req;
  req.id = new_completion_id();
  const int64_t vocab = config.vocab_size > 0 ? config.vocab_size : tokenizer.vocab_size();
  const bool max_tokens_given = r.find("max_tokens") != nullptr;
  int max_tokens = limits.default_max_tokens;
  int64_t logprobs = -1;
  bool include_usage = false;
  SamplingParams& s = req.sampling;
  const bool ok = read_known_fields(r, body) && read_model(r, served_model, req) &&
                  read_prompts(r, body, tokenizer, vocab, config.n_positions, limits, req.prompts) &&
                  read_plain_fields(r, limits, req, max_tokens, logprobs) && read_seed(r, s.seed) &&
                  read_stream_options(r, req.stream, include_usage) && read_user(r) &&
                  read_logit_bias(r, vocab, s.logit_bias) && read_choice_mode(r, limits, req, logprobs >= 0) && read_suffix(r) &&
                  fit_context(r, config.n_positions, max_tokens_given, max_tokens, req);
  if (!ok) return failed(*r.error(), error);
  req.logprobs = int(logprobs);

  // The end-of-text token joins stop_token_ids (so min_tokens masks it) unless ignore_eos.
  int64_t eos = config.eos_token_id;
  if (eos < 0) eos = tokenizer.eos_id().value_or(-1);
  if (!req.ignore_eos && eos >= 0 && eos < vocab) s.stop_token_ids.push_back(int32_t(eos));
  if (Status st = validate_sampling_params(s, vocab); !st.ok()) {
    r.fail("", st.message());
    return failed(*r.error(), error);
  }
  req.arrival = std::chrono::steady_clock::now();
  if (options) {
    options->include_usage = include_usage;
    options->system_fingerprint = system_fingerprint(served_model, config, tokenizer);
  }
  return req;
}

Expected<CompletionRequest> parse_completion_body(std::string_view body, const Tokenizer& tokenizer,
                                                  const ModelConfig& config, const ApiLimits& limits,
                                                  std::string_view served_model, ApiError* error,
                                                  ResponseOptions* options) {
  json parsed;
  try {
    parsed = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
    return failed(api_error(400, std::string("the request body is not valid JSON: ") + e.what()), error);
  }
  return parse_completion_request(parsed, tokenizer, config, limits, served_model, error, options);
}

}  // namespace conveyor

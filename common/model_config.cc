#include "common/model_config.h"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>

namespace conveyor {
namespace {

using nlohmann::json;

Status bad(const std::string& source, const std::string& what) {
  return Status::error(source + ": " + what);
}

// Reads an integer key; absent keys keep `out` when `required` is false.
Status read_int(const json& j, const std::string& source, const char* key, bool required,
                int64_t& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return bad(source, std::string("missing required key \"") + key + "\"");
    return ok_status();
  }
  if (!it->is_number_integer()) return bad(source, std::string("key \"") + key + "\" must be an integer");
  out = it->get<int64_t>();
  if (out <= 0) return bad(source, std::string("key \"") + key + "\" must be positive, got " + std::to_string(out));
  return ok_status();
}

}  // namespace

Expected<ModelConfig> parse_model_config(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
    return bad(source, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return bad(source, "top level must be a JSON object");
  if (auto mt = j.find("model_type"); mt != j.end() && mt->is_string() && *mt != "gpt2")
    return bad(source, "model_type \"" + mt->get<std::string>() + "\" is not supported (only gpt2)");

  ModelConfig c;
  Status s;
  if (!(s = read_int(j, source, "n_embd", true, c.n_embd))) return s;
  if (!(s = read_int(j, source, "n_head", true, c.n_head))) return s;
  if (!(s = read_int(j, source, "n_layer", true, c.n_layer))) return s;
  if (!(s = read_int(j, source, "n_positions", true, c.n_positions))) return s;
  if (!(s = read_int(j, source, "vocab_size", true, c.vocab_size))) return s;
  c.n_inner = 4 * c.n_embd;
  if (!(s = read_int(j, source, "n_inner", false, c.n_inner))) return s;
  if (c.n_embd % c.n_head != 0)
    return bad(source, "n_embd (" + std::to_string(c.n_embd) + ") is not divisible by n_head (" +
                           std::to_string(c.n_head) + ")");
  if (auto it = j.find("layer_norm_epsilon"); it != j.end() && !it->is_null()) {
    if (!it->is_number()) return bad(source, "key \"layer_norm_epsilon\" must be a number");
    c.layer_norm_epsilon = it->get<float>();
    if (!(c.layer_norm_epsilon > 0)) return bad(source, "key \"layer_norm_epsilon\" must be positive");
  }
  if (auto it = j.find("activation_function"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return bad(source, "key \"activation_function\" must be a string");
    const auto a = it->get<std::string>();
    if (a == "gelu_new" || a == "gelu_pytorch_tanh" || a == "gelu_fast")
      c.activation = Activation::GeluNew;
    else if (a == "gelu")
      c.activation = Activation::Gelu;
    else
      return bad(source, "activation_function \"" + a + "\" is not supported (gelu_new or gelu)");
  }
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad(source, "key \"tie_word_embeddings\" must be true or false");
    c.tie_word_embeddings = it->get<bool>();
  }
  if (auto it = j.find("eos_token_id"); it != j.end() && it->is_number_integer())
    c.eos_token_id = it->get<int64_t>();
  return c;
}

Expected<ModelConfig> load_model_config(const std::string& path) {
  // A model directory (existing, or a missing path not naming a .json file) means
  // DIR/config.json, so the error names the file we looked for. error_code overloads: a
  // permission problem must not throw.
  std::filesystem::path p(path);
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec) || (!std::filesystem::exists(p, ec) && p.extension() != ".json"))
    p /= "config.json";
  errno = 0;
  std::ifstream in(p);
  if (!in)
    return Status::error(p.string() + ": cannot open model config" +
                         (errno ? ": " + std::error_code(errno, std::generic_category()).message() : std::string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_model_config(ss.str(), p.string());
}

Expected<ModelConfig> named_model_shape(const std::string& spec) {
  ModelConfig c;
  c.vocab_size = 50257;
  c.n_positions = 2048;
  c.eos_token_id = 50256;
  if (spec == "gpt2-xl") {
    c.n_layer = 48, c.n_embd = 1600, c.n_head = 25, c.n_positions = 1024;
  } else if (spec == "gpt3-6.7b") {
    c.n_layer = 32, c.n_embd = 4096, c.n_head = 32;
  } else if (spec == "gpt3-13b") {
    c.n_layer = 40, c.n_embd = 5120, c.n_head = 40;
  } else if (spec == "gpt3-175b") {
    c.n_layer = 96, c.n_embd = 12288, c.n_head = 96;
  } else {
    int64_t l = 0, e = 0, h = 0;
    char c1 = 0, c2 = 0;
    std::istringstream is(spec);
    if (!(is >> l >> c1 >> e >> c2 >> h) || c1 != ',' || c2 != ',' || l <= 0 || e <= 0 || h <= 0 ||
        e % h != 0 || !is.eof())
      return Status::error("unknown model shape \"" + spec +
                           "\": use gpt2-xl, gpt3-6.7b, gpt3-13b, gpt3-175b or n_layer,n_embd,n_head "
                           "(n_embd divisible by n_head)");
    c.n_layer = l, c.n_embd = e, c.n_head = h;
  }
  c.n_inner = 4 * c.n_embd;
  return c;
}

}  // namespace conveyor

// ChatTemplate's public face (model/chat_template.h): parsing and rendering with the
// errors made into messages that name the template and the place, the variables taken from
// JSON, and where a server's template comes from.
#include "model/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/chat_template_syntax.h"

namespace conveyor {

namespace detail = chat_template_detail;

namespace {

constexpr int kMaxValueDepth = 64;

detail::Value from_json(const nlohmann::ordered_json& j, int depth) {
  using detail::Value;
  if (depth > kMaxValueDepth) throw detail::TemplateFailure(0, "the variables nest too deeply");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return j.get<uint64_t>() > uint64_t(INT64_MAX) ? Value::number(j.get<double>()) : Value::integer(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      detail::List items;
      for (const auto& x : j) items.push_back(from_json(x, depth + 1));
      return Value::of_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      detail::Dict d;
      for (const auto& [k, v] : j.items()) d.emplace_back(k, from_json(v, depth + 1));
      return Value::of_dict(std::move(d));
    }
    default: return Value::none();
  }
}

std::string where(const std::string& name, const std::string& source, detail::Pos pos) {
  return "chat template '" + name + "': " + detail::position_text(source, pos) + ": ";
}

Expected<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A token's text in tokenizer_config.json: a string, or an AddedToken {"content": ...}.
std::optional<std::string> token_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

Expected<ChatTemplate> ChatTemplate::parse(std::string_view source, std::string name) {
  auto program = std::make_shared<detail::Program>();
  const std::string text = detail::normalise_source(std::string(source));
  try {
    *program = detail::parse_program(text, name);
  } catch (const detail::TemplateFailure& f) {
    return Status::error(where(name, text, f.pos) + f.what());
  }
  return ChatTemplate(std::move(program), std::move(name));
}

std::optional<std::string> ChatTemplate::render(const nlohmann::ordered_json& variables, ChatTemplateError* error) const {
  try {
    return detail::render_program(*program_, from_json(variables, 0));
  } catch (const detail::TemplateFailure& f) {
    if (error) {
      error->raised = f.raised;
      error->message = f.raised ? "chat template '" + name_ + "' refused the conversation (" +
                                      detail::position_text(program_->source, f.pos) + "): " + f.what()
                                : where(name_, program_->source, f.pos) + f.what();
    }
    return std::nullopt;
  }
}

Expected<ModelChatConfig> load_model_chat_config(const std::string& model_dir) {
  ModelChatConfig out;
  const std::string path = (std::filesystem::path(model_dir) / "tokenizer_config.json").string();
  if (!std::filesystem::exists(path)) return out;
  Expected<std::string> text = read_file(path);
  if (!text.ok()) return text.status();
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text.value());
  } catch (const nlohmann::json::exception& e) {
    return Status::error(path + " is not valid JSON: " + e.what());
  }
  if (!config.is_object()) return Status::error(path + " must hold a JSON object");
  if (auto it = config.find("chat_template"); it != config.end() && !it->is_null()) {
    if (it->is_string()) {
      out.chat_template = it->get<std::string>();
    } else if (it->is_array()) {  // named templates: the "default" one
      for (const auto& t : *it)
        if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
          out.chat_template = t["template"].get<std::string>();
      if (!out.chat_template)
        return Status::error(path + ": 'chat_template' is a list of named templates without one named \"default\"");
    } else {
      return Status::error(path + ": 'chat_template' must be a string or a list of {name, template}");
    }
  }
  if (auto it = config.find("bos_token"); it != config.end())
    if (auto t = token_text(*it)) out.bos_token = *t;
  if (auto it = config.find("eos_token"); it != config.end())
    if (auto t = token_text(*it)) out.eos_token = *t;
  return out;
}

Expected<std::optional<ChatTemplate>> choose_chat_template(const std::string& spec, const ModelChatConfig& model) {
  std::string source, name;
  if (spec.empty()) {
    if (!model.chat_template) return std::optional<ChatTemplate>();
    source = *model.chat_template;
    name = "tokenizer_config.json";
  } else if (auto builtin = builtin_chat_template(spec)) {
    source = std::string(*builtin);
    name = spec;
  } else {
    if (!std::filesystem::is_regular_file(spec)) {
      std::string names;
      for (const std::string& n : builtin_chat_template_names()) names += (names.empty() ? "" : ", ") + n;
      return Status::error("chat template '" + spec + "' is neither a built-in template (" + names + ") nor a file");
    }
    Expected<std::string> text = read_file(spec);
    if (!text.ok()) return text.status();
    source = std::move(text).value();
    name = spec;
  }
  Expected<ChatTemplate> parsed = ChatTemplate::parse(source, name);
  if (!parsed.ok()) return parsed.status();
  return std::optional<ChatTemplate>(std::move(parsed).value());
}

}  // namespace conveyor

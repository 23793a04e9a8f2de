// Chat templates: the Jinja subset HuggingFace chat templates are written in, rendered as
// transformers' apply_chat_template renders them (trim_blocks and lstrip_blocks on, one
// trailing newline of the source dropped, `raise_exception`, a `tojson` that writes as
// Python's json.dumps(ensure_ascii=False) does).
//
// What the engine covers (docs/API.md, "Chat templates", lists it for template authors):
//   tags      {{ expr }}, {% if/elif/else/endif %}, {% for x in xs [if cond] %}...{% else %}
//             ...{% endfor %} (loop.index, index0, revindex, revindex0, first, last, length,
//             previtem, nextitem), {% set x = expr %}, {% set ns.attr = expr %},
//             {% break %}/{% continue %}, {% generation %}...{% endgeneration %}, {# comments #},
//             whitespace control with '-' and '+' on either side
//   exprs     literals (strings, numbers, true/false/none, lists, dicts), names, a.b, a[i],
//             slices a[i:j:k], calls, a if c else b, or/and/not, == != < <= > >=, in / not in,
//             is [not] TEST, + - * / // % ~, unary -, filters a|f(args)
//   globals   raise_exception(msg), namespace(k=v, ...), range(...)
//   filters   trim, length/count, upper, lower, capitalize, title, tojson(indent=), string, int,
//             float, default/d, first, last, join, replace, list, reverse, items, abs,
//             selectattr/rejectattr(attr[, test, arg]), map(attribute=), safe
//   tests     defined, undefined, none, string, number, integer, float, boolean, mapping,
//             sequence, iterable, true, false, odd, even, equalto/eq/==, ne/!=, in
//   methods   str: strip lstrip rstrip startswith endswith split upper lower title replace
//             capitalize; dict: get items keys values
// Strings are UTF-8 bytes; length, indexing and slicing of strings count code points as
// Python does, but upper/lower/title/capitalize change ASCII letters only.
//
// Errors name the template and the place: "chat template 'chatml': line 3, column 12: ...".
// A syntax error is found by parse(); render() reports what goes wrong at run time
// (raise_exception's message, an unknown filter, a wrong type), with `raised` set for
// raise_exception (the template refusing its input: a client error).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace conveyor {

namespace chat_template_detail {
struct Program;
}

struct ChatTemplateError {
  std::string message;  // names the template and the position
  bool raised = false;  // the template called raise_exception
};

class ChatTemplate {
 public:
  // Parses `source`; `name` is what errors call the template (a built-in's name, a file).
  static Expected<ChatTemplate> parse(std::string_view source, std::string name);

  // Renders with `variables` (an object: messages, add_generation_prompt, bos_token, ...),
  // whose key order is kept (dict iteration and tojson follow it). On failure returns
  // nullopt and fills `*error`.
  std::optional<std::string> render(const nlohmann::ordered_json& variables, ChatTemplateError* error) const;

  const std::string& name() const { return name_; }

 private:
  ChatTemplate(std::shared_ptr<const chat_template_detail::Program> program, std::string name)
      : program_(std::move(program)), name_(std::move(name)) {}
  std::shared_ptr<const chat_template_detail::Program> program_;
  std::string name_;
};

// The templates shipped with Conveyor, by name: chatml, llama2, llama3, mistral, zephyr,
// gemma (tests/data/chat_templates/NAME.jinja holds the same text). nullopt: no such name.
std::optional<std::string_view> builtin_chat_template(std::string_view name);
std::vector<std::string> builtin_chat_template_names();

// What a model directory says about chat: tokenizer_config.json's chat_template (a string,
// or a list of {name, template} of which "default" is taken) and its bos/eos token texts
// (a string or {"content": ...}). Without the file, or without the keys, the template is
// absent and both tokens are GPT-2's "<|endoftext|>".
struct ModelChatConfig {
  std::optional<std::string> chat_template;
  std::string bos_token = "<|endoftext|>";
  std::string eos_token = "<|endoftext|>";
};
Expected<ModelChatConfig> load_model_chat_config(const std::string& model_dir);

// The template a server uses: `spec` (a built-in's name, else a template file's path) when
// not empty, else the model's own; nullopt when neither exists. Errors name the file or the
// template and the syntax error.
Expected<std::optional<ChatTemplate>> choose_chat_template(const std::string& spec, const ModelChatConfig& model);

}  // namespace conveyor

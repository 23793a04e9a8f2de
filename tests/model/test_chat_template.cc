// The chat template engine (model/chat_template.h): every golden file of
// tests/data/chat_templates/golden (rendered by scripts/make_chat_goldens.py with transformers
// or plain jinja2) byte for byte, the built-in templates against their files there, the errors
// that name the template and the place, and where a server's template comes from.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "model/chat_template.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

fs::path data_dir() { return fs::path(testing::source_dir()) / "tests/data/chat_templates"; }


ordered_json variables(const ordered_json& messages, bool add_generation_prompt) {
  return {{"messages", messages}, {"tools", nullptr}, {"documents", nullptr},
          {"add_generation_prompt", add_generation_prompt}, {"bos_token", "<s>"}, {"eos_token", "</s>"}};
}

ChatTemplate parse_ok(std::string_view text, const std::string& name = "t") {
  auto t = ChatTemplate::parse(text, name);
  EXPECT_TRUE(t.ok()) << t.error();
  return std::move(t).value();
}

std::string render_ok(std::string_view text, const ordered_json& vars) {
  ChatTemplateError error;
  auto out = parse_ok(text).render(vars, &error);
  EXPECT_TRUE(out) << error.message;
  return out.value_or("");
}

std::string parse_error(std::string_view text) {
  auto t = ChatTemplate::parse(text, "bad");
  EXPECT_FALSE(t.ok());
  return t.ok() ? "" : t.error();
}

std::string render_error(std::string_view text, const ordered_json& vars = ordered_json::object()) {
  ChatTemplateError error;
  auto out = parse_ok(text, "bad").render(vars, &error);
  EXPECT_FALSE(out) << "rendered: " << out.value_or("");
  return error.message;
}

TEST(ChatTemplateGolden, EveryGoldenFileByteForByte) {
  int compared = 0;
  for (const auto& entry : fs::directory_iterator(data_dir() / "golden")) {
    const std::string file = entry.path().filename().string();
    // TEMPLATE.CONVERSATION.(gen|plain)[.error].txt
    std::vector<std::string> parts;
    std::stringstream ss(file);
    for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
    ASSERT_GE(parts.size(), 4u) << file;
    const bool error_case = parts[3] == "error";
    const auto tmpl = ChatTemplate::parse(testing::read_text_file(data_dir() / (parts[0] + ".jinja")), parts[0]);
    ASSERT_TRUE(tmpl.ok()) << tmpl.error();
    const ordered_json messages = ordered_json::parse(testing::read_text_file(data_dir() / "conversations" / (parts[1] + ".json")));
    ChatTemplateError error;
    const auto out = tmpl.value().render(variables(messages, parts[2] == "gen"), &error);
    const std::string golden = testing::read_text_file(entry.path());
    if (error_case) {
      ASSERT_FALSE(out) << file << ": the template should have refused the conversation";
      EXPECT_TRUE(error.raised) << file << ": " << error.message;
      EXPECT_NE(error.message.find(golden), std::string::npos) << file << ": " << error.message;
    } else {
      ASSERT_TRUE(out) << file << ": " << error.message;
      EXPECT_EQ(*out, golden) << file;
    }
    ++compared;
  }
  // 7 templates x 8 conversations x 2 (add_generation_prompt): every case has its file.
  EXPECT_EQ(compared, 112) << "run scripts/make_chat_goldens.py after adding a template or a conversation";
}

TEST(ChatTemplateGolden, BuiltinsAreTheTestDataTemplates) {
  const std::vector<std::string> names = builtin_chat_template_names();
  EXPECT_EQ(names, (std::vector<std::string>{"chatml", "llama2", "llama3", "mistral", "zephyr", "gemma"}));
  for (const std::string& name : names) {
    ASSERT_TRUE(builtin_chat_template(name)) << name;
    EXPECT_EQ(std::string(*builtin_chat_template(name)), testing::read_text_file(data_dir() / (name + ".jinja"))) << name;
  }
  EXPECT_FALSE(builtin_chat_template("vicuna"));
}

TEST(ChatTemplateErrors, SyntaxErrorsNameTheTemplateLineAndColumn) {
  EXPECT_EQ(parse_error("hello\n{{ messages[0] "), "chat template 'bad': line 2, column 1: this '{{' is never closed");
  EXPECT_EQ(parse_error("{% for m in messages %}x"),
            "chat template 'bad': line 1, column 25: the template ended where 'else' or 'endfor' was expected");
  EXPECT_EQ(parse_error("ab\n  {% if x %}{% endfor %}"),
            "chat template 'bad': line 2, column 16: unknown tag 'endfor'");
  EXPECT_EQ(parse_error("{{ a + }}"), "chat template 'bad': line 1, column 8: expected an expression, got the end of the tag");
  EXPECT_EQ(parse_error("{{ 'open }}"), "chat template 'bad': line 1, column 1: this '{{' is never closed");
  EXPECT_EQ(parse_error("{% macro f() %}{% endmacro %}"),
            "chat template 'bad': line 1, column 4: the 'macro' tag is not supported by Conveyor's template engine");
  EXPECT_EQ(parse_error("{{ a $ b }}"), "chat template 'bad': line 1, column 6: unexpected character '$'");
}

TEST(ChatTemplateErrors, RunTimeErrorsNameThePlace) {
  EXPECT_EQ(render_error("x\n {{ 'a' | frobnicate }}"), "chat template 'bad': line 2, column 9: unknown filter 'frobnicate'");
  EXPECT_EQ(render_error("{{ nothing.role }}"), "chat template 'bad': line 1, column 11: 'nothing' is undefined");
  EXPECT_EQ(render_error("{{ 'a' + 1 }}"), "chat template 'bad': line 1, column 8: cannot apply '+' to a string and an integer");
  EXPECT_EQ(render_error("{{ 1 // 0 }}"), "chat template 'bad': line 1, column 6: division by zero");
  EXPECT_EQ(render_error("{{ shout() }}"), "chat template 'bad': line 1, column 4: unknown function 'shout'");
  ChatTemplateError error;
  auto out = parse_ok("{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}", "strict")
                 .render({{"messages", {1, 2}}}, &error);
  EXPECT_FALSE(out);
  EXPECT_TRUE(error.raised);
  EXPECT_EQ(error.message, "chat template 'strict' refused the conversation (line 1, column 34): one message only");
}

TEST(ChatTemplateEngine, WhitespaceControlAsTransformersSetsIt) {
  const ordered_json v = {{"xs", {1, 2}}};
  // trim_blocks: a block tag's newline goes; lstrip_blocks: so does the indent before it.
  EXPECT_EQ(render_ok("{% for x in xs %}\n  {{ x }}\n  {% endfor %}\nend", v), "  1\n  2\nend");
  EXPECT_EQ(render_ok("a  {%- if true -%}  b  {%- endif %}", v), "ab");
  EXPECT_EQ(render_ok("  {%+ if true %}x{% endif +%}\ny", v), "  x\ny");
  EXPECT_EQ(render_ok("{{ 'v' }}\n{# note #}\nz\n", v), "v\nz");  // one trailing newline is dropped
  EXPECT_EQ(render_ok("a\r\nb", v), "a\nb");
}

TEST(ChatTemplateEngine, ExpressionsAsPythonEvaluatesThem) {
  const ordered_json v = {{"m", {{"role", "user"}, {"content", " hi "}}}, {"xs", {3, 1, 2}}, {"s", "héllo"}};
  EXPECT_EQ(render_ok("{{ xs[1:] }} {{ xs[::-1] }} {{ xs[-1] }} {{ s[1:3] }} {{ s | length }}", v),
            "[1, 2] [2, 1, 3] 2 él 5");
  EXPECT_EQ(render_ok("{{ m.content | trim | upper }}|{{ m['role'] ~ '!' }}|{{ 'er' in m.role }}|{{ 4 not in xs }}", v),
            "HI|user!|True|True");
  EXPECT_EQ(render_ok("{{ 7 % 3 }} {{ -7 // 2 }} {{ 2 ** 10 }} {{ 1 / 4 }} {{ 0.1 + 0.2 }} {{ 1e20 }}", v),
            "1 -4 1024 0.25 0.30000000000000004 1e+20");
  EXPECT_EQ(render_ok("{{ m | tojson }} {{ 'a\"b\\n' | tojson }} {{ none }} {{ xs is defined and y is not defined }}", v),
            "{\"role\": \"user\", \"content\": \" hi \"} \"a\\\"b\\n\" None True");
  EXPECT_EQ(render_ok("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% set local = 1 %}"
                      "{% endfor %}{{ ns.n }} {{ local is defined }}",
                      v),
            "6 False");
  EXPECT_EQ(render_ok("{% for k, val in m.items() %}{{ k }}={{ val }};{% endfor %}{{ m.get('name', 'anon') }}", v),
            "role=user;content= hi ;anon");
}

TEST(ChatTemplateSources, ModelConfigBuiltinsAndFiles) {
  const fs::path dir = fs::temp_directory_path() / ("chat_template_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto none = load_model_chat_config(dir.string());
  ASSERT_TRUE(none.ok()) << none.error();
  EXPECT_FALSE(none.value().chat_template);
  EXPECT_EQ(none.value().eos_token, "<|endoftext|>");
  auto chosen = choose_chat_template("", none.value());
  ASSERT_TRUE(chosen.ok());
  EXPECT_FALSE(chosen.value()) << "no template anywhere: none";

  std::ofstream(dir / "tokenizer_config.json")
      << R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}],
            "bos_token": {"content": "<B>", "lstrip": false}, "eos_token": "<E>"})";
  auto model = load_model_chat_config(dir.string());
  ASSERT_TRUE(model.ok()) << model.error();
  EXPECT_EQ(model.value().chat_template.value_or(""), "{{ bos_token }}D");
  EXPECT_EQ(model.value().bos_token, "<B>");
  EXPECT_EQ(model.value().eos_token, "<E>");
  chosen = choose_chat_template("", model.value());
  ASSERT_TRUE(chosen.ok() && chosen.value());
  EXPECT_EQ(chosen.value()->name(), "tokenizer_config.json");

  chosen = choose_chat_template("zephyr", model.value());  // a flag beats the model's own
  ASSERT_TRUE(chosen.ok() && chosen.value());
  EXPECT_EQ(chosen.value()->name(), "zephyr");
  std::ofstream(dir / "mine.jinja") << "{{ messages | length }}";
  chosen = choose_chat_template((dir / "mine.jinja").string(), model.value());
  ASSERT_TRUE(chosen.ok() && chosen.value()) << chosen.error();
  std::ofstream(dir / "broken.jinja") << "{% if %}";
  chosen = choose_chat_template((dir / "broken.jinja").string(), model.value());
  ASSERT_FALSE(chosen.ok());
  EXPECT_NE(chosen.error().find("broken.jinja': line 1, column 7"), std::string::npos) << chosen.error();
  chosen = choose_chat_template("no-such-template", model.value());
  ASSERT_FALSE(chosen.ok());
  EXPECT_EQ(chosen.error(), "chat template 'no-such-template' is neither a built-in template (chatml, llama2, llama3, "
                            "mistral, zephyr, gemma) nor a file");
  std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": 7})";
  EXPECT_FALSE(load_model_chat_config(dir.string()).ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conveyor

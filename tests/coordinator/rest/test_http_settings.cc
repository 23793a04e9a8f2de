// The REST layer's settings from the cluster file (http.cors_origins, model.chat_template),
// refused with the line and the reason when wrong, and the rules they feed: which origins
// CORS allows, which client X-Request-Ids are kept, which chat template a server uses.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "coordinator/cluster_config.h"
#include "coordinator/rest/chat_api.h"
#include "coordinator/rest/http_headers.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;

std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

Expected<ClusterConfig> parse(const std::string& model_extra, const std::string& http, const std::string& base = "") {
  return parse_cluster_config(
      "model: {path: \"" + model_dir() + "\"" + model_extra + "}\nhttp: " + http + "\ncontrol: {join_token: t}\n", "c.yaml",
      base);
}

TEST(HttpSettings, CorsOriginsFromTheClusterFile) {
  auto none = parse("", "{port: 8000}");
  ASSERT_TRUE(none.ok()) << none.error();
  EXPECT_TRUE(none->cors_origins.empty());
  auto list = parse("", "{cors_origins: [\"https://app.example.com\", \"http://127.0.0.1:3000\"]}");
  ASSERT_TRUE(list.ok()) << list.error();
  EXPECT_EQ(list->cors_origins, (std::vector<std::string>{"https://app.example.com", "http://127.0.0.1:3000"}));
  auto star = parse("", "{cors_origins: \"*\"}");
  ASSERT_TRUE(star.ok()) << star.error();
  EXPECT_EQ(star->cors_origins, std::vector<std::string>{"*"});

  auto path = parse("", "{cors_origins: [\"https://app.example.com/ui\"]}");
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.error(), "c.yaml:2: 'http.cors_origins': 'https://app.example.com/ui' is not an origin: write "
                          "scheme://host[:port] (http or https, no path), or '*'");
  auto mixed = parse("", "{cors_origins: [\"*\", \"https://a.example\"]}");
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.error().find("'*' allows every origin: list it alone"), std::string::npos) << mixed.error();
  EXPECT_FALSE(parse("", "{cors_origins: [\"ftp://a.example\"]}").ok());
  EXPECT_FALSE(parse("", "{cors_origins: {a: 1}}").ok());
  EXPECT_FALSE(parse("", "{cors_origins: [[1]]}").ok());
}

TEST(HttpSettings, ChatTemplateFromTheClusterFile) {
  auto builtin = parse(", chat_template: llama3", "{port: 8000}", "/somewhere");
  ASSERT_TRUE(builtin.ok()) << builtin.error();
  EXPECT_EQ(builtin->chat_template, "llama3") << "a built-in's name stays a name";
  auto file = parse(", chat_template: mine.jinja", "{port: 8000}", "/etc/conveyor");
  ASSERT_TRUE(file.ok()) << file.error();
  EXPECT_EQ(file->chat_template, "/etc/conveyor/mine.jinja") << "a file is relative to the cluster file";
  EXPECT_FALSE(parse(", chat_template: [a]", "{port: 8000}").ok());

  // What a server makes of it: the template, or an error naming the file.
  auto settings = load_chat_settings(model_dir(), "gemma");
  ASSERT_TRUE(settings.ok()) << settings.error();
  ASSERT_TRUE(settings.value()->chat_template);
  EXPECT_EQ(settings.value()->chat_template->name(), "gemma");
  EXPECT_EQ(settings.value()->eos_token, "<|endoftext|>");
  auto demo = load_chat_settings(model_dir(), "");
  ASSERT_TRUE(demo.ok()) << demo.error();
  EXPECT_FALSE(demo.value()->chat_template) << "the demo model has no template of its own";
  EXPECT_FALSE(load_chat_settings(model_dir(), "/no/such/template.jinja").ok());
}

TEST(HttpSettings, WhichOriginsCorsAllows) {
  const std::vector<std::string> list = {"https://a.example", "http://b.example:8080"};
  EXPECT_EQ(cors_allow_origin(list, "https://a.example"), "https://a.example");
  EXPECT_EQ(cors_allow_origin(list, "http://b.example:8080"), "http://b.example:8080");
  EXPECT_FALSE(cors_allow_origin(list, "http://b.example"));
  EXPECT_FALSE(cors_allow_origin(list, "https://a.example.evil.com"));
  EXPECT_FALSE(cors_allow_origin(list, ""));
  EXPECT_FALSE(cors_allow_origin({}, "https://a.example"));
  EXPECT_EQ(cors_allow_origin({"*"}, "null"), "*");
}

TEST(HttpSettings, WhichClientRequestIdsAreKept) {
  EXPECT_EQ(client_request_id("abc-123_X.y:z"), "abc-123_X.y:z");
  EXPECT_EQ(client_request_id(std::string(128, 'a')), std::string(128, 'a'));
  EXPECT_FALSE(client_request_id(std::string(129, 'a')));
  EXPECT_FALSE(client_request_id(""));
  EXPECT_FALSE(client_request_id("with space"));
  EXPECT_FALSE(client_request_id("caf\xc3\xa9"));
  EXPECT_FALSE(client_request_id("line\nbreak"));
  const std::string a = new_request_id(), b = new_request_id();
  EXPECT_NE(a, b);
  EXPECT_TRUE(a.starts_with("req-") && a.size() == 36) << a;
}

}  // namespace
}  // namespace conveyor

// The REST server's chat endpoint, /tokenize and /detokenize, X-Request-Id and CORS, end to
// end over the brown-gpt2 model (http_server_test_util.h's fixture, plus a server with the
// built-in ChatML template and CORS for one origin, and one with CORS for any origin and an
// API key). Chat must equal /v1/completions on the rendered prompt with the same seed.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/rest/chat_api.h"
#include "tests/coordinator/rest/http_server_test_util.h"

namespace conveyor {
namespace {

using namespace http_server_test;

constexpr const char* kOrigin = "http://app.example:3000";

class ChatServerTest : public HttpServerTest {
 protected:
  static void SetUpTestSuite() {
    HttpServerTest::SetUpTestSuite();
    RestContext ctx = context("", true);
    ctx.chat = load_chat_settings(model_dir(), "chatml").value();
    ctx.cors_origins = {kOrigin};
    chat_server_ = HttpServer::start("127.0.0.1", 0, std::move(ctx), 2).value().release();
    RestContext any = context("k3y", false);
    any.cors_origins = {"*"};
    any_origin_server_ = HttpServer::start("127.0.0.1", 0, std::move(any), 1).value().release();
  }
  static void TearDownTestSuite() {
    delete chat_server_;  // before the backend goes (the base's teardown)
    delete any_origin_server_;
    HttpServerTest::TearDownTestSuite();
  }
  static int chat_port() { return chat_server_->port(); }

  static Reply chat(const json& body, const Headers& headers = {}, int at = 0) {
    return call(at ? at : chat_port(), http::verb::post, "/v1/chat/completions", body.dump(), headers);
  }

  static inline HttpServer* chat_server_ = nullptr;
  static inline HttpServer* any_origin_server_ = nullptr;
};

const json kMessages = json::array({{{"role", "system"}, {"content", "You write news."}},
                                    {{"role", "user"}, {"content", "The jury said"}}});

json sampled_chat(int n = 1) {
  return {{"messages", kMessages}, {"max_tokens", 10}, {"temperature", 0.9}, {"seed", 1234},
          {"ignore_eos", true},    {"n", n}};
}

TEST_F(ChatServerTest, ChatAnswersWhatCompletionsAnswersForTheRenderedPrompt) {
  Reply r = chat(sampled_chat());
  ASSERT_EQ(r.status, 200) << r.body();
  const json doc = r.body_json();
  EXPECT_EQ(doc["object"], "chat.completion");
  EXPECT_TRUE(doc["id"].get<std::string>().starts_with("chatcmpl-")) << doc["id"];
  EXPECT_EQ(std::string(r.message["X-Request-Id"]), doc["id"].get<std::string>());
  ASSERT_EQ(doc["choices"].size(), 1u);
  const json& choice = doc["choices"][0];
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_TRUE(choice["logprobs"].is_null());
  EXPECT_EQ(doc["usage"]["completion_tokens"], 10);

  // The same prompt through /tokenize (the template's text) and /v1/completions, same seed.
  Reply tok = call(chat_port(), http::verb::post, "/tokenize", json{{"messages", kMessages}}.dump());
  ASSERT_EQ(tok.status, 200) << tok.body();
  const json ids = tok.body_json()["tokens"];
  EXPECT_EQ(doc["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(tokenizer_->decode(ids.get<std::vector<int32_t>>()),
            "<|im_start|>system\nYou write news.<|im_end|>\n<|im_start|>user\nThe jury said<|im_end|>\n"
            "<|im_start|>assistant\n");
  json completion = sampled_chat();
  completion.erase("messages");
  completion["prompt"] = ids;
  Reply c = post(chat_port(), completion);
  ASSERT_EQ(c.status, 200) << c.body();
  EXPECT_EQ(choice["message"]["content"], c.body_json()["choices"][0]["text"]);
  EXPECT_FALSE(choice["message"]["content"].get<std::string>().empty());
}

TEST_F(ChatServerTest, StreamOpensEachChoiceWithItsRoleAndEndsWithUsage) {
  json body = sampled_chat(2);
  Reply whole = chat(body);
  ASSERT_EQ(whole.status, 200) << whole.body();
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  Reply r = chat(body, {{"X-Request-Id", "client-id-42"}});
  ASSERT_EQ(r.status, 200) << r.body();
  EXPECT_EQ(r.header(http::field::content_type), "text/event-stream");
  EXPECT_EQ(std::string(r.message["X-Request-Id"]), "client-id-42");
  const std::vector<std::string> events = sse_data(r.body());
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<std::string> text(2);
  std::vector<int> finished(2, 0);
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_EQ(chunk["id"], "client-id-42");
    EXPECT_TRUE(chunk["usage"].is_null());
    const json& c = chunk["choices"][0];
    const size_t index = c["index"].get<size_t>();
    ASSERT_LT(index, 2u);
    if (i < 2) EXPECT_EQ(c["delta"], (json{{"role", "assistant"}, {"content", ""}})) << events[i];
    else EXPECT_FALSE(c["delta"].contains("role")) << events[i];
    if (c["delta"].contains("content")) text[index] += c["delta"]["content"].get<std::string>();
    finished[index] += !c["finish_reason"].is_null();
  }
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"], whole.body_json()["usage"]);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(finished[i], 1) << "choice " << i << " ends once";
    EXPECT_EQ(text[i], whole.body_json()["choices"][i]["message"]["content"]) << "choice " << i;
  }
  EXPECT_NE(text[0], text[1]) << "n samples draw differently";
}

TEST_F(ChatServerTest, LogprobsContentListsEachTokenWithItsAlternatives) {
  json body = sampled_chat();
  body["logprobs"] = true;
  body["top_logprobs"] = 3;
  Reply r = chat(body);
  ASSERT_EQ(r.status, 200) << r.body();
  const json choice = r.body_json()["choices"][0];
  const json& content = choice["logprobs"]["content"];
  ASSERT_EQ(content.size(), 10u);
  std::string bytes;
  for (const json& t : content) {
    ASSERT_TRUE(t["logprob"].is_number()) << t;
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    ASSERT_EQ(t["top_logprobs"].size(), 3u) << t;
    for (const json& alt : t["top_logprobs"]) EXPECT_TRUE(alt.contains("token") && alt.contains("bytes"));
    for (const json& b : t["bytes"]) bytes += char(b.get<int>());
  }
  EXPECT_EQ(bytes, choice["message"]["content"]);
  body["top_logprobs"] = 21;
  Reply bad = chat(body);
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.body_json()["error"]["param"], "top_logprobs");
}

// One refusal: its status, param and a piece of its message.
void expect_refusal(const Reply& r, int status, const std::string& param, const std::string& says) {
  EXPECT_EQ(r.status, status) << r.body();
  const json e = json::parse(r.body())["error"];
  EXPECT_EQ(e["param"].is_null() ? "" : e["param"].get<std::string>(), param) << r.body();
  EXPECT_NE(e["message"].get<std::string>().find(says), std::string::npos) << r.body();
  EXPECT_FALSE(std::string(r.message["X-Request-Id"]).empty()) << "errors carry X-Request-Id too";
}

TEST_F(ChatServerTest, BadChatRequestsAre400sNamingTheField) {
  expect_refusal(chat({{"max_tokens", 3}}), 400, "messages", "'messages' is required");
  expect_refusal(chat({{"messages", "hi"}}), 400, "messages", "must be an array");
  expect_refusal(chat({{"messages", json::array()}}), 400, "messages", "'messages' is empty");
  expect_refusal(chat({{"messages", {{{"content", "x"}}}}}), 400, "messages", "'messages'[0].role");
  expect_refusal(chat({{"messages", {{{"role", "user"}, {"content", 5}}}}}), 400, "messages", "content must be");
  expect_refusal(chat({{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}), 400, "messages",
                 "text part");
  expect_refusal(chat({{"messages", kMessages}, {"prompt", "x"}}), 400, "prompt", "unknown field 'prompt'");
  expect_refusal(chat({{"messages", kMessages}, {"tools", json::array({1})}}), 400, "tools", "not supported");
  expect_refusal(chat({{"messages", kMessages}, {"top_logprobs", 2}}), 400, "top_logprobs", "needs 'logprobs': true");
  expect_refusal(chat({{"messages", kMessages}, {"temperature", 9}}), 400, "temperature", "between 0.0 and 2.0");
  expect_refusal(chat({{"messages", kMessages}, {"max_completion_tokens", 1000}}), 400, "max_completion_tokens",
                 "maximum context length");
  std::string long_text;
  for (int i = 0; i < 300; ++i) long_text += "word ";
  expect_refusal(chat({{"messages", {{{"role", "user"}, {"content", long_text}}}}}), 400, "messages",
                 "the conversation renders to");
  // Text parts are joined; the answer is the same as for the plain string.
  json parts = sampled_chat();
  parts["messages"][1]["content"] = json::array({{{"type", "text"}, {"text", "The jury said"}}});
  EXPECT_EQ(chat(parts).body_json()["choices"], chat(sampled_chat()).body_json()["choices"]);
}

TEST_F(ChatServerTest, AModelWithoutATemplateSaysHowToGiveOne) {
  Reply r = chat({{"messages", kMessages}}, {}, port());  // the base server has no template
  expect_refusal(r, 400, "messages", "--chat-template");
  EXPECT_EQ(r.body_json()["error"]["code"], "chat_template_missing");
  expect_refusal(call(port(), http::verb::post, "/tokenize", json{{"messages", kMessages}}.dump()), 400, "messages",
                 "no chat template");
}

TEST(ChatPrompt, ATemplatesRefusalIsTheClientsError) {
  ChatSettings settings;
  settings.chat_template = ChatTemplate::parse(*builtin_chat_template("llama2"), "llama2").value();
  ApiError error;
  auto out = render_chat_prompt(json::array({{{"role", "user"}, {"content", "a"}}, {{"role", "user"}, {"content", "b"}}}),
                                true, settings, &error);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(error.http_status, 400);
  EXPECT_EQ(error.param, "messages");
  EXPECT_NE(error.message.find("chat template 'llama2' refused the conversation"), std::string::npos) << error.message;
}

TEST(ChatPrompt, SpecialTokenTextsBecomeTheirTokens) {
  auto tokenizer = Tokenizer::load(model_dir()).value();
  ChatSettings settings;
  const int32_t eos = tokenizer.eos_id().value();
  const std::vector<int32_t> ids = encode_chat_prompt(tokenizer, "a<|endoftext|>b<|endoftext|>", settings);
  std::vector<int32_t> expected = tokenizer.encode("a");
  expected.push_back(eos);
  for (int32_t id : tokenizer.encode("b")) expected.push_back(id);
  expected.push_back(eos);
  EXPECT_EQ(ids, expected);
}

TEST_F(ChatServerTest, RequestIdIsEchoedOrMadeOnEveryAnswer) {
  Reply ok = call(chat_port(), http::verb::get, "/v1/models", "", {{"X-Request-Id", "abc-123"}});
  EXPECT_EQ(std::string(ok.message["X-Request-Id"]), "abc-123");
  Reply missing = call(chat_port(), http::verb::get, "/no/such", "", {{"X-Request-Id", "abc-404"}});
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(std::string(missing.message["X-Request-Id"]), "abc-404");
  Reply bad = chat({{"messages", 1}}, {{"X-Request-Id", "abc-400"}});
  EXPECT_EQ(std::string(bad.message["X-Request-Id"]), "abc-400");
  Reply unauthorized = call(any_origin_server_->port(), http::verb::get, "/v1/models", "", {{"X-Request-Id", "abc-401"}});
  EXPECT_EQ(unauthorized.status, 401);
  EXPECT_EQ(std::string(unauthorized.message["X-Request-Id"]), "abc-401");
  Reply named = chat(sampled_chat(), {{"X-Request-Id", "run-7"}});
  EXPECT_EQ(named.body_json()["id"], "run-7") << "the request runs under the client's id";
  for (const std::string& unacceptable : {std::string("has space"), std::string(129, 'x'), std::string("tab\there")}) {
    Reply r = call(chat_port(), http::verb::get, "/v1/models", "", {{"X-Request-Id", unacceptable}});
    const std::string id(r.message["X-Request-Id"]);
    EXPECT_TRUE(id.starts_with("req-") && id.size() == 36) << id;
  }
  const std::string made_a(call(port(), http::verb::get, "/health").message["X-Request-Id"]);
  const std::string made_b(call(port(), http::verb::get, "/health").message["X-Request-Id"]);
  EXPECT_NE(made_a, made_b);
}

TEST_F(ChatServerTest, CorsPreflightAndHeadersForAllowedOriginsOnly) {
  const Headers preflight = {{"Origin", kOrigin},
                             {"Access-Control-Request-Method", "POST"},
                             {"Access-Control-Request-Headers", "content-type,authorization"}};
  Reply r = call(chat_port(), http::verb::options, "/v1/chat/completions", "", preflight);
  EXPECT_EQ(r.status, 204);
  EXPECT_EQ(r.header(http::field::access_control_allow_origin), kOrigin);
  EXPECT_EQ(r.header(http::field::access_control_allow_methods), "GET, POST, OPTIONS");
  EXPECT_EQ(r.header(http::field::access_control_allow_headers), "content-type,authorization");
  EXPECT_EQ(r.header(http::field::access_control_max_age), "600");
  EXPECT_EQ(r.header(http::field::vary), "Origin");
  EXPECT_TRUE(r.body().empty());
  EXPECT_EQ(r.header(http::field::content_length), "");

  Reply other = call(chat_port(), http::verb::options, "/v1/chat/completions", "",
                     {{"Origin", "http://evil.example"}, {"Access-Control-Request-Method", "POST"}});
  EXPECT_EQ(other.status, 204);
  EXPECT_EQ(other.header(http::field::access_control_allow_origin), "");
  EXPECT_EQ(other.header(http::field::allow), "GET, POST, OPTIONS");

  Reply get = call(chat_port(), http::verb::get, "/v1/models", "", {{"Origin", kOrigin}});
  EXPECT_EQ(get.header(http::field::access_control_allow_origin), kOrigin);
  EXPECT_EQ(get.header(http::field::access_control_expose_headers), "X-Request-Id");
  Reply error = chat({{"messages", 1}}, {{"Origin", kOrigin}});
  EXPECT_EQ(error.header(http::field::access_control_allow_origin), kOrigin) << "errors are readable cross-origin too";
  EXPECT_EQ(call(chat_port(), http::verb::get, "/v1/models").header(http::field::access_control_allow_origin), "");

  // No CORS configured: OPTIONS is still answered (204, Allow), without Access-Control-*.
  Reply off = call(port(), http::verb::options, "/v1/completions", "", preflight);
  EXPECT_EQ(off.status, 204);
  EXPECT_EQ(off.header(http::field::access_control_allow_origin), "");
  EXPECT_EQ(off.header(http::field::allow), "GET, POST, OPTIONS");
  // "*": any origin; a preflight needs no API key (browsers send none), the call itself does.
  Reply star = call(any_origin_server_->port(), http::verb::options, "/v1/completions", "",
                    {{"Origin", "https://anything.example"}, {"Access-Control-Request-Method", "POST"}});
  EXPECT_EQ(star.status, 204);
  EXPECT_EQ(star.header(http::field::access_control_allow_origin), "*");
  EXPECT_EQ(star.header(http::field::access_control_allow_headers), "Authorization, Content-Type, X-Request-Id");
  Reply denied = call(any_origin_server_->port(), http::verb::get, "/v1/models", "", {{"Origin", "https://a.example"}});
  EXPECT_EQ(denied.status, 401);
  EXPECT_EQ(denied.header(http::field::access_control_allow_origin), "*");
}

TEST_F(ChatServerTest, TokenizeAndDetokenizeAsVllm) {
  Reply t = call(chat_port(), http::verb::post, "/tokenize", json{{"prompt", "The jury said"}, {"model", "brown-gpt2"}}.dump());
  ASSERT_EQ(t.status, 200) << t.body();
  const json doc = t.body_json();
  EXPECT_EQ(doc["tokens"], json(tokenizer_->encode("The jury said")));
  EXPECT_EQ(doc["count"], doc["tokens"].size());
  EXPECT_EQ(doc["max_model_len"], 256);
  EXPECT_TRUE(doc["token_strs"].is_null());
  Reply strs = call(chat_port(), http::verb::post, "/tokenize", json{{"prompt", "a b"}, {"return_token_strs", true}}.dump());
  EXPECT_EQ(strs.body_json()["token_strs"], json::array({"a", " b"}));
  Reply d = call(chat_port(), http::verb::post, "/detokenize", json{{"tokens", doc["tokens"]}}.dump());
  ASSERT_EQ(d.status, 200) << d.body();
  EXPECT_EQ(d.body_json(), (json{{"prompt", "The jury said"}}));

  auto post_to = [&](const char* path, const json& body) { return call(chat_port(), http::verb::post, path, body.dump()); };
  expect_refusal(post_to("/tokenize", json::object()), 400, "prompt", "exactly one of 'prompt'");
  expect_refusal(post_to("/tokenize", {{"prompt", 7}}), 400, "prompt", "'prompt' must be a string");
  expect_refusal(post_to("/tokenize", {{"prompt", "x"}, {"messages", kMessages}}), 400, "prompt", "exactly one");
  expect_refusal(post_to("/tokenize", {{"prompt", "x"}, {"extra", 1}}), 400, "extra", "unknown field 'extra'");
  expect_refusal(post_to("/tokenize", {{"prompt", "x"}, {"model", "gpt-4"}}), 404, "model", "does not exist");
  expect_refusal(post_to("/detokenize", json::object()), 400, "tokens", "'tokens' is required");
  expect_refusal(post_to("/detokenize", {{"tokens", "12"}}), 400, "tokens", "must be an array of token ids");
  expect_refusal(post_to("/detokenize", {{"tokens", {1, "2"}}}), 400, "tokens", "'tokens'[1] must be a token id");
  expect_refusal(post_to("/detokenize", {{"tokens", {1, 4096}}}), 400, "tokens", "valid: 0..4095");
  expect_refusal(post_to("/detokenize", {{"tokens", {-1}}}), 400, "tokens", "is not a token id");
  expect_refusal(call(chat_port(), http::verb::post, "/tokenize", "{not json"), 400, "", "not valid JSON");
  EXPECT_EQ(call(chat_port(), http::verb::get, "/tokenize").status, 405);
}

}  // namespace
}  // namespace conveyor

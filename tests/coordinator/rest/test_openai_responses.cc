// The completion response: the non-streaming document and the SSE stream (golden text),
// with logprobs, echo, several prompts and choices, usage and the fingerprint.
#include "coordinator/rest/openai_api.h"

#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/coordinator/rest/openai_test_util.h"

namespace conveyor {
namespace {

using namespace openai_test;
// --- responses -----------------------------------------------------------------------

ResponseOptions options(bool include_usage = false) {
  ResponseOptions o;
  o.include_usage = include_usage;
  o.system_fingerprint = "fp_0123456789ab";
  return o;
}

std::shared_ptr<CompletionRequest> request_for(const json& body) {
  auto r = std::make_shared<CompletionRequest>(ok(body));
  r->id = "cmpl-test";
  return r;
}

ChoiceUpdate update(size_t choice, std::vector<int32_t> ids, std::string text,
                    std::optional<std::string> finish = std::nullopt) {
  ChoiceUpdate u;
  u.choice = choice;
  for (int32_t id : ids) u.tokens.push_back(TokenOut{id, -1.5f, {}});
  u.text = std::move(text);
  u.finish_reason = std::move(finish);
  return u;
}

int32_t id_of(const std::string& text) {
  std::vector<int32_t> ids = tok().encode(text);
  EXPECT_EQ(ids.size(), 1u) << text;
  return ids.empty() ? 0 : ids[0];
}

TEST(CompletionResponse, NonStreamingDocument) {
  auto req = request_for({{"prompt", "The jury"}, {"max_tokens", 3}});
  CompletionResponseBuilder b(req, tok(), 1700000000, options());
  const int32_t a = id_of(" said"), c = id_of(" it");
  b.add(update(0, {a}, " said"));
  b.add(update(0, {c}, " it", "length"));
  EXPECT_TRUE(b.all_finished());
  const int64_t prompt_tokens = int64_t(req->prompts[0].size());
  const json expected = {
      {"id", "cmpl-test"},
      {"object", "text_completion"},
      {"created", 1700000000},
      {"model", kModel},
      {"system_fingerprint", "fp_0123456789ab"},
      {"choices", {{{"text", " said it"}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", "length"}}}},
      {"usage", {{"prompt_tokens", prompt_tokens},
                 {"completion_tokens", 2},
                 {"total_tokens", prompt_tokens + 2},
                 {"prompt_tokens_details", {{"cached_tokens", 0}}}}}};
  EXPECT_EQ(b.response(), expected) << b.response().dump(2);
}

TEST(CompletionResponse, SeveralPromptsAndChoicesWithEchoAndTokenIds) {
  auto req = request_for({{"prompt", {"A", "B"}}, {"n", 2}, {"echo", true}, {"return_token_ids", true}});
  CompletionResponseBuilder b(req, tok(), 1, options());
  // Interleaved updates, as the core may send them.
  b.add(update(3, {7}, "x"));
  b.add(update(0, {8}, "y", "stop"));
  b.add(update(1, {9}, "z", "length"));
  b.add(update(2, {10}, "w", "length"));
  EXPECT_FALSE(b.all_finished());
  b.add(update(3, {11}, "v", "length"));
  EXPECT_TRUE(b.all_finished());
  const json doc = b.response();
  ASSERT_EQ(doc["choices"].size(), 4u);
  EXPECT_EQ(doc["choices"][0]["text"], "Ay");
  EXPECT_EQ(doc["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(doc["choices"][1]["text"], "Az");
  EXPECT_EQ(doc["choices"][2]["text"], "Bw");
  EXPECT_EQ(doc["choices"][3]["text"], "Bxv");
  EXPECT_EQ(doc["choices"][3]["index"], 3);
  EXPECT_EQ(doc["choices"][3]["token_ids"], json({7, 11}));
  EXPECT_EQ(doc["choices"][3]["prompt_token_ids"], json(tok().encode("B")));
  // Each prompt counts once in usage, whatever n is.
  EXPECT_EQ(doc["usage"]["prompt_tokens"], int64_t(tok().encode("A").size() + tok().encode("B").size()));
  EXPECT_EQ(doc["usage"]["completion_tokens"], 5);
}

TEST(CompletionResponse, LogprobsWithEchoFollowOpenAIShape) {
  auto req = request_for({{"prompt", "The jury"}, {"logprobs", 1}, {"echo", true}});
  const std::vector<int32_t>& prompt = req->prompts[0];
  ASSERT_GE(prompt.size(), 2u);
  CompletionResponseBuilder b(req, tok(), 1, options());
  ChoiceUpdate u = update(0, {id_of(" said")}, " said");
  u.tokens[0].logprob = -0.5f;
  u.tokens[0].top = {{id_of(" was"), -0.25f}};  // the chosen token is not the top one
  for (size_t i = 0; i < prompt.size(); ++i)
    u.prompt_tokens.push_back(TokenOut{prompt[i], i == 0 ? NAN : -2.0f, i == 0 ? std::vector<std::pair<int32_t, float>>{}
                                                                              : std::vector<std::pair<int32_t, float>>{{prompt[i], -2.0f}}});
  b.add(u);
  ChoiceUpdate last = update(0, {id_of(" it")}, " it", "length");
  last.tokens[0].logprob = -1.0f;
  last.tokens[0].top = {{id_of(" it"), -1.0f}};
  b.add(last);
  const json lp = b.response()["choices"][0]["logprobs"];
  const size_t n = prompt.size() + 2;
  ASSERT_EQ(lp["tokens"].size(), n);
  ASSERT_EQ(lp["token_logprobs"].size(), n);
  ASSERT_EQ(lp["top_logprobs"].size(), n);
  ASSERT_EQ(lp["text_offset"].size(), n);
  EXPECT_EQ(lp["tokens"][0], tok().token_bytes(prompt[0]));
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());  // the first prompt token has no context
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["token_logprobs"][1], -2.0);
  EXPECT_EQ(lp["tokens"][n - 2], " said");
  EXPECT_EQ(lp["token_logprobs"][n - 2], -0.5);
  EXPECT_EQ(lp["top_logprobs"][n - 2], json({{" was", -0.25}, {" said", -0.5}}));  // chosen always listed
  EXPECT_EQ(lp["top_logprobs"][n - 1], json({{" it", -1.0}}));
  // Byte offsets into the returned text, the echoed prompt first.
  const std::string text = b.response()["choices"][0]["text"];
  EXPECT_EQ(text, "The jury said it");
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][n - 2], 8);   // " said" starts after "The jury"
  EXPECT_EQ(lp["text_offset"][n - 1], 13);  // " it"
}

TEST(CompletionResponse, LogprobsWithoutEchoStartAtZero) {
  auto req = request_for({{"prompt", "The jury"}, {"logprobs", 0}});
  CompletionResponseBuilder b(req, tok(), 1, options());
  b.add(update(0, {id_of(" said"), id_of(" it")}, " said it", "length"));
  const json lp = b.response()["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({" said", " it"}));
  EXPECT_EQ(lp["text_offset"], json({0, 5}));
  EXPECT_EQ(lp["top_logprobs"][0], json({{" said", -1.5}}));  // logprobs 0: just the chosen token
}

TEST(CompletionResponse, TokenStringsAreValidUtf8) {
  const int32_t partial = tok().token_id("\xc3\xa2").value();  // the byte-level symbol of byte 0xE2
  ASSERT_EQ(tok().token_bytes(partial), "\xe2");
  EXPECT_EQ(token_display_string(tok(), partial), "bytes:\\xe2");
  EXPECT_EQ(token_display_string(tok(), id_of(" said")), " said");
  // A text delta with a broken character is replaced, not thrown on.
  auto req = request_for({{"prompt", "x"}, {"logprobs", 0}});
  CompletionResponseBuilder b(req, tok(), 1, options());
  const std::string event = b.sse_chunk(update(0, {partial}, "\xe2", "length"));
  EXPECT_NE(event.find("\"bytes:\\\\xe2\""), std::string::npos) << event;
  EXPECT_NE(event.find("\"text\":\"\xef\xbf\xbd\""), std::string::npos) << event;
  EXPECT_NO_THROW(json::parse(event.substr(6)));
}

TEST(CompletionResponse, SseGoldenWithoutUsage) {
  // No stream_options: OpenAI sends no "usage" field in any chunk.
  auto req = request_for({{"prompt", "The jury"}, {"stream", true}});
  CompletionResponseBuilder b(req, tok(), 1700000000, options());
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" said")}, " said")),
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"logprobs\":null,\"text\":\" said\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\"}\n\n");
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" it")}, " it", "stop")),
            "data: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"logprobs\":null,\"text\":\" it\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\"}\n\n");
  EXPECT_EQ(b.sse_finish(), "data: [DONE]\n\n");
  EXPECT_EQ(CompletionResponseBuilder::sse_error(api_error(500, "boom", "", "server_error")),
            "data: {\"error\":{\"code\":null,\"message\":\"boom\",\"param\":null,\"type\":\"server_error\"}}\n\n");
}

TEST(CompletionResponse, SseGoldenWithIncludeUsage) {
  // include_usage: every choice chunk has "usage": null, then one chunk with no choices
  // carries the usage, then [DONE].
  auto req = request_for({{"prompt", "The jury"}, {"stream", true}, {"stream_options", {{"include_usage", true}}}});
  const int64_t p = int64_t(req->prompts[0].size());
  CompletionResponseBuilder b(req, tok(), 1700000000, options(/*include_usage=*/true));
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" said")}, " said")),
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"logprobs\":null,\"text\":\" said\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\",\"usage\":null}\n\n");
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" it")}, " it", "stop")),
            "data: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"logprobs\":null,\"text\":\" it\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\",\"usage\":null}\n\n");
  EXPECT_EQ(b.sse_finish(),
            "data: {\"choices\":[],\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\","
            "\"object\":\"text_completion\",\"system_fingerprint\":\"fp_0123456789ab\",\"usage\":{\"completion_tokens\":2,"
            "\"prompt_tokens\":" + std::to_string(p) + ",\"prompt_tokens_details\":{\"cached_tokens\":0},\"total_tokens\":" +
            std::to_string(p + 2) + "}}\n\n"
            "data: [DONE]\n\n");
}

TEST(CompletionResponse, NoFingerprintIsNull) {
  auto req = request_for({{"prompt", "The jury"}});
  CompletionResponseBuilder b(req, tok(), 1, ResponseOptions{});
  const json doc = b.response();
  ASSERT_TRUE(doc.contains("system_fingerprint"));
  EXPECT_TRUE(doc["system_fingerprint"].is_null());
}

TEST(CompletionResponse, SseEchoAndUsageWhenTheCoreEndsEarly) {
  const json body = {{"prompt", "The jury"}, {"stream", true}, {"echo", true}, {"n", 2}, {"return_token_ids", true}};
  for (bool include_usage : {false, true}) {
    SCOPED_TRACE(include_usage ? "include_usage" : "no usage");
    auto req = request_for(body);
    CompletionResponseBuilder b(req, tok(), 1, options(include_usage));
    json first = json::parse(b.sse_chunk(update(1, {5}, " a")).substr(6));
    EXPECT_EQ(first["choices"][0]["index"], 1);
    EXPECT_EQ(first["choices"][0]["text"], "The jury a");  // the echo rides on a choice's first chunk
    EXPECT_EQ(first["choices"][0]["token_ids"], json({5}));
    EXPECT_EQ(first["choices"][0]["prompt_token_ids"], json(req->prompts[0]));
    json second = json::parse(b.sse_chunk(update(1, {6}, " b", "length")).substr(6));
    EXPECT_EQ(second["choices"][0]["text"], " b");
    EXPECT_FALSE(second["choices"][0].contains("prompt_token_ids"));
    EXPECT_EQ(second.contains("usage"), include_usage);
    if (include_usage) {
      EXPECT_TRUE(second["usage"].is_null());
    }
    // The core ends with choice 0 unfinished: the usage chunk (when asked for) still comes.
    const std::string tail = b.sse_finish();
    ASSERT_TRUE(tail.ends_with("data: [DONE]\n\n"));
    if (!include_usage) {
      EXPECT_EQ(tail, "data: [DONE]\n\n");
      continue;
    }
    json usage_chunk = json::parse(tail.substr(6, tail.find("\n\n") - 6));
    EXPECT_TRUE(usage_chunk["choices"].empty());
    EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 2);
    EXPECT_EQ(usage_chunk["system_fingerprint"], "fp_0123456789ab");
  }
}

}  // namespace
}  // namespace conveyor

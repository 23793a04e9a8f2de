// The REST server's completions endpoint end to end: the model's own text, plain and
// streamed (one SSE chunk per update), seeded sampling with several choices and logprobs,
// stop strings, bad requests as 400s naming the field, the core's refusals and failures as
// status codes or SSE error events, and a client leaving mid-stream. The fixture (a real
// server over the brown-gpt2 model) is http_server_test_util.h.
#include "coordinator/rest/http_server.h"

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/coordinator/rest/http_server_test_util.h"

namespace conveyor {
namespace {

using namespace http_server_test;

TEST_F(HttpServerTest, NonStreamingCompletionIsTheModelsOwnText) {
  const std::string expected = greedy_text("The jury said", 8);
  const uint64_t ok_before = metrics_->requests_with_code(200);
  Reply r = post(port(), kGreedy);
  ASSERT_EQ(r.status, 200) << r.body();
  EXPECT_EQ(r.header(http::field::content_type), "application/json");
  const json doc = r.body_json();
  EXPECT_EQ(doc["object"], "text_completion");
  EXPECT_EQ(doc["model"], "brown-gpt2");
  EXPECT_EQ(std::string(r.message["X-Request-Id"]), doc["id"].get<std::string>());
  ASSERT_EQ(doc["choices"].size(), 1u);
  EXPECT_EQ(doc["choices"][0]["text"], expected);
  EXPECT_EQ(doc["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(doc["usage"]["completion_tokens"], 8);
  EXPECT_EQ(doc["usage"]["prompt_tokens"], int(tokenizer_->encode("The jury said").size()));
  EXPECT_EQ(metrics_->requests_with_code(200), ok_before + 1);
}

TEST_F(HttpServerTest, StreamingSendsOneChunkPerUpdateAndTheSameText) {
  const std::string expected = greedy_text("The jury said", 8);
  const uint64_t ttft_before = metrics_->time_to_first_token_count();
  const uint64_t itl_before = metrics_->inter_token_latency_count();
  json body = kGreedy;
  body["stream"] = true;
  Reply r = post(port(), body);
  ASSERT_EQ(r.status, 200) << r.body();
  EXPECT_EQ(r.header(http::field::content_type), "text/event-stream");
  EXPECT_TRUE(r.message.chunked());
  const std::vector<std::string> events = sse_data(r.body());
  ASSERT_EQ(events.size(), 8u + 1u);  // one per token, then [DONE]
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    EXPECT_EQ(chunk["object"], "text_completion");
    ASSERT_EQ(chunk["choices"].size(), 1u);
    text += chunk["choices"][0]["text"].get<std::string>();
    const bool last = i + 2 == events.size();
    EXPECT_EQ(chunk["choices"][0]["finish_reason"].is_null(), !last);
    EXPECT_FALSE(chunk.contains("usage")) << events[i];  // no stream_options: no usage, as OpenAI
  }
  EXPECT_EQ(text, expected);
  EXPECT_EQ(metrics_->time_to_first_token_count(), ttft_before + 1);
  EXPECT_EQ(metrics_->inter_token_latency_count(), itl_before + 7);
}

TEST_F(HttpServerTest, StreamWithIncludeUsageEndsWithAUsageOnlyChunk) {
  const std::string expected = greedy_text("The jury said", 8);
  json body = kGreedy;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  Reply r = post(port(), body);
  ASSERT_EQ(r.status, 200) << r.body();
  const std::vector<std::string> events = sse_data(r.body());
  ASSERT_EQ(events.size(), 8u + 2u);  // one per token, the usage chunk, then [DONE]
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i < 8; ++i) {
    const json chunk = json::parse(events[i]);
    ASSERT_EQ(chunk["choices"].size(), 1u) << events[i];
    ASSERT_TRUE(chunk.contains("usage")) << events[i];
    EXPECT_TRUE(chunk["usage"].is_null()) << events[i];
    text += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, expected);
  const json usage_chunk = json::parse(events[8]);
  EXPECT_EQ(usage_chunk["object"], "text_completion");
  EXPECT_EQ(usage_chunk["choices"], json::array());
  const int prompt_tokens = int(tokenizer_->encode("The jury said").size());
  EXPECT_EQ(usage_chunk["usage"], json({{"prompt_tokens", prompt_tokens},
                                        {"completion_tokens", 8},
                                        {"total_tokens", prompt_tokens + 8},
                                        {"prompt_tokens_details", {{"cached_tokens", 0}}}}));
  EXPECT_EQ(usage_chunk["id"], json::parse(events[0])["id"]);

  // include_usage false is the same as leaving stream_options out.
  body["stream_options"] = {{"include_usage", false}};
  Reply without = post(port(), body);
  ASSERT_EQ(without.status, 200) << without.body();
  const std::vector<std::string> plain = sse_data(without.body());
  ASSERT_EQ(plain.size(), 8u + 1u);
  for (size_t i = 0; i < 8; ++i) EXPECT_FALSE(json::parse(plain[i]).contains("usage")) << plain[i];

  // stream_options without a stream is refused, naming it.
  json not_streaming = kGreedy;
  not_streaming["stream_options"] = {{"include_usage", true}};
  Reply refused = post(port(), not_streaming);
  EXPECT_EQ(refused.status, 400);
  EXPECT_EQ(refused.body_json()["error"]["param"], "stream_options");
}

TEST_F(HttpServerTest, EveryResponseAndChunkCarriesOneSystemFingerprint) {
  Reply plain = post(port(), kGreedy);
  ASSERT_EQ(plain.status, 200) << plain.body();
  const json fingerprint = plain.body_json()["system_fingerprint"];
  ASSERT_TRUE(fingerprint.is_string()) << plain.body();
  EXPECT_TRUE(fingerprint.get<std::string>().starts_with("fp_")) << fingerprint;
  EXPECT_EQ(fingerprint, system_fingerprint("brown-gpt2", load_model_config(model_dir()).value(), *tokenizer_));
  // Another request, and the other server of the same model and build, say the same.
  EXPECT_EQ(post(port(), kGreedy).body_json()["system_fingerprint"], fingerprint);
  Reply keyed = post(keyed_server_->port(), kGreedy, {{"Authorization", "Bearer s3cret-key"}});
  ASSERT_EQ(keyed.status, 200) << keyed.body();
  EXPECT_EQ(keyed.body_json()["system_fingerprint"], fingerprint);
  // Every stream chunk, the usage chunk included.
  json body = kGreedy;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  Reply streamed = post(port(), body);
  ASSERT_EQ(streamed.status, 200) << streamed.body();
  const std::vector<std::string> events = sse_data(streamed.body());
  ASSERT_EQ(events.size(), 10u);
  for (size_t i = 0; i + 1 < events.size(); ++i) EXPECT_EQ(json::parse(events[i])["system_fingerprint"], fingerprint);
}

TEST_F(HttpServerTest, SeedsAcrossThe64BitRange) {
  // The largest unsigned seed and its signed twin (-1, equal modulo 2^64) sample alike.
  const std::string prefix = R"({"prompt": "The jury said", "max_tokens": 6, "temperature": 1, "ignore_eos": true, "seed": )";
  Reply top = call(port(), http::verb::post, "/v1/completions", prefix + "18446744073709551615}");
  Reply minus_one = call(port(), http::verb::post, "/v1/completions", prefix + "-1}");
  ASSERT_EQ(top.status, 200) << top.body();
  ASSERT_EQ(minus_one.status, 200) << minus_one.body();
  EXPECT_EQ(top.body_json()["choices"][0]["text"], minus_one.body_json()["choices"][0]["text"]);
  Reply lowest = call(port(), http::verb::post, "/v1/completions", prefix + "-9223372036854775808}");
  EXPECT_EQ(lowest.status, 200) << lowest.body();
  // 2^64 does not fit: a 400 that says so.
  Reply over = call(port(), http::verb::post, "/v1/completions", prefix + "18446744073709551616}");
  ASSERT_EQ(over.status, 400) << over.body();
  const json err = over.body_json()["error"];
  EXPECT_EQ(err["param"], "seed");
  EXPECT_NE(err["message"].get<std::string>().find("from -2^63 to 2^64-1"), std::string::npos) << over.body();
  EXPECT_EQ(err["message"].get<std::string>().find("non-integer"), std::string::npos) << over.body();
}

TEST_F(HttpServerTest, SeededSamplingWithSeveralChoicesIsReproducible) {
  const json body = {{"prompt", {"The jury", "It was"}}, {"max_tokens", 6}, {"n", 2},          {"temperature", 0.9},
                     {"seed", 7},                        {"logprobs", 2},  {"echo", true},    {"return_token_ids", true},
                     {"ignore_eos", true}};
  Reply a = post(port(), body), b = post(port(), body);
  ASSERT_EQ(a.status, 200) << a.body();
  ASSERT_EQ(b.status, 200) << b.body();
  const json da = a.body_json(), db = b.body_json();
  ASSERT_EQ(da["choices"].size(), 4u);
  for (size_t c = 0; c < 4; ++c) {
    const json& ch = da["choices"][c];
    EXPECT_EQ(ch["index"], c);
    EXPECT_EQ(ch["text"], db["choices"][c]["text"]);
    const std::string prompt = c < 2 ? "The jury" : "It was";
    EXPECT_TRUE(ch["text"].get<std::string>().starts_with(prompt)) << ch["text"];
    const size_t prompt_len = tokenizer_->encode(prompt).size();
    EXPECT_EQ(ch["logprobs"]["tokens"].size(), prompt_len + 6);
    EXPECT_TRUE(ch["logprobs"]["token_logprobs"][0].is_null());
    EXPECT_LE(ch["logprobs"]["token_logprobs"][prompt_len].get<double>(), 0.0);
    EXPECT_GE(ch["logprobs"]["top_logprobs"][prompt_len].size(), 2u);
    EXPECT_EQ(ch["token_ids"].size(), 6u);
    // The returned ids are what the text says.
    std::vector<int32_t> ids = ch["token_ids"];
    EXPECT_EQ(prompt + tokenizer_->decode(ids), ch["text"].get<std::string>());
  }
  // Two samples of one prompt differ (seeded by choice), and a different seed changes them.
  EXPECT_NE(da["choices"][0]["token_ids"], da["choices"][1]["token_ids"]);
  json other = body;
  other["seed"] = 8;
  EXPECT_NE(post(port(), other).body_json()["choices"][0]["token_ids"], da["choices"][0]["token_ids"]);
}

TEST_F(HttpServerTest, StopStringEndsTheText) {
  const std::string full = greedy_text("The jury said", 12);
  ASSERT_GT(full.size(), 8u);
  const std::string stop = full.substr(full.size() / 2, 3);
  json body = kGreedy;
  body["max_tokens"] = 12;
  body["stop"] = stop;
  Reply r = post(port(), body);
  ASSERT_EQ(r.status, 200) << r.body();
  const json doc = r.body_json();
  EXPECT_EQ(doc["choices"][0]["text"], full.substr(0, full.find(stop)));
  EXPECT_EQ(doc["choices"][0]["finish_reason"], "stop");
}

TEST_F(HttpServerTest, BadRequestsAre400sNamingTheField) {
  struct Case {
    std::string body;
    std::string param;  // "" = null
  };
  std::string long_prompt = "[";
  for (int i = 0; i < 300; ++i) long_prompt += (i ? ",5" : "5");
  long_prompt += "]";
  std::string full_prompt = "[";  // exactly the context (256 tokens): no room to generate
  for (int i = 0; i < 256; ++i) full_prompt += (i ? ",5" : "5");
  full_prompt += "]";
  const std::vector<Case> cases = {
      {"{\"prompt\": \"x\"", ""},                                    // malformed JSON
      {"[1,2,3]", ""},                                               // not an object
      {R"({"prompt": "x", "max_tokens": "ten"})", "max_tokens"},     // wrong type
      {R"({"prompt": "x", "temperature": "warm"})", "temperature"},
      {R"({"prompt": "x", "max_tokens": 300})", "max_tokens"},       // beyond the context
      {R"({"prompt": ""})", "prompt"},                               // empty
      {R"({"prompt": []})", "prompt"},
      {"{\"prompt\": " + long_prompt + "}", "prompt"},               // longer than n_positions
      {"{\"prompt\": " + full_prompt + "}", "prompt"},               // fills it, no max_tokens sent
      {R"({"prompt": [1, 2, 4096]})", "prompt"},                     // outside the vocabulary
      {R"({"prompt": [-5]})", "prompt"},
      {R"({"prompt": "x", "frobnicate": 1})", "frobnicate"},         // unknown field
      {R"({"prompt": "x", "logit_bias": {"1": 101}})", "logit_bias"},   // beyond [-100, 100]
      {R"({"prompt": "x", "use_beam_search": true, "top_p": 0.5})", "top_p"},  // beam search is not sampling
      {R"({"prompt": "x", "stop": ["a","b","c","d","e"]})", "stop"},
  };
  const uint64_t before = metrics_->requests_with_code(400);
  const int accepted_before = backend_->accepted();
  for (const Case& c : cases) {
    Reply r = call(port(), http::verb::post, "/v1/completions", c.body);
    EXPECT_EQ(r.status, 400) << c.body << " -> " << r.body();
    const json err = r.body_json()["error"];
    EXPECT_EQ(err["type"], "invalid_request_error") << r.body();
    if (c.param.empty()) {
      EXPECT_TRUE(err["param"].is_null()) << r.body();
    } else {
      EXPECT_EQ(err["param"], c.param) << r.body();
    }
    EXPECT_FALSE(err["message"].get<std::string>().empty());
    EXPECT_TRUE(err.contains("code"));
  }
  EXPECT_EQ(metrics_->requests_with_code(400), before + cases.size());
  EXPECT_EQ(backend_->accepted(), accepted_before);  // nothing bad reached the core
  // A prompt that fills the context, sent without max_tokens, is not blamed on max_tokens.
  Reply full = call(port(), http::verb::post, "/v1/completions", "{\"prompt\": " + full_prompt + "}");
  EXPECT_EQ(full.body_json()["error"]["message"],
            "this model's maximum context length is 256 tokens, however the prompt has 256 tokens, "
            "which leaves no room for a completion; reduce the prompt");
  // A model the server does not serve: 404 as OpenAI does.
  Reply wrong_model = post(port(), {{"model", "gpt-4"}, {"prompt", "x"}});
  EXPECT_EQ(wrong_model.status, 404);
  EXPECT_EQ(wrong_model.body_json()["error"]["code"], "model_not_found");
}

TEST_F(HttpServerTest, RefusalsMapToStatusCodes) {
  backend_->mode = EngineBackend::Mode::QueueFull;
  Reply full = post(port(), kGreedy);
  EXPECT_EQ(full.status, 429);
  EXPECT_EQ(full.body_json()["error"]["type"], "rate_limit_error");
  EXPECT_EQ(full.body_json()["error"]["message"], "the queue is full (64 requests)");
  backend_->mode = EngineBackend::Mode::Unavailable;
  Reply unavailable = post(port(), kGreedy);
  EXPECT_EQ(unavailable.status, 503);
  EXPECT_EQ(unavailable.body_json()["error"]["message"], "no pipeline is ready");
  json streaming = kGreedy;
  streaming["stream"] = true;
  EXPECT_EQ(post(port(), streaming).status, 503);  // refused before any byte of a stream
  backend_->mode = EngineBackend::Mode::Invalid;
  EXPECT_EQ(post(port(), kGreedy).status, 400);
  backend_->mode = EngineBackend::Mode::Serve;
  EXPECT_EQ(post(port(), kGreedy).status, 200);
}

TEST_F(HttpServerTest, CoreFailureIs500OrAnSseErrorEvent) {
  backend_->mode = EngineBackend::Mode::FailMidway;
  Reply plain = post(port(), kGreedy);
  EXPECT_EQ(plain.status, 500);
  EXPECT_EQ(plain.body_json()["error"]["type"], "server_error");
  EXPECT_NE(plain.body_json()["error"]["message"].get<std::string>().find("lost stage 1"), std::string::npos);

  json body = kGreedy;
  body["stream"] = true;
  Connection c(port());
  Reply streamed = c.call(http::verb::post, "/v1/completions", body.dump());
  EXPECT_EQ(streamed.status, 200);
  const std::vector<std::string> events = sse_data(streamed.body());
  ASSERT_EQ(events.size(), 3u) << streamed.body();  // two updates, then the error
  EXPECT_TRUE(json::parse(events[0]).contains("choices"));
  const json err = json::parse(events[2]);
  EXPECT_EQ(err["error"]["type"], "server_error");
  EXPECT_EQ(streamed.body().find("[DONE]"), std::string::npos);
  EXPECT_TRUE(c.closed_by_peer());
}

// Waits (bounded) until the backend was told to cancel `n` requests in all.
bool cancelled(EngineBackend& backend, int n) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (backend.cancels() < n)
    if (std::chrono::steady_clock::now() > deadline) return false;
    else std::this_thread::sleep_for(2ms);
  return true;
}

TEST_F(HttpServerTest, ClientDisconnectMidStreamCancelsTheRequest) {
  backend_->update_delay_ms = 30;
  const int done_before = backend_->done(), cancels_before = backend_->cancels();
  {
    Connection c(port());
    json body = {{"prompt", "The jury said"}, {"max_tokens", 30}, {"stream", true}, {"ignore_eos", true}};
    const std::string text = body.dump();
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(text.size()) +
               "\r\n\r\n" + text);
    const std::string got = c.read_until("data: ");
    ASSERT_NE(got.find("200 OK"), std::string::npos) << got;
    c.socket.close();  // gone, mid-stream
  }
  // The core is told to stop it (it ends early); the server keeps serving.
  EXPECT_TRUE(cancelled(*backend_, cancels_before + 1));
  ASSERT_TRUE(backend_->wait_done(done_before + 1));
  backend_->update_delay_ms = 0;
  EXPECT_EQ(post(port(), kGreedy).status, 200);
  EXPECT_EQ(call(port(), http::verb::get, "/metrics").status, 200);
}

// A client that closes its connection while it waits for a non-stream answer is cancelled too
// (the session sees the connection's end although it writes nothing yet).
TEST_F(HttpServerTest, ClientDisconnectWhileWaitingCancelsTheRequest) {
  backend_->update_delay_ms = 30;  // 30 tokens: about a second of updates
  const int done_before = backend_->done(), cancels_before = backend_->cancels(), accepted_before = backend_->accepted();
  {
    Connection c(port());
    json body = {{"prompt", "The jury said"}, {"max_tokens", 30}, {"ignore_eos", true}};
    const std::string text = body.dump();
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(text.size()) +
               "\r\n\r\n" + text);
    while (backend_->accepted() == accepted_before)  // the watchdog bounds the program
      std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(50ms);  // it runs
    c.socket.close();
  }
  EXPECT_TRUE(cancelled(*backend_, cancels_before + 1));
  ASSERT_TRUE(backend_->wait_done(done_before + 1));
  // A pipelined second request on one connection is no disconnect: both are answered.
  backend_->update_delay_ms = 0;
  Connection c(port());
  const std::string text = kGreedy.dump();
  const std::string one = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                          std::to_string(text.size()) + "\r\n\r\n" + text;
  c.send_raw(one + one);
  auto answers = [](const std::string& bytes) {
    size_t n = 0;
    for (size_t at = bytes.find("\"text_completion\""); at != std::string::npos; at = bytes.find("\"text_completion\"", at + 1)) ++n;
    return n;
  };
  std::string got = c.read_until("\"text_completion\"");
  if (answers(got) < 2) got += c.read_until("\"text_completion\"");
  EXPECT_EQ(answers(got), 2u) << got;
  EXPECT_EQ(backend_->cancels(), cancels_before + 1);
}

}  // namespace
}  // namespace conveyor

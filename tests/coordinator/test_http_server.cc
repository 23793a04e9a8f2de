// The REST server end to end: a real HttpServer on 127.0.0.1 (port 0), a CompletionBackend
// that answers from the real brown-gpt2 model (model/engine.h) on its own thread, and plain
// HTTP clients (Beast, synchronous, or raw sockets). A watchdog bounds every test program.
#include "coordinator/http_server.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <gtest/gtest.h>

#include "coordinator/text_stream.h"
#include "model/engine.h"
#include "model/weights.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;
using namespace std::chrono_literals;

// A hung server or client must fail the run, not stall it.
const struct Watchdog {
  Watchdog() {
    std::thread([] {
      std::this_thread::sleep_for(240s);
      std::fprintf(stderr, "test_http_server: watchdog: the test took longer than 240 s\n");
      std::abort();
    }).detach();
  }
} watchdog;

std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

std::unique_ptr<Engine> load_engine() {
  return std::make_unique<Engine>(load_stage_weights(model_dir(), 0, 6).value());
}

// The core, as small as it can be: one thread runs each request through the Engine, then
// replays its tokens as ChoiceUpdates (round robin over choices, one token per update),
// with the stop strings applied by TextStream as the real core does.
class EngineBackend : public CompletionBackend {
 public:
  enum class Mode { Serve, QueueFull, Unavailable, Invalid, FailMidway };

  explicit EngineBackend(std::shared_ptr<const Tokenizer> tokenizer)
      : engine_(load_engine()), tokenizer_(std::move(tokenizer)), thread_([this] { loop(); }) {}
  ~EngineBackend() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  SubmitResult submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) override {
    switch (mode.load()) {
      case Mode::QueueFull: return {SubmitError::QueueFull, "the queue is full (64 requests)"};
      case Mode::Unavailable: return {SubmitError::Unavailable, "no pipeline is ready"};
      case Mode::Invalid: return {SubmitError::Invalid, "the scheduler cannot take this request"};
      default: break;
    }
    {
      std::lock_guard lock(mu_);
      queue_.emplace_back(std::move(request), std::move(sink));
      ++accepted_;
    }
    cv_.notify_all();
    return {};
  }

  // Waits until `n` accepted requests got on_done; false after `timeout`.
  bool wait_done(int n, std::chrono::milliseconds timeout = 60s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return done_ >= n; });
  }
  int done() {
    std::lock_guard lock(mu_);
    return done_;
  }
  int accepted() {
    std::lock_guard lock(mu_);
    return accepted_;
  }

  std::atomic<Mode> mode{Mode::Serve};
  std::atomic<int> update_delay_ms{0};

 private:
  void loop() {
    for (;;) {
      std::pair<std::shared_ptr<const CompletionRequest>, CompletionSink> job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      serve(*job.first, job.second);
      job = {};  // the sink goes before the request counts as done
      {
        std::lock_guard lock(mu_);
        ++done_;
      }
      cv_.notify_all();
    }
  }

  void serve(const CompletionRequest& r, CompletionSink& sink) {
    const size_t choices = r.num_choices();
    std::vector<GenerationRequest> gens(choices);
    for (size_t c = 0; c < choices; ++c) {
      GenerationRequest& g = gens[c];
      g.prompt = r.prompts[c / size_t(r.n)];
      g.max_new_tokens = r.max_tokens;
      g.sampling = r.sampling;
      g.logprobs = std::max(r.logprobs, 0);
      g.echo_logprobs = r.echo && r.logprobs >= 0;
      g.ignore_eos = r.ignore_eos;
      g.sample_index = c % size_t(r.n);
    }
    Expected<std::vector<GenerationResult>> results = engine_->generate(gens);
    if (!results.ok()) return sink.on_done(results.error());
    std::vector<TextStream> texts;
    for (size_t c = 0; c < choices; ++c) texts.emplace_back(*tokenizer_, r.stop);
    std::vector<size_t> next(choices, 0);
    std::vector<bool> finished(choices, false);
    int sent = 0;
    for (bool any = true; any;) {
      any = false;
      for (size_t c = 0; c < choices; ++c) {
        if (finished[c]) continue;
        any = true;
        const GenerationResult& res = (*results)[c];
        ChoiceUpdate u;
        u.choice = c;
        if (next[c] == 0 && gens[c].echo_logprobs)
          for (size_t i = 0; i < gens[c].prompt.size(); ++i)
            u.prompt_tokens.push_back(TokenOut{gens[c].prompt[i], res.prompt_logprobs[i],
                                               r.logprobs > 0 ? res.prompt_top_logprobs[i]
                                                              : std::vector<std::pair<int32_t, float>>{}});
        const size_t i = next[c]++;
        const int32_t id = res.tokens[i];
        u.tokens.push_back(TokenOut{id, res.token_logprobs[i],
                                    r.logprobs > 0 ? res.top_logprobs[i] : std::vector<std::pair<int32_t, float>>{}});
        const bool last = next[c] == res.tokens.size();
        const bool stop_id = last && res.finish_reason == "stop";  // the eos / stop id has no text
        if (!stop_id) u.text = texts[c].push(id);
        if (texts[c].stopped()) {
          u.finish_reason = "stop";
        } else if (last) {
          u.text += texts[c].flush();
          u.finish_reason = res.finish_reason;
        }
        finished[c] = u.finish_reason.has_value();
        sink.on_update(std::move(u));
        if (mode.load() == Mode::FailMidway && ++sent == 2) return sink.on_done("the pipeline lost stage 1");
        if (int ms = update_delay_ms.load()) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      }
    }
    sink.on_done("");
  }

  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<const CompletionRequest>, CompletionSink>> queue_;
  bool stopping_ = false;
  int accepted_ = 0, done_ = 0;
  std::thread thread_;  // last: starts after everything it uses
};

// --- a small synchronous HTTP client ---------------------------------------------------

struct Reply {
  int status = 0;
  http::response<http::string_body> message;
  const std::string& body() const { return message.body(); }
  json body_json() const { return json::parse(message.body()); }
  std::string header(http::field f) const { return std::string(message[f]); }
};

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Connection {
  net::io_context ioc;
  tcp::socket socket{ioc};
  beast::flat_buffer buffer;

  explicit Connection(int port) { socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), uint16_t(port))); }

  Reply call(http::verb verb, const std::string& target, const std::string& body = "", const Headers& headers = {}) {
    http::request<http::string_body> req{verb, target, 11};
    req.set(http::field::host, "127.0.0.1");
    if (!body.empty()) req.set(http::field::content_type, "application/json");
    for (const auto& [k, v] : headers) req.set(k, v);
    req.body() = body;
    req.prepare_payload();
    http::write(socket, req);
    Reply r;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    http::read(socket, buffer, parser);
    r.message = parser.release();
    r.status = int(r.message.result_int());
    return r;
  }

  void send_raw(const std::string& bytes) { net::write(socket, net::buffer(bytes)); }

  // Reads until `needle` appears (or the peer closes); returns all bytes read.
  std::string read_until(const std::string& needle) {
    std::string got(static_cast<const char*>(buffer.data().data()), buffer.size());
    buffer.consume(buffer.size());
    char chunk[4096];
    while (got.find(needle) == std::string::npos) {
      beast::error_code ec;
      const size_t n = socket.read_some(net::buffer(chunk), ec);
      if (ec) break;
      got.append(chunk, n);
    }
    return got;
  }

  // True when the server closed the connection (EOF before any byte).
  bool closed_by_peer() {
    char c;
    beast::error_code ec;
    socket.read_some(net::buffer(&c, 1), ec);
    return ec == net::error::eof || ec == net::error::connection_reset;
  }
};

Reply call(int port, http::verb verb, const std::string& target, const std::string& body = "",
           const Headers& headers = {}) {
  Connection c(port);
  return c.call(verb, target, body, headers);
}

Reply post(int port, const json& body, const Headers& headers = {}) {
  return call(port, http::verb::post, "/v1/completions", body.dump(), headers);
}

// The `data:` payloads of an SSE body, in order.
std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated SSE event at " << pos << ": " << body.substr(pos);
    if (end == std::string::npos) break;
    const std::string event = body.substr(pos, end - pos);
    EXPECT_TRUE(event.starts_with("data: ")) << event;
    out.push_back(event.substr(6));
    pos = end + 2;
  }
  return out;
}

// --- the fixture -------------------------------------------------------------------------

class HttpServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ = std::make_shared<const Tokenizer>(Tokenizer::load(model_dir()).value());
    metrics_ = new Metrics();
    backend_ = new EngineBackend(tokenizer_);
    reference_ = load_engine().release();
    server_ = start_server("").release();
    keyed_server_ = start_server("s3cret-key", /*cluster_callbacks=*/false).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete keyed_server_;
    delete backend_;  // after the servers: it may still hold sinks
    delete reference_;
    delete metrics_;
  }

  void SetUp() override {
    backend_->mode = EngineBackend::Mode::Serve;
    backend_->update_delay_ms = 0;
    ready_ = true;
  }

  static RestContext context(const std::string& api_key, bool cluster_callbacks) {
    RestContext ctx;
    ctx.model_name = "brown-gpt2";
    ctx.config = load_model_config(model_dir()).value();
    ctx.tokenizer = tokenizer_;
    ctx.backend = backend_;
    ctx.metrics = metrics_;
    ctx.api_key = api_key;
    ctx.health = [] {
      return std::pair<bool, json>(ready_.load(), {{"status", ready_ ? "ok" : "starting"}, {"pipelines_ready", ready_ ? 1 : 0}});
    };
    if (cluster_callbacks) {
      ctx.cluster = [] { return json{{"pipelines", 1}, {"workers", json::array({"w0"})}}; };
      ctx.plan = [](const json& body) { return std::pair<int, json>(202, {{"accepted", body}}); };
      ctx.drain = [](const std::string& worker) { return std::pair<int, json>(200, {{"draining", worker}}); };
    }
    return ctx;
  }

  static std::unique_ptr<HttpServer> start_server(const std::string& api_key, bool cluster_callbacks = true) {
    Expected<std::unique_ptr<HttpServer>> s = HttpServer::start("127.0.0.1", 0, context(api_key, cluster_callbacks), 2);
    EXPECT_TRUE(s.ok()) << s.error();
    return std::move(s).value();
  }

  // What the model itself generates, greedily, with no stop condition.
  static std::string greedy_text(const std::string& prompt, int max_tokens) {
    GenerationRequest g;
    g.prompt = tokenizer_->encode(prompt);
    g.max_new_tokens = max_tokens;
    g.sampling.temperature = 0;
    g.ignore_eos = true;
    auto out = reference_->generate({g}).value();
    return tokenizer_->decode(out[0].tokens);
  }

  static int port() { return server_->port(); }

  static inline std::shared_ptr<const Tokenizer> tokenizer_;
  static inline Metrics* metrics_ = nullptr;
  static inline EngineBackend* backend_ = nullptr;
  static inline Engine* reference_ = nullptr;
  static inline HttpServer* server_ = nullptr;
  static inline HttpServer* keyed_server_ = nullptr;
  static inline std::atomic<bool> ready_{true};
};

const json kGreedy = {{"prompt", "The jury said"}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};

TEST_F(HttpServerTest, ReportsTheBoundPortAndRefusesABusyOne) {
  EXPECT_GT(port(), 0);
  EXPECT_NE(port(), keyed_server_->port());
  Expected<std::unique_ptr<HttpServer>> again = HttpServer::start("127.0.0.1", port(), context("", true));
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.error().find(std::to_string(port())), std::string::npos) << again.error();
  EXPECT_FALSE(HttpServer::start("no.such.host.invalid", 0, context("", true)).ok());
  EXPECT_FALSE(HttpServer::start("127.0.0.1", 70000, context("", true)).ok());
}

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
    EXPECT_EQ(chunk.contains("usage"), last);
    if (last) {
      EXPECT_EQ(chunk["usage"]["completion_tokens"], 8);
    }
  }
  EXPECT_EQ(text, expected);
  EXPECT_EQ(metrics_->time_to_first_token_count(), ttft_before + 1);
  EXPECT_EQ(metrics_->inter_token_latency_count(), itl_before + 7);
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
  const std::vector<Case> cases = {
      {"{\"prompt\": \"x\"", ""},                                    // malformed JSON
      {"[1,2,3]", ""},                                               // not an object
      {R"({"prompt": "x", "max_tokens": "ten"})", "max_tokens"},     // wrong type
      {R"({"prompt": "x", "temperature": "warm"})", "temperature"},
      {R"({"prompt": "x", "max_tokens": 300})", "max_tokens"},       // beyond the context
      {R"({"prompt": ""})", "prompt"},                               // empty
      {R"({"prompt": []})", "prompt"},
      {"{\"prompt\": " + long_prompt + "}", "prompt"},               // longer than n_positions
      {R"({"prompt": [1, 2, 4096]})", "prompt"},                     // outside the vocabulary
      {R"({"prompt": [-5]})", "prompt"},
      {R"({"prompt": "x", "frobnicate": 1})", "frobnicate"},         // unknown field
      {R"({"prompt": "x", "logit_bias": {"1": 5}})", "logit_bias"},
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
  // A model the server does not serve: 404 as OpenAI does.
  Reply wrong_model = post(port(), {{"model", "gpt-4"}, {"prompt", "x"}});
  EXPECT_EQ(wrong_model.status, 404);
  EXPECT_EQ(wrong_model.body_json()["error"]["code"], "model_not_found");
}

TEST_F(HttpServerTest, ApiKeyIsRequiredWhenSet) {
  const int p = keyed_server_->port();
  Reply none = call(p, http::verb::get, "/v1/models");
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.body_json()["error"]["code"], "invalid_api_key");
  EXPECT_EQ(none.header(http::field::www_authenticate), "Bearer");
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer wrong"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer s3cret-ke"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer s3cret-key2"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "s3cret-key"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/metrics").status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/nowhere").status, 401);  // no probing of paths without the key
  EXPECT_EQ(post(p, kGreedy).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer s3cret-key"}}).status, 200);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "bearer s3cret-key"}}).status, 200);
  EXPECT_EQ(post(p, kGreedy, {{"Authorization", "Bearer s3cret-key"}}).status, 200);
  EXPECT_EQ(call(p, http::verb::get, "/health").status, 200);  // open for load balancers
  // The keyless server takes anything.
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models", "", {{"Authorization", "Bearer whatever"}}).status, 200);
}

TEST_F(HttpServerTest, ConstantTimeCompare) {
  EXPECT_TRUE(constant_time_equals("abc", "abc"));
  EXPECT_FALSE(constant_time_equals("abd", "abc"));
  EXPECT_FALSE(constant_time_equals("ab", "abc"));
  EXPECT_FALSE(constant_time_equals("abcd", "abc"));
  EXPECT_FALSE(constant_time_equals("", "abc"));
  EXPECT_TRUE(constant_time_equals("", ""));
}

TEST_F(HttpServerTest, UnknownPathsAndWrongMethods) {
  Reply missing = call(port(), http::verb::get, "/v2/things");
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(missing.body_json().contains("error"));
  EXPECT_EQ(call(port(), http::verb::post, "/v1/completion", "{}").status, 404);
  Reply wrong = call(port(), http::verb::get, "/v1/completions");
  EXPECT_EQ(wrong.status, 405);
  EXPECT_EQ(wrong.header(http::field::allow), "POST");
  EXPECT_EQ(call(port(), http::verb::post, "/health", "{}").status, 405);
  EXPECT_EQ(call(port(), http::verb::delete_, "/v1/models").status, 405);
  EXPECT_EQ(call(port(), http::verb::get, "/v1/cluster/plan").status, 405);
  EXPECT_EQ(call(port(), http::verb::get, "/v1/cluster/workers/w0/drain").status, 405);
  // A query string does not change the route.
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models?x=1").status, 200);
}

TEST_F(HttpServerTest, BodyOverFourMiBIs413) {
  Connection c(port());
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
             std::to_string((4 << 20) + 1) + "\r\n\r\n{\"prompt\": ");
  const std::string reply = c.read_until("\r\n\r\n");
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 413")) << reply;
  // Chunked bodies are cut at the limit too.
  Connection d(port());
  d.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
  const std::string chunk(1 << 20, ' ');
  char hex[16];
  std::snprintf(hex, sizeof hex, "%zx\r\n", chunk.size());
  for (int i = 0; i < 6; ++i) {
    beast::error_code ec;
    net::write(d.socket, net::buffer(std::string(hex) + chunk + "\r\n"), ec);
    if (ec) break;
  }
  const std::string reply2 = d.read_until("\r\n\r\n");
  EXPECT_TRUE(reply2.starts_with("HTTP/1.1 413")) << reply2.substr(0, 100);
  // Just under the limit is read (and then refused for its content, not its size).
  Reply big = call(port(), http::verb::post, "/v1/completions",
                   "{\"prompt\": \"x\", \"user\": \"" + std::string((4 << 20) - 64, 'u') + "\"}");
  EXPECT_EQ(big.status, 200) << big.body().substr(0, 200);
}

TEST_F(HttpServerTest, Expect100ContinueIsAnswered) {
  Connection c(port());
  const std::string body = kGreedy.dump();
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: " +
             std::to_string(body.size()) + "\r\n\r\n");
  const std::string interim = c.read_until("\r\n\r\n");
  EXPECT_TRUE(interim.starts_with("HTTP/1.1 100 Continue")) << interim;
  c.send_raw(body);
  http::response<http::string_body> res;
  http::read(c.socket, c.buffer, res);
  EXPECT_EQ(res.result_int(), 200u) << res.body();
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

TEST_F(HttpServerTest, ClientDisconnectMidStreamHarmsNothing) {
  backend_->update_delay_ms = 30;
  const int done_before = backend_->done();
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
  // The request still completes in the core; the server drops its output and keeps serving.
  ASSERT_TRUE(backend_->wait_done(done_before + 1));
  backend_->update_delay_ms = 0;
  EXPECT_EQ(post(port(), kGreedy).status, 200);
  EXPECT_EQ(call(port(), http::verb::get, "/metrics").status, 200);
}

TEST_F(HttpServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  Connection c(port());
  EXPECT_EQ(c.call(http::verb::get, "/health").status, 200);
  Reply plain = c.call(http::verb::post, "/v1/completions", kGreedy.dump());
  EXPECT_EQ(plain.status, 200);
  json body = kGreedy;
  body["stream"] = true;
  Reply streamed = c.call(http::verb::post, "/v1/completions", body.dump());
  EXPECT_EQ(streamed.status, 200);
  EXPECT_TRUE(streamed.body().ends_with("data: [DONE]\n\n"));
  EXPECT_EQ(c.call(http::verb::post, "/v1/completions", R"({"prompt": ""})").status, 400);
  EXPECT_EQ(c.call(http::verb::get, "/nope").status, 404);
  Reply models = c.call(http::verb::get, "/v1/models");
  EXPECT_EQ(models.status, 200);
  EXPECT_TRUE(models.message.keep_alive());
  EXPECT_EQ(plain.body_json()["choices"][0]["text"], greedy_text("The jury said", 8));
}

TEST_F(HttpServerTest, ConnectionCloseIsHonoured) {
  Connection c(port());
  Reply r = c.call(http::verb::get, "/v1/models", "", {{"Connection", "close"}});
  EXPECT_EQ(r.status, 200);
  EXPECT_FALSE(r.message.keep_alive());
  EXPECT_TRUE(c.closed_by_peer());
}

TEST_F(HttpServerTest, ConcurrentClientsAllGetAnswers) {
  std::vector<std::thread> clients;
  std::vector<std::string> ids(8);
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i)
    clients.emplace_back([&, i] {
      json body = {{"prompt", "It was"}, {"max_tokens", 4}, {"seed", i}, {"stream", i % 2 == 1}};
      Reply r = post(port(), body);
      if (r.status == 200) ++ok;
      if (i % 2 == 0 && r.status == 200) ids[size_t(i)] = r.body_json()["id"];
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 8);
  std::set<std::string> distinct;
  for (int i = 0; i < 8; i += 2) distinct.insert(ids[size_t(i)]);
  EXPECT_EQ(distinct.size(), 4u);
}

TEST_F(HttpServerTest, HealthModelsMetricsAndCluster) {
  Reply health = call(port(), http::verb::get, "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body_json()["status"], "ok");
  ready_ = false;
  Reply starting = call(port(), http::verb::get, "/health");
  EXPECT_EQ(starting.status, 503);
  EXPECT_EQ(starting.body_json()["status"], "starting");
  ready_ = true;

  const json models = call(port(), http::verb::get, "/v1/models").body_json();
  EXPECT_EQ(models["object"], "list");
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "brown-gpt2");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(models["data"][0]["max_model_len"], 256);
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models/brown-gpt2").body_json()["id"], "brown-gpt2");
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models/gpt-4").status, 404);

  ASSERT_EQ(post(port(), kGreedy).status, 200);
  Reply metrics = call(port(), http::verb::get, "/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_EQ(metrics.header(http::field::content_type), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_NE(metrics.body().find("conveyor_requests_total{code=\"200\"}"), std::string::npos);
  EXPECT_NE(metrics.body().find("conveyor_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), std::string::npos);
  EXPECT_EQ(metrics.body().find("conveyor_generated_tokens_total 0\n"), std::string::npos);

  Reply cluster = call(port(), http::verb::get, "/v1/cluster");
  EXPECT_EQ(cluster.status, 200);
  EXPECT_EQ(cluster.body_json()["pipelines"], 1);
  Reply plan = call(port(), http::verb::post, "/v1/cluster/plan", R"({"stages": 2, "pipelines": 1})");
  EXPECT_EQ(plan.status, 202);
  EXPECT_EQ(plan.body_json()["accepted"]["stages"], 2);
  EXPECT_EQ(call(port(), http::verb::post, "/v1/cluster/plan", "{oops").status, 400);
  Reply drain = call(port(), http::verb::post, "/v1/cluster/workers/gpu%20node-3/drain");
  EXPECT_EQ(drain.status, 200);
  EXPECT_EQ(drain.body_json()["draining"], "gpu node-3");
  EXPECT_EQ(call(port(), http::verb::post, "/v1/cluster/workers//drain").status, 404);

  // A coordinator without these callbacks says so with 404s.
  const Headers key = {{"Authorization", "Bearer s3cret-key"}};
  const int p = keyed_server_->port();
  EXPECT_EQ(call(p, http::verb::get, "/v1/cluster", "", key).status, 404);
  EXPECT_EQ(call(p, http::verb::post, "/v1/cluster/plan", "{}", key).status, 404);
  EXPECT_EQ(call(p, http::verb::post, "/v1/cluster/workers/w0/drain", "", key).status, 404);
}

TEST_F(HttpServerTest, StoppingWithRequestsInFlightIsSafe) {
  std::unique_ptr<HttpServer> server = start_server("");
  backend_->update_delay_ms = 20;
  const int done_before = backend_->done();
  Connection c(server->port());
  json body = {{"prompt", "It was"}, {"max_tokens", 25}, {"stream", true}, {"ignore_eos", true}};
  const std::string text = body.dump();
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(text.size()) +
             "\r\n\r\n" + text);
  ASSERT_NE(c.read_until("data: ").find("data: "), std::string::npos);
  server->stop();
  server.reset();  // the core still holds the sink and keeps calling it
  ASSERT_TRUE(backend_->wait_done(done_before + 1));
  EXPECT_TRUE(c.closed_by_peer());  // the connection went with the io_context
  backend_->update_delay_ms = 0;
  EXPECT_EQ(post(port(), kGreedy).status, 200);  // the other server is unaffected
}

}  // namespace
}  // namespace conveyor

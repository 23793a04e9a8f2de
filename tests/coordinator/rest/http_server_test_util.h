// The fixture of the REST server test programs (test_http_server*.cc): a real HttpServer on
// 127.0.0.1 (port 0), a CompletionBackend that answers from the real brown-gpt2 model
// (stage/engine.h) on its own thread, and plain HTTP clients (Beast, synchronous, or raw
// sockets). A watchdog bounds every test program.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <gtest/gtest.h>

#include "coordinator/rest/http_server.h"
#include "coordinator/text_stream.h"
#include "stage/engine.h"
#include "model/weights.h"
#include "tests/test_util.h"

namespace conveyor::http_server_test {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;
using namespace std::chrono_literals;

// A hung server or client must fail the run, not stall it (one watchdog per test program).
struct Watchdog {
  Watchdog() {
    std::thread([] {
      std::this_thread::sleep_for(240s);
      std::fprintf(stderr, "test_http_server: watchdog: the test took longer than 240 s\n");
      std::abort();
    }).detach();
  }
};
inline const Watchdog watchdog;

inline std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

inline std::unique_ptr<Engine> load_engine() {
  return Engine::create(load_stage_weights(model_dir(), 0, 6).value()).value();
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

  CoreStatus submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) override {
    switch (mode.load()) {
      case Mode::QueueFull: return CoreStatus::refuse(CoreError::QueueFull, "the queue is full (64 requests)");
      case Mode::Unavailable: return CoreStatus::refuse(CoreError::Unavailable, "no pipeline is ready");
      case Mode::Invalid: return CoreStatus::refuse(CoreError::Invalid, "the scheduler cannot take this request");
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

  // The REST layer saw the client go: the request stops before its next update.
  void cancel(const CompletionRequest& request) override {
    std::lock_guard lock(mu_);
    cancelled_.push_back(&request);
    ++cancels_;
  }
  int cancels() {
    std::lock_guard lock(mu_);
    return cancels_;
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
      {
        std::lock_guard lock(mu_);
        std::erase(cancelled_, job.first.get());  // its address may be a later request's
      }
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
        if (cancelled(r)) return sink.on_done("the client closed its connection");
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

  bool cancelled(const CompletionRequest& r) {
    std::lock_guard lock(mu_);
    return std::find(cancelled_.begin(), cancelled_.end(), &r) != cancelled_.end();
  }

  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::mutex mu_;
  std::vector<const CompletionRequest*> cancelled_;  // by identity, as the core knows them
  int cancels_ = 0;
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

inline Reply call(int port, http::verb verb, const std::string& target, const std::string& body = "",
                  const Headers& headers = {}) {
  Connection c(port);
  return c.call(verb, target, body, headers);
}

inline Reply post(int port, const json& body, const Headers& headers = {}) {
  return call(port, http::verb::post, "/v1/completions", body.dump(), headers);
}

// The `data:` payloads of an SSE body, in order.
inline std::vector<std::string> sse_data(const std::string& body) {
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
      ctx.plan = [](const PlanRequest& r) { return AdminReply{{}, {{"accepted_stages", r.stages.value_or(-1)}}}; };
      ctx.drain = [](const std::string& worker) {
        if (worker == "busy") return AdminReply{CoreStatus::refuse(CoreError::Conflict, "worker 'busy' has no spare"), {}};
        return AdminReply{{}, {{"draining", worker}}};
      };
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

inline const json kGreedy = {{"prompt", "The jury said"}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};

}  // namespace conveyor::http_server_test

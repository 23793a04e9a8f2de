// The cluster end to end on loopback: a real conveyor-coordinator and real conveyor-worker
// processes talking over ZeroMQ and UCX, clients over HTTP. Every answer must be
// token-identical to the single-process engine with the same parameters.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/http_client.h"
#include "coordinator/text_stream.h"
#include "model/engine.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
using testing::ChildProcess;

std::string bin(const std::string& name) { return std::string(CONVEYOR_BINARY_DIR) + "/bin/" + name; }
std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

fs::path temp_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / ("conveyor-test-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A coordinator and its workers, torn down whatever happens.
struct Cluster {
  fs::path dir;
  std::unique_ptr<ChildProcess> coordinator;
  std::vector<std::unique_ptr<ChildProcess>> workers;
  int http_port = 0, control_port = 0;
  std::string token = "test-token";
  std::string api_key;  // set before start(): the coordinator requires it

  // Starts the coordinator from `yaml_extra` (appended to a base config) and `n_workers`
  // workers; returns false (with a message) when it does not come up.
  ::testing::AssertionResult start(const std::string& tag, int stages, int n_workers, const std::string& yaml_extra = "") {
    dir = temp_dir(tag);
    std::ofstream(dir / "cluster.yaml") << "model: {path: \"" << model_dir() << "\"}\n"
                                        << "http: {host: 127.0.0.1, port: 0" << (api_key.empty() ? "" : ", api_key: " + api_key) << "}\n"
                                        << "control: {host: 127.0.0.1, port: 0, join_token: " << token << "}\n"
                                        << "pipeline: {stages: " << stages << "}\n"
                                        << yaml_extra;
    coordinator = std::make_unique<ChildProcess>(
        std::vector<std::string>{bin("conveyor-coordinator"), "--config", (dir / "cluster.yaml").string()},
        (dir / "coordinator.log").string());
    const std::string line = coordinator->read_line_matching("listening on", std::chrono::seconds(30));
    if (std::sscanf(line.c_str(), "conveyor-coordinator: listening on http://127.0.0.1:%d (control tcp://127.0.0.1:%d)",
                    &http_port, &control_port) != 2)
      return ::testing::AssertionFailure() << "coordinator did not start: " << read(dir / "coordinator.log");
    for (int i = 0; i < n_workers; ++i) add_worker("w" + std::to_string(i), token);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      auto r = get("/health");
      if (r.ok() && r->status == 200) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return ::testing::AssertionFailure() << "cluster not healthy: " << read(dir / "coordinator.log");
  }

  ChildProcess& add_worker(const std::string& name, const std::string& join_token) {
    workers.push_back(std::make_unique<ChildProcess>(
        std::vector<std::string>{bin("conveyor-worker"), "--coordinator", "127.0.0.1:" + std::to_string(control_port),
                                 "--name", name, "--join-token", join_token, "--kv-cache-mb", "64"},
        (dir / (name + ".log")).string()));
    return *workers.back();
  }

  Expected<HttpResponse> get(const std::string& target) {
    HttpRequest r;
    r.target = target;
    r.timeout = std::chrono::seconds(5);
    return http_call("127.0.0.1", http_port, r);
  }
  Expected<HttpResponse> post(const std::string& target, const json& body, std::function<void(std::string_view)> on_body = {},
                              std::vector<std::pair<std::string, std::string>> headers = {}) {
    HttpRequest r;
    r.method = "POST";
    r.target = target;
    r.body = body.dump();
    r.on_body = std::move(on_body);
    r.headers = std::move(headers);
    r.timeout = std::chrono::seconds(120);
    return http_call("127.0.0.1", http_port, r);
  }

  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  ~Cluster() {
    for (auto& w : workers) w->stop(std::chrono::milliseconds(3000));
    if (coordinator) coordinator->stop(std::chrono::milliseconds(3000));
    if (!dir.empty() && !::testing::Test::HasFailure()) fs::remove_all(dir);
  }
};

// What the single-process engine says a request must produce.
struct Expected_ {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish;
};

struct Reference {
  Tokenizer tokenizer = Tokenizer::load(model_dir()).value();
  Engine engine{load_stage_weights(model_dir(), 0, 6).value()};
  std::mutex mu;

  Expected_ run(const std::vector<int32_t>& prompt, int max_tokens, const SamplingParams& sp,
                const std::vector<std::string>& stop) {
    std::lock_guard lk(mu);
    GenerationRequest g;
    g.prompt = prompt;
    g.max_new_tokens = max_tokens;
    g.sampling = sp;
    auto out = engine.generate({g});
    EXPECT_TRUE(out.ok()) << out.error();
    const GenerationResult& r = (*out)[0];
    Expected_ e;
    e.finish = r.finish_reason;
    TextStream ts(tokenizer, stop);
    const int32_t eos = int32_t(engine.config().eos_token_id);
    for (size_t i = 0; i < r.tokens.size(); ++i) {
      const int32_t t = r.tokens[i];
      e.tokens.push_back(t);
      if (t == eos && i + 1 == r.tokens.size() && r.finish_reason == "stop") break;
      e.text += ts.push(t);
      if (ts.stopped()) {
        e.finish = "stop";
        break;
      }
    }
    e.text += ts.flush();
    return e;
  }
};

const char* kSentences[] = {
    "The jury said",
    "In the morning the old man walked down to the river, where",
    "It was a time of great change in the country, and",
    "\"I don't know,\" she said.",
    "The committee will meet again next week to consider the proposal, which has been",
    "Mr. Brown",
};

TEST(Cluster, SixtyFourConcurrentRequestsMatchTheEngine) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("concurrent", 3, 3));
  Reference ref;

  struct Case {
    json body;
    std::vector<int32_t> prompt;
    Expected_ expect;
  };
  std::vector<Case> cases(64);
  std::mt19937 rng(20261122);
  for (int i = 0; i < 64; ++i) {
    Case& c = cases[size_t(i)];
    json b;
    if (i % 4 == 0) {  // token-id prompt, up to 180 tokens (longer than a prefill chunk)
      const int n = 1 + int(rng() % 180);
      for (int k = 0; k < n; ++k) c.prompt.push_back(int32_t(1 + rng() % 4095));
      b["prompt"] = c.prompt;
    } else {
      std::string text = kSentences[size_t(i) % std::size(kSentences)];
      if (i % 5 == 1)
        for (int k = 0; k < 6; ++k) text += std::string(" ") + kSentences[size_t(k)];
      c.prompt = ref.tokenizer.encode(text);
      b["prompt"] = text;
    }
    const int max_tokens = 8 + i % 24;
    SamplingParams sp;
    if (i % 3 == 0) {
      sp.temperature = 0;
    } else {
      sp.temperature = 0.9f;
      if (i % 2) sp.top_k = 40;
      if (i % 5 == 0) sp.top_p = 0.95f;
    }
    sp.seed = 1000 + uint64_t(i);
    sp.stop_token_ids.push_back(0);  // eos, as the server adds it
    std::vector<std::string> stop;
    if (i % 7 == 0) stop = {" the", "."};
    b["max_tokens"] = max_tokens;
    b["temperature"] = sp.temperature;
    if (sp.top_k) b["top_k"] = sp.top_k;
    if (sp.top_p < 1) b["top_p"] = sp.top_p;
    b["seed"] = sp.seed;
    if (!stop.empty()) b["stop"] = stop;
    b["stream"] = (i % 2 == 1);
    b["return_token_ids"] = true;
    c.body = b;
    c.expect = ref.run(c.prompt, max_tokens, sp, stop);
  }

  std::atomic<int> next{0};
  std::mutex fail_mu;
  std::vector<std::string> failures;
  auto client = [&] {
    for (int i; (i = next++) < 64;) {
      Case& c = cases[size_t(i)];
      std::vector<int32_t> ids;
      std::string text, finish;
      std::string err;
      if (c.body["stream"].get<bool>()) {
        bool done = false;
        SseParser sse([&](std::string_view data) {
          if (data == "[DONE]") {
            done = true;
            return;
          }
          const json chunk = json::parse(data);
          for (const auto& ch : chunk.at("choices")) {
            text += ch.value("text", std::string());
            if (ch.contains("token_ids"))
              for (int32_t t : ch["token_ids"]) ids.push_back(t);
            if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
          }
        });
        auto r = cluster.post("/v1/completions", c.body, [&](std::string_view b) { sse.feed(b); });
        if (!r || r->status != 200) err = r ? "HTTP " + std::to_string(r->status) : r.error();
        else if (!done) err = "stream ended without [DONE]";
      } else {
        auto r = cluster.post("/v1/completions", c.body);
        if (!r || r->status != 200) {
          err = r ? "HTTP " + std::to_string(r->status) + " " + r->body : r.error();
        } else {
          const json j = json::parse(r->body);
          const json& ch = j.at("choices").at(0);
          text = ch.at("text");
          ids = ch.at("token_ids").get<std::vector<int32_t>>();
          finish = ch.at("finish_reason");
        }
      }
      std::string why;
      if (!err.empty()) why = err;
      else if (ids != c.expect.tokens) why = "token ids differ";
      else if (text != c.expect.text) why = "text differs: got \"" + text + "\" want \"" + c.expect.text + "\"";
      else if (finish != c.expect.finish) why = "finish_reason " + finish + " want " + c.expect.finish;
      if (!why.empty()) {
        std::lock_guard lk(fail_mu);
        failures.push_back("request " + std::to_string(i) + " " + c.body.dump().substr(0, 200) + ": " + why);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) threads.emplace_back(client);
  for (auto& t : threads) t.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_TRUE(failures.empty());

  auto metrics = cluster.get("/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("conveyor_requests_total"), std::string::npos);
  auto info = cluster.get("/v1/cluster");
  ASSERT_TRUE(info.ok());
  const json c = json::parse(info->body);
  EXPECT_EQ(c.at("workers").size(), 3u);
  EXPECT_EQ(c.at("pipelines").at(0).at("stages").size(), 3u);
}

TEST(Cluster, OverloadGets429AndEveryAcceptedRequestCompletes) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("overload", 2, 2, "scheduler: {max_queue: 2, max_running: 1}\n"));
  std::atomic<int> ok{0}, busy{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 12; ++t)
    threads.emplace_back([&] {
      auto r = cluster.post("/v1/completions", {{"prompt", "The jury said"}, {"max_tokens", 40}, {"temperature", 0}});
      if (r && r->status == 200 && json::parse(r->body)["choices"][0]["text"].get<std::string>().size() > 0) ++ok;
      else if (r && r->status == 429) ++busy;
      else ++other;
    });
  for (auto& t : threads) t.join();
  EXPECT_GT(busy.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(ok + busy, 12);
}

TEST(Cluster, ApiKeyIsRequiredWhenConfigured) {
  Cluster cluster;
  cluster.api_key = "s3cret-key";
  ASSERT_TRUE(cluster.start("apikey", 1, 1));
  const json body = {{"prompt", "The jury said"}, {"max_tokens", 3}};
  auto none = cluster.post("/v1/completions", body);
  ASSERT_TRUE(none.ok()) << none.error();
  EXPECT_EQ(none->status, 401);
  auto wrong = cluster.post("/v1/completions", body, {}, {{"Authorization", "Bearer nope"}});
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(wrong->status, 401);
  auto right = cluster.post("/v1/completions", body, {}, {{"Authorization", "Bearer s3cret-key"}});
  ASSERT_TRUE(right.ok());
  EXPECT_EQ(right->status, 200) << right->body;
}

TEST(Cluster, WorkerWithWrongJoinTokenIsRefused) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("token", 1, 1));
  ChildProcess& intruder = cluster.add_worker("intruder", "not-the-token");
  const auto code = intruder.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value()) << "a worker with a wrong token is still running";
  EXPECT_EQ(*code, 3);
  EXPECT_NE(Cluster::read(cluster.dir / "intruder.log").find("wrong join token"), std::string::npos);
  auto info = cluster.get("/v1/cluster");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->body.find("intruder"), std::string::npos);
}

TEST(Cluster, ConfigErrorNamesFileAndLine) {
  const fs::path dir = temp_dir("badconfig");
  const std::string path = (dir / "cluster.yaml").string();
  std::ofstream(path) << "model: {path: \"" << model_dir() << "\"}\n"
                      << "control: {join_token: x}\n"
                      << "pipeline:\n"
                      << "  stagez: 3\n";
  ChildProcess coord({bin("conveyor-coordinator"), "--config", path}, (dir / "log").string());
  const auto code = coord.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 2);
  const std::string log = Cluster::read(dir / "log");
  EXPECT_NE(log.find(path + ":4:"), std::string::npos) << log;
  EXPECT_NE(log.find("stagez"), std::string::npos) << log;

  std::ofstream(path) << "model: {path: \"" << model_dir() << "\"}\n"
                      << "control: {join_token: x}\n"
                      << "pipeline: {stages: 9}\n";
  ChildProcess coord2({bin("conveyor-coordinator"), "--config", path}, (dir / "log2").string());
  ASSERT_TRUE(coord2.wait_exit(std::chrono::seconds(20)).has_value());
  const std::string log2 = Cluster::read(dir / "log2");
  EXPECT_NE(log2.find(path + ":3:"), std::string::npos) << log2;
  EXPECT_NE(log2.find("impossible plan"), std::string::npos) << log2;
  fs::remove_all(dir);
}

TEST(Cluster, LocalLauncherServesAndStopsCleanly) {
  const fs::path dir = temp_dir("local");
  ChildProcess local({bin("conveyor"), "local", "--model", model_dir(), "--stages", "2", "--port", "0", "--log-dir",
                      dir.string()});
  const std::string line = local.read_line_matching("ready at", std::chrono::seconds(60));
  int port = 0;
  ASSERT_EQ(std::sscanf(line.c_str(), "conveyor local: ready at http://127.0.0.1:%d", &port), 1) << line;
  HttpRequest r;
  r.method = "POST";
  r.target = "/v1/completions";
  r.body = json({{"prompt", "The jury said"}, {"max_tokens", 5}}).dump();
  auto resp = http_call("127.0.0.1", port, r);
  ASSERT_TRUE(resp.ok()) << resp.error();
  EXPECT_EQ(resp->status, 200) << resp->body;
  local.signal(SIGINT);
  const auto code = local.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conveyor

// The harness of the cluster tests: a real coordinator and real workers on loopback, torn
// down whatever happens; the single-process engine as the reference; and a mixed load of
// requests (text and token-id prompts, greedy and seeded sampling, stop strings, streaming
// and not) whose every answer must be token-identical to the engine's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "coordinator/text_stream.h"
#include "stage/engine.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor::cluster_test {

using json = nlohmann::json;
namespace fs = std::filesystem;
using testing::ChildProcess;

inline std::string bin(const std::string& name) { return testing::bin_dir() + "/" + name; }
inline std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

inline fs::path temp_dir(const std::string& tag) {
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
  std::string http_host = "127.0.0.1";  // where the REST API is reached (a node's address in tests/netns)
  std::string token = "test-token";
  std::string api_key;  // set before start(): the coordinator requires it
  int replicas = 1;     // set before start(): the pipeline replicas of its plan
  // Set before start(): worker i's own arguments, after `worker_args` (e.g. its GPU).
  std::function<std::vector<std::string>(int)> worker_args_for;
  // A test that injects faults (kills, stops, cuts, failing stages) sets this. Otherwise no
  // pipeline may replay: a micro-batch that failed on a stage or was taken for lost
  // (scheduler.batch_timeout_ms) in a fault-free run is a bug the replay would hide (issue 28),
  // so the teardown fails the test on the coordinator's word for either.
  bool faults_expected = false;

  // Starts the coordinator from `yaml_extra` (appended to a base config) and `n_workers`
  // workers; returns false (with a message) when it does not come up.
  ::testing::AssertionResult start(const std::string& tag, int stages, int n_workers, const std::string& yaml_extra = "",
                                   const std::vector<std::string>& worker_args = {}) {
    dir = temp_dir(tag);
    std::ofstream(dir / "cluster.yaml") << "model: {path: \"" << model_dir() << "\"}\n"
                                        << "http: {host: 127.0.0.1, port: 0" << (api_key.empty() ? "" : ", api_key: " + api_key) << "}\n"
                                        << "control: {host: 127.0.0.1, port: 0, join_token: " << token << "}\n"
                                        << "pipeline: {stages: " << stages << ", replicas: " << replicas << "}\n"
                                        << yaml_extra;
    coordinator = std::make_unique<ChildProcess>(
        std::vector<std::string>{bin("conveyor-coordinator"), "--config", (dir / "cluster.yaml").string()},
        (dir / "coordinator.log").string());
    const std::string line = coordinator->read_line_matching("listening on", std::chrono::seconds(30));
    if (std::sscanf(line.c_str(), "conveyor-coordinator: listening on http://127.0.0.1:%d (control tcp://127.0.0.1:%d)",
                    &http_port, &control_port) != 2)
      return ::testing::AssertionFailure() << "coordinator did not start: " << read(dir / "coordinator.log");
    for (int i = 0; i < n_workers; ++i) {
      std::vector<std::string> args = worker_args;
      if (worker_args_for) {
        const auto own = worker_args_for(i);
        args.insert(args.end(), own.begin(), own.end());
      }
      add_worker("w" + std::to_string(i), token, args);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      auto r = get("/health");
      if (r.ok() && r->status == 200) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return ::testing::AssertionFailure() << "cluster not healthy: " << read(dir / "coordinator.log");
  }

  ChildProcess& add_worker(const std::string& name, const std::string& join_token,
                           const std::vector<std::string>& extra_args = {}) {
    std::vector<std::string> argv = {bin("conveyor-worker"), "--coordinator", "127.0.0.1:" + std::to_string(control_port),
                                     "--name", name, "--join-token", join_token, "--kv-cache-mb", "64"};
    // The CPU unless the test says otherwise: the answers are checked against the CPU engine,
    // and a worker's default (--backend auto) would take a GPU where the machine has one.
    if (std::find(extra_args.begin(), extra_args.end(), "--backend") == extra_args.end())
      argv.insert(argv.end(), {"--backend", "cpu"});
    // Loopback, as `conveyor local` starts its workers: the data plane stays on `lo` (no
    // bridge another test makes meanwhile is ever offered to a peer).
    if (std::find(extra_args.begin(), extra_args.end(), "--host") == extra_args.end())
      argv.insert(argv.end(), {"--host", "127.0.0.1"});
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    workers.push_back(std::make_unique<ChildProcess>(argv, (dir / (name + ".log")).string()));
    return *workers.back();
  }

  Expected<HttpResponse> get(const std::string& target) {
    HttpRequest r;
    r.target = target;
    r.timeout = std::chrono::seconds(5);
    return http_call(http_host, http_port, r);
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
    return http_call(http_host, http_port, r);
  }

  // GET /v1/cluster, parsed; null when it does not answer.
  json info() {
    auto r = get("/v1/cluster");
    return r && r->status == 200 ? json::parse(r->body, nullptr, false) : json();
  }

  // Waits (bounded) until /health is ok and `ok(/v1/cluster)` holds.
  ::testing::AssertionResult wait_until(const std::function<bool(const json&)>& ok,
                                        std::chrono::seconds timeout = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    json last;
    while (std::chrono::steady_clock::now() < deadline) {
      auto h = get("/health");
      last = info();
      if (h && h->status == 200 && last.is_object() && ok(last)) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return ::testing::AssertionFailure() << "the cluster did not get there; last /v1/cluster: " << last.dump();
  }

  // Starts a new coordinator on the ports of the one before (which must be gone): the
  // workers find it by themselves.
  ::testing::AssertionResult restart_coordinator() {
    std::string yaml = read(dir / "cluster.yaml");
    yaml = std::regex_replace(yaml, std::regex("http: \\{host: 127.0.0.1, port: 0"), "http: {host: 127.0.0.1, port: " + std::to_string(http_port));
    yaml = std::regex_replace(yaml, std::regex("control: \\{host: 127.0.0.1, port: 0"), "control: {host: 127.0.0.1, port: " + std::to_string(control_port));
    std::ofstream(dir / "cluster-restart.yaml") << yaml;
    coordinator = std::make_unique<ChildProcess>(
        std::vector<std::string>{bin("conveyor-coordinator"), "--config", (dir / "cluster-restart.yaml").string()},
        (dir / "coordinator-restarted.log").string());
    const std::string line = coordinator->read_line_matching("listening on", std::chrono::seconds(30));
    if (line.find(":" + std::to_string(http_port) + " ") == std::string::npos)
      return ::testing::AssertionFailure() << "the new coordinator did not start on port " << http_port << ": " << line
                                           << read(dir / "coordinator-restarted.log");
    return ::testing::AssertionSuccess();
  }

  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // The coordinator's log lines that say a pipeline replayed (engine.cc, scheduler.cc).
  std::string replays() const {
    std::string found;
    for (const char* log : {"coordinator.log", "coordinator-restarted.log"}) {
      std::istringstream in(read(dir / log));
      for (std::string line; std::getline(in, line);)
        if (line.find("has not come back") != std::string::npos ||
            (line.find(" batch ") != std::string::npos && line.find(" failed: ") != std::string::npos))
          found += "  " + line + "\n";
    }
    return found;
  }

  ~Cluster() {
    if (!faults_expected && !dir.empty() && !::testing::Test::HasFailure())
      if (const std::string r = replays(); !r.empty())
        ADD_FAILURE() << "a fault-free run replayed a pipeline (the coordinator said):\n" << r;
    for (auto& w : workers) w->signal(SIGTERM);  // all at once: each hands its stage over
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
  std::unique_ptr<Engine> engine = Engine::create(load_stage_weights(model_dir(), 0, 6).value()).value();
  std::mutex mu;

  Expected_ run(const std::vector<int32_t>& prompt, int max_tokens, const SamplingParams& sp,
                const std::vector<std::string>& stop) {
    std::lock_guard lk(mu);
    GenerationRequest g;
    g.prompt = prompt;
    g.max_new_tokens = max_tokens;
    g.sampling = sp;
    auto out = engine->generate({g});
    EXPECT_TRUE(out.ok()) << out.error();
    const GenerationResult& r = (*out)[0];
    Expected_ e;
    e.finish = r.finish_reason;
    TextStream ts(tokenizer, stop);
    const int32_t eos = int32_t(engine->config().eos_token_id);
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

inline const char* kSentences[] = {
    "The jury said",
    "In the morning the old man walked down to the river, where",
    "It was a time of great change in the country, and",
    "\"I don't know,\" she said.",
    "The committee will meet again next week to consider the proposal, which has been",
    "Mr. Brown",
};


struct Case {
  json body;
  std::vector<int32_t> prompt;
  Expected_ expect;
};

// n requests drawn from `seed`, each with the engine's answer.
inline std::vector<Case> make_cases(Reference& ref, int n, uint32_t seed) {
  std::vector<Case> cases(static_cast<size_t>(n));
  std::mt19937 rng(seed);
  for (int i = 0; i < n; ++i) {
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

  return cases;
}

// Sends every case from `clients` threads; returns one line per answer that is not the
// engine's (or did not come).
inline std::vector<std::string> run_cases(Cluster& cluster, std::vector<Case>& cases, int clients) {
  std::atomic<int> next{0};
  std::mutex fail_mu;
  std::vector<std::string> failures;
  auto client = [&] {
    for (int i; (i = next++) < int(cases.size());) {
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
  for (int t = 0; t < clients; ++t) threads.emplace_back(client);
  for (auto& t : threads) t.join();
  return failures;
}

// Sends `n` cases drawn from `seed` from 16 clients while `meanwhile` runs on this thread;
// every answer must be the engine's.
inline void run_load(Cluster& cluster, uint32_t seed, int n, const std::function<void()>& meanwhile) {
  Reference ref;
  std::vector<Case> cases = make_cases(ref, n, seed);
  std::vector<std::string> failures;
  std::thread load([&] { failures = run_cases(cluster, cases, 16); });
  meanwhile();
  load.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_TRUE(failures.empty()) << "coordinator log:\n" << Cluster::read(cluster.dir / "coordinator.log").substr(0, 20000);
}

// Every line of a JSON-lines file, parsed (a malformed line fails the test).
inline std::vector<json> json_lines(const fs::path& path) {
  std::vector<json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// A metric's value in a Prometheus text body ("" labels: none); NaN when absent.
inline double metric(const std::string& body, const std::string& name_and_labels) {
  const std::string key = "\n" + name_and_labels + " ";
  const size_t at = body.find(key);
  if (at == std::string::npos) return std::nan("");
  return std::stod(body.substr(at + key.size()));
}

// /v1/cluster says requests are running on pipeline 0 (they hold K/V reservations).
inline bool requests_running(const json& info) {
  return info["pipelines"][0]["kv_reserved_tokens"].get<int64_t>() > 0;
}

}  // namespace conveyor::cluster_test

// conveyor-bench-cluster: the cluster through its REST API, on this machine.
//
//   throughput mode (default): starts `conveyor local --stages N`, reports each worker's
//     weight load (GB/s), sends --warmup untimed completions (default: --concurrency; a
//     GPU worker's first steps of each size plan GEMMs and capture graphs), then --requests
//     completions from --concurrency client threads, and reports generated tokens/s,
//     requests/s, mean latency and each stage's busy fraction (the workers' own compute
//     time over wall time, polled from /v1/cluster while the load runs).
//   --overhead: a 1-stage cluster of --model against the in-process engine on the same
//     requests, one at a time: the added latency per request is the coordinator, HTTP and
//     transport cost. Also requests/s with --concurrency clients.
//
//   --recovery: a cluster of --stages stages and --spares spares (default 1) under a steady
//     streaming load; a serving worker (the last stage) is killed with SIGKILL and the pause
//     every stream sees is measured: from the kill to each stream's next token (the longest
//     and the median), with the weight-loading time reported beside it (the spare's; with
//     --spares 0 the survivors are re-planned and the slowest of their loads counts), so
//     the recovery time both with and without loading can be read. Every request must
//     still complete.
//   --random L,C,H: instead of --model's weights, random weights of that shape (L layers,
//     width C, H heads) with --model's tokenizer and vocabulary, written to a temporary
//     checkpoint (e.g. a 1-layer model for --overhead, or a shape whose stages balance).
//
//   conveyor-bench-cluster --model models/brown-gpt2 --stages 3 --requests 96 --concurrency 32
//   conveyor-bench-cluster --overhead --random 1,256,4
#include <algorithm>
#include <csignal>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "model/checkpoint_writer.h"
#include "stage/engine.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "tests/process_util.h"

using namespace conveyor;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct LocalCluster {
  std::unique_ptr<testing::ChildProcess> proc;
  int port = 0;
  std::string backend = "cpu";
  int gpus = 1;  // cuda: worker i on GPU i % gpus
  int spares = 0;
  bool start(const std::string& bin_dir, const std::string& model, int stages, int in_flight) {
    const std::string logs = (std::filesystem::temp_directory_path() / ("conveyor-bench-" + std::to_string(::getpid()))).string();
    std::vector<std::string> argv = {bin_dir + "/conveyor", "local", "--model", model, "--stages", std::to_string(stages),
                                     "--port", "0", "--log-dir", logs};
    if (in_flight > 0) argv.insert(argv.end(), {"--in-flight", std::to_string(in_flight)});
    argv.insert(argv.end(), {"--backend", backend, "--spares", std::to_string(spares)});
    if (backend == "cuda") argv.insert(argv.end(), {"--gpus", std::to_string(gpus)});
    proc = std::make_unique<testing::ChildProcess>(argv);
    const std::string line = proc->read_line_matching("ready at", std::chrono::seconds(120));
    return std::sscanf(line.c_str(), "conveyor local: ready at http://127.0.0.1:%d", &port) == 1;
  }
  ~LocalCluster() {
    if (proc) {
      proc->signal(SIGINT);
      proc->wait_exit(std::chrono::seconds(10));
    }
  }
};

Expected<int> complete(int port, const json& body) {
  HttpRequest r;
  r.method = "POST";
  r.target = "/v1/completions";
  r.body = body.dump();
  r.timeout = std::chrono::minutes(5);
  auto resp = http_call("127.0.0.1", port, r);
  if (!resp) return resp.status();
  if (resp->status != 200) return Status::error("HTTP " + std::to_string(resp->status) + ": " + resp->body);
  return json::parse(resp->body).at("usage").at("completion_tokens").get<int>();
}

// A checkpoint of random weights of shape "L,C,H" with the vocabulary and tokenizer of
// `model`, in a fresh temporary folder; returns the folder.
Expected<std::string> random_checkpoint(const std::string& model, const std::string& shape) {
  auto base = load_model_config(model);
  if (!base) return base.status();
  ModelConfig c = *base;
  if (std::sscanf(shape.c_str(), "%ld,%ld,%ld", &c.n_layer, &c.n_embd, &c.n_head) != 3 || c.n_layer < 1 ||
      c.n_embd < 1 || c.n_head < 1 || c.n_embd % c.n_head != 0)
    return Status::error("--random wants L,C,H with C a multiple of H, got '" + shape + "'");
  c.n_inner = 4 * c.n_embd;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("conveyor-bench-model-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  if (Status s = write_gpt2_checkpoint(dir.string(), c, random_stage_weights(c, 0, c.n_layer, 1234), DType::F16); !s)
    return s;
  for (const char* f : {"vocab.json", "merges.txt"})
    std::filesystem::copy_file(std::filesystem::path(model) / f, dir / f,
                               std::filesystem::copy_options::overwrite_existing);
  return dir.string();
}

// GET /v1/cluster; an empty object (and a line on stderr) when it fails.
json cluster_info(int port) {
  HttpRequest r;
  r.target = "/v1/cluster";
  auto resp = http_call("127.0.0.1", port, r);
  if (!resp || resp->status != 200) {
    std::fprintf(stderr, "GET /v1/cluster: %s\n", resp ? ("HTTP " + std::to_string(resp->status)).c_str() : resp.error().c_str());
    return json::object();
  }
  return json::parse(resp->body);
}

// Each serving worker's weight load (checkpoint bytes read, converted and placed on its
// device), from /v1/cluster: load_bytes_total comes from the worker's load progress,
// load_seconds from its `ready`. Both are 0 for a worker that re-used layers it already held
// (load_seconds 0) or whose record the coordinator started afresh (it registered again,
// e.g. after missing heartbeats, and then kept its layers): then the figures of its real
// load are not known, and the bench says so instead of printing "0.0 MB in 0.00 s".
void print_loads(int port) {
  auto known = [](const json& w) {
    return w.value("state", std::string()) == "ready" && w.value("load_seconds", 0.0) > 0 &&
           w.value("load_bytes_total", 0.0) > 0;
  };
  // The pipelines are ready when this is called; give stragglers (a replica, a repair in
  // progress) a few seconds to report.
  json workers = json::array();
  for (const auto deadline = Clock::now() + std::chrono::seconds(5);;) {
    workers = json::array();
    for (const auto& w : cluster_info(port).value("workers", json::array()))
      if (w.contains("stage")) workers.push_back(w);
    const bool all = std::all_of(workers.begin(), workers.end(), known);
    if ((all && !workers.empty()) || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (const auto& w : workers) {
    const json dp = w.value("data_plane", json::object());
    const std::string name = w.value("name", std::string());
    const double secs = w.value("load_seconds", 0.0), bytes = w.value("load_bytes_total", 0.0);
    std::printf("load: %s stage %d, ", name.c_str(), w["stage"].get<int>());
    if (known(w))
      std::printf("%.1f MB in %.2f s = %.2f GB/s", bytes / 1e6, secs, bytes / secs / 1e9);
    else
      std::printf("not known (state %s, load_seconds %.2f, load_bytes_total %.0f: it re-used layers it already held, "
                  "or registered again and kept them)",
                  w.value("state", std::string("?")).c_str(), secs, bytes);
    std::printf("; activations staged in %s memory, UCX CUDA memory: %s\n", dp.value("staging", std::string("?")).c_str(),
                dp.value("ucx_cuda_memory", false) ? "yes" : "no");
  }
}

// The --recovery mode (see the top of the file).
int recovery(const std::string& bin_dir, const std::string& model, const std::string& backend, int stages,
             int spares, int concurrency) {
  LocalCluster cluster;
  cluster.backend = backend;
  cluster.spares = spares;
  if (!cluster.start(bin_dir, model, stages, 0)) {
    std::fprintf(stderr, "the cluster did not start\n");
    return 1;
  }
  std::mutex mu;
  std::vector<double> pause(static_cast<size_t>(concurrency), 0);
  std::atomic<bool> killed{false}, stop{false};
  Clock::time_point kill_time;
  std::atomic<int> failed{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < concurrency; ++c)
    clients.emplace_back([&, c] {
      while (!stop) {
        HttpRequest r;
        r.method = "POST";
        r.target = "/v1/completions";
        r.body = json{{"prompt", "The jury said"}, {"max_tokens", 200}, {"temperature", 0}, {"stream", true},
                      {"ignore_eos", true}, {"seed", c}}.dump();
        r.timeout = std::chrono::minutes(5);
        r.on_body = [&](std::string_view) {
          const auto now = Clock::now();
          std::lock_guard lk(mu);
          if (killed && now > kill_time && pause[size_t(c)] == 0)
            pause[size_t(c)] = std::chrono::duration<double>(now - kill_time).count();
        };
        auto resp = http_call("127.0.0.1", cluster.port, r);
        if (!resp || resp->status != 200) ++failed;
      }
    });
  std::this_thread::sleep_for(std::chrono::seconds(2));  // steady state
  const json info = cluster_info(cluster.port);
  int victim = -1;
  std::string victim_name;
  for (const auto& w : info.value("workers", json::array()))
    if (w.value("stage", -1) == stages - 1 && w.value("state", std::string()) == "ready")
      victim = w.value("pid", -1), victim_name = w.value("name", std::string());
  if (victim <= 0) {
    std::fprintf(stderr, "no serving last stage found\n");
    stop = true;
    for (auto& t : clients) t.join();
    return 1;
  }
  {
    std::lock_guard lk(mu);
    kill_time = Clock::now();
    killed = true;
  }
  ::kill(victim, SIGKILL);
  // Until every stream has had its next token (or 120 s).
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  for (bool all = false; !all && Clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::lock_guard lk(mu);
    all = std::all_of(pause.begin(), pause.end(), [](double p) { return p > 0; });
  }
  stop = true;
  for (auto& t : clients) t.join();
  double load_s = 0;
  const json after = cluster_info(cluster.port);
  for (const auto& w : after.value("workers", json::array()))
    if (w.value("stage", -1) >= 0) load_s = std::max(load_s, w.value("load_seconds", 0.0));
  std::vector<double> p = pause;
  std::sort(p.begin(), p.end());
  std::printf("%s, %d stages + %d spare(s), %d streams: killed %s (last stage); now %d stage(s); pause to the next "
              "token: median %.3f s, longest %.3f s; the slowest weight load took %.3f s "
              "(longest pause without loading: %.3f s); %d requests failed\n",
              backend.c_str(), stages, spares, concurrency, victim_name.c_str(),
              after.value("plan", json::object()).value("stages", 0), p[p.size() / 2], p.back(), load_s,
              p.back() - load_s, failed.load());
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/brown-gpt2";
  int stages = 3, requests = 96, concurrency = 32, max_tokens = 48, in_flight = 0, warmup = -1;
  std::string random_shape, backend = "cpu";
  bool recovery_mode = false;
  bool overhead = false;
  CLI::App app{"conveyor-bench-cluster: the cluster through its REST API"};
  app.add_option("--model", model, "checkpoint directory");
  app.add_option("--stages", stages, "pipeline stages");
  app.add_option("--requests", requests, "requests to send");
  app.add_option("--concurrency", concurrency, "client threads");
  app.add_option("--warmup", warmup, "untimed requests before the timed ones (default: --concurrency)");
  app.add_option("--max-tokens", max_tokens, "tokens per request");
  app.add_option("--in-flight", in_flight, "micro-batches in flight (0: = stages)");
  app.add_option("--backend", backend, "the workers' backend: cpu or cuda");
  int gpus = 1;
  app.add_option("--gpus", gpus, "cuda: GPUs to spread the workers over (worker i on GPU i % gpus)")
      ->check(CLI::Range(1, 64));
  app.add_option("--random", random_shape, "random weights of shape L,C,H with --model's vocabulary");
  app.add_flag("--recovery", recovery_mode, "kill the last stage under a streaming load and measure the pause");
  int spares = 1;
  app.add_option("--spares", spares, "--recovery: spare workers (0: the survivors are re-planned)")->check(CLI::NonNegativeNumber);
  app.add_flag("--overhead", overhead, "measure the coordinator's added latency against the in-process engine");
  CLI11_PARSE(app, argc, argv);
  if (warmup < 0) warmup = concurrency;
  const std::string bin_dir = std::filesystem::canonical("/proc/self/exe").parent_path().string();
  model = std::filesystem::absolute(model).string();
  std::string random_dir;
  if (!random_shape.empty()) {
    auto dir = random_checkpoint(model, random_shape);
    if (!dir) {
      std::fprintf(stderr, "%s\n", dir.error().c_str());
      return 1;
    }
    model = random_dir = *dir;
  }
  struct RemoveDir {
    const std::string& dir;
    ~RemoveDir() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } remove_random{random_dir};

  if (recovery_mode) return recovery(bin_dir, model, backend, stages, spares, concurrency);
  if (overhead) {
    if (backend != "cpu") {
      std::fprintf(stderr, "--overhead compares with the in-process CPU engine: use --backend cpu\n");
      return 2;
    }
    auto tok = Tokenizer::load(model);
    auto w = load_stage_weights(model, 0, load_model_config(model)->n_layer);
    if (!tok || !w) {
      std::fprintf(stderr, "cannot load %s: %s\n", model.c_str(), (tok ? w.error() : tok.error()).c_str());
      return 1;
    }
    auto engine = Engine::create(std::move(w).value());
    if (!engine) {
      std::fprintf(stderr, "%s\n", engine.error().c_str());
      return 1;
    }
    LocalCluster cluster;
    cluster.backend = backend;
    cluster.gpus = gpus;
    if (!cluster.start(bin_dir, model, 1, 0)) {
      std::fprintf(stderr, "the cluster did not start\n");
      return 1;
    }
    const std::vector<int32_t> prompt = tok->encode("The jury said");
    for (int n : {1, 16}) {
      std::vector<double> engine_s, cluster_s;
      for (int i = 0; i < 30; ++i) {
        GenerationRequest g;
        g.prompt = prompt;
        g.max_new_tokens = n;
        g.sampling.temperature = 0;
        g.ignore_eos = true;
        auto t0 = Clock::now();
        (void)(*engine)->generate({g});
        engine_s.push_back(seconds_since(t0));
        t0 = Clock::now();
        auto r = complete(cluster.port, {{"prompt", prompt}, {"max_tokens", n}, {"temperature", 0}, {"ignore_eos", true}});
        if (!r) {
          std::fprintf(stderr, "%s\n", r.error().c_str());
          return 1;
        }
        cluster_s.push_back(seconds_since(t0));
      }
      std::sort(engine_s.begin(), engine_s.end());
      std::sort(cluster_s.begin(), cluster_s.end());
      const double e = engine_s[engine_s.size() / 2] * 1e3, c = cluster_s[cluster_s.size() / 2] * 1e3;
      std::printf("max_tokens %2d: engine %.2f ms, cluster %.2f ms, added %.2f ms per request (%.2f ms per token)\n", n,
                  e, c, c - e, (c - e) / n);
    }
    // Requests/s of tiny requests: the coordinator's own ceiling.
    std::atomic<int> next{0}, done{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> th;
    for (int t = 0; t < concurrency; ++t)
      th.emplace_back([&] {
        while (next++ < requests * 4)
          if (complete(cluster.port, {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}})) ++done;
      });
    for (auto& t : th) t.join();
    std::printf("requests/s (max_tokens 1, %d clients): %.1f\n", concurrency, done / seconds_since(t0));
    return 0;
  }

  LocalCluster cluster;
  cluster.backend = backend;
  cluster.gpus = gpus;
  if (!cluster.start(bin_dir, model, stages, in_flight)) {
    std::fprintf(stderr, "the cluster did not start\n");
    return 1;
  }
  print_loads(cluster.port);
  const char* prompts[] = {"The jury said", "In the morning the old man walked down to the river, where",
                           "It was a time of great change in the country, and", "Mr. Brown"};
  std::atomic<int> next{0}, tokens{0}, failed{0};
  std::mutex lat_mu;
  std::vector<double> latencies;
  std::atomic<bool> running{true};
  // n requests from `concurrency` clients; `record`: their tokens, latencies and failures count.
  auto drive = [&](int n, bool record) {
    next = 0;
    std::vector<std::thread> th;
    for (int t = 0; t < concurrency; ++t)
      th.emplace_back([&] {
        for (int i; (i = next++) < n;) {
          const auto s = Clock::now();
          auto r = complete(cluster.port, {{"prompt", prompts[i % 4]}, {"max_tokens", max_tokens}, {"temperature", 0.8},
                                           {"top_k", 40}, {"seed", i}, {"ignore_eos", true}});
          if (!record) continue;
          if (!r) {
            ++failed;
            continue;
          }
          tokens += *r;
          std::lock_guard lk(lat_mu);
          latencies.push_back(seconds_since(s));
        }
      });
    for (auto& t : th) t.join();
  };
  // Untimed first: a worker's first steps of each size plan their GEMMs and capture graphs.
  if (warmup > 0) drive(warmup, false);
  std::vector<std::vector<double>> busy(static_cast<size_t>(stages), std::vector<double>{});
  // Each stage's cumulative busy seconds at its own clock, per heartbeat seen: the busy
  // fraction over the whole load is the difference between two of them.
  std::vector<std::vector<std::pair<double, double>>> busy_total(static_cast<size_t>(stages));
  std::thread poller([&] {
    while (running) {
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
      const json info = cluster_info(cluster.port);
      if (!running) continue;
      for (const auto& w : info.value("workers", json::array())) {
        if (!w.contains("stage")) continue;
        const size_t st = size_t(w["stage"].get<int>());
        busy[st].push_back(w["busy_fraction"].get<double>());
        const std::pair<double, double> total{w.value("busy_seconds_total", 0.0), w.value("clock_seconds", 0.0)};
        if (busy_total[st].empty() || busy_total[st].back().second != total.second) busy_total[st].push_back(total);
      }
    }
  });
  const auto t0 = Clock::now();
  drive(requests, true);
  const double wall = seconds_since(t0);
  running = false;
  poller.join();
  std::printf("%s, stages %d, in-flight %d, %d requests x %d tokens, %d clients: %.1f tokens/s, %.2f requests/s, "
              "mean latency %.2f s, %d failed\n",
              backend.c_str(), stages, in_flight > 0 ? in_flight : stages, requests, max_tokens, concurrency, tokens / wall,
              double(latencies.size()) / wall, latencies.empty() ? 0.0 : std::accumulate(latencies.begin(), latencies.end(), 0.0) / double(latencies.size()),
              failed.load());
  for (int s = 0; s < stages; ++s) {
    auto& b = busy[size_t(s)];
    // Drop the first and last samples: the ramp up and down.
    if (b.size() > 2) b = std::vector<double>(b.begin() + 1, b.end() - 1);
    // Cumulative: between the second and the second-to-last heartbeat (past the ramps).
    const auto& c = busy_total[size_t(s)];
    const size_t first = c.size() >= 4 ? 1 : 0, last = c.size() >= 4 ? c.size() - 2 : c.size() - 1;
    const double window = c.size() >= 2 ? c[last].second - c[first].second : 0.0;
    std::printf("  stage %d busy fraction: %.0f%% over %.1f s (cumulative busy time); heartbeat windows: mean %.0f%% of %zu\n",
                s, window > 0 ? 100 * (c[last].first - c[first].first) / window : 0.0, window,
                b.empty() ? 0.0 : 100 * std::accumulate(b.begin(), b.end(), 0.0) / double(b.size()), b.size());
  }
  return failed ? 1 : 0;
}

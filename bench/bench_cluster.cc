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
//     every stream sees is measured: its longest wait for a token among those that end after
//     the kill (the longest and the median over streams), with the weight-loading time
//     reported beside it (the spare's; with --spares 0 the survivors are re-planned and the
//     slowest of their loads counts), so the recovery time both with and without loading can
//     be read. Every request must still complete.
//   --random L,C,H: instead of --model's weights, random weights of that shape (L layers,
//     width C, H heads) with --model's tokenizer and vocabulary, written to a temporary
//     checkpoint (e.g. a 1-layer model for --overhead, or a shape whose stages balance).
//     A named shape (gpt2-xl, gpt3-6.7b, ...) keeps its own vocabulary (50257) and has its
//     context raised to the longest prompt + --max-tokens where it is shorter, as
//     conveyor-bench-gpu-decode does, so both programs run the same model.
//
//   Throughput mode, more:
//     --concurrency 1,64,256: one load per figure, on the same cluster, one row each
//       (--requests-per-client R: R x clients requests a row; else --requests);
//     --shared-prefix S (with --prompt-tokens P): every prompt is the same S token ids, then P
//       of its own (prefix reuse; --no-prefix-cache runs the cluster without it);
//     --prompt-tokens P: prompts of P token ids (seeded, the same every run) instead of the
//       four short texts; --prompt-mix 128,1024: requests take these lengths in turn (with
//       --prompt-tokens: one more load after the others, --mix-clients clients);
//     --stream: clients stream (return_token_ids) and the time to first token and the
//       inter-token latency (p50, p99) are reported; --prompt-mix implies it; --stream-at
//       1,... streams only the loads of those client counts;
//     --trace: the workers and the coordinator write their step traces
//       (CONVEYOR_TRACE_DIR; stage_worker/step_trace.h, coordinator/batch_trace.h) and a
//       summary of each load's window is printed: per stage the rows a step, busy %, the
//       wait for input and the idle time with the next input waiting, and the
//       coordinator's turn-around between a result and the next micro-batch;
//     --json FILE: each row also as one JSON line appended to FILE (bench/serving_table.sh).
//     --tp N, --replicas R: conveyor local's (a stage's ranks on N GPUs; R pipelines); each
//       serving worker's busy fraction is reported (bench/two_gpu_table.sh: three shapes).
//   --engine: no cluster: the in-process CPU engine (stage/engine.h) on the same model,
//     a static batch of --concurrency sequences of --prompt-tokens, --max-tokens new tokens
//     each: decode tokens/s and ms a step (the CPU column of bench/serving_table.sh).
//
//   conveyor-bench-cluster --model models/brown-gpt2 --stages 3 --requests 96 --concurrency 32
//   conveyor-bench-cluster --overhead --random 1,256,4
//   conveyor-bench-cluster --random 13,256,4 --stages 3 --concurrency 64 --requests 512 --trace
//   conveyor-bench-cluster --backend cuda --random gpt2-xl --stages 1 --concurrency 64,256
//       --requests-per-client 2 --prompt-tokens 128 --max-tokens 128 --trace
//   (--fp8: the cuda workers run FP8 layer matrices, conveyor local --fp8; --kv-dtype fp8: their
//   K/V caches in E4M3, conveyor local --kv-dtype fp8)
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "model/checkpoint_writer.h"
#include "stage/engine.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "common/model_config.h"
#include "tests/process_util.h"
#include "bench/cluster_report.h"

using namespace conveyor;
using namespace conveyor::bench;
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
  int tp = 1, replicas = 1;  // conveyor local --tp, --replicas
  std::string kv_cache_mb;  // conveyor local --kv-cache-mb; empty: its default (auto)
  bool fp8 = false;         // cuda: conveyor local --fp8
  std::string kv_dtype = "auto";  // cuda: conveyor local --kv-dtype
  bool no_prefix_cache = false;
  bool no_step_ahead = false;  // conveyor local --no-step-ahead
  bool start(const std::string& bin_dir, const std::string& model, int stages, int in_flight) {
    const std::string logs = (std::filesystem::temp_directory_path() / ("conveyor-bench-" + std::to_string(::getpid()))).string();
    std::vector<std::string> argv = {bin_dir + "/conveyor", "local", "--model", model, "--stages", std::to_string(stages),
                                     "--port", "0", "--log-dir", logs};
    if (in_flight > 0) argv.insert(argv.end(), {"--in-flight", std::to_string(in_flight)});
    argv.insert(argv.end(), {"--backend", backend, "--spares", std::to_string(spares)});
    if (tp > 1) argv.insert(argv.end(), {"--tp", std::to_string(tp)});
    if (replicas > 1) argv.insert(argv.end(), {"--replicas", std::to_string(replicas)});
    if (backend == "cuda") argv.insert(argv.end(), {"--gpus", std::to_string(gpus)});
    if (backend == "cuda" && fp8) argv.push_back("--fp8");
    if (backend == "cuda" && kv_dtype != "auto") argv.insert(argv.end(), {"--kv-dtype", kv_dtype});
    if (no_prefix_cache) argv.push_back("--no-prefix-cache");
    if (no_step_ahead) argv.push_back("--no-step-ahead");
    if (!kv_cache_mb.empty()) argv.insert(argv.end(), {"--kv-cache-mb", kv_cache_mb});
    // Says why it did not start (the callers add "the cluster did not start").
    if (::access(argv[0].c_str(), X_OK) != 0) {
      std::fprintf(stderr, "%s: %s (the cluster starts through `conveyor local`, found beside this program)\n",
                   argv[0].c_str(), std::strerror(errno));
      return false;
    }
    proc = std::make_unique<testing::ChildProcess>(argv);
    const std::string line = proc->read_line_matching("ready at", std::chrono::seconds(120));
    if (std::sscanf(line.c_str(), "conveyor local: ready at http://127.0.0.1:%d", &port) == 1) return true;
    if (std::optional<int> code = proc->wait_exit(std::chrono::milliseconds(100)))
      std::fprintf(stderr, "conveyor local exited with status %d before it was ready (its logs: %s)\n", *code,
                   logs.c_str());
    else
      std::fprintf(stderr, "conveyor local printed no \"ready at\" line within 120 s (its logs: %s)\n", logs.c_str());
    return false;
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
// `model`, or of a named shape ("gpt2-xl": its own vocabulary, `model`'s tokenizer, which
// decodes the ids it knows), in a fresh temporary folder; returns the folder. The context is
// raised to `min_positions` where it is shorter.
Expected<std::string> random_checkpoint(const std::string& model, const std::string& shape, int64_t min_positions) {
  auto base = load_model_config(model);
  if (!base) return base.status();
  ModelConfig c = *base;
  if (shape.find(',') == std::string::npos) {
    auto named = named_model_shape(shape);
    if (!named) return Status::error("--random: " + named.error());
    c = *named;
  } else if (std::sscanf(shape.c_str(), "%ld,%ld,%ld", &c.n_layer, &c.n_embd, &c.n_head) != 3 || c.n_layer < 1 ||
             c.n_embd < 1 || c.n_head < 1 || c.n_embd % c.n_head != 0) {
    return Status::error("--random wants L,C,H with C a multiple of H, or a named shape, got '" + shape + "'");
  }
  c.n_inner = 4 * c.n_embd;
  c.n_positions = std::max(c.n_positions, min_positions);
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
  // A stream's pause: its longest wait for a token (or for a new request's first) among the
  // waits that end after the kill. Not the time from the kill to the next token: a fast
  // backend has tokens on their way when the kill lands, and those arrive at once.
  std::mutex mu;
  const auto n = static_cast<size_t>(concurrency);
  std::vector<double> pause(n, 0);
  std::vector<Clock::time_point> last(n), latest(n);  // the stream's previous token; its newest since the kill
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
        {
          std::lock_guard lk(mu);
          last[size_t(c)] = Clock::now();
        }
        r.on_body = [&](std::string_view) {
          const auto now = Clock::now();
          std::lock_guard lk(mu);
          if (killed && now > kill_time) {
            pause[size_t(c)] = std::max(pause[size_t(c)], std::chrono::duration<double>(now - last[size_t(c)]).count());
            latest[size_t(c)] = now;
          }
          last[size_t(c)] = now;
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
  // Until every stream has had a token 2 s after the kill or later (or 120 s): by then each
  // has waited out the recovery, however long, if it had to.
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  for (bool all = false; !all && Clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::lock_guard lk(mu);
    all = std::all_of(latest.begin(), latest.end(),
                      [&](Clock::time_point t) { return t > kill_time + std::chrono::seconds(2); });
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
              "token (longest wait for a token after the kill, per stream): median %.3f s, longest %.3f s; the slowest weight load took %.3f s "
              "(longest pause without loading: %.3f s); %d requests failed\n",
              backend.c_str(), stages, spares, concurrency, victim_name.c_str(),
              after.value("plan", json::object()).value("stages", 0), p[p.size() / 2], p.back(), load_s,
              p.back() - load_s, failed.load());
  return failed ? 1 : 0;
}


// The comma-separated integers of `text`, each in [1, max]; nullopt when one is not.
std::optional<std::vector<int64_t>> positive_list(const std::string& text, int64_t max) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string x; std::getline(ss, x, ',');) {
    char* end = nullptr;
    const long v = std::strtol(x.c_str(), &end, 10);
    if (x.empty() || *end != '\0' || v < 1 || v > max) return std::nullopt;
    out.push_back(v);
  }
  return out;
}

// Request i's prompt of n token ids: seeded by i, the same every run, ids in [1, vocab).
std::vector<int32_t> token_prompt(int64_t n, int i, int32_t vocab) {
  std::mt19937 rng(uint32_t(i) * 2654435761u + 17u);
  std::uniform_int_distribution<int32_t> id(1, std::max(1, vocab - 1));
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = id(rng);
  return out;
}

// One streamed completion (SSE with return_token_ids). Fills the time to its first token and
// the gaps between its tokens (an event of k tokens counts its gap as k gaps of 1/k), all in
// seconds; returns the tokens received.
Expected<int> complete_streamed(int port, json body, double& ttft, std::vector<double>& gaps) {
  body["stream"] = true;
  body["return_token_ids"] = true;
  HttpRequest r;
  r.method = "POST";
  r.target = "/v1/completions";
  r.body = body.dump();
  r.timeout = std::chrono::minutes(5);
  std::string pending;
  int tokens = 0;
  std::string error;
  const auto start = Clock::now();
  auto last = start;
  r.on_body = [&](std::string_view chunk) {
    const auto now = Clock::now();
    pending.append(chunk);
    for (size_t end; (end = pending.find("\n\n")) != std::string::npos;) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      const json e = json::parse(event.substr(6), nullptr, false);
      if (e.is_discarded()) continue;
      if (e.contains("error")) {
        error = e["error"].dump();
        continue;
      }
      int k = 0;
      for (const auto& c : e.value("choices", json::array())) k += int(c.value("token_ids", json::array()).size());
      if (k == 0) continue;
      if (tokens == 0) ttft = std::chrono::duration<double>(now - start).count();
      else
        for (int j = 0; j < k; ++j) gaps.push_back(std::chrono::duration<double>(now - last).count() / k);
      tokens += k;
      last = now;
    }
  };
  auto resp = http_call("127.0.0.1", port, r);
  if (!resp) return resp.status();
  if (resp->status != 200) return Status::error("HTTP " + std::to_string(resp->status) + ": " + resp->body);
  if (!error.empty()) return Status::error("stream ended with an error: " + error);
  return tokens;
}

// The --engine mode: the in-process CPU engine, a static batch per figure of `batches`.
int engine_mode(const std::string& model, const std::vector<int>& batches, int64_t prompt_tokens, int max_tokens,
                const std::string& json_path) {
  auto w = load_stage_weights(model, 0, load_model_config(model)->n_layer);
  if (!w) {
    std::fprintf(stderr, "cannot load %s: %s\n", model.c_str(), w.error().c_str());
    return 1;
  }
  auto engine = Engine::create(std::move(w).value(), EngineOptions{.max_batch_tokens = 512});
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.error().c_str());
    return 1;
  }
  const int32_t vocab = int32_t((*engine)->config().vocab_size);
  for (int batch : batches) {
    std::vector<GenerationRequest> reqs(static_cast<size_t>(batch));
    for (int i = 0; i < batch; ++i) {
      reqs[size_t(i)].prompt = token_prompt(prompt_tokens, i, vocab);
      reqs[size_t(i)].max_new_tokens = max_tokens;
      reqs[size_t(i)].sampling.temperature = 0.8f;
      reqs[size_t(i)].sampling.top_k = 40;
      reqs[size_t(i)].sampling.seed = uint64_t(i);
      reqs[size_t(i)].ignore_eos = true;
    }
    std::vector<Clock::time_point> token_times;
    const auto t0 = Clock::now();
    auto out = (*engine)->generate(reqs, [&](size_t, int32_t, float) { token_times.push_back(Clock::now()); });
    if (!out) {
      std::fprintf(stderr, "engine: %s\n", out.error().c_str());
      return 1;
    }
    // Tokens come a step at a time: the first `batch` are the prefill's, the rest decode steps.
    const double ttft = std::chrono::duration<double>(token_times[size_t(batch) - 1] - t0).count();
    const double decode_s = std::chrono::duration<double>(token_times.back() - token_times[size_t(batch) - 1]).count();
    const double decode_tokens = double(token_times.size()) - batch;
    const double ms_step = decode_s * 1e3 / std::max(1, max_tokens - 1);
    const double whole_s = std::chrono::duration<double>(token_times.back() - t0).count();  // whole requests
    std::printf("engine, batch %d, prompt %lld, %d new tokens: %.1f tokens/s (decode), %.3f ms a step, prefill %.3f s\n",
                batch, (long long)prompt_tokens, max_tokens, decode_tokens / decode_s, ms_step, ttft);
    if (!json_path.empty()) {
      std::ofstream(json_path, std::ios::app) << json{{"mode", "engine"}, {"backend", "cpu"}, {"clients", batch},
                                                      {"prompt", prompt_tokens}, {"max_tokens", max_tokens},
                                                      {"tokens_per_s", decode_tokens / decode_s},
                                                      {"whole_tokens_per_s", double(token_times.size()) / whole_s},
                                                      {"ms_per_token", ms_step}, {"ttft_s", ttft}}.dump()
                                              << "\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/brown-gpt2";
  int stages = 3, requests = 96, max_tokens = 48, in_flight = 0, warmup = -1, requests_per_client = 0;
  std::string concurrency_list = "32";
  std::string random_shape, backend = "cpu", prompt_mix, json_path, kv_cache_mb;
  int64_t prompt_tokens = 0;
  bool recovery_mode = false, overhead = false, stream = false, trace = false, engine = false;
  CLI::App app{"conveyor-bench-cluster: the cluster through its REST API"};
  app.add_option("--model", model, "checkpoint directory");
  app.add_option("--stages", stages, "pipeline stages")->check(CLI::Range(1, 64));
  int tp = 1, replicas = 1;
  app.add_option("--tp", tp, "tensor-parallel ranks per worker (conveyor local --tp)")->check(CLI::Range(1, 64));
  app.add_option("--replicas", replicas, "pipeline replicas (conveyor local --replicas)")->check(CLI::Range(1, 64));
  app.add_option("--requests", requests, "requests to send (each load)")->check(CLI::PositiveNumber);
  app.add_option("--requests-per-client", requests_per_client, "requests a load: this many per client (overrides --requests)")
      ->check(CLI::PositiveNumber);
  app.add_option("--concurrency", concurrency_list, "client threads; a list (1,64,256) runs one load each on one cluster");
  app.add_option("--warmup", warmup, "untimed requests before each load (default: its clients)");
  app.add_option("--max-tokens", max_tokens, "tokens per request")->check(CLI::PositiveNumber);
  bool greedy = false;
  app.add_flag("--greedy", greedy, "greedy requests (temperature 0) instead of temperature 0.8, top-k 40");
  app.add_option("--prompt-tokens", prompt_tokens, "prompts of this many token ids (default: four short texts)")
      ->check(CLI::PositiveNumber);
  int64_t shared_prefix = 0;
  app.add_option("--shared-prefix", shared_prefix,
                 "with --prompt-tokens: every prompt begins with the same this many token ids (prefix reuse)")
      ->check(CLI::PositiveNumber);
  bool no_prefix_cache = false, no_step_ahead = false;
  app.add_flag("--no-prefix-cache", no_prefix_cache, "conveyor local --no-prefix-cache: compute every prompt whole");
  app.add_flag("--no-step-ahead", no_step_ahead, "conveyor local --no-step-ahead: a one-stage pipeline waits for each result");
  app.add_option("--prompt-mix", prompt_mix,
                 "prompt lengths in tokens that requests take in turn, e.g. 128,1024 (streamed); with --prompt-tokens, "
                 "one more load after the others, of --mix-clients clients");
  int mix_clients = 64;
  app.add_option("--mix-clients", mix_clients, "clients of the --prompt-mix load that follows the --prompt-tokens ones")
      ->check(CLI::PositiveNumber);
  app.add_flag("--stream", stream, "stream the completions and report time to first token and inter-token latency");
  std::string stream_at;
  app.add_option("--stream-at", stream_at, "stream only the loads of these client counts (e.g. 1: a client's per-token latency)");
  app.add_flag("--trace", trace, "collect the workers' and the coordinator's step traces and summarise each load");
  app.add_option("--json", json_path, "append each row as a JSON line to this file");
  app.add_option("--in-flight", in_flight, "micro-batches in flight (0: the coordinator's default)");
  app.add_option("--kv-cache-mb", kv_cache_mb, "conveyor local --kv-cache-mb (default: its own, auto)");
  app.add_option("--backend", backend, "the workers' backend: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  int gpus = 1;
  app.add_option("--gpus", gpus, "cuda: GPUs to spread the workers over (worker i on GPU i % gpus)")
      ->check(CLI::Range(1, 64));
  bool fp8 = false;
  app.add_flag("--fp8", fp8, "cuda: the workers' layer matrices and their inputs in FP8 (conveyor local --fp8)");
  std::string kv_dtype = "auto";
  app.add_option("--kv-dtype", kv_dtype, "cuda: the workers' K/V caches, auto or fp8 (conveyor local --kv-dtype)")
      ->check(CLI::IsMember({"auto", "fp8"}));
  app.add_option("--random", random_shape, "random weights of shape L,C,H with --model's vocabulary, or a named shape");
  app.add_flag("--recovery", recovery_mode, "kill the last stage under a streaming load and measure the pause");
  int spares = 1;
  app.add_option("--spares", spares, "--recovery: spare workers (0: the survivors are re-planned)")->check(CLI::NonNegativeNumber);
  app.add_flag("--overhead", overhead, "measure the coordinator's added latency against the in-process engine");
  app.add_flag("--engine", engine, "no cluster: the in-process CPU engine, a static batch of each --concurrency figure");
  CLI11_PARSE(app, argc, argv);
  const auto concurrency_values = positive_list(concurrency_list, 100000);
  if (!concurrency_values) {
    std::fprintf(stderr, "--concurrency wants positive integers separated by commas, got '%s'\n", concurrency_list.c_str());
    return 2;
  }
  const std::vector<int> concurrencies(concurrency_values->begin(), concurrency_values->end());
  const auto mix_values = positive_list(prompt_mix, LONG_MAX);
  if (!mix_values) {
    std::fprintf(stderr, "--prompt-mix wants prompt lengths (tokens) separated by commas, got '%s'\n", prompt_mix.c_str());
    return 2;
  }
  const std::vector<int64_t>& mix = *mix_values;
  const auto streamed_values = positive_list(stream_at, INT_MAX);  // client counts whose loads stream (all with --stream)
  if (!streamed_values) {
    std::fprintf(stderr, "--stream-at wants client counts separated by commas, got '%s'\n", stream_at.c_str());
    return 2;
  }
  const std::vector<int> streamed(streamed_values->begin(), streamed_values->end());
  if (engine && backend != "cpu") {
    std::fprintf(stderr, "--engine runs the in-process CPU engine; for the GPU use conveyor-bench-gpu-decode\n");
    return 2;
  }
  const int concurrency = concurrencies.front();
  const int64_t longest_prompt = mix.empty() ? std::max<int64_t>(shared_prefix + prompt_tokens, 16) : *std::max_element(mix.begin(), mix.end());
  const std::string bin_dir = std::filesystem::canonical("/proc/self/exe").parent_path().string();
  model = std::filesystem::absolute(model).string();
  std::string random_dir;
  if (!random_shape.empty()) {
    auto dir = random_checkpoint(model, random_shape, longest_prompt + max_tokens);
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
  if (shared_prefix > 0 && prompt_tokens == 0) {
    std::fprintf(stderr, "--shared-prefix needs --prompt-tokens (the tokens each prompt has after the shared ones)\n");
    return 2;
  }
  if ((fp8 || kv_dtype != "auto") && backend != "cuda") {
    std::fprintf(stderr, "--fp8 and --kv-dtype fp8 need --backend cuda\n");
    return 2;
  }
  if (engine) return engine_mode(model, concurrencies, std::max<int64_t>(prompt_tokens, 1), max_tokens, json_path);

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

  std::string trace_dir;
  if (trace) {
    trace_dir = (std::filesystem::temp_directory_path() / ("conveyor-bench-trace-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(trace_dir);
    ::setenv("CONVEYOR_TRACE_DIR", trace_dir.c_str(), 1);  // the cluster's processes inherit it
    std::printf("step traces in %s\n", trace_dir.c_str());
  }
  LocalCluster cluster;
  cluster.backend = backend;
  cluster.gpus = gpus;
  cluster.kv_cache_mb = kv_cache_mb;
  cluster.fp8 = fp8;
  cluster.kv_dtype = kv_dtype;
  cluster.no_prefix_cache = no_prefix_cache;
  cluster.no_step_ahead = no_step_ahead;
  cluster.tp = tp;
  cluster.replicas = replicas;
  if (!cluster.start(bin_dir, model, stages, in_flight)) {
    std::fprintf(stderr, "the cluster did not start\n");
    return 1;
  }
  print_loads(cluster.port);
  int32_t vocab = 0;
  if (auto c = load_model_config(model)) vocab = int32_t(std::min<int64_t>(c->vocab_size, 50257));
  const char* prompts[] = {"The jury said", "In the morning the old man walked down to the river, where",
                           "It was a time of great change in the country, and", "Mr. Brown"};
  int any_failed = 0;
  // The loads: one per --concurrency figure, with the mix alone when it is the only prompt
  // setting, else with --prompt-tokens and then one mixed load of --mix-clients.
  struct Load {
    int clients;
    bool mixed;
  };
  std::vector<Load> loads;
  for (int c : concurrencies) loads.push_back({c, !mix.empty() && prompt_tokens == 0});
  if (!mix.empty() && prompt_tokens > 0) loads.push_back({mix_clients, true});
  for (const auto& [clients, mixed] : loads) {
    const int n_requests = requests_per_client > 0 ? requests_per_client * clients : requests;
    std::atomic<int> next{0}, tokens{0}, failed{0};
    std::mutex lat_mu;
    std::vector<double> latencies, ttfts, gaps;
    std::atomic<bool> running{true};
    const bool stream_load = stream || mixed || std::find(streamed.begin(), streamed.end(), clients) != streamed.end();
    // The body of request i: a text, or token ids of the stated length (the mix in turn).
    auto body_of = [&](int i) {
      json body = greedy ? json{{"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}}
                         : json{{"max_tokens", max_tokens}, {"temperature", 0.8}, {"top_k", 40}, {"seed", i}, {"ignore_eos", true}};
      if (mixed) body["prompt"] = token_prompt(mix[size_t(i) % mix.size()], i, vocab);
      else if (prompt_tokens > 0 && shared_prefix > 0) {  // the same first tokens, then its own
        std::vector<int32_t> p = token_prompt(shared_prefix, -1, vocab);
        const std::vector<int32_t> own = token_prompt(prompt_tokens, i, vocab);
        p.insert(p.end(), own.begin(), own.end());
        body["prompt"] = p;
      } else if (prompt_tokens > 0) body["prompt"] = token_prompt(prompt_tokens, i, vocab);
      else body["prompt"] = prompts[i % 4];
      return body;
    };
    // n requests from `clients` clients; `record`: their tokens, latencies and failures count.
    auto drive = [&](int n, bool record) {
      next = 0;
      std::vector<std::thread> th;
      for (int t = 0; t < clients; ++t)
        th.emplace_back([&] {
          for (int i; (i = next++) < n;) {
            const auto s = Clock::now();
            double ttft = 0;
            std::vector<double> my_gaps;
            auto r = stream_load ? complete_streamed(cluster.port, body_of(i), ttft, my_gaps) : complete(cluster.port, body_of(i));
            if (!record) continue;
            if (!r) {
              if (failed++ < 3) std::fprintf(stderr, "request %d: %s\n", i, r.error().c_str());
              continue;
            }
            tokens += *r;
            std::lock_guard lk(lat_mu);
            latencies.push_back(seconds_since(s));
            if (stream_load) {
              ttfts.push_back(ttft);
              gaps.insert(gaps.end(), my_gaps.begin(), my_gaps.end());
            }
          }
        });
      for (auto& t : th) t.join();
    };
    // Untimed first: a worker's first steps of each size plan their GEMMs and capture graphs.
    if (warmup != 0) drive(warmup < 0 ? clients : warmup, false);
    // Per worker serving a stage (a replica's stage is a worker of its own): its busy
    // fraction per heartbeat, and its cumulative busy seconds at its own clock per heartbeat
    // seen, so the busy fraction over the whole load is the difference between two of them.
    struct Series {
      std::vector<double> busy;
      std::vector<std::pair<double, double>> total;  // busy_seconds_total, clock_seconds
      std::vector<double> idle;                      // idle_ready_seconds_total
    };
    std::map<std::pair<int, std::string>, Series> series;  // (stage, worker)
    std::thread poller([&] {
      while (running) {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        const json info = cluster_info(cluster.port);
        if (!running) continue;
        for (const auto& w : info.value("workers", json::array())) {
          if (!w.contains("stage") || w["stage"].get<int>() >= stages) continue;
          Series& ser = series[{w["stage"].get<int>(), w.value("name", std::string())}];
          ser.busy.push_back(w["busy_fraction"].get<double>());
          const std::pair<double, double> total{w.value("busy_seconds_total", 0.0), w.value("clock_seconds", 0.0)};
          if (ser.total.empty() || ser.total.back().second != total.second) {
            ser.total.push_back(total);
            ser.idle.push_back(w.value("idle_ready_seconds_total", 0.0));
          }
        }
      }
    });
    const double clock0 = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
    const auto t0 = Clock::now();
    drive(n_requests, true);
    const double wall = seconds_since(t0);
    const double clock1 = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
    running = false;
    poller.join();
    const double mean_latency = mean_of(latencies);
    std::printf("%s, stages %d, replicas %d, tp %d, in-flight %s, %d requests x %d tokens, prompt %s, %d clients: %.1f tokens/s, %.2f requests/s, "
                "mean latency %.2f s, %d failed\n",
                backend.c_str(), stages, replicas, tp, in_flight > 0 ? std::to_string(in_flight).c_str() : "default", n_requests, max_tokens,
                mixed ? ("mix " + prompt_mix).c_str()
                             : prompt_tokens > 0 ? (std::to_string(prompt_tokens) + " tokens").c_str() : "short texts",
                clients, tokens / wall, double(latencies.size()) / wall, mean_latency, failed.load());
    json row = {{"mode", "rest"}, {"backend", backend}, {"stages", stages},
                {"replicas", replicas}, {"tp", tp}, {"clients", clients},
                {"requests", n_requests}, {"prompt", mixed ? json(prompt_mix) : json(prompt_tokens)}, {"mixed", mixed},
                {"max_tokens", max_tokens}, {"tokens_per_s", tokens / wall}, {"mean_latency_s", mean_latency},
                {"failed", failed.load()}, {"busy", json::array()}};
    if (stream_load) {
      // A client's per-token latency: the mean gap between its tokens.
      std::printf("  time to first token: p50 %.1f ms, p99 %.1f ms; inter-token latency: mean %.2f ms, p50 %.2f ms, "
                  "p99 %.2f ms (%zu gaps)\n",
                  percentile(ttfts, 50) * 1e3, percentile(ttfts, 99) * 1e3, mean_of(gaps) * 1e3,
                  percentile(gaps, 50) * 1e3, percentile(gaps, 99) * 1e3, gaps.size());
      row["ttft_ms_p50"] = percentile(ttfts, 50) * 1e3, row["ttft_ms_p99"] = percentile(ttfts, 99) * 1e3;
      row["itl_ms_mean"] = mean_of(gaps) * 1e3;
      row["itl_ms_p50"] = percentile(gaps, 50) * 1e3, row["itl_ms_p99"] = percentile(gaps, 99) * 1e3;
    }
    for (auto& [key, ser] : series) {
      auto& b = ser.busy;
      // Drop the first and last samples: the ramp up and down.
      if (b.size() > 2) b = std::vector<double>(b.begin() + 1, b.end() - 1);
      // Cumulative: between the second and the second-to-last heartbeat (past the ramps).
      const auto& c = ser.total;
      const auto& idle = ser.idle;
      if (c.empty()) continue;
      const size_t first = c.size() >= 4 ? 1 : 0, last = c.size() >= 4 ? c.size() - 2 : c.size() - 1;
      const double window = c.size() >= 2 ? c[last].second - c[first].second : 0.0;
      const double frac = window > 0 ? (c[last].first - c[first].first) / window : 0.0;
      const double idle_frac = window > 0 ? (idle[last] - idle[first]) / window : 0.0;
      std::printf("  stage %d (%s) busy fraction: %.0f%% over %.1f s (cumulative busy time); idle with its next input "
                  "waiting: %.1f%%; heartbeat windows: mean %.0f%% of %zu\n",
                  key.first, key.second.c_str(), 100 * frac, window, 100 * idle_frac, b.empty() ? 0.0 : 100 * mean_of(b),
                  b.size());
      row["busy"].push_back(frac);
    }
    if (trace) row["trace"] = print_trace_summary(trace_dir, clock0, clock1);
    if (!json_path.empty()) std::ofstream(json_path, std::ios::app) << row.dump() << "\n";
    any_failed += failed.load();
  }
  if (!trace_dir.empty()) std::printf("step traces kept in %s\n", trace_dir.c_str());
  return any_failed ? 1 : 0;
}

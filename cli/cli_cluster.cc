// `conveyor local`, `conveyor generate`, `conveyor status`: a cluster on this machine, and
// a client of any cluster's REST API.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "cli/http_client.h"

namespace conveyor::cli {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::atomic<bool> g_interrupted{false};
void on_interrupt(int) { g_interrupted = true; }

fs::path self_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::current_path() : exe.parent_path();
}

// A child process; killed (TERM, then KILL) when the launcher ends.
struct Child {
  std::string name;
  pid_t pid = -1;
};

// Starts `argv` with stdout+stderr to `log` (or inherited when empty). When `out_fd` is
// given, stdout goes to a pipe returned there instead.
pid_t spawn(const std::vector<std::string>& argv, const std::string& log, int* out_fd) {
  int pipefd[2] = {-1, -1};
  if (out_fd && ::pipe(pipefd) != 0) return -1;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // a launcher that dies takes its cluster with it
    if (::getppid() != parent) ::_exit(1);
    ::setpgid(0, 0);                     // Ctrl-C reaches the launcher only; it stops children in order
    if (!log.empty()) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd >= 0) ::dup2(fd, 1), ::dup2(fd, 2);
    }
    if (out_fd) ::dup2(pipefd[1], 1), ::close(pipefd[0]), ::close(pipefd[1]);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::perror(("exec " + argv[0]).c_str());
    ::_exit(127);
  }
  if (out_fd) ::close(pipefd[1]), *out_fd = pipefd[0];
  return pid;
}

// SIGTERM to `c`; SIGKILL at `deadline` if it is still there.
void stop_child(Child& c, std::chrono::steady_clock::time_point deadline) {
  if (c.pid <= 0) return;
  ::kill(c.pid, SIGTERM);
  while (c.pid > 0) {
    int status = 0;
    const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid || r < 0) {
      c.pid = -1;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &status, 0);
      c.pid = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void stop_children(std::vector<Child>& children) {
  // The coordinator first (children[0]): it finishes what it accepted and says goodbye, so
  // the workers then leave at once instead of handing their stages to each other.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  if (!children.empty()) stop_child(children[0], deadline);
  for (size_t i = 1; i < children.size(); ++i)
    if (children[i].pid > 0) ::kill(children[i].pid, SIGTERM);
  for (size_t i = 1; i < children.size(); ++i) stop_child(children[i], deadline + std::chrono::seconds(3));
}

// Reads one line from fd within the timeout ("" on timeout or EOF).
std::string read_line(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  while (std::chrono::steady_clock::now() < deadline) {
    char c;
    const ssize_t n = ::read(fd, &c, 1);
    if (n == 1) {
      if (c == '\n') return line;
      line += c;
    } else if (n == 0) {
      return "";
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return "";
}

std::string random_token() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

std::string api_key_header(const std::string& key) { return "Bearer " + key; }

// How a child's wait status reads: "status 2", "signal 11".
std::string exit_text(int status) {
  if (WIFEXITED(status)) return "status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

// Waits up to `timeout` for `c` to exit; its wait status, or nothing while it still runs.
std::optional<int> wait_exit(Child& c, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (c.pid > 0) {
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.pid = -1;
      return status;
    }
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return std::nullopt;
}

// The line of a daemon's log that says why it stopped: from the end, the first line that
// is its own message ("conveyor-coordinator: ...", its prefix dropped) or reads as an error;
// else the last line. Empty when there is no log (--verbose: it went to the terminal).
std::string reason_from_log(const fs::path& log, const std::string& program) {
  if (log.empty()) return "";  // --verbose: it told the terminal itself
  std::ifstream in(log);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  const std::string prefix = program + ": ";
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (it->starts_with(prefix)) return it->substr(prefix.size());
    for (const char* mark : {"[error]", "[critical]", "error:", "Error", "cannot ", "failed"})
      if (it->find(mark) != std::string::npos) return *it;
  }
  return lines.empty() ? std::string() : lines.back();
}

// "conveyor local: NAME <what> (status 1): REASON" and where its log is, on stderr.
void report_failure(const std::string& name, const std::string& what, std::optional<int> status,
                    const fs::path& log, const std::string& program) {
  const std::string reason = reason_from_log(log, program);
  std::cerr << "conveyor local: " << name << " " << what;
  if (status) std::cerr << " (" << exit_text(*status) << ")";
  if (!reason.empty()) std::cerr << ": " << reason;
  std::cerr << "\n";
  if (!log.empty() && fs::exists(log)) std::cerr << "conveyor local: its log: " << log.string() << "\n";
}

}  // namespace

void add_local_command(CLI::App& app, LocalOptions& o) {
  CLI::App* cmd = app.add_subcommand("local", "start a coordinator and N stage workers on this machine");
  cmd->add_option("--model", o.model_dir, "checkpoint directory")->required();
  cmd->add_option("--stages", o.stages, "pipeline stages")->check(CLI::Range(1, 1024));
  cmd->add_option("--replicas", o.replicas, "pipeline replicas")->check(CLI::Range(1, 64));
  cmd->add_option("--spares", o.spares, "extra workers kept as spares")->check(CLI::Range(0, 64));
  cmd->add_option("--port", o.port, "HTTP port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--kv-cache-mb", o.kv_cache_mb,
                  "K/V-cache budget per worker, MiB, or auto (default): 256 MiB on the CPU; on CUDA the worker "
                  "sizes its cache from the GPU memory left after its weights (see `conveyor status`)")
      ->check([](const std::string& v) -> std::string {
        if (v == "auto") return "";
        char* end = nullptr;
        const long long n = std::strtoll(v.c_str(), &end, 10);
        if (v.empty() || *end != '\0' || n < 1 || n > (1 << 24))
          return "--kv-cache-mb wants auto or a whole number of MiB in [1, 16777216], got '" + v + "'";
        return "";
      });
  cmd->add_option("--in-flight", o.in_flight, "micro-batches in flight per pipeline (0: = stages)");
  cmd->add_flag("--no-prefix-cache", o.no_prefix_cache, "compute every prompt whole (no K/V reuse of shared prefixes)");
  cmd->add_option("--log-dir", o.log_dir, "where the daemons' logs go (default: a new temporary folder)");
  cmd->add_option("--backend", o.backend, "where the stages run: cpu, cuda, or auto (cuda when there is a GPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--gpus", o.gpus, "cuda: GPUs to spread the workers over (worker i on GPU i % gpus; auto: all)")
      ->check(CLI::Range(1, 64))
      ->each([&o](const std::string&) { o.gpus_given = true; });
  cmd->add_option("--dtype", o.dtype, "cuda: f16 or bf16")->check(CLI::IsMember({"f16", "bf16"}));
  cmd->add_flag("--int8-weights", o.int8_weights, "cuda: int8 weight-only layer matrices (converted at load)");
  cmd->add_flag("--fp8", o.fp8, "cuda, Hopper: FP8 E4M3 layer matrices (converted at load) and activations");
  cmd->add_option("--tp", o.tp, "tensor-parallel ranks per worker: threads (cpu) or GPUs (cuda)")->check(CLI::Range(1, 256));
  cmd->add_flag("--verbose", o.verbose, "daemons log to this terminal");
}

// What admission works with, from /v1/cluster: each pipeline's K/V budget (its smallest
// stage's capacity), its admission limit and micro-batch limits.
void print_capacity(int http_port) {
  HttpRequest q;
  q.target = "/v1/cluster";
  q.timeout = std::chrono::milliseconds(2000);
  auto answer = http_call("127.0.0.1", http_port, q);
  const json cluster = answer && answer->status == 200 ? json::parse(answer->body, nullptr, false) : json();
  if (!cluster.is_object()) return;
  for (const auto& p : cluster.value("pipelines", json::array())) {
    const json l = p.value("limits", json::object());
    std::cout << "conveyor local: pipeline " << p.value("pipeline", 0) << ": K/V cache "
              << p.value("kv_budget_tokens", int64_t(0)) << " tokens a stage; up to " << l.value("max_running", int64_t(0))
              << " sequences running (" << p.value("in_flight_depth", 0) << " micro-batches in flight of up to "
              << l.value("max_sequences_per_batch", int64_t(0)) << " sequences, "
              << l.value("prefill_tokens_per_batch", int64_t(0)) << " prompt tokens); more wait in the queue"
              << std::endl;
  }
}

// The GPUs a worker on this machine can use (`conveyor-worker --print-gpus`); -1 when it
// cannot be asked.
int usable_gpus(const fs::path& worker) {
  int out = -1;
  const pid_t pid = spawn({worker.string(), "--print-gpus"}, "/dev/null", &out);
  if (pid < 0) return -1;
  const std::string line = read_line(out, std::chrono::seconds(30));
  ::close(out);
  int status = 0;
  ::waitpid(pid, &status, 0);
  int n = -1;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 && std::sscanf(line.c_str(), "%d", &n) == 1 ? n : -1;
}

int local_command(const LocalOptions& options) {
  const fs::path bin = self_dir();
  for (const char* prog : {"conveyor-coordinator", "conveyor-worker"})
    if (!fs::exists(bin / prog)) {
      std::cerr << "conveyor local: " << (bin / prog).string() << " not found (build the project first)\n";
      return 1;
    }
  LocalOptions o = options;
  if (o.backend == "auto") {  // the GPUs when there are any, all of them unless --gpus says
    const int n = usable_gpus(bin / "conveyor-worker");
    if (n < 0) std::cerr << "conveyor local: cannot ask conveyor-worker for the GPUs; using the CPU\n";
    o.backend = n > 0 ? "cuda" : "cpu";
    if (n > 0 && !o.gpus_given) o.gpus = n;
    std::cout << "conveyor local: " << (n > 0 ? std::to_string(n) + " GPU(s) found: the stages run on CUDA over " +
                                                    std::to_string(o.gpus) + " (--backend cpu for the CPU)"
                                              : std::string("no GPU found: the stages run on the CPU"))
              << std::endl;
  }
  if (o.fp8 && (o.backend != "cuda" || o.int8_weights)) {
    std::cerr << "conveyor local: --fp8 " << (o.int8_weights ? "and --int8-weights exclude each other (choose one)"
                                                             : "needs the CUDA backend (a GPU with FP8 tensor cores)")
              << "\n";
    return 2;
  }
  std::error_code ec;
  const fs::path model = fs::absolute(o.model_dir, ec);
  if (!fs::exists(model / "config.json")) {
    std::cerr << "conveyor local: " << model.string() << " has no config.json\n";
    return 1;
  }
  fs::path dir = o.log_dir.empty() ? fs::temp_directory_path() / ("conveyor-local-" + std::to_string(::getpid()))
                                   : fs::path(o.log_dir);
  fs::create_directories(dir, ec);
  const std::string token = random_token();
  {
    std::ofstream y(dir / "cluster.yaml");
    y << "model: {path: \"" << model.string() << "\"}\n"
      << "http: {host: 127.0.0.1, port: " << o.port << "}\n"
      << "control: {host: 127.0.0.1, port: 0, join_token: \"" << token << "\"}\n"
      << "pipeline: {stages: " << o.stages << ", replicas: " << o.replicas << "}\n";
    y << "scheduler: {prefix_cache: " << (o.no_prefix_cache ? "false" : "true");
    if (o.in_flight > 0) y << ", in_flight: " << o.in_flight;
    y << "}\n";
  }
  ::signal(SIGINT, on_interrupt);
  ::signal(SIGTERM, on_interrupt);
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<Child> children;
  int coord_out = -1;
  const pid_t cpid = spawn({(bin / "conveyor-coordinator").string(), "--config", (dir / "cluster.yaml").string()},
                           o.verbose ? "" : (dir / "coordinator.log").string(), &coord_out);
  if (cpid < 0) {
    std::cerr << "conveyor local: cannot start the coordinator\n";
    return 1;
  }
  children.push_back({"coordinator", cpid});
  // "conveyor-coordinator: listening on http://127.0.0.1:PORT (control tcp://127.0.0.1:CPORT)"
  int http_port = 0, control_port = 0;
  bool started = false;
  for (std::string line; !started;) {
    line = read_line(coord_out, std::chrono::seconds(60));
    if (line.empty()) break;
    started = std::sscanf(line.c_str(), "conveyor-coordinator: listening on http://127.0.0.1:%d (control tcp://127.0.0.1:%d)",
                          &http_port, &control_port) == 2;
  }
  if (!started) {
    // Most often it exited at once (a bad plan, an unreadable model): give it a moment to.
    const std::optional<int> status = wait_exit(children[0], std::chrono::seconds(3));
    report_failure("the coordinator", status ? "did not start" : "did not say it was listening within 60 s", status,
                   o.verbose ? fs::path() : dir / "coordinator.log", "conveyor-coordinator");
    ::close(coord_out);
    stop_children(children);
    return 1;
  }
  ::close(coord_out);
  const int n_workers = o.stages * o.replicas + o.spares;
  // The workers share this machine's cores (spares idle, so count the serving ones).
  const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  if (!std::getenv("CONVEYOR_CPU_THREADS"))
    ::setenv("CONVEYOR_CPU_THREADS", std::to_string(std::max(1L, cores / (o.stages * o.replicas))).c_str(), 1);
  for (int i = 0; i < n_workers; ++i) {
    const std::string name = "worker" + std::to_string(i);
    // --host 127.0.0.1: the worker's data plane stays on loopback (`lo`), as the
    // coordinator's does (control.host 127.0.0.1); left to UCX it may pick any interface,
    // a container bridge that comes and goes included (issue 28: the cluster hung).
    std::vector<std::string> argv = {(bin / "conveyor-worker").string(), "--coordinator",
                                     "127.0.0.1:" + std::to_string(control_port), "--host", "127.0.0.1", "--name", name,
                                     "--join-token", token, "--backend", o.backend};
    // auto: 256 MiB for a CPU worker; a CUDA worker sizes its cache from the GPU's memory.
    if (o.kv_cache_mb != "auto") argv.insert(argv.end(), {"--kv-cache-mb", o.kv_cache_mb});
    else if (o.backend != "cuda") argv.insert(argv.end(), {"--kv-cache-mb", "256"});
    if (o.tp > 1) argv.insert(argv.end(), {"--tp", std::to_string(o.tp)});
    if (o.backend == "cuda") {  // worker i's ranks on GPUs (i * tp + k) % gpus
      std::string gpus;
      for (int k = 0; k < o.tp; ++k) gpus += (k ? "," : "") + std::to_string((i * o.tp + k) % o.gpus);
      const int per_gpu = std::max(1, (n_workers * o.tp + o.gpus - 1) / o.gpus);
      argv.insert(argv.end(), {"--gpus", gpus, "--dtype", o.dtype,
                               // several ranks may share a GPU: each takes a share of what is left
                               "--gpu-memory-fraction", std::to_string(0.9 / per_gpu)});
      if (o.int8_weights) argv.push_back("--int8-weights");
      if (o.fp8) argv.push_back("--fp8");
    }
    const pid_t pid = spawn(argv,
                            o.verbose ? "" : (dir / (name + ".log")).string(), nullptr);
    if (pid < 0) {
      std::cerr << "conveyor local: cannot start " << name << "\n";
      stop_children(children);
      return 1;
    }
    children.push_back({name, pid});
  }
  const std::string url = "http://127.0.0.1:" + std::to_string(http_port);
  std::cout << "conveyor local: " << n_workers << " workers starting, logs in " << dir.string() << std::endl;
  bool ready = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  std::set<std::string> load_failures_told;
  auto last_cluster_look = std::chrono::steady_clock::now();
  while (!g_interrupted && !ready && std::chrono::steady_clock::now() < deadline) {
    HttpRequest h;
    h.target = "/health";
    h.timeout = std::chrono::milliseconds(2000);
    auto r = http_call("127.0.0.1", http_port, h);
    ready = r.ok() && r->status == 200;
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (Child& c : children) {
      int status = 0;
      if (c.pid > 0 && ::waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.pid = -1;
        const bool coordinator = &c == &children[0];
        report_failure(c.name, "exited during start-up", status, o.verbose ? fs::path() : dir / (c.name + ".log"),
                       coordinator ? "conveyor-coordinator" : "conveyor-worker");
        stop_children(children);
        return 1;
      }
    }
    // A worker that cannot load its layers stays up (the coordinator may give its stage to
    // a spare): say why at once, and give up when every worker has failed.
    if (!ready && std::chrono::steady_clock::now() - last_cluster_look > std::chrono::milliseconds(500)) {
      last_cluster_look = std::chrono::steady_clock::now();
      HttpRequest q;
      q.target = "/v1/cluster";
      q.timeout = std::chrono::milliseconds(2000);
      auto answer = http_call("127.0.0.1", http_port, q);
      const json cluster = answer && answer->status == 200 ? json::parse(answer->body, nullptr, false) : json();
      int failed = 0;
      if (cluster.is_object())
        for (const auto& w : cluster.value("workers", json::array())) {
          if (w.value("state", std::string()) != "failed") continue;
          ++failed;
          const std::string name = w.value("name", std::string("?"));
          if (load_failures_told.insert(name).second)
            std::cerr << "conveyor local: " << name << " failed to load its layers: "
                      << w.value("last_error", std::string("(no reason given)")) << "\n";
        }
      if (failed >= n_workers) {
        std::cerr << "conveyor local: no worker could load the model; stopping (logs in " << dir.string() << ")\n";
        stop_children(children);
        return 1;
      }
    }
  }
  if (!ready) {
    stop_children(children);
    if (g_interrupted) return 130;
    std::cerr << "conveyor local: the cluster did not become ready (see " << dir.string() << ")\n";
    return 1;
  }
  print_capacity(http_port);
  std::cout << "conveyor local: ready at " << url << " (Ctrl-C stops the cluster)" << std::endl;
  while (!g_interrupted) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (Child& c : children) {
      int status = 0;
      if (c.pid > 0 && ::waitpid(c.pid, &status, WNOHANG) == c.pid) {
        std::cerr << "conveyor local: " << c.name << " exited (status " << status << ")\n";
        c.pid = -1;
      }
    }
  }
  std::cout << "conveyor local: stopping" << std::endl;
  stop_children(children);
  return 0;
}

void add_generate_command(CLI::App& app, GenerateOptions& o) {
  CLI::App* cmd = app.add_subcommand("generate", "stream a completion from a cluster's REST API");
  cmd->add_option("prompt", o.prompt, "the text to continue")->required();
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--max-tokens", o.max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", o.temperature, "0 = greedy");
  cmd->add_option("--top-k", o.top_k, "0 = off");
  cmd->add_option("--top-p", o.top_p, "1 = off");
  cmd->add_option("--seed", o.seed, "sampling seed");
  cmd->add_option("--stop", o.stop, "stop strings");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int generate_command(const GenerateOptions& o) {
  auto hp = parse_http_url(o.url);
  if (!hp) {
    std::cerr << "conveyor generate: " << hp.error() << "\n";
    return 2;
  }
  json body = {{"prompt", o.prompt}, {"max_tokens", o.max_tokens}, {"temperature", o.temperature},
               {"top_p", o.top_p}, {"top_k", o.top_k}, {"stream", true}};
  if (o.seed) body["seed"] = *o.seed;
  if (!o.stop.empty()) body["stop"] = o.stop;
  HttpRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.body = body.dump();
  req.timeout = std::chrono::minutes(10);
  std::string key = o.api_key;
  if (key.empty())
    if (const char* k = std::getenv("CONVEYOR_API_KEY")) key = k;
  if (!key.empty()) req.headers.push_back({"Authorization", api_key_header(key)});
  std::string error;
  std::cout << o.prompt << std::flush;
  SseParser sse([&](std::string_view data) {
    if (data == "[DONE]") return;
    try {
      const json chunk = json::parse(data);
      if (chunk.contains("error")) {
        error = chunk["error"].value("message", chunk["error"].dump());
        return;
      }
      for (const auto& c : chunk.at("choices")) std::cout << c.value("text", std::string()) << std::flush;
    } catch (const std::exception& e) {
      error = std::string("bad event from the server: ") + e.what();
    }
  });
  std::string raw;
  req.on_body = [&](std::string_view bytes) {
    raw.append(bytes);
    sse.feed(bytes);
  };
  auto r = http_call(hp->first, hp->second, req);
  std::cout << "\n";
  if (!r) {
    std::cerr << "conveyor generate: " << r.error() << "\n";
    return 1;
  }
  if (r->status != 200) {
    std::string msg = raw;
    try {
      msg = json::parse(raw).at("error").value("message", raw);
    } catch (const std::exception&) {
    }
    std::cerr << "conveyor generate: HTTP " << r->status << ": " << msg << "\n";
    return 1;
  }
  if (!error.empty()) {
    std::cerr << "conveyor generate: " << error << "\n";
    return 1;
  }
  return 0;
}

namespace {

// POSTs `body` to one of the coordinator's admin endpoints; on anything but 200 prints the
// server's message as "conveyor CMD: ..." and returns nothing (`rc` says the exit code).
std::optional<json> admin_post(const std::string& cmd, const std::string& url, std::string key, const std::string& target,
                               const json& body, int& rc) {
  auto hp = parse_http_url(url);
  if (!hp) {
    std::cerr << "conveyor " << cmd << ": " << hp.error() << "\n";
    rc = 2;
    return std::nullopt;
  }
  HttpRequest req;
  req.method = "POST";
  req.target = target;
  req.body = body.dump();
  if (key.empty())
    if (const char* k = std::getenv("CONVEYOR_API_KEY")) key = k;
  if (!key.empty()) req.headers.push_back({"Authorization", api_key_header(key)});
  auto r = http_call(hp->first, hp->second, req);
  rc = 1;
  if (!r) {
    std::cerr << "conveyor " << cmd << ": " << r.error() << "\n";
    return std::nullopt;
  }
  json answer = json::parse(r->body, nullptr, false);
  if (r->status != 200) {
    std::string msg = r->body;
    if (!answer.is_discarded() && answer.contains("error")) msg = answer["error"].value("message", msg);
    std::cerr << "conveyor " << cmd << ": HTTP " << r->status << ": " << msg << "\n";
    return std::nullopt;
  }
  rc = 0;
  return answer.is_discarded() ? json::object() : answer;
}

std::string shape_text(const json& plan) {
  std::string s = std::to_string(plan.value("stages", 0)) + " stage(s) x " + std::to_string(plan.value("replicas", 0)) +
                  " replica(s), layers";
  for (const auto& r : plan.value("layers", json::array()))
    s += " " + std::to_string(r[0].get<int>()) + "-" + std::to_string(r[1].get<int>());
  return s;
}

}  // namespace

void add_drain_command(CLI::App& app, DrainOptions& o) {
  CLI::App* cmd = app.add_subcommand("drain", "take a worker out of service; a spare (or a smaller plan) takes its stage");
  cmd->add_option("worker", o.worker, "the worker's name (see conveyor status)")->required();
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int drain_command(const DrainOptions& o) {
  int rc = 0;
  auto body = admin_post("drain", o.url, o.api_key, "/v1/cluster/workers/" + o.worker + "/drain", json::object(), rc);
  if (!body) return rc;
  std::cout << "conveyor drain: " << o.worker << " drained";
  if (body->contains("replaced_by")) std::cout << "; its stage went to " << (*body)["replaced_by"].get<std::string>();
  if (body->contains("replanned")) std::cout << "; the plan is now " << shape_text((*body)["replanned"]);
  std::cout << "\n";
  return 0;
}

void add_plan_command(CLI::App& app, PlanOptions& o) {
  CLI::App* cmd = app.add_subcommand("plan", "change the number of stages, replicas or the layer split while serving");
  cmd->add_option("--stages", o.stages, "pipeline stages")->check(CLI::PositiveNumber);
  cmd->add_option("--replicas", o.replicas, "pipeline replicas")->check(CLI::PositiveNumber);
  cmd->add_option("--layers", o.layers, "explicit layer ranges, e.g. 0:3,3:5,5:6");
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int plan_command(const PlanOptions& o) {
  json plan = json::object();
  if (o.stages) plan["stages"] = *o.stages;
  if (o.replicas) plan["replicas"] = *o.replicas;
  if (!o.layers.empty()) {
    json ranges = json::array();
    std::stringstream ss(o.layers);
    for (std::string item; std::getline(ss, item, ',');) {
      long long b = 0, e = 0;
      char extra = 0;
      if (std::sscanf(item.c_str(), "%lld:%lld%c", &b, &e, &extra) != 2) {
        std::cerr << "conveyor plan: --layers: '" << item << "' is not BEGIN:END (e.g. 0:3,3:6)\n";
        return 2;
      }
      ranges.push_back({b, e});
    }
    plan["layers"] = ranges;
  }
  if (plan.empty()) {
    std::cerr << "conveyor plan: give --stages, --replicas and/or --layers\n";
    return 2;
  }
  int rc = 0;
  auto body = admin_post("plan", o.url, o.api_key, "/v1/cluster/plan", plan, rc);
  if (!body) return rc;
  std::cout << "conveyor plan: " << (body->value("changed", true) ? "now " : "unchanged: ")
            << shape_text(body->value("plan", json::object())) << "\n";
  return 0;
}

void add_status_command(CLI::App& app, StatusOptions& o) {
  CLI::App* cmd = app.add_subcommand("status", "print a cluster's workers and pipelines");
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int status_command(const StatusOptions& o) {
  auto hp = parse_http_url(o.url);
  if (!hp) {
    std::cerr << "conveyor status: " << hp.error() << "\n";
    return 2;
  }
  HttpRequest req;
  req.target = "/v1/cluster";
  std::string key = o.api_key;
  if (key.empty())
    if (const char* k = std::getenv("CONVEYOR_API_KEY")) key = k;
  if (!key.empty()) req.headers.push_back({"Authorization", api_key_header(key)});
  auto r = http_call(hp->first, hp->second, req);
  if (!r || r->status != 200) {
    std::cerr << "conveyor status: " << (r ? "HTTP " + std::to_string(r->status) + ": " + r->body : r.error()) << "\n";
    return 1;
  }
  const json c = json::parse(r->body, nullptr, false);
  if (c.is_discarded()) {
    std::cerr << "conveyor status: the server's answer is not JSON\n";
    return 1;
  }
  std::printf("model %s, queue %d\n", c.value("model", std::string("?")).c_str(), c.value("queue", 0));
  if (c.contains("plan")) {
    std::printf("plan: %s", shape_text(c["plan"]).c_str());
    if (c.contains("target") && c["target"] != c["plan"]) std::printf(" (target: %s)", shape_text(c["target"]).c_str());
    std::printf("\n");
  }
  std::printf("\n");
  std::printf("%-14s %-10s %-8s %-9s %-5s %-10s %-6s %-6s %s\n", "WORKER", "HOST", "PID", "STATE", "STAGE", "LAYERS",
              "LOAD", "BUSY", "KV USED/CAP");
  for (const auto& w : c.value("workers", json::array())) {
    const std::string stage = w.contains("stage") ? std::to_string(w["pipeline"].get<int>()) + "." +
                                                        std::to_string(w["stage"].get<int>())
                                                  : "-";
    const std::string layers = w.contains("layers") ? std::to_string(w["layers"][0].get<int>()) + "-" +
                                                          std::to_string(w["layers"][1].get<int>())
                                                    : "-";
    std::printf("%-14s %-10s %-8lld %-9s %-5s %-10s %5.0f%% %5.0f%% %lld/%lld\n", w.value("name", "").c_str(),
                w.value("host", "").c_str(), (long long)w.value("pid", 0LL), w.value("state", "").c_str(),
                stage.c_str(), layers.c_str(), 100 * w.value("load_progress", 0.0), 100 * w.value("busy_fraction", 0.0),
                (long long)w.value("kv_used_tokens", 0LL), (long long)w.value("kv_capacity_tokens", 0LL));
  }
  std::printf("\n");
  for (const auto& p : c.value("pipelines", json::array()))
    std::printf("pipeline %d: %s, epoch %d, %d batches in flight\n", p.value("pipeline", 0),
                p.value("ready", false) ? "ready" : "NOT READY", p.value("epoch", 0), p.value("in_flight", 0));
  return 0;
}

}  // namespace conveyor::cli

// `conveyor local`: a cluster on this machine (a coordinator and its workers as child
// processes), serving until Ctrl-C.
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
#include "common/options.h"
#include "common/model_config.h"
#include "coordinator/layout_choice.h"
#include "coordinator/planner.h"
#include "model/chat_template.h"
#include "stage/backend_factory.h"

namespace conveyor::cli {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::atomic<bool> g_interrupted{false};
std::atomic<int> g_signal{0};  // the signal that stopped it (SIGINT: Ctrl-C)
void on_interrupt(int sig) {
  g_signal = sig;
  g_interrupted = true;
}

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
// given, stdout goes to a pipe returned there instead. `env` is set in the child only: a
// secret passed there stays out of its command line, which every user can read in ps.
pid_t spawn(const std::vector<std::string>& argv, const std::string& log, int* out_fd,
            const std::vector<std::pair<std::string, std::string>>& env = {}) {
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
    for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
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
  // the workers then leave at once instead of handing their stages to each other. After
  // Ctrl-C a person waits: 0.5 s for the whole cluster (what is still sent is cut; workers the
  // coordinator's goodbye did not end by then get 0.1 s more), then SIGKILL; a hung cluster once
  // took 9.6 s to go (issue 28), and 0.5 s for each in turn came to 1.5 s on busy cores.
  // SIGTERM gives 5 s, and 3 s more to the workers.
  using std::chrono::milliseconds;
  const bool now = g_signal == SIGINT;
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(now ? 500 : 5000);
  if (!children.empty()) stop_child(children[0], deadline);
  for (size_t i = 1; i < children.size(); ++i)
    if (children[i].pid > 0) ::kill(children[i].pid, SIGTERM);
  const auto after = std::chrono::steady_clock::now();
  const auto workers_by = now ? std::max(deadline, after + milliseconds(100)) : after + milliseconds(3000);
  for (size_t i = 1; i < children.size(); ++i) stop_child(children[i], workers_by);
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
  const auto shape_given = [&o](const std::string&) { o.shape_given = true; };
  cmd->add_option("--stages", o.stages, "pipeline stages")->check(CLI::Range(1, 1024))->each(shape_given);
  cmd->add_option("--replicas", o.replicas, "pipeline replicas")->check(CLI::Range(1, 64))->each(shape_given);
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
  cmd->add_option("--in-flight", o.in_flight, "micro-batches in flight per pipeline (0: auto, from the stages)")
      ->check(CLI::Range(0, 64));
  cmd->add_flag("--no-prefix-cache", o.no_prefix_cache, "compute every prompt whole (no K/V reuse of shared prefixes)");
  cmd->add_flag("--no-step-ahead", o.no_step_ahead,
                "a one-stage pipeline waits for each step's result before sending the next (scheduler.step_ahead)");
  cmd->add_option("--log-dir", o.log_dir, "where the daemons' logs go (default: a new temporary folder)");
  cmd->add_option("--backend", o.backend, "where the stages run: cpu, cuda, or auto (cuda when there is a GPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--gpus", o.gpus, "cuda: GPUs to spread the workers over (worker i on GPU i % gpus; auto: all)")
      ->check(CLI::Range(1, 64))
      ->default_str("all")
      ->each([&o](const std::string&) { o.gpus_given = true; });
  cmd->add_option("--dtype", o.dtype, "cuda: f16 or bf16")->check(CLI::IsMember({"f16", "bf16"}));
  cmd->add_flag("--int8-weights", o.int8_weights, "cuda: int8 weight-only layer matrices (converted at load)");
  cmd->add_flag("--fp8", o.fp8, "cuda, Hopper: FP8 E4M3 layer matrices (converted at load) and activations");
  cmd->add_option("--kv-dtype", o.kv_dtype, "cuda: the K/V cache's type, auto (the dtype) or fp8 (E4M3, twice the positions)")
      ->check(CLI::IsMember({"auto", "fp8"}));
  cmd->add_option("--tp", o.tp, "tensor-parallel ranks per worker: threads (cpu) or GPUs (cuda)")
      ->check(CLI::Range(1, 256))
      ->each(shape_given);
  cmd->add_option("--objective", o.objective,
                  "what the cluster optimises (its cluster file's objective): with several GPUs and no --stages, "
                  "--tp or --replicas, the layout measured best for it is taken")
      ->check(CLI::IsMember({"latency", "throughput"}));
  cmd->add_option("--layout-figures", o.layout_figures,
                  "the measured figures the layout is chosen from (bench/two_gpu_table.sh's figures.jsonl; default: "
                  "the project's bench/layout_figures.jsonl)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--chat-template", o.chat_template,
                  "the template /v1/chat/completions renders conversations with: a built-in name (chatml, llama2, "
                  "llama3, mistral, zephyr, gemma) or a Jinja file (default: the model's tokenizer_config.json)")
      ->check([](const std::string& v) -> std::string {
        if (builtin_chat_template(v) || fs::is_regular_file(v)) return "";
        return "--chat-template wants a built-in template's name or a file, got '" + v + "'";
      });
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

// The GPUs a worker on this machine can use and the smallest one's memory
// (`conveyor-worker --print-gpus`); count -1 when it cannot be asked. Asked once a launch:
// each ask starts a worker that opens CUDA (about a second), and both the backend's and the
// layout's choice need the answer.
struct GpuCensus {
  int count = -1;
  long long smallest_bytes = 0;
};
GpuCensus ask_gpu_census(const fs::path& worker) {
  int out = -1;
  const pid_t pid = spawn({worker.string(), "--print-gpus"}, "/dev/null", &out);
  if (pid < 0) return {};
  const std::string line = read_line(out, std::chrono::seconds(30));
  ::close(out);
  int status = 0;
  ::waitpid(pid, &status, 0);
  GpuCensus g;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || std::sscanf(line.c_str(), "%d %lld", &g.count, &g.smallest_bytes) < 1)
    return {};
  return g;
}
const GpuCensus& gpu_census(const fs::path& worker) {
  static const GpuCensus census = ask_gpu_census(worker);
  return census;
}

namespace {

// `auto`: the GPUs when there are any, all of them unless --gpus says.
void resolve_backend(LocalOptions& o, const fs::path& bin) {
  if (o.backend != "auto") return;
  const int n = gpu_census(bin / "conveyor-worker").count;
  if (n < 0) std::cerr << "conveyor local: cannot ask conveyor-worker for the GPUs; using the CPU\n";
  o.backend = n > 0 ? "cuda" : "cpu";
  if (n > 0 && !o.gpus_given) o.gpus = n;
  std::cout << "conveyor local: " << (n > 0 ? std::to_string(n) + " GPU(s) found: the stages run on CUDA over " +
                                                  std::to_string(o.gpus) + " (--backend cpu for the CPU)"
                                            : std::string("no GPU found: the stages run on the CPU"))
            << std::endl;
}

// The project's measured figures (bench/layout_figures.jsonl) beside an installed or a built
// `conveyor`: <prefix>/share/conveyor, or the source tree above build/bin.
fs::path default_layout_figures(const fs::path& bin) {
  for (const fs::path& p : {bin / "../share/conveyor/layout_figures.jsonl", bin / "../../bench/layout_figures.jsonl"}) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) return fs::weakly_canonical(p, ec);
  }
  return {};
}

// With several GPUs and no shape given: the layout (tp, stages or replicas) that the measured
// figures say is best for the objective, said with why. False (said) when the figures or the
// model cannot be read.
bool choose_local_layout(LocalOptions& o, const fs::path& model, const fs::path& bin) {
  if (o.backend != "cuda" || o.gpus < 2 || o.shape_given) return true;
  auto config = load_model_config(model.string());
  if (!config) {
    std::cerr << "conveyor local: " << config.error() << "\n";
    return false;
  }
  StageOptions so;
  so.backend = Backend::Cuda;
  so.dtype = o.dtype == "bf16" ? DType::BF16 : DType::F16;
  so.int8_weights = o.int8_weights;
  so.fp8 = o.fp8;
  const auto footprint = stage_footprint(*config, so);
  const int64_t weights = footprint ? stage_weight_bytes(*footprint, {0, config->n_layer}, config->n_layer) : 0;
  const GpuCensus& g = gpu_census(bin / "conveyor-worker");
  // A replica needs the whole model on one GPU with room left for its K/V cache.
  const bool fits = footprint && g.smallest_bytes > 0 && double(weights) <= 0.8 * double(g.smallest_bytes);
  const fs::path file = o.layout_figures.empty() ? default_layout_figures(bin) : fs::path(o.layout_figures);
  std::vector<LayoutFigure> figures;
  if (!file.empty()) {
    std::ifstream in(file);
    std::stringstream text;
    text << in.rdbuf();
    auto parsed = parse_layout_figures(text.str(), file.string());
    if (!in || !parsed) {
      std::cerr << "conveyor local: " << (parsed ? file.string() + ": cannot read it" : parsed.error()) << "\n";
      return false;
    }
    figures = std::move(parsed).value();
  }
  const LayoutChoice c = choose_layout(*parse_objective(o.objective), o.gpus, fits, figures);
  o.stages = c.stages, o.tp = c.tp, o.replicas = c.replicas;
  std::cout << "conveyor local: " << o.gpus << " GPUs, objective " << o.objective << ": " << c.layout << " ("
            << c.stages << " stage(s) x " << c.replicas << " replica(s), tp " << c.tp << "): " << c.why
            << (file.empty() ? "" : "; figures from " + file.string()) << " (--stages, --tp or --replicas set it)"
            << std::endl;
  return true;
}

// The cluster file holds no secret: the join token goes to every daemon in its environment
// (CONVEYOR_JOIN_TOKEN), never on a command line or in a file others may read.
void write_cluster_yaml(const fs::path& file, const fs::path& model, const LocalOptions& o) {
  std::ofstream y(file);
  y << "model: {path: " << nlohmann::json(model.string()).dump();
  if (!o.chat_template.empty())  // a file is given to the coordinator by its absolute path
    y << ", chat_template: "
      << nlohmann::json(builtin_chat_template(o.chat_template) ? o.chat_template : fs::absolute(o.chat_template).string()).dump();
  y << "}\n"
    << "http: {host: 127.0.0.1, port: " << o.port << "}\n"
    << "control: {host: 127.0.0.1, port: 0}\n"
    << "pipeline: {stages: " << o.stages << ", replicas: " << o.replicas << "}\n"
    << "objective: " << o.objective << "\n";
  y << "scheduler: {prefix_cache: " << (o.no_prefix_cache ? "false" : "true");
  if (o.no_step_ahead) y << ", step_ahead: false";
  if (o.in_flight > 0) y << ", in_flight: " << o.in_flight;
  y << "}\n";
}

// The processes of one `conveyor local` and where they log.
struct LocalCluster {
  LocalOptions o;
  fs::path bin, dir;
  std::string token;
  std::vector<Child> children;
  int http_port = 0, control_port = 0;
  std::set<std::string> load_failures_told;  // workers whose failure was said

  int n_workers() const { return o.stages * o.replicas + o.spares; }
  std::string log_of(const std::string& name) const { return o.verbose ? "" : (dir / (name + ".log")).string(); }
  fs::path log_path(const std::string& name) const { return o.verbose ? fs::path() : dir / (name + ".log"); }

  bool start_coordinator();
  std::vector<std::string> worker_argv(int i) const;
  bool start_workers();
  int wait_ready();  // 0 when ready, else the exit code
  bool any_worker_loads();
  void serve();
};

// Starts the coordinator and reads its ports from the line it prints:
// "conveyor-coordinator: listening on http://127.0.0.1:PORT (control tcp://127.0.0.1:CPORT)".
bool LocalCluster::start_coordinator() {
  int out = -1;
  const pid_t pid = spawn({(bin / "conveyor-coordinator").string(), "--config", (dir / "cluster.yaml").string()},
                          log_of("coordinator"), &out, {{"CONVEYOR_JOIN_TOKEN", token}});
  if (pid < 0) {
    std::cerr << "conveyor local: cannot start the coordinator\n";
    return false;
  }
  children.push_back({"coordinator", pid});
  bool started = false;
  for (std::string line; !started;) {
    line = read_line(out, std::chrono::seconds(60));
    if (line.empty()) break;
    started = std::sscanf(line.c_str(), "conveyor-coordinator: listening on http://127.0.0.1:%d (control tcp://127.0.0.1:%d)",
                          &http_port, &control_port) == 2;
  }
  ::close(out);
  if (started) return true;
  // Most often it exited at once (a bad plan, an unreadable model): give it a moment to.
  const std::optional<int> status = wait_exit(children[0], std::chrono::seconds(3));
  report_failure("the coordinator", status ? "did not start" : "did not say it was listening within 60 s", status,
                 log_path("coordinator"), "conveyor-coordinator");
  stop_children(children);
  return false;
}

std::vector<std::string> LocalCluster::worker_argv(int i) const {
  const std::string name = "worker" + std::to_string(i);
  // --host 127.0.0.1: the worker's data plane stays on loopback (`lo`), as the
  // coordinator's does (control.host 127.0.0.1); left to UCX it may pick any interface,
  // a container bridge that comes and goes included (issue 28: the cluster hung).
  std::vector<std::string> argv = {(bin / "conveyor-worker").string(), "--coordinator",
                                   "127.0.0.1:" + std::to_string(control_port), "--host", "127.0.0.1", "--name", name,
                                   "--backend", o.backend};
  // auto: 256 MiB for a CPU worker; a CUDA worker sizes its cache from the GPU's memory.
  if (o.kv_cache_mb != "auto") argv.insert(argv.end(), {"--kv-cache-mb", o.kv_cache_mb});
  else if (o.backend != "cuda") argv.insert(argv.end(), {"--kv-cache-mb", "256"});
  if (o.tp > 1) argv.insert(argv.end(), {"--tp", std::to_string(o.tp)});
  if (o.backend == "cuda") {  // worker i's ranks on GPUs (i * tp + k) % gpus
    std::string gpus;
    for (int k = 0; k < o.tp; ++k) gpus += (k ? "," : "") + std::to_string((i * o.tp + k) % o.gpus);
    const int per_gpu = std::max(1, (n_workers() * o.tp + o.gpus - 1) / o.gpus);
    argv.insert(argv.end(), {"--gpus", gpus, "--dtype", o.dtype,
                             // several ranks may share a GPU: each takes a share of what is left
                             "--gpu-memory-fraction", std::to_string(0.9 / per_gpu)});
    if (o.int8_weights) argv.push_back("--int8-weights");
    if (o.fp8) argv.push_back("--fp8");
    if (o.kv_dtype != "auto") argv.insert(argv.end(), {"--kv-dtype", o.kv_dtype});
  }
  return argv;
}

bool LocalCluster::start_workers() {
  // The workers share this machine's cores (spares idle, so count the serving ones).
  const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  if (!process_options().set_by_environment("cpu.threads"))  // the user's choice stands
    ::setenv("CONVEYOR_CPU_THREADS", std::to_string(std::max(1L, cores / (o.stages * o.replicas))).c_str(), 1);
  for (int i = 0; i < n_workers(); ++i) {
    const std::string name = "worker" + std::to_string(i);
    const pid_t pid = spawn(worker_argv(i), log_of(name), nullptr, {{"CONVEYOR_JOIN_TOKEN", token}});
    if (pid < 0) {
      std::cerr << "conveyor local: cannot start " << name << "\n";
      stop_children(children);
      return false;
    }
    children.push_back({name, pid});
  }
  return true;
}

// A worker that cannot load its layers stays up (the coordinator may give its stage to a
// spare): says why at once; false when every worker has failed.
bool LocalCluster::any_worker_loads() {
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
  return failed < n_workers();
}

int LocalCluster::wait_ready() {
  bool ready = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
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
        report_failure(c.name, "exited during start-up", status, log_path(c.name),
                       coordinator ? "conveyor-coordinator" : "conveyor-worker");
        stop_children(children);
        return 1;
      }
    }
    if (!ready && std::chrono::steady_clock::now() - last_cluster_look > std::chrono::milliseconds(500)) {
      last_cluster_look = std::chrono::steady_clock::now();
      if (!any_worker_loads()) {
        std::cerr << "conveyor local: no worker could load the model; stopping (logs in " << dir.string() << ")\n";
        stop_children(children);
        return 1;
      }
    }
  }
  if (ready) return 0;
  stop_children(children);
  if (g_interrupted) return 130;
  std::cerr << "conveyor local: the cluster did not become ready (see " << dir.string() << ")\n";
  return 1;
}

// Until Ctrl-C (or SIGTERM): children that exit are reported, the rest keep serving.
void LocalCluster::serve() {
  while (!g_interrupted) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (Child& c : children) {
      int status = 0;
      if (c.pid > 0 && ::waitpid(c.pid, &status, WNOHANG) == c.pid) {
        const fs::path log = log_path(c.name);
        std::cerr << "conveyor local: " << c.name << " exited (" << exit_text(status)
                  << (log.empty() ? std::string() : "; its log: " + log.string()) << ")\n";
        c.pid = -1;
      }
    }
  }
  std::cout << "conveyor local: stopping" << std::endl;
  stop_children(children);
}

}  // namespace

int local_command(const LocalOptions& options) {
  LocalCluster c;
  c.bin = self_dir();
  for (const char* prog : {"conveyor-coordinator", "conveyor-worker"})
    if (!fs::exists(c.bin / prog)) {
      std::cerr << "conveyor local: " << (c.bin / prog).string() << " not found (build the project first)\n";
      return 1;
    }
  c.o = options;
  LocalOptions& o = c.o;
  resolve_backend(o, c.bin);
  if (o.fp8 && (o.backend != "cuda" || o.int8_weights)) {
    std::cerr << "conveyor local: --fp8 " << (o.int8_weights ? "and --int8-weights exclude each other (choose one)"
                                                             : "needs the CUDA backend (a GPU with FP8 tensor cores)")
              << "\n";
    return 2;
  }
  if (o.kv_dtype == "fp8" && o.backend != "cuda") {
    std::cerr << "conveyor local: --kv-dtype fp8 needs the CUDA backend (the CPU stage keeps fp32 K/V)\n";
    return 2;
  }
  std::error_code ec;
  const fs::path model = fs::absolute(o.model_dir, ec);
  if (!fs::exists(model / "config.json")) {
    std::cerr << "conveyor local: " << model.string() << " has no config.json\n";
    return 1;
  }
  if (!choose_local_layout(o, model, c.bin)) return 2;
  c.dir = o.log_dir.empty() ? fs::temp_directory_path() / ("conveyor-local-" + std::to_string(::getpid()))
                            : fs::path(o.log_dir);
  fs::create_directories(c.dir, ec);
  c.token = random_token();
  write_cluster_yaml(c.dir / "cluster.yaml", model, o);
  ::signal(SIGINT, on_interrupt);
  ::signal(SIGTERM, on_interrupt);
  ::signal(SIGPIPE, SIG_IGN);

  if (!c.start_coordinator() || !c.start_workers()) return 1;
  std::cout << "conveyor local: " << c.n_workers() << " workers starting, logs in " << c.dir.string() << std::endl;
  if (const int code = c.wait_ready(); code != 0) return code;
  print_capacity(c.http_port);
  std::cout << "conveyor local: ready at http://127.0.0.1:" << c.http_port << " (Ctrl-C stops the cluster)" << std::endl;
  c.serve();
  return 0;
}

}  // namespace conveyor::cli

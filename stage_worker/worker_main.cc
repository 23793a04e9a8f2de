// conveyor-worker: the stage worker daemon (see stage_worker/worker.h).
//   conveyor-worker --coordinator HOST:PORT [--backend cpu|cuda|auto] [--gpus 0,1,...] ... [--check]
// The environment's options (common/options.h) are read once, first: a bad value stops the
// worker naming the variable. --check prints their effective values and exits.
#include <algorithm>
#include <csignal>
#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "common/options.h"
#include "stage/backend_factory.h"
#include "stage_worker/worker.h"

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

constexpr int kBadInput = 2;  // a bad flag or environment (1: a failure to start)

// The command line: WorkerOptions, and the flags that become part of it after parsing.
struct Flags {
  conveyor::WorkerOptions opt;
  int64_t kv_mb = conveyor::WorkerOptions{}.stage.kv_cache_bytes >> 20;
  CLI::Option* kv_mb_given = nullptr;
  std::string backend = "auto", dtype = "f16", kv_dtype = "auto";
  int heartbeat_ms = int(conveyor::WorkerOptions{}.heartbeat_interval.count());
  int liveness_ms = int(conveyor::WorkerOptions{}.coordinator_liveness.count());
  int64_t drain_ms = conveyor::WorkerOptions{}.drain_timeout.count();
  int device = 0;
  std::vector<int> gpus;
  bool print_gpus = false, check = false;
};

void add_worker_flags(CLI::App& app, Flags& f) {
  conveyor::WorkerOptions& opt = f.opt;
  app.add_option("--coordinator", opt.coordinator, "the coordinator's control endpoint, HOST:PORT (required)");
  app.add_option("--name", opt.name, "this worker's unique name (default: HOST-PID)");
  app.add_option("--host", opt.host,
                 "this node's address on the cluster network (IPv4 or a name): advertised to the coordinator and the "
                 "only interface the data plane uses (default: the host name, and the interface of the route to the "
                 "coordinator)");
  app.add_option("--data-interface", opt.data_interface,
                 "the data plane's network interface(s), UCX_NET_DEVICES syntax, or 'any' (default: the interface "
                 "holding --host's address, lo for 127.0.0.1; without --host, the route to the coordinator's; UCX_NET_DEVICES in the "
                 "environment wins)");
  app.add_option("--join-token", opt.join_token, "the cluster's join token; every user can read it in ps: pass it as "
                 "$CONVEYOR_JOIN_TOKEN instead (the default)");
  app.add_option("--curve-server-key", opt.curve_server_key, "the coordinator's CURVE public key (Z85)");
  app.add_option("--heartbeat-ms", f.heartbeat_ms, "heartbeat period")->check(CLI::Range(10, 60000));
  app.add_option("--coordinator-liveness-ms", f.liveness_ms, "register again after this much silence")
      ->check(CLI::Range(100, 600000));
  app.add_option("--drain-timeout-ms", f.drain_ms, "on SIGTERM, how long to wait for the stage to be taken over")
      ->check(CLI::Range(0, 3600000));
  app.add_flag("--check", f.check,
               "print the options this worker would run with (name = value (default or env VARIABLE); secrets as "
               "set or unset) and exit");
}

void add_stage_flags(CLI::App& app, Flags& f) {
  conveyor::StageOptions& stage = f.opt.stage;
  f.kv_mb_given =
      app.add_option("--kv-cache-mb", f.kv_mb,
                     "KV-cache budget of this worker's stage, MiB (cpu: default 512; cuda: a cap on each GPU's cache, "
                     "which otherwise takes --gpu-memory-fraction of what the weights leave)")
          ->check(CLI::Range(1, 1 << 24));
  app.add_option("--backend", f.backend, "where the stage runs: cpu, cuda, or auto (cuda when this node has a GPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_flag("--print-gpus", f.print_gpus, "print how many GPUs this worker can use (0 without CUDA) and the smallest one's memory in bytes, and exit");
  app.add_option("--device", f.device, "cuda: the stage's first GPU (with --tp N: GPUs device .. device+N-1)")
      ->check(CLI::Range(0, 255));
  app.add_option("--gpus", f.gpus, "cuda: the stage's GPUs, tensor parallel over them (e.g. 0,1,2,3)")
      ->delimiter(',')
      ->check(CLI::Range(0, 255))
      ->default_str("none: --device and --tp");
  app.add_option("--dtype", f.dtype, "cuda: f16 or bf16")->check(CLI::IsMember({"f16", "bf16"}));
  app.add_flag("--int8-weights", stage.int8_weights,
               "cuda: store the layer matrices as int8 with a scale per output channel (converted at load)");
  app.add_flag("--fp8", stage.fp8,
               "cuda, Hopper (compute capability 9.0): store the layer matrices as FP8 E4M3 with a scale per output "
               "channel (converted at load) and quantise their inputs per token; not with --int8-weights");
  app.add_option("--kv-dtype", f.kv_dtype,
                 "cuda: the K/V cache's type: auto (the stage's dtype) or fp8 (E4M3 with a scale per token and head: "
                 "half the bytes, twice the positions)")
      ->check(CLI::IsMember({"auto", "fp8"}));
  app.add_option("--gpu-memory-fraction", stage.gpu_memory_fraction,
                 "cuda: share of the GPU memory left after the weights that the K/V cache takes")
      ->check(CLI::Range(0.01, 0.99));
  app.add_option("--tp", stage.tensor_parallel, "tensor-parallel ranks of the stage: threads (cpu) or GPUs (cuda)")
      ->check(CLI::Range(1, 256));
}

// The stage's backend and GPUs from --backend, --device, --gpus and --tp; an error names the
// flags that disagree.
conveyor::Status resolve_stage(Flags& f) {
  conveyor::StageOptions& stage = f.opt.stage;
  if (f.backend == "auto") {
    const int n = conveyor::usable_gpus();
    f.backend = n > 0 ? "cuda" : "cpu";
    std::cerr << "conveyor-worker: --backend auto: " << (n > 0 ? std::to_string(n) + " GPU(s), the stage runs on CUDA"
                                                               : std::string("no usable GPU, the stage runs on the CPU"))
              << "\n";
  }
  stage.backend = *conveyor::parse_backend(f.backend);  // CLI11 allowed only cpu and cuda here
  stage.dtype = f.dtype == "bf16" ? conveyor::DType::BF16 : conveyor::DType::F16;
  stage.kv_fp8 = f.kv_dtype == "fp8";
  if (stage.backend == conveyor::Backend::Cuda) {
    if (f.gpus.empty()) {
      for (int r = 0; r < stage.tensor_parallel; ++r) f.gpus.push_back(f.device + r);
    } else if (stage.tensor_parallel > 1 && stage.tensor_parallel != int(f.gpus.size())) {
      return conveyor::Status::error("--tp " + std::to_string(stage.tensor_parallel) + " but --gpus names " +
                                     std::to_string(f.gpus.size()) + " GPUs");
    }
    if (f.gpus.size() > 8)
      return conveyor::Status::error("a stage runs tensor parallel over at most 8 GPUs; --gpus names " +
                                     std::to_string(f.gpus.size()));
    stage.gpus = f.gpus;
    stage.tensor_parallel = int(f.gpus.size());
  } else if (!f.gpus.empty() || stage.int8_weights || stage.fp8 || stage.kv_fp8) {
    return conveyor::Status::error("--gpus, --int8-weights, --fp8 and --kv-dtype fp8 need the CUDA backend (--backend "
                                   "cuda, or auto on a node with a usable GPU)");
  }
  if (stage.fp8 && stage.int8_weights) return conveyor::Status::error("--fp8 and --int8-weights exclude each other (choose one)");
  return conveyor::ok_status();
}

// The environment's options and the remaining flags into WorkerOptions; the kernels' process-wide
// settings applied.
conveyor::Status finish_options(Flags& f, const conveyor::Options& options) {
  conveyor::WorkerOptions& opt = f.opt;
  if (opt.join_token.empty()) opt.join_token = options.join_token;
  opt.stage.gemm = options.kernels.gemm;
  opt.direct_min_bytes = options.direct_min_bytes;
  opt.data_idle_spin_us = options.data_idle_spin_us;
  opt.data_shared_memory = options.data_shared_memory;
  if (conveyor::Status s = conveyor::apply_kernel_options(options.kernels); !s) return s;
  opt.stage.kv_cache_bytes = f.kv_mb << 20;
  if (f.kv_mb_given->count() > 0) opt.stage.gpu_kv_cache_max_bytes = f.kv_mb << 20;
  opt.heartbeat_interval = std::chrono::milliseconds(f.heartbeat_ms);
  opt.coordinator_liveness = std::chrono::milliseconds(f.liveness_ms);
  opt.drain_timeout = std::chrono::milliseconds(f.drain_ms);
  return conveyor::ok_status();
}

int fail(const std::string& why, int code) {
  std::cerr << "conveyor-worker: " << why << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"conveyor-worker: a pipeline stage worker"};
  app.option_defaults()->always_capture_default();  // --help shows each default
  add_worker_flags(app, flags);
  add_stage_flags(app, flags);
  CLI11_PARSE(app, argc, argv);
  auto options = conveyor::read_options();
  if (!options) return fail(options.error(), kBadInput);
  // The snapshot the libraries read (the trace folder); nothing has read it yet.
  if (conveyor::Status s = conveyor::install_options(*options); !s) return fail(s.message(), 1);
  if (flags.check) {
    std::cout << conveyor::describe_options(*options, conveyor::kWorkerScope) << std::flush;
    return 0;
  }
  if (flags.print_gpus) {  // the count, then the smallest GPU's memory in bytes (0: none)
    const int n = conveyor::usable_gpus();
    int64_t smallest = 0;
    for (int g = 0; g < n; ++g) {
      conveyor::StageOptions o;
      o.backend = conveyor::Backend::Cuda;
      o.gpus = {g};
      const int64_t bytes = conveyor::stage_memory_bytes(o);
      smallest = g == 0 ? bytes : std::min(smallest, bytes);
    }
    std::cout << n << " " << smallest << std::endl;
    return 0;
  }
  if (flags.opt.coordinator.empty()) return fail("--coordinator HOST:PORT is required", kBadInput);
  if (conveyor::Status s = resolve_stage(flags); !s) return fail(s.message(), kBadInput);
  spdlog::set_default_logger(spdlog::stderr_color_mt("worker"));  // stdout is for the ready line
  spdlog::set_level(options->log_level);
  if (conveyor::Status s = finish_options(flags, *options); !s) return fail(s.message(), 1);

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto worker = conveyor::Worker::create(flags.opt);
  if (!worker) return fail(worker.error(), 1);
  return (*worker)->run(g_stop);
}

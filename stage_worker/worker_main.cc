// conveyor-worker: the stage worker daemon (see stage_worker/worker.h).
//   conveyor-worker --coordinator HOST:PORT [--backend cpu|cuda|auto] [--gpus 0,1,...] ... [--check]
// The environment's options (common/options.h) are read once, first: a bad value stops the
// worker naming the variable. --check prints their effective values and exits.
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
}  // namespace

int main(int argc, char** argv) {
  conveyor::WorkerOptions opt;
  conveyor::StageOptions& stage = opt.stage;
  int64_t kv_mb = stage.kv_cache_bytes >> 20;
  std::string backend = "auto", dtype = "f16";
  int heartbeat_ms = int(opt.heartbeat_interval.count());
  int liveness_ms = int(opt.coordinator_liveness.count());
  CLI::App app{"conveyor-worker: a pipeline stage worker"};
  app.add_option("--coordinator", opt.coordinator, "the coordinator's control endpoint, HOST:PORT (required)");
  app.add_option("--name", opt.name, "this worker's unique name (default: HOST-PID)");
  app.add_option("--host", opt.host,
                 "this node's address on the cluster network (IPv4 or a name): advertised to the coordinator and the "
                 "only interface the data plane uses (default: the host name, every interface)");
  app.add_option("--data-interface", opt.data_interface,
                 "the data plane's network interface(s), UCX_NET_DEVICES syntax, or 'any' (default: the interface "
                 "holding --host's address, lo for 127.0.0.1; every one without --host; UCX_NET_DEVICES in the "
                 "environment wins)");
  app.add_option("--join-token", opt.join_token, "the cluster's join token (default: $CONVEYOR_JOIN_TOKEN)");
  app.add_option("--curve-server-key", opt.curve_server_key, "the coordinator's CURVE public key (Z85)");
  CLI::Option* kv_opt =
      app.add_option("--kv-cache-mb", kv_mb,
                     "KV-cache budget of this worker's stage, MiB (cpu: default 512; cuda: a cap on each GPU's cache, "
                     "which otherwise takes --gpu-memory-fraction of what the weights leave)")
          ->check(CLI::Range(1, 1 << 24));
  app.add_option("--backend", backend, "where the stage runs: cpu, cuda, or auto (cuda when this node has a GPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  bool print_gpus = false;
  app.add_flag("--print-gpus", print_gpus, "print how many GPUs this worker can use (0 without CUDA) and exit");
  int device = 0;
  std::vector<int> gpus;
  app.add_option("--device", device, "cuda: the stage's first GPU (with --tp N: GPUs device .. device+N-1)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--gpus", gpus, "cuda: the stage's GPUs, tensor parallel over them (e.g. 0,1,2,3)")
      ->delimiter(',')
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", dtype, "cuda: f16 or bf16")->check(CLI::IsMember({"f16", "bf16"}));
  app.add_flag("--int8-weights", stage.int8_weights,
               "cuda: store the layer matrices as int8 with a scale per output channel (converted at load)");
  app.add_flag("--fp8", stage.fp8,
               "cuda, Hopper (compute capability 9.0): store the layer matrices as FP8 E4M3 with a scale per output "
               "channel (converted at load) and quantise their inputs per token; not with --int8-weights");
  app.add_option("--gpu-memory-fraction", stage.gpu_memory_fraction,
                 "cuda: share of the GPU memory left after the weights that the K/V cache takes")
      ->check(CLI::Range(0.01, 0.99));
  app.add_option("--heartbeat-ms", heartbeat_ms, "heartbeat period")->check(CLI::Range(10, 60000));
  app.add_option("--coordinator-liveness-ms", liveness_ms, "register again after this much silence")
      ->check(CLI::Range(100, 600000));
  app.add_option("--tp", stage.tensor_parallel, "tensor-parallel ranks of the stage: threads (cpu) or GPUs (cuda)")
      ->check(CLI::Range(1, 256));
  int64_t drain_ms = opt.drain_timeout.count();
  app.add_option("--drain-timeout-ms", drain_ms, "on SIGTERM, how long to wait for the stage to be taken over")
      ->check(CLI::Range(0, 3600000));
  bool check = false;
  app.add_flag("--check", check,
               "print the options this worker would run with (name = value (default or env VARIABLE); secrets as "
               "set or unset) and exit");
  CLI11_PARSE(app, argc, argv);
  auto options = conveyor::read_options();
  if (!options) {
    std::cerr << "conveyor-worker: " << options.error() << "\n";
    return 2;
  }
  // The snapshot the libraries read (the trace folder); nothing has read it yet.
  if (conveyor::Status s = conveyor::install_options(*options); !s) {
    std::cerr << "conveyor-worker: " << s.message() << "\n";
    return 1;
  }
  if (check) {
    std::cout << conveyor::describe_options(*options, conveyor::kWorkerScope) << std::flush;
    return 0;
  }
  if (print_gpus) {
    std::cout << conveyor::usable_gpus() << std::endl;
    return 0;
  }
  if (opt.coordinator.empty()) {
    std::cerr << "conveyor-worker: --coordinator HOST:PORT is required\n";
    return 2;
  }
  if (backend == "auto") {
    const int n = conveyor::usable_gpus();
    backend = n > 0 ? "cuda" : "cpu";
    std::cerr << "conveyor-worker: --backend auto: " << (n > 0 ? std::to_string(n) + " GPU(s), the stage runs on CUDA"
                                                               : std::string("no usable GPU, the stage runs on the CPU"))
              << "\n";
  }
  stage.backend = *conveyor::parse_backend(backend);  // CLI11 allowed only cpu and cuda here
  stage.dtype = dtype == "bf16" ? conveyor::DType::BF16 : conveyor::DType::F16;
  if (stage.backend == conveyor::Backend::Cuda) {
    if (gpus.empty()) {
      for (int r = 0; r < stage.tensor_parallel; ++r) gpus.push_back(device + r);
    } else if (stage.tensor_parallel > 1 && stage.tensor_parallel != int(gpus.size())) {
      std::cerr << "conveyor-worker: --tp " << stage.tensor_parallel << " but --gpus names " << gpus.size() << " GPUs\n";
      return 2;
    }
    if (gpus.size() > 8) {
      std::cerr << "conveyor-worker: a stage runs tensor parallel over at most 8 GPUs; --gpus names " << gpus.size() << "\n";
      return 2;
    }
    stage.gpus = gpus;
    stage.tensor_parallel = int(gpus.size());
  } else if (!gpus.empty() || stage.int8_weights || stage.fp8) {
    std::cerr << "conveyor-worker: --gpus, --int8-weights and --fp8 need the CUDA backend (--backend cuda, or auto on "
                 "a node with a usable GPU)\n";
    return 2;
  }
  if (stage.fp8 && stage.int8_weights) {
    std::cerr << "conveyor-worker: --fp8 and --int8-weights exclude each other (choose one)\n";
    return 2;
  }
  spdlog::set_default_logger(spdlog::stderr_color_mt("worker"));  // stdout is for the ready line
  spdlog::set_level(options->log_level);
  if (opt.join_token.empty()) opt.join_token = options->join_token;
  stage.gemm = options->kernels.gemm;
  opt.direct_min_bytes = options->direct_min_bytes;
  if (conveyor::Status s = conveyor::apply_kernel_options(options->kernels); !s) {
    std::cerr << "conveyor-worker: " << s.message() << "\n";
    return 1;
  }
  stage.kv_cache_bytes = kv_mb << 20;
  if (kv_opt->count() > 0) stage.gpu_kv_cache_max_bytes = kv_mb << 20;
  opt.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
  opt.coordinator_liveness = std::chrono::milliseconds(liveness_ms);
  opt.drain_timeout = std::chrono::milliseconds(drain_ms);

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto worker = conveyor::Worker::create(opt);
  if (!worker) {
    std::cerr << "conveyor-worker: " << worker.error() << "\n";
    return 1;
  }
  return (*worker)->run(g_stop);
}

// The stage worker: joins the coordinator, loads the layers of the stage it is assigned,
// runs micro-batches and hands them on around the ring.
//
// Threads:
//  - control (run()): the ZeroMQ DEALER. Registers (with the cluster's join token and this
//    worker's data-plane address), sends heartbeats with load figures, takes `assign`,
//    `unassign`, `drain` and `shutdown`. A coordinator silent for the liveness window is
//    presumed gone: the worker keeps its weights and registers again, naming what it holds,
//    so a restarted coordinator need not make it reload.
//  - loader: converts the assigned layers (load_progress messages), then `ready`.
//  - compute: receives micro-batches on the data plane (UCX), runs them (StageExecutor)
//    and sends the activations to the next stage, or the BatchResult to the coordinator.
//    Data-plane failures are reported to the coordinator as `data_error`.
//
// Control messages (JSON "type"; see docs/ARCHITECTURE.md for every field):
//   worker -> coordinator: register, load_progress, ready, load_failed, heartbeat, data_error, leaving
//   coordinator -> worker: welcome, rejected, assign, unassign, heartbeat, drain, shutdown
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor {

// CUDA devices this worker could run a stage on: 0 when it was built without the CUDA
// backend or the driver finds none. `--backend auto` (the default) picks cuda when there are any.
int usable_gpus();

struct WorkerOptions {
  std::string coordinator;             // control endpoint, "host:port" or "tcp://host:port"
  std::string name;                    // unique in the cluster; default host-pid
  std::string join_token;              // must match the coordinator's
  std::string curve_server_key;        // the coordinator's CURVE public key, when it uses CURVE
  int64_t kv_cache_bytes = 512ll << 20;  // KV-cache budget of this worker's stage (CPU backend)
  std::string backend = "cpu";           // cpu | cuda
  int tensor_parallel = 1;               // the stage's layers run over this many threads (cpu) or GPUs (cuda)
  std::vector<int> gpus = {0};           // cuda: the GPUs of the stage, in rank order (tensor_parallel of them)
  std::string dtype = "f16";             // cuda: f16 | bf16
  bool int8_weights = false;             // cuda: layer matrices int8 weight-only (per-channel scales)
  double gpu_memory_fraction = 0.9;      // cuda: of the memory left after weights, for the K/V cache
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds coordinator_liveness{3000};
  // On SIGTERM a worker with a stage waits this long for the coordinator to take it over.
  std::chrono::milliseconds drain_timeout{30000};
};

class Worker {
 public:
  static Expected<std::unique_ptr<Worker>> create(WorkerOptions options);
  ~Worker();

  // Runs until `stop` turns true (then hands its stage over first, see drain_timeout), a
  // `shutdown` arrives or the join is refused. Returns the process exit code (0: clean
  // shutdown; 3: rejected by the coordinator).
  int run(const std::atomic<bool>& stop);

  struct Impl;

 private:
  explicit Worker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor

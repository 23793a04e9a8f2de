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
// Control messages (transport/control_messages.h defines each one):
//   worker -> coordinator: register, load_progress, ready, load_failed, heartbeat, data_error,
//                          draining, leaving
//   coordinator -> worker: welcome, rejected, assign, unassign, heartbeat, goodbye, drain, shutdown
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/options.h"
#include "common/status.h"
#include "stage/backend_factory.h"

namespace conveyor {

struct WorkerOptions {
  std::string coordinator;             // control endpoint, "host:port" or "tcp://host:port"
  std::string name;                    // unique in the cluster; default host-pid
  // This node's address on the cluster network (IPv4 or a name): advertised in `register`
  // and the only interface the data plane publishes and uses (`lo` for 127.0.0.1, as
  // `conveyor local` gives). Empty: the host name, and every interface.
  std::string host;
  // The data plane's interface(s) instead (transport/net_interface.h): "any", or names in
  // UCX_NET_DEVICES's syntax. Empty: as `host` says. UCX_NET_DEVICES overrides both.
  std::string data_interface;
  std::string join_token;              // must match the coordinator's
  std::string curve_server_key;        // the coordinator's CURVE public key, when it uses CURVE
  // What the stage runs on (stage/backend_factory.h): the backend, its threads or GPUs, the
  // K/V budget. `name` is set per assignment.
  StageOptions stage;
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds coordinator_liveness{3000};
  // On SIGTERM a worker with a stage waits this long for the coordinator to take it over.
  std::chrono::milliseconds drain_timeout{30000};
  // Micro-batches smaller than this go staged even where the direct GPU path is open
  // (CONVEYOR_DIRECT_MIN_BYTES; worker_impl.h says why 64 KiB).
  int64_t direct_min_bytes = Options{}.direct_min_bytes;
  // The data plane's polling after progress (CONVEYOR_DATA_IDLE_SPIN_US), microseconds.
  int64_t data_idle_spin_us = Options{}.data_idle_spin_us;
  bool data_shared_memory = Options{}.data_shared_memory;  // CONVEYOR_DATA_SHM
};

class Worker {
 public:
  static Expected<std::unique_ptr<Worker>> create(WorkerOptions options);
  ~Worker();

  // Runs until `stop` turns true (then hands its stage over first, see drain_timeout), a
  // `shutdown` arrives or the join is refused. Returns the process exit code (0: clean
  // shutdown; 3: rejected by the coordinator). A step whose failure leaves the backend unable
  // to run any other (StageBackend::health) ends the process at once with kExitBackendLost.
  int run(const std::atomic<bool>& stop);
  static constexpr int kExitBackendLost = 4;

  struct Impl;

 private:
  explicit Worker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor

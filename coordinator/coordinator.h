// The coordinator's core: membership (the control plane), the stage plan, and the engine
// that keeps every pipeline full (the data plane), in two parts along the data flow:
//
//   ClusterManager (cluster_manager.h): workers, control messages, planner, placement,
//     failover, drains. Publishes an immutable ClusterSnapshot after every change.
//   Engine (engine.h): requests, the scheduler, prefix cache, beam search, the data plane's
//     sends and results. Owns all per-pipeline runtime state; follows the latest snapshot.
//
//   snapshot -> plan (the scheduler's StepPlan) -> step (a micro-batch to stage 0) -> result
//
// Threads:
//  - control (the cluster manager's): the ZeroMQ ROUTER, which it alone touches (the other
//    threads' messages to workers are posted to it: transport/control_plane.h). Admits workers
//    that present the join token, assigns stages (idle workers beyond the plan are spares),
//    tracks load progress, readiness and heartbeats; a worker silent for the liveness window
//    is dead.
//  - engine: continuous batching. Each micro-batch mixes decode steps (one token per
//    sequence) and prefill chunks (at most prefill_chunk tokens of a prompt), up to
//    max_batch_tokens; up to in_flight micro-batches per pipeline travel the ring at once, the
//    live sequences spread across them so every stage has work. Results from the last stage
//    come back on the coordinator's own UCX channel. It wakes on events (a result, a submit,
//    a new snapshot) and on its timers, never on a fixed tick.
//  - callers (REST threads): submit(), health(), cluster(), drain(), plan(), quiesce().
// Each part has its own mutex and no thread holds both: a part calls the other only with its
// own released (the engine's asks name the epoch they saw; the manager reads the engine's
// stats before taking its mutex). Sinks are called with the engine's mutex held, so they must
// only hand work elsewhere (the REST layer posts to its own executor).
//
// Failure: when a pipeline loses a stage (dead worker, data-plane error) it gets a new
// epoch: a spare (or the returning worker) takes the stage, every stage of the pipeline
// drops its KV cache, batches of the old epoch are ignored, and each sequence is fed again
// from its first token (prompt + tokens generated so far) — sampling is keyed by step, so
// the continuation is the same. Clients see a pause.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "coordinator/cluster_config.h"
#include "coordinator/completion.h"
#include "coordinator/metrics.h"
#include "coordinator/planner.h"
#include "model/tokenizer.h"

namespace conveyor {

class Coordinator final : public CompletionBackend {
 public:
  // Binds the control plane (ROUTER) and creates the data-plane channel; starts the threads.
  static Expected<std::unique_ptr<Coordinator>> start(ClusterConfig config, std::shared_ptr<const Tokenizer> tokenizer,
                                                      Metrics* metrics);
  ~Coordinator() override;

  CoreStatus submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) override;
  void cancel(const CompletionRequest& request) override;

  int control_port() const;
  // /health: ready when some pipeline has every stage ready.
  std::pair<bool, nlohmann::json> health() const;
  // /v1/cluster: workers and pipelines.
  nlohmann::json cluster() const;
  // POST /v1/cluster/workers/{name}/drain: takes a worker out of service without failing
  // anything. A serving worker's stage goes to a spare and the pipeline replays its
  // sequences; the worker is then told to drop its stage and is no longer planned (a
  // re-registration makes it a spare again). With no spare the plan shrinks over the other
  // workers when their memory allows; otherwise Conflict and nothing changes. NotFound for
  // an unknown or dead worker.
  AdminReply drain(const std::string& worker);
  // POST /v1/cluster/plan (stages, replicas and/or layers; the others keep their value): the
  // new target plan, applied at once under load (workers that keep their layers only
  // re-wire, running sequences are replayed). Invalid for an impossible plan, Conflict
  // (nothing changes) when the workers are too few or too small.
  AdminReply plan(const PlanRequest& request);
  // SIGTERM: takes no new requests (503, /health says "shutting down") and waits up to
  // `timeout` for the accepted ones to finish; returns how many are left.
  size_t quiesce(std::chrono::milliseconds timeout);
  // Stops the threads; accepted requests still running are failed with a message.
  void stop();

  struct Impl;

 private:
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor

// The engine: the coordinator's data flow. It owns every request and all per-pipeline runtime
// state (pipeline_run.h), the scheduler with its prefix caches and beam groups (scheduler.h),
// the data-plane traffic on the coordinator's channel and the batch trace; it knows of the
// cluster only the latest snapshot the cluster manager published (cluster_snapshot.h).
//
// Its loop, in one sentence: wait for an event (a result on the channel, a submitted request,
// a new snapshot, or the next timer), take the newest snapshot, take the result, admit what
// fits, send each pipeline's next step plans; then ask the cluster for what it must do.
//
//   snapshot -> plan (Scheduler::next_step) -> step (encode_step, send) -> result (on_result)
//
// Waking: the thread waits in the channel's recv(), which a result ends, and which submit()
// and post_snapshot() end through Channel::interrupt(). The wait is bounded by the next timer:
// the oldest micro-batch in flight's batch_timeout_ms, the queue's pipeline_wait_ms deadline,
// and a safety net (EngineOptions::max_wait); there is no fixed tick.
//
// Threads: the engine thread, and REST threads in submit()/quiesce()/stats(). One mutex (its
// own) guards the runtime; sinks are called with it held, so they must only hand work
// elsewhere. Calls to the cluster manager (ClusterAsk) are made with it released.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "coordinator/batch_trace.h"
#include "coordinator/between_parts.h"
#include "coordinator/cluster_config.h"
#include "coordinator/cluster_snapshot.h"
#include "coordinator/completion.h"
#include "coordinator/metrics.h"
#include "coordinator/pipeline_run.h"
#include "coordinator/scheduler.h"
#include "model/tokenizer.h"
#include "transport/channel.h"

namespace conveyor {

class ClusterManager;

struct EngineOptions {
  // The longest wait with no timer due: a safety net, not a tick (events wake the engine).
  std::chrono::milliseconds max_wait{1000};
};

class Engine {
 public:
  // `channel` (the coordinator's data plane) and `metrics` (may be null) must outlive it.
  Engine(ClusterConfig cfg, std::shared_ptr<const Tokenizer> tokenizer, Metrics* metrics, transport::Channel& channel,
         EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Where its asks go (before start()); without one they are logged and dropped (tests).
  void connect_cluster(ClusterManager* cluster) { cluster_ = cluster; }
  void start();  // the engine thread
  void stop();   // joins it; requests stay (fail_all)

  // Any thread, holding no lock of the cluster manager's: the newest snapshot (older versions
  // are ignored); wakes the engine.
  void post_snapshot(SnapshotPtr snapshot);

  // See Coordinator::submit. Wakes the engine. A refusal has its line in the request log.
  CoreStatus submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink);
  // The client of `request` went away (CompletionBackend::cancel): it ends as cancelled
  // (conveyor_requests_cancelled_total), and the engine wakes to send its frees at once.
  void cancel(const CompletionRequest& request);
  // Takes no new requests; waits up to `timeout` for the accepted ones; returns how many are left.
  size_t quiesce(std::chrono::milliseconds timeout);
  bool accepting() const;
  EngineStats stats() const;
  // Fails every accepted request with `why` (after stop()).
  void fail_all(const std::string& why);

 private:
  void loop();
  // Each under mu_.
  void apply_snapshot();
  void restart(PipelineRun& run, uint32_t epoch);
  void track_progress(PipelineRun& run);
  void take_result(const transport::Message& message, std::chrono::steady_clock::time_point arrived,
                   std::vector<ClusterAsk>& asks);
  void launch(PipelineRun& run, std::vector<ClusterAsk>& asks);
  void replay_lost_batches(std::vector<ClusterAsk>& asks);
  void halt(PipelineRun& run, ClusterAsk::Kind kind, std::string why, std::vector<ClusterAsk>& asks);
  std::chrono::milliseconds time_to_next_timer() const;
  CoreStatus admit_submission(const std::shared_ptr<const CompletionRequest>& request, CompletionSink sink);
  SnapshotPtr latest() const;
  void ask_cluster(const ClusterAsk& ask);  // without mu_

  const ClusterConfig cfg_;
  Metrics* const metrics_;
  transport::Channel& channel_;
  const EngineOptions options_;
  ClusterManager* cluster_ = nullptr;

  mutable std::mutex mu_;  // the runtime: everything below but latest_
  std::vector<PipelineRun> runs_;
  std::unique_ptr<Scheduler> scheduler_;  // over runs_
  std::unique_ptr<BatchTrace> trace_;     // CONVEYOR_TRACE_DIR
  SnapshotPtr applied_;                   // the snapshot runs_ follow
  bool accepting_ = true;

  mutable std::mutex snapshot_mu_;  // latest_ alone (taken after mu_, never before)
  SnapshotPtr latest_;

  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace conveyor

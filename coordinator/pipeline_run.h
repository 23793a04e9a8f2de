// A pipeline replica as the engine runs it: the engine's own account of its work (micro-
// batches in flight, sequences to free, K/V tokens reserved, the batch limits) beside a copy
// of what the latest cluster snapshot said of it (`view`). Plain data, owned by the engine
// (engine.h) and changed by it and its scheduler under the engine's mutex; the cluster
// manager never sees it (it reads the engine's stats instead).
//
// Epochs: the runtime belongs to one epoch of the pipeline (view.epoch). A snapshot with
// another epoch voids it: the batches in flight are forgotten (their results are ignored),
// the pending frees dropped (the stages drop their whole caches), and every sequence is fed
// again from its first token.
#pragma once

#include <chrono>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "coordinator/cluster_snapshot.h"

namespace conveyor {

struct InFlightBatch {
  uint32_t epoch = 0;
  std::vector<uint64_t> seq_ids;
  std::chrono::steady_clock::time_point sent;
};

// What one micro-batch of a pipeline may hold, and how many sequences may run on it: the
// cluster file's scheduler section with its automatic values resolved from what the
// pipeline's workers say of their steps (Scheduler's batch_limits). Zero until then.
struct BatchLimits {
  int64_t max_sequences = 0;   // slices per micro-batch
  int64_t max_rows = 0;        // rows per micro-batch: decode rows + prompt rows
  int64_t prefill_chunk = 0;   // prompt rows of one sequence per micro-batch
  int64_t prefill_tokens = 0;  // prompt rows of all sequences together per micro-batch
  int64_t max_running = 0;     // sequences admitted onto the pipeline (the admission limit)
  bool operator==(const BatchLimits&) const = default;
};

// Why the head of the queue is not admitted (GET /v1/cluster, conveyor_queue_waiting_requests).
enum class QueueWait { None, NoPipeline, KvCache, RunningLimit };
const char* queue_wait_name(QueueWait w);

struct PipelineRun {
  int index = 0;
  uint32_t epoch = 1;   // the epoch this runtime belongs to (view.epoch once applied)
  PipelineView view;    // the latest snapshot's word on it
  // The engine asked the cluster to act on this epoch (a replay, a dead first stage): nothing
  // more is launched on it until a snapshot brings a newer one.
  bool halted = false;

  int in_flight = 0;                     // micro-batches on the ring
  std::unordered_map<uint64_t, InFlightBatch> batches;  // by batch id
  std::vector<uint64_t> pending_frees;   // sequences whose K/V the next micro-batch frees
  int64_t kv_reserved = 0;               // tokens its admitted requests may grow to
  int64_t admitted = 0;                  // requests given to it, for the balance between replicas
  BatchLimits limits;                    // from view.figures, set when a snapshot is applied
  StageFigures figures;                  // view.figures (the scheduler's K/V granule)
  // The trace and the turn-around gauge: when a result of it last arrived and no micro-batch
  // has been sent since.
  std::chrono::steady_clock::time_point result_at{};
  bool result_pending_send = false;
  // When it last made progress: a result of its epoch taken, or work admitted while it had
  // none (`working` false). A replay is not progress. Work and no progress for
  // batch_timeout_ms: /health says degraded (Engine::stats, EngineStats::Run::stalled_ms).
  std::chrono::steady_clock::time_point progress_at = std::chrono::steady_clock::now();
  bool working = false;  // sequences admitted on it or micro-batches in flight, at the last look
};

}  // namespace conveyor

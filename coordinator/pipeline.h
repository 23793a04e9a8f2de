// A pipeline replica as the coordinator runs it: which worker serves each stage in the
// current epoch, the coordinator's data-plane endpoints to its ends, and the scheduler's
// account of it (micro-batches in flight, K/V tokens reserved). Plain data: the coordinator
// changes the membership side, the scheduler (scheduler.h) the work side, both under the
// coordinator's mutex.
//
// Epochs: a pipeline that loses a stage, is re-wired or re-planned starts a new epoch;
// results of an older epoch are ignored and its sequences are fed again from their first
// token. Epochs grow over all pipelines together and start above any a worker holds from an
// earlier coordinator (Coordinator::Impl::next_epoch): a worker fences stale micro-batches by
// epoch alone, so its new assignment's epoch must be one no earlier micro-batch carries.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/channel.h"

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
  int64_t max_tokens = 0;      // rows per micro-batch: decode rows + prompt rows
  int64_t prefill_chunk = 0;   // prompt rows of one sequence per micro-batch
  int64_t prefill_tokens = 0;  // prompt rows of all sequences together per micro-batch
  int64_t max_running = 0;     // sequences admitted onto the pipeline (the admission limit)
  bool operator==(const BatchLimits&) const = default;
};

// What a pipeline's workers say of their steps (their register's StageCapabilities), taken
// together: the hard limits are the smallest stage's, the batching figures the largest any
// stage asks for (a pipeline with one GPU stage batches like a GPU, and its depth hides the
// rest), the K/V granule one that is whole pages on every stage.
struct StageFigures {
  int64_t max_rows = 0;      // rows a step may carry (0: no stage limits them)
  int64_t sequences = 0;     // sequences a step should carry
  int64_t prompt_rows = 0;   // prompt rows a step should carry, per stage
  int extra_in_flight = 0;   // micro-batches beyond one per stage (the smallest any stage asks)
  int64_t kv_page_tokens = 1;  // the least common multiple of the stages' K/V pages
  std::string backends;      // "cpu", "cuda", "cpu+cuda": shown in /v1/cluster
  bool operator==(const StageFigures&) const = default;
};

// Why the head of the queue is not admitted (GET /v1/cluster, conveyor_queue_waiting_requests).
enum class QueueWait { None, NoPipeline, KvCache, RunningLimit };
const char* queue_wait_name(QueueWait w);

struct Pipeline {
  int index = 0;
  uint32_t epoch = 1;
  std::vector<std::string> workers;  // per stage; "" = unfilled
  transport::PeerId first_peer = transport::kNoPeer, last_peer = transport::kNoPeer;
  std::vector<std::byte> first_address, last_address;  // whom first_peer / last_peer reach
  bool wired = false;
  std::string down_reason;  // why it is not serving, for /health

  // The scheduler's side.
  int in_flight = 0;                     // micro-batches on the ring
  std::unordered_map<uint64_t, InFlightBatch> batches;  // by batch id
  std::vector<uint64_t> pending_frees;   // sequences whose K/V the next micro-batch frees
  int64_t kv_reserved = 0;               // tokens its admitted requests may grow to
  int64_t admitted = 0;                  // requests given to it, for the balance between replicas
  BatchLimits limits;                    // set by the coordinator before each admit / launch
  StageFigures figures;                  // its workers' figures: set with limits
  // The trace and the turn-around gauge: when a result of it last arrived and no micro-batch
  // has been sent since.
  std::chrono::steady_clock::time_point result_at{};
  bool result_pending_send = false;

  bool filled() const {
    for (const std::string& w : workers)
      if (w.empty()) return false;
    return true;
  }
};

}  // namespace conveyor

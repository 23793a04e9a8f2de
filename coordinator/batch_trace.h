// BatchTrace: the coordinator's opt-in record of its pipelines' micro-batches, the twin of the
// workers' step trace (stage_worker/step_trace.h). CONVEYOR_TRACE_DIR=DIR makes it append to
// DIR/coordinator.jsonl one JSON line per micro-batch sent and per result taken in:
//
//   {"ev":"send", "t", "pipeline", "batch", "seqs", "decode_rows", "prefill_rows", "frees",
//    "admissions" (sequences whose request state it brings the last stage), "header_bytes",
//    "in_flight" (after this one), "depth", "gap" (ms from the result that freed the slot to
//    this send; absent when no result preceded it), "form" (ms forming, encoding, sending it),
//    "running" (sequences on the pipeline), "queue" (requests waiting), "queue_wait" (why),
//    "max_running" (the admission limit), "max_sequences", "max_rows", "prefill_tokens",
//    "kv_reserved", "kv_capacity" (tokens: reserved by admitted requests, the budget)}
//   {"ev":"result", "t", "pipeline", "batch", "seqs", "rtt" (ms since it was sent),
//    "deliver" (ms turning its tokens into text and updates, after the next micro-batch
//    it allowed was sent), "error" (when it failed)}
//
// "t" is the steady clock in seconds (CLOCK_MONOTONIC, as the workers' lines). The lines are
// made here, from the step plan and the facts the engine measured around it (SentStep), and
// from the result (TakenResult): the engine's loop only hands them over.
#pragma once

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "common/status.h"
#include "coordinator/pipeline_run.h"
#include "coordinator/step_plan.h"
#include "protocol/batch_result.h"

namespace conveyor {

class BatchTrace {
 public:
  // DIR/coordinator.jsonl under $CONVEYOR_TRACE_DIR; null when that is unset or empty.
  static Expected<std::unique_ptr<BatchTrace>> from_environment();
  explicit BatchTrace(std::FILE* file) : file_(file) {}
  ~BatchTrace();
  BatchTrace(const BatchTrace&) = delete;
  BatchTrace& operator=(const BatchTrace&) = delete;

  // What the engine knew when it sent a plan: the figures of the "send" line beside the plan's.
  struct SentStep {
    size_t header_bytes = 0;
    int in_flight = 0;  // after this one
    int depth = 0;
    double form_ms = 0;
    std::optional<double> gap_ms;
    int64_t running = 0;
    size_t queue = 0;
    QueueWait queue_wait = QueueWait::None;
    BatchLimits limits;
    int64_t kv_reserved = 0, kv_capacity = 0;
  };
  void sent(const StepPlan& plan, const SentStep& facts);
  // A result of a batch sent at `sent_at`, arrived at `arrived`; `deliver_ms` turning it into updates.
  void result(const BatchResult& result, std::chrono::steady_clock::time_point arrived,
              std::chrono::steady_clock::time_point sent_at, double deliver_ms);

  // One line (a JSON object's text without the braces' newline), flushed.
  void write(const std::string& json_object);

 private:
  std::FILE* file_;
};

}  // namespace conveyor

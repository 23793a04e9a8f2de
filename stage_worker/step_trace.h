// StepTrace: the worker's opt-in record of every micro-batch it runs, one JSON line per step,
// for finding where a serving step's time goes (docs/PERFORMANCE.md, "Serving path trace").
//
// On when the environment names a folder: CONVEYOR_TRACE_DIR=DIR makes each worker append to
// DIR/worker-NAME.jsonl (the coordinator writes DIR/coordinator.jsonl, coordinator/batch_trace.h:
// the same steps as the scheduler sees them). conveyor-bench-cluster --trace sets it and prints a summary.
//
// A line (times in milliseconds unless named otherwise; "t" is the worker's steady clock in
// seconds, CLOCK_MONOTONIC, so lines of processes on one machine can be compared):
//   t            when the step's compute began
//   stage, batch, epoch
//   seqs, decode_rows, prefill_rows, frees   what the micro-batch held: slices, rows of slices
//                that continue a generated sequence (one each), prompt rows, sequences freed
//   compute      the stage's own work on it (StageExecutor::run), less any wait for a send slot
//   wait_input   from the end of the previous step until this input arrived, when it had not
//                arrived by then (the stage had nothing to do)
//   idle_ready   from the end of the previous step (or the input's arrival, when later) until
//                this step's compute began: time the stage sat with its next input waiting
//                (its own bookkeeping: the previous result's send, decoding the header)
//   slot_wait    waiting for a free send slot (the next stage, or the coordinator, is behind)
//   send         the handoff thread's send time since this step began (the previous step's
//                activations, or a last stage's result queued because its next input was
//                already waiting), plus a result this thread sent itself (a last stage with
//                no input waiting, or an error)
//   sample       the last stage: choosing tokens on the host (0 when the backend chose them
//                in its step, which compute then includes)
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "common/status.h"

namespace conveyor {

struct StepRecord {
  double t = 0;  // seconds, steady clock
  int stage = 0;
  uint64_t batch = 0;
  uint32_t epoch = 0;
  int64_t seqs = 0, decode_rows = 0, prefill_rows = 0, frees = 0;
  double compute_ms = 0, wait_input_ms = 0, idle_ready_ms = 0, slot_wait_ms = 0, send_ms = 0, sample_ms = 0;
};

class StepTrace {
 public:
  // The trace of `name` under $CONVEYOR_TRACE_DIR, or null when that is unset or empty. A
  // folder that cannot be written is an error (the worker says so and runs untraced).
  static Expected<std::unique_ptr<StepTrace>> from_environment(const std::string& name);
  explicit StepTrace(std::FILE* file) : file_(file) {}
  ~StepTrace();
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  // One line, flushed: a reader may look while the worker runs.
  void write(const StepRecord& r);

 private:
  std::FILE* file_;
};

}  // namespace conveyor

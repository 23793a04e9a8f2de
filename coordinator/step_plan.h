// StepPlan: what the scheduler decides for one step of a pipeline, as plain data (vLLM's
// SchedulerOutput): the sequences it steps and how far, their tokens, the K/V forks and frees,
// the request states the pipeline's last stage does not hold yet, and the record the engine
// keeps while the step is in flight. The engine turns it into the wire's micro-batch in one
// place (to_microbatch / encode_step) and sends it; the batch trace describes it.
#pragma once

#include <cstdint>
#include <vector>

#include "coordinator/pipeline_run.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"

namespace conveyor {

struct StepPlan {
  uint64_t batch_id = 0;
  int pipeline = 0;
  uint32_t epoch = 0;
  std::vector<SeqStep> steps;        // per sequence: its slice and the step's flags
  std::vector<int32_t> token_ids;    // every step's tokens, concatenated in step order
  std::vector<SeqFork> forks;        // applied before the frees (new cache entries first)
  std::vector<uint64_t> frees;       // sequences whose K/V goes
  std::vector<Admission> admissions; // states the last stage does not hold in this epoch
  InFlightBatch record;              // kept by the engine until the result comes back

  int64_t decode_rows() const;
  int64_t prefill_rows() const;
};

// The plan as the stages read it (protocol/microbatch.h), and its bytes.
MicroBatch to_microbatch(const StepPlan& plan);
std::vector<uint8_t> encode_step(const StepPlan& plan);

}  // namespace conveyor

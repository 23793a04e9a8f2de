#include "coordinator/step_plan.h"

namespace conveyor {

int64_t StepPlan::decode_rows() const {
  int64_t n = 0;
  for (const SeqStep& s : steps) n += s.prefill ? 0 : s.slice.num_tokens;
  return n;
}

int64_t StepPlan::prefill_rows() const {
  int64_t n = 0;
  for (const SeqStep& s : steps) n += s.prefill ? s.slice.num_tokens : 0;
  return n;
}

MicroBatch to_microbatch(const StepPlan& plan) {
  MicroBatch b;
  b.batch_id = plan.batch_id;
  b.pipeline = uint32_t(plan.pipeline);
  b.epoch = plan.epoch;
  b.seqs = plan.steps;
  b.token_ids = plan.token_ids;
  b.forks = plan.forks;
  b.free_seq_ids = plan.frees;
  b.admissions = encode_admissions(plan.admissions);
  return b;
}

std::vector<uint8_t> encode_step(const StepPlan& plan) { return encode(to_microbatch(plan)); }

}  // namespace conveyor

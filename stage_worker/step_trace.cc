#include "stage_worker/step_trace.h"

#include "common/trace_file.h"

namespace conveyor {

Expected<std::unique_ptr<StepTrace>> StepTrace::from_environment(const std::string& name) {
  const std::string dir = trace_dir_from_environment();
  if (dir.empty()) return std::unique_ptr<StepTrace>();
  auto f = open_trace_file(dir, "worker-" + name + ".jsonl");
  if (!f) return f.status();
  return std::make_unique<StepTrace>(*f);
}

StepTrace::~StepTrace() { std::fclose(file_); }

void StepTrace::write(const StepRecord& r) {
  std::fprintf(file_,
               "{\"t\":%.6f,\"stage\":%d,\"batch\":%llu,\"epoch\":%u,\"seqs\":%lld,\"decode_rows\":%lld,"
               "\"prefill_rows\":%lld,\"frees\":%lld,\"compute\":%.4f,\"wait_input\":%.4f,\"idle_ready\":%.4f,"
               "\"slot_wait\":%.4f,\"send\":%.4f,\"sample\":%.4f}\n",
               r.t, r.stage, (unsigned long long)r.batch, r.epoch, (long long)r.seqs, (long long)r.decode_rows,
               (long long)r.prefill_rows, (long long)r.frees, r.compute_ms, r.wait_input_ms, r.idle_ready_ms,
               r.slot_wait_ms, r.send_ms, r.sample_ms);
  std::fflush(file_);
}

}  // namespace conveyor

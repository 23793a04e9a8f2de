#include "coordinator/batch_trace.h"

#include <nlohmann/json.hpp>

#include "common/trace_file.h"

namespace conveyor {

Expected<std::unique_ptr<BatchTrace>> BatchTrace::from_environment() {
  const std::string dir = trace_dir_from_environment();
  if (dir.empty()) return std::unique_ptr<BatchTrace>();
  auto f = open_trace_file(dir, "coordinator.jsonl");
  if (!f) return f.status();
  return std::make_unique<BatchTrace>(*f);
}

BatchTrace::~BatchTrace() { std::fclose(file_); }

namespace {
double seconds_of(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
}  // namespace

void BatchTrace::sent(const StepPlan& plan, const SentStep& f) {
  nlohmann::json line = {{"ev", "send"}, {"t", seconds_of(std::chrono::steady_clock::now())},
                         {"pipeline", plan.pipeline}, {"batch", plan.batch_id}, {"seqs", plan.steps.size()},
                         {"decode_rows", plan.decode_rows()}, {"prefill_rows", plan.prefill_rows()},
                         {"frees", plan.frees.size()}, {"admissions", plan.admissions.size()},
                         {"header_bytes", f.header_bytes}, {"in_flight", f.in_flight}, {"depth", f.depth},
                         {"form", f.form_ms}, {"running", f.running}, {"queue", f.queue},
                         {"queue_wait", queue_wait_name(f.queue_wait)}, {"max_running", f.limits.max_running},
                         {"max_sequences", f.limits.max_sequences}, {"max_rows", f.limits.max_rows},
                         {"prefill_tokens", f.limits.prefill_tokens}, {"kv_reserved", f.kv_reserved},
                         {"kv_capacity", f.kv_capacity}};
  if (f.gap_ms) line["gap"] = *f.gap_ms;
  write(line.dump());
}

void BatchTrace::result(const BatchResult& r, std::chrono::steady_clock::time_point arrived,
                        std::chrono::steady_clock::time_point sent_at, double deliver_ms) {
  nlohmann::json line = {{"ev", "result"}, {"t", seconds_of(arrived)}, {"pipeline", r.pipeline},
                         {"batch", r.batch_id}, {"seqs", r.seqs.size()},
                         {"rtt", std::chrono::duration<double, std::milli>(arrived - sent_at).count()},
                         {"deliver", deliver_ms}};
  if (!r.error.empty()) line["error"] = r.error;
  write(line.dump());
}

void BatchTrace::write(const std::string& json_object) {
  std::fputs(json_object.c_str(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
}

}  // namespace conveyor

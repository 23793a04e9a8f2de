// The compute thread (Worker::Impl in worker_impl.h): takes micro-batches off the data plane
// one at a time, runs each on the stage and hands its activations to the next stage (or its
// BatchResult to the coordinator) through the handoff, timing each step for the trace and
// the heartbeat figures.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>

#include <spdlog/spdlog.h>

#include "stage_worker/worker_impl.h"

namespace conveyor {

using Clock = std::chrono::steady_clock;
using transport::AssignMsg;
using transport::PeerId;
using transport::WorkerState;

namespace {

int64_t nanoseconds(Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); }
double milliseconds(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

void Worker::Impl::compute_loop() {
  std::optional<Received> ready_at_end;  // what that look found
  Clock::time_point prev_end = Clock::now();
  while (!compute_stop) {
    const bool was_ready = ready_at_end.has_value();
    Received got = was_ready ? std::move(*ready_at_end) : channel->recv(std::chrono::milliseconds(100));
    ready_at_end.reset();
    const auto arrived = Clock::now();
    if (!got) {
      spdlog::warn("{}: data plane: {}", opt.name, got.error());
      report_data_error(got.error(), "");
      continue;
    }
    if (!got->has_value()) continue;
    transport::Message& msg = **got;
    spdlog::debug("{}: message of {} + {} bytes", opt.name, msg.header.size(), msg.payload.size());
    // Held until the batch has been handed on: a re-assignment waits for it.
    std::unique_lock run_lock(run_mu);
    run_step(msg, was_ready, arrived, prev_end, ready_at_end);
  }
}

void Worker::Impl::run_step(transport::Message& msg, bool was_ready, Clock::time_point arrived,
                            Clock::time_point& prev_end, std::optional<Received>& ready_at_end) {
  const std::optional<StepStage> st = ready_stage();
  if (!st) return;
  auto header = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg.header.data()), msg.header.size());
  auto batch = decode_microbatch(header);
  BatchResult result;
  if (!batch) {
    result.error = opt.name + ": " + batch.error();
    send_result(st->coord, result);
    return;
  }
  // A batch from before a re-plan or failover is fenced off; so is one of the epoch this stage
  // still runs while an assignment to a newer one is being applied (its neighbours may be gone).
  if (batch->epoch != st->a.epoch || st->a.epoch < st->assigned_epoch) {
    spdlog::info("{}: dropped a stale micro-batch (batch {}, epoch {}; this stage runs epoch {}{})", opt.name,
                 batch->batch_id, batch->epoch, st->a.epoch,
                 st->a.epoch < st->assigned_epoch ? ", re-assigned to " + std::to_string(st->assigned_epoch) : "");
    return;
  }
  result.batch_id = batch->batch_id, result.pipeline = batch->pipeline, result.epoch = batch->epoch;
  // The outgoing activations go into a free send slot, asked for once the layers have run
  // (on a GPU: been queued); waiting for the slot is not busy time.
  StepTiming timing = start_step(was_ready, arrived, prev_end);
  StepOutput out;
  const ActivationSink sink = activation_sink(direct_to(st->next), *st->ex, out);
  Status s = st->ex->run(*batch, msg.payload.view(), sink, st->a.next_address.empty() ? &result : nullptr);
  prev_end = Clock::now();
  timing.busy = prev_end - timing.start - out.waited;
  ready_at_end = peek_next_input();
  if (s && !st->a.next_address.empty() && out.slot < 0) s = Status::error("the stage handed on no activations");
  if (!s && out.slot >= 0) handoff->cancel(out.slot);
  if (!s && compute_stop) {  // its slot wait was cut short: the stage is stopping, its epoch over
    spdlog::info("{}: dropped micro-batch {} (epoch {}): the stage is stopping", opt.name, batch->batch_id,
                 batch->epoch);
    return;
  }
  busy_ns += nanoseconds(timing.busy);
  ++batches;
  publish_stats();
  StepRecord rec;
  if (trace) rec = step_record(st->a, *batch, *st->ex, timing, out);
  if (!s) {
    leave_if_backend_lost(*st->ex, s);
    result.error = opt.name + " (stage " + std::to_string(st->a.stage) + "): " + s.message();
    const auto s0 = Clock::now();
    send_result(st->coord, result);
    write_trace(rec, timing, Clock::now() - s0);
    return;
  }
  if (st->a.next_address.empty()) return finish_last_stage(*st, result, rec, timing, ready_at_end.has_value());
  hand_on(*st, std::move(msg.header), *batch, std::move(result), out);
  write_trace(rec, timing, {});
}

// A backend that can run no other step (a GPU's sticky fault; tensor-parallel ranks out of step)
// would fail every micro-batch sent here, and the coordinator would fail each request after its
// replays. Ending the process instead turns it into a dead worker, which the coordinator fails
// over (a spare takes the stage, or the plan shrinks) without losing a request. No clean-up:
// destructors would call into the broken CUDA context, or wait on ranks stuck in an all-reduce.
void Worker::Impl::leave_if_backend_lost(StageExecutor& ex, const Status& step) {
  const Status health = ex.backend().health();
  if (health) return;
  spdlog::critical("{}: the stage can no longer run ({}), after a step failed ({}); exiting with status {} so "
                   "that the coordinator fails its work over",
                   opt.name, health.message(), step.message(), Worker::kExitBackendLost);
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  std::_Exit(Worker::kExitBackendLost);
}

std::optional<Worker::Impl::StepStage> Worker::Impl::ready_stage() {
  std::lock_guard lk(stage_mu);
  if (!executor || state != WorkerState::Ready) {  // cannot happen while the compute thread runs
    spdlog::warn("{}: dropped a micro-batch: the stage is {}", opt.name, executor ? "not ready" : "not loaded");
    return std::nullopt;
  }
  return StepStage{.ex = executor, .a = *assignment, .next = next_peer, .coord = coord_peer, .assigned_epoch = assigned_epoch};
}

Worker::Impl::StepTiming Worker::Impl::start_step(bool was_ready, Clock::time_point arrived, Clock::time_point prev_end) {
  StepTiming t{.start = Clock::now()};
  t.wait_input = was_ready ? Clock::duration{} : std::max(Clock::duration{}, arrived - prev_end);
  t.idle_ready = t.start - (was_ready ? prev_end : std::max(prev_end, arrived));
  wait_input_ns += nanoseconds(t.wait_input);
  idle_ready_ns += nanoseconds(t.idle_ready);
  t.sent_ns_before = handoff->send_ns_total();
  return t;
}

bool Worker::Impl::direct_to(PeerId next) {
  const bool direct = direct_capable() && next != transport::kNoPeer && channel->peer_takes_device_memory(next);
  if (next != transport::kNoPeer && direct_to_next != direct) {
    direct_to_next = direct;
    spdlog::info("{}: activations to the next stage go {}", opt.name,
                 direct ? "direct, GPU to GPU (device memory through UCX), micro-batches of " +
                              std::to_string(direct_min_bytes()) + " bytes or more; staged below"
                        : (opt.stage.backend == Backend::Cuda ? "staged, through page-locked host memory"
                                                              : "staged, from host memory"));
  }
  return direct;
}

ActivationSink Worker::Impl::activation_sink(bool direct, StageExecutor& ex, StepOutput& out) {
  return [this, direct, &ex, &out](size_t bytes) -> Expected<std::span<std::byte>> {
    const auto w0 = Clock::now();
    auto got = direct && bytes >= direct_min_bytes()
                   ? handoff->acquire(bytes, [&](size_t n) { return device_slot(n); }, /*device=*/true)
                   : handoff->acquire(bytes, [&](size_t n) { return ex.backend().allocate_host(n); });
    out.waited += Clock::now() - w0;
    if (!got) return got.status();
    out.slot = *got;
    out.bytes = bytes;
    return handoff->slot(out.slot).first(bytes);
  };
}

std::optional<Worker::Impl::Received> Worker::Impl::peek_next_input() {
  if (compute_stop) return std::nullopt;
  Received got = channel->recv(std::chrono::milliseconds(0));
  if (got && !got->has_value()) return std::nullopt;  // nothing waiting
  return std::optional<Received>(std::move(got));
}

StepRecord Worker::Impl::step_record(const AssignMsg& a, const MicroBatch& batch, const StageExecutor& ex,
                                     const StepTiming& t, const StepOutput& out) const {
  StepRecord rec;
  rec.t = std::chrono::duration<double>(t.start.time_since_epoch()).count();
  rec.stage = a.stage, rec.batch = batch.batch_id, rec.epoch = batch.epoch;
  rec.seqs = int64_t(batch.seqs.size()), rec.frees = int64_t(batch.free_seq_ids.size());
  for (const SeqStep& w : batch.seqs) (w.prefill ? rec.prefill_rows : rec.decode_rows) += w.slice.num_tokens;
  rec.compute_ms = milliseconds(t.busy), rec.wait_input_ms = milliseconds(t.wait_input);
  rec.idle_ready_ms = milliseconds(t.idle_ready);
  rec.slot_wait_ms = milliseconds(out.waited), rec.sample_ms = ex.last_sample_seconds() * 1e3;
  return rec;
}

void Worker::Impl::write_trace(StepRecord& rec, const StepTiming& t, Clock::duration send) {
  if (!trace) return;
  // What the handoff thread spent sending since this step began (mostly the previous
  // step's activations, or on the last stage its result); a failed step's error result
  // is sent on this thread (`send`).
  rec.send_ms = milliseconds(send) + double(handoff->send_ns_total() - t.sent_ns_before) * 1e-6;
  trace->write(rec);
}

void Worker::Impl::finish_last_stage(const StepStage& st, BatchResult& result, StepRecord& rec, const StepTiming& t,
                                     bool next_waiting) {
  result.busy_seconds = std::chrono::duration<double>(t.busy).count();
  const auto s0 = Clock::now();
  if (next_waiting) {
    queue_result(st.coord, result, st.ex);
    if (trace) rec.slot_wait_ms += milliseconds(Clock::now() - s0);
    write_trace(rec, t, {});
  } else {
    if (!handoff->idle() && !handoff->drain()) return;  // results leave in order; cut short: stopping
    send_result(st.coord, result);
    write_trace(rec, t, Clock::now() - s0);
  }
}

void Worker::Impl::hand_on(const StepStage& st, std::vector<std::byte> header, const MicroBatch& batch,
                           BatchResult result, const StepOutput& out) {
  if (batch.activation_dtype != st.ex->activation_dtype())
    (void)patch_activation_dtype(header, st.ex->activation_dtype());  // it decoded: it is a header
  handoff->submit(out.slot, st.next, std::move(header), out.bytes,
                  [this, next = st.next, coord = st.coord, result = std::move(result)](const Status& sent) mutable {
                    {
                      std::lock_guard lk(stage_mu);
                      if (next_peer == next) next_address.clear();  // the next wiring connects afresh
                    }
                    report_data_error(sent.message(), "next", result.epoch);
                    if (superseded(result.epoch)) return log_superseded(result, sent);
                    result.error = opt.name + ": could not hand batch to the next stage: " + sent.message();
                    send_result(coord, result);
                  });
}

std::shared_ptr<std::byte[]> Worker::Impl::device_slot(size_t bytes) {
  auto* p = static_cast<std::byte*>(device.allocator.allocate(bytes));
  if (!p) return nullptr;
  return std::shared_ptr<std::byte[]>(p, [release = device.allocator.release](std::byte* q) { release(q); });
}

void Worker::Impl::queue_result(PeerId coord, const BatchResult& r, const std::shared_ptr<StageExecutor>& ex) {
  auto slot = handoff->acquire(0, [&](size_t n) { return ex->backend().allocate_host(n); });
  if (!slot) {  // no slot memory cannot happen for 0 bytes; send here all the same
    send_result(coord, r);
    return;
  }
  const std::vector<uint8_t> bytes = encode(r);
  std::vector<std::byte> header(reinterpret_cast<const std::byte*>(bytes.data()),
                                reinterpret_cast<const std::byte*>(bytes.data()) + bytes.size());
  handoff->submit(*slot, coord, std::move(header), 0, [this, epoch = r.epoch](const Status& sent) {
    report_data_error(sent.message(), "coordinator", epoch);
  });
}

void Worker::Impl::send_result(PeerId coord, const BatchResult& r) {
  const std::vector<uint8_t> bytes = encode(r);
  Status s = channel->send(coord, std::as_bytes(std::span(bytes)), {}, std::chrono::milliseconds(10000));
  if (!s) report_data_error(s.message(), "coordinator", r.epoch);
}

void Worker::Impl::log_superseded(const BatchResult& r, const Status& sent) {
  spdlog::info("{}: micro-batch {} of epoch {} not handed on ({}): the stage has been re-assigned since; no error "
               "result for it",
               opt.name, r.batch_id, r.epoch, sent.message());
}

}  // namespace conveyor

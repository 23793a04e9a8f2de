#include "coordinator/engine.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "coordinator/cluster_manager.h"
#include "coordinator/step_plan.h"
#include "protocol/batch_result.h"

namespace conveyor {

using Clock = std::chrono::steady_clock;

namespace {
constexpr auto kSendTimeout = std::chrono::milliseconds(10000);
// How long a pipeline with work may go without progress before /health says degraded, when
// scheduler.batch_timeout_ms is 0 (no lost-batch replays): the batch timeout's default.
constexpr int kStallMs = 30000;
}  // namespace

Engine::Engine(ClusterConfig cfg, std::shared_ptr<const Tokenizer> tokenizer, Metrics* metrics,
               transport::Channel& channel, EngineOptions options)
    : cfg_(std::move(cfg)), metrics_(metrics), channel_(channel), options_(options) {
  scheduler_ = std::make_unique<Scheduler>(cfg_, std::move(tokenizer), runs_);
  if (auto trace = BatchTrace::from_environment(); !trace)
    spdlog::warn("coordinator: no batch trace: {}", trace.error());
  else
    trace_ = std::move(trace).value();
}

Engine::~Engine() { stop(); }

void Engine::start() { thread_ = std::thread([this] { loop(); }); }

void Engine::stop() {
  stopping_ = true;
  channel_.interrupt();
  if (thread_.joinable()) thread_.join();
}

// Wait for an event, take the newest snapshot, take the result, admit, launch; then ask the
// cluster (with the engine's mutex released) for what it must do.
void Engine::loop() {
  std::chrono::milliseconds wait{0};
  while (!stopping_) {
    auto got = channel_.recv(wait);
    const auto arrived = Clock::now();
    std::vector<ClusterAsk> asks;
    {
      std::lock_guard lk(mu_);
      apply_snapshot();
      if (!got) {
        spdlog::warn("coordinator: data plane: {}", got.error());
        asks.push_back({ClusterAsk::Kind::CheckEndpoints, -1, 0, got.error()});
      } else if (got->has_value()) {
        take_result(**got, arrived, asks);
      }
      replay_lost_batches(asks);
      scheduler_->refuse_unserved(applied_ && applied_->serviceable);
      scheduler_->expire_requests();
      scheduler_->admit([](const PipelineRun& r) { return r.view.open && !r.halted; },
                        [](const PipelineRun& r) { return r.view.kv_capacity; });
      for (PipelineRun& r : runs_) {
        launch(r, asks);
        track_progress(r);
      }
      wait = time_to_next_timer();
    }
    for (const ClusterAsk& a : asks) ask_cluster(a);
  }
}

SnapshotPtr Engine::latest() const {
  std::lock_guard lk(snapshot_mu_);
  return latest_;
}

void Engine::post_snapshot(SnapshotPtr snapshot) {
  {
    std::lock_guard lk(snapshot_mu_);
    if (latest_ && latest_->version >= snapshot->version) return;
    latest_ = std::move(snapshot);
  }
  channel_.interrupt();
}

// A new plan generation (a re-plan) makes new runtimes and redistributes every running
// request; a pipeline whose epoch changed restarts (its work in flight is void, its sequences
// are fed again); every pipeline takes the snapshot's figures and limits.
void Engine::apply_snapshot() {
  SnapshotPtr next = latest();
  if (!next || next == applied_) return;
  const ClusterSnapshot& s = *next;
  const bool reshaped =
      !applied_ || s.plan_generation != applied_->plan_generation || s.pipelines.size() != runs_.size();
  if (reshaped) {
    std::vector<PipelineRun> fresh(s.pipelines.size());
    for (size_t i = 0; i < fresh.size(); ++i) {
      fresh[i].index = int(i);
      fresh[i].epoch = s.pipelines[i].epoch;
      if (i < runs_.size()) fresh[i].admitted = runs_[i].admitted;
    }
    runs_ = std::move(fresh);
  }
  for (size_t i = 0; i < runs_.size(); ++i) {
    PipelineRun& r = runs_[i];
    const PipelineView& v = s.pipelines[i];
    if (r.epoch != v.epoch) restart(r, v.epoch);
    r.view = v;
    r.figures = v.figures;
    r.limits = Scheduler::batch_limits(cfg_, v.figures, int(v.workers.size()), v.depth);
  }
  if (reshaped && applied_) scheduler_->redistribute();
  applied_ = std::move(next);
}

// The stall clock starts when a pipeline that had no work gets some (results restart it).
// Work: a request admitted on it (its K/V reservation, O(1) where counting its sequences
// would scan them all on every pass) or a micro-batch in flight.
void Engine::track_progress(PipelineRun& r) {
  const bool working = r.in_flight > 0 || r.kv_reserved > 0;
  if (working && !r.working) r.progress_at = Clock::now();
  r.working = working;
}

void Engine::restart(PipelineRun& r, uint32_t epoch) {
  r.epoch = epoch;
  r.halted = false;
  r.batches.clear();
  r.in_flight = 0;
  r.pending_frees.clear();  // every stage drops its whole cache on the new assignment
  scheduler_->restart(r.index);
}

void Engine::take_result(const transport::Message& m, Clock::time_point arrived, std::vector<ClusterAsk>& asks) {
  auto res = decode_batch_result(std::span(reinterpret_cast<const uint8_t*>(m.header.data()), m.header.size()));
  if (!res) {
    spdlog::error("coordinator: {}", res.error());
    return;
  }
  PipelineRun* run = res->pipeline < runs_.size() ? &runs_[res->pipeline] : nullptr;
  std::optional<Clock::time_point> sent_at;
  if (run && res->epoch == run->epoch)
    if (auto it = run->batches.find(res->batch_id); it != run->batches.end()) {
      sent_at = it->second.sent;
      run->result_at = arrived;
      run->progress_at = arrived;
      run->result_pending_send = true;
    }
  PipelineRun* replay = scheduler_->on_result(*res);
  if (const int64_t discarded = scheduler_->take_discarded_tokens(); discarded > 0 && metrics_)
    metrics_->add_discarded_tokens(uint64_t(discarded));
  // What the result made possible leaves before its tokens become text and updates, unless
  // the pipeline steps ahead: its stage has its next step already, and the text first lets a
  // stop string end its sequence before one more step ahead of it goes.
  const bool launch_now = !replay && sent_at;
  if (launch_now && !run->view.step_ahead) launch(*run, asks);
  const auto taken = Clock::now();
  scheduler_->deliver();
  if (launch_now && run->view.step_ahead) launch(*run, asks);
  if (trace_ && sent_at)
    trace_->result(*res, arrived, *sent_at, std::chrono::duration<double, std::milli>(Clock::now() - taken).count());
  if (replay) halt(*replay, ClusterAsk::Kind::Replay, "replaying after: " + res->error, asks);
}

// Sends `r`'s next step plans while it has room in flight: its depth, and one more for steps
// ahead (Scheduler::next_step).
void Engine::launch(PipelineRun& r, std::vector<ClusterAsk>& asks) {
  const int depth = r.view.depth;
  const int room = depth + (r.view.step_ahead ? 1 : 0);
  while (r.in_flight < room && r.view.ready && !r.halted) {
    const auto t0 = Clock::now();
    std::optional<StepPlan> plan = scheduler_->next_step(r, depth);
    if (!plan) return;
    const std::vector<uint8_t> header = encode_step(*plan);
    Status sent = channel_.send(r.view.first_peer, std::as_bytes(std::span(header)), {}, kSendTimeout);
    if (!sent) {
      spdlog::warn("coordinator: cannot send to pipeline {} stage 0: {}", r.index, sent.message());
      halt(r, ClusterAsk::Kind::StageUnreachable, "data plane: " + sent.message(), asks);
      return;
    }
    const auto t1 = Clock::now();
    // The turn-around: from the result that freed this slot to the next micro-batch out.
    std::optional<double> gap_ms;
    if (r.result_pending_send) {
      gap_ms = std::chrono::duration<double, std::milli>(t1 - r.result_at).count();
      r.result_pending_send = false;
      if (metrics_) metrics_->observe_coordinator_gap(*gap_ms * 1e-3);
    }
    if (trace_)
      trace_->sent(*plan, {.header_bytes = header.size(), .in_flight = r.in_flight + 1, .depth = room,
                           .form_ms = std::chrono::duration<double, std::milli>(t1 - t0).count(), .gap_ms = gap_ms,
                           .running = scheduler_->running_on(r.index), .queue = scheduler_->queue_size(),
                           .queue_wait = scheduler_->queue_wait(), .limits = r.limits, .kv_reserved = r.kv_reserved,
                           .kv_capacity = r.view.kv_capacity});
    Scheduler::sent(r, std::move(*plan));
  }
}

// A micro-batch that never comes back (no result, no error) would leave its sequences in
// flight for good: past scheduler.batch_timeout_ms its pipeline replays in a new epoch, the
// way a stage's error makes it.
void Engine::replay_lost_batches(std::vector<ClusterAsk>& asks) {
  if (cfg_.batch_timeout_ms <= 0) return;
  const auto now = Clock::now();
  for (PipelineRun& r : runs_) {
    if (r.halted) continue;
    auto lost = std::find_if(r.batches.begin(), r.batches.end(), [&](const auto& e) {
      return now - e.second.sent >= std::chrono::milliseconds(cfg_.batch_timeout_ms);
    });
    if (lost == r.batches.end()) continue;
    const uint64_t id = lost->first;
    spdlog::warn("coordinator: pipeline {}: micro-batch {} has not come back {} ms after it was sent; replaying the "
                 "pipeline",
                 r.index, id, cfg_.batch_timeout_ms);
    if (metrics_) metrics_->count_batch_timeout_replay();
    halt(r, ClusterAsk::Kind::LostBatch, "replaying after micro-batch " + std::to_string(id) + " was lost", asks);
  }
}

void Engine::halt(PipelineRun& r, ClusterAsk::Kind kind, std::string why, std::vector<ClusterAsk>& asks) {
  r.halted = true;
  asks.push_back({kind, r.index, r.epoch, std::move(why)});
}

// Until the next timer: the oldest micro-batch in flight's batch_timeout_ms, the queue's
// pipeline_wait_ms deadline, at most options_.max_wait.
std::chrono::milliseconds Engine::time_to_next_timer() const {
  const auto now = Clock::now();
  auto until = now + options_.max_wait;
  if (cfg_.batch_timeout_ms > 0)
    for (const PipelineRun& r : runs_) {
      if (r.halted) continue;
      for (const auto& [_, b] : r.batches) until = std::min(until, b.sent + std::chrono::milliseconds(cfg_.batch_timeout_ms));
    }
  if (auto due = scheduler_->refuse_deadline()) until = std::min(until, *due);
  if (auto due = scheduler_->expiry_deadline()) until = std::min(until, *due);
  return std::max(std::chrono::milliseconds(0), std::chrono::ceil<std::chrono::milliseconds>(until - now));
}

void Engine::ask_cluster(const ClusterAsk& ask) {
  if (cluster_) cluster_->on_engine_ask(ask);
  else spdlog::info("coordinator: engine: no cluster manager for an ask about pipeline {}: {}", ask.pipeline, ask.why);
}

// ---------------------------------------------------------------- calls from other threads

CoreStatus Engine::submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) {
  CoreStatus st = admit_submission(request, std::move(sink));
  if (!st.ok()) {
    log_refused(*request, st);
    return st;
  }
  channel_.interrupt();  // the engine admits it now, not at its next timer
  return {};
}

CoreStatus Engine::admit_submission(const std::shared_ptr<const CompletionRequest>& request, CompletionSink sink) {
  std::lock_guard lk(mu_);
  if (stopping_ || !accepting_)
    return CoreStatus::retry_later(CoreError::Unavailable, "the coordinator is shutting down",
                                   Scheduler::kRetryUnavailableSeconds);
  const SnapshotPtr s = latest();
  // With no pipeline able to serve, the request still queues: a worker may join within
  // scheduler.pipeline_wait_ms (the loop refuses it after that). A wait of 0 refuses now.
  if (cfg_.pipeline_wait_ms == 0 && (!s || !s->serviceable))
    return CoreStatus::retry_later(CoreError::Unavailable,
                                   "no pipeline can serve: " + (s ? s->health_reason : std::string("no plan yet")),
                                   Scheduler::kRetryUnavailableSeconds);
  // A request larger than the largest pipeline's K/V is refused now (400, with the numbers).
  int64_t kv_capacity = 0;
  if (s)
    for (const PipelineView& p : s->pipelines) kv_capacity = std::max(kv_capacity, p.kv_capacity);
  return scheduler_->submit(request, std::move(sink), kv_capacity);
}

void Engine::cancel(const CompletionRequest& request) {
  {
    std::lock_guard lk(mu_);
    if (!scheduler_->cancel(&request)) return;
  }
  if (metrics_) metrics_->count_cancelled();
  channel_.interrupt();  // its frees leave on the next micro-batch, sent now
}

size_t Engine::quiesce(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  accepting_ = false;
  scheduler_->wait_idle(lk, timeout);
  return scheduler_->outstanding();
}

bool Engine::accepting() const {
  std::lock_guard lk(mu_);
  return accepting_;
}

EngineStats Engine::stats() const {
  std::lock_guard lk(mu_);
  EngineStats st;
  st.accepting = accepting_;
  st.outstanding = scheduler_->outstanding();
  st.queue = scheduler_->queue_size();
  st.queue_wait = scheduler_->queue_wait();
  st.running_sequences = scheduler_->running_sequences();
  const Scheduler::PrefixStats ps = scheduler_->prefix_stats();
  st.prefix = {.lookups = ps.lookups, .hits = ps.hits, .reused_tokens = ps.reused_tokens,
               .computed_tokens = ps.computed_tokens, .entries = ps.entries, .cached_tokens = ps.cached_tokens};
  const auto now = Clock::now();
  const auto stall = std::chrono::milliseconds(cfg_.batch_timeout_ms > 0 ? cfg_.batch_timeout_ms : kStallMs);
  for (const PipelineRun& r : runs_) {
    const int64_t running = scheduler_->running_on(r.index);
    const bool working = r.view.ready && r.working;  // halted too: no progress
    st.pipelines.push_back({.index = r.index, .epoch = r.epoch, .busy = scheduler_->busy(r.index),
                            .in_flight = r.in_flight, .kv_reserved = r.kv_reserved, .admitted = r.admitted,
                            .running = running, .limits = r.limits, .backends = r.figures.backends,
                            .stalled_ms = working && now - r.progress_at > stall
                                              ? std::chrono::duration_cast<std::chrono::milliseconds>(now - r.progress_at).count()
                                              : 0});
  }
  return st;
}

void Engine::fail_all(const std::string& why) {
  std::lock_guard lk(mu_);
  scheduler_->fail_all(why);
}

}  // namespace conveyor

#include "coordinator/coordinator.h"

#include <algorithm>
#include <limits>

#include <spdlog/spdlog.h>

#include "coordinator/coordinator_impl.h"
#include "transport/net_interface.h"

namespace conveyor {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {
constexpr auto kSendTimeout = std::chrono::milliseconds(10000);
}  // namespace

// ---------------------------------------------------------------- the state's questions

bool Coordinator::Impl::pipeline_ready(const Pipeline& p) const {
  if (!p.wired) return false;
  for (const std::string& w : p.workers) {
    auto it = workers.find(w);
    if (w.empty() || it == workers.end() || it->second.state != MemberState::Ready || it->second.epoch != p.epoch)
      return false;
  }
  return true;
}

int64_t Coordinator::Impl::pipeline_kv_capacity(const Pipeline& p) const {
  int64_t cap = std::numeric_limits<int64_t>::max();
  for (const std::string& w : p.workers) {
    auto it = workers.find(w);
    cap = std::min(cap, it == workers.end() ? 0 : it->second.kv_capacity_tokens);
  }
  return cap;
}

bool Coordinator::Impl::pipeline_recoverable(const Pipeline& p) const {
  int missing = 0;
  for (const std::string& w : p.workers)
    if (w.empty() || !workers.count(w) || !workers.at(w).alive()) ++missing;
  int spares = 0;
  for (const auto& [_, w] : workers) spares += w.state == MemberState::Spare;
  return missing <= spares;
}

bool Coordinator::Impl::serviceable() const {
  return std::any_of(pipelines.begin(), pipelines.end(),
                     [&](const Pipeline& p) { return pipeline_ready(p) || pipeline_recoverable(p); });
}

bool Coordinator::Impl::has_leaver(const Pipeline& p) const {
  return std::any_of(p.workers.begin(), p.workers.end(), [&](const std::string& n) {
    auto it = workers.find(n);
    return it != workers.end() && it->second.leaving;
  });
}

bool Coordinator::Impl::has_spare() const {
  return std::any_of(workers.begin(), workers.end(), [](const auto& e) { return e.second.state == MemberState::Spare; });
}

StageFigures Coordinator::Impl::pipeline_figures(const Pipeline& p) const {
  std::vector<const WorkerInfo*> stages;
  for (const std::string& name : p.workers) {
    auto it = workers.find(name);
    stages.push_back(it == workers.end() ? nullptr : &it->second);
  }
  return Scheduler::figures_of(stages);
}

int Coordinator::Impl::in_flight_depth(const Pipeline& p) const {
  // Auto: a micro-batch per stage, and on a pipeline of several stages the extra its workers
  // ask for (a CPU stage's step costs less a row at fewer rows, so it gains from finding its
  // next input waiting; a single stage gains nothing: its input waits on its own result).
  if (!cfg.in_flight_auto) return std::max(1, cfg.in_flight);
  const int stages = std::max(1, int(p.workers.size()));
  return stages + (stages == 1 ? 0 : p.figures.extra_in_flight);
}

bool Coordinator::Impl::whole() const {
  return std::all_of(pipelines.begin(), pipelines.end(), [](const Pipeline& p) { return p.filled(); });
}

std::string Coordinator::Impl::health_reason() const {
  std::string why;
  for (const Pipeline& p : pipelines)
    why += (why.empty() ? "" : "; ") + ("pipeline " + std::to_string(p.index) + ": " +
                                        (p.down_reason.empty() ? "waiting for workers" : p.down_reason));
  return why;
}

// ---------------------------------------------------------------- the loops

void Coordinator::Impl::control_loop() {
  while (!stopping) {
    auto m = control->recv(std::chrono::milliseconds(20));
    std::lock_guard lk(mu);
    if (!m) spdlog::warn("coordinator: control plane: {}", m.error());
    else if (m->has_value()) handle_control((*m)->peer, (*m)->message);
    check_liveness();
    release_leavers();
    reshape_if_pending();
    update_gauges();
  }
}

void Coordinator::Impl::update_gauges() {
  if (!metrics) return;
  metrics->set_queue_depth(int64_t(scheduler->queue_size()));
  metrics->set_queue_wait(queue_wait_name(scheduler->queue_wait()), int64_t(scheduler->queue_size()));
  metrics->set_running_sequences(scheduler->running_sequences());
  const Scheduler::PrefixStats ps = scheduler->prefix_stats();
  metrics->set_prefix_cache({.lookups = ps.lookups, .hits = ps.hits, .reused_tokens = ps.reused_tokens,
                             .computed_tokens = ps.computed_tokens, .entries = ps.entries,
                             .cached_tokens = ps.cached_tokens});
  metrics->clear_stage_gauges();
  for (const Pipeline& p : pipelines) {
    metrics->set_pipeline_admission(p.index, p.limits.max_running, scheduler->running_on(p.index), p.kv_reserved,
                                    pipeline_kv_capacity(p));
    for (size_t s = 0; s < p.workers.size(); ++s) {
      auto it = workers.find(p.workers[s]);
      if (it == workers.end()) continue;
      metrics->set_stage_busy_fraction(p.index, int(s), it->first, it->second.busy_fraction);
      metrics->set_stage_idle_ready_fraction(p.index, int(s), it->first, it->second.idle_ready_fraction);
      metrics->set_kv_cache_tokens(p.index, int(s), it->second.kv_used_tokens, it->second.kv_capacity_tokens);
    }
  }
}

// Forms and sends micro-batches for `p` while it has room in flight.
void Coordinator::Impl::launch(Pipeline& p) {
  const int depth = in_flight_depth(p);
  while (p.in_flight < depth && pipeline_ready(p)) {
    const auto t0 = Clock::now();
    auto formed = scheduler->next_batch(p, depth);
    if (!formed) return;
    const std::vector<uint8_t> header = encode(formed->batch);
    Status sent = channel->send(p.first_peer, std::as_bytes(std::span(header)), {}, kSendTimeout);
    if (!sent) {
      const std::string first = p.workers.front();
      spdlog::warn("coordinator: cannot send to pipeline {} stage 0: {}", p.index, sent.message());
      if (workers.count(first)) mark_dead(workers.at(first), "data plane: " + sent.message());
      return;
    }
    const auto t1 = Clock::now();
    // The turn-around: from the result that freed this slot to the next micro-batch out.
    std::optional<double> gap_ms;
    if (p.result_pending_send) {
      gap_ms = std::chrono::duration<double, std::milli>(t1 - p.result_at).count();
      p.result_pending_send = false;
      if (metrics) metrics->observe_coordinator_gap(*gap_ms * 1e-3);
    }
    if (trace) trace_sent(p, *formed, header.size(), std::chrono::duration<double, std::milli>(t1 - t0).count(), gap_ms);
    Scheduler::sent(p, std::move(*formed));
  }
}

void Coordinator::Impl::trace_sent(const Pipeline& p, const Scheduler::Formed& formed, size_t header_bytes,
                                   double form_ms, std::optional<double> gap_ms) {
  const MicroBatch& b = formed.batch;
  int64_t decode = 0, prefill = 0;
  for (const SeqStep& w : b.seqs) (w.prefill ? prefill : decode) += w.slice.num_tokens;
  json line = {{"ev", "send"},
               {"t", std::chrono::duration<double>(Clock::now().time_since_epoch()).count()},
               {"pipeline", p.index}, {"batch", b.batch_id}, {"seqs", b.seqs.size()}, {"decode_rows", decode},
               {"prefill_rows", prefill}, {"frees", b.free_seq_ids.size()}, {"admissions", formed.admissions},
               {"header_bytes", header_bytes}, {"in_flight", p.in_flight + 1},
               {"depth", in_flight_depth(p)}, {"form", form_ms}, {"running", scheduler->running_on(p.index)},
               {"queue", scheduler->queue_size()}, {"queue_wait", queue_wait_name(scheduler->queue_wait())},
               {"max_running", p.limits.max_running}, {"max_sequences", p.limits.max_sequences},
               {"max_tokens", p.limits.max_tokens}, {"prefill_tokens", p.limits.prefill_tokens},
               {"kv_reserved", p.kv_reserved}, {"kv_capacity", pipeline_kv_capacity(p)}};
  if (gap_ms) line["gap"] = *gap_ms;
  trace->write(line.dump());
}

// A micro-batch that never comes back (no result, no error) would leave its sequences in
// flight for good: past scheduler.batch_timeout_ms its pipeline replays in a new epoch, the
// way a stage's error makes it.
void Coordinator::Impl::replay_lost_batches() {
  if (cfg.batch_timeout_ms <= 0) return;
  const auto now = Clock::now();
  for (Pipeline& p : pipelines) {
    auto lost = std::find_if(p.batches.begin(), p.batches.end(), [&](const auto& e) {
      return now - e.second.sent >= std::chrono::milliseconds(cfg.batch_timeout_ms);
    });
    if (lost == p.batches.end()) continue;
    const uint64_t id = lost->first;
    spdlog::warn("coordinator: pipeline {}: micro-batch {} has not come back {} ms after it was sent; replaying the "
                 "pipeline",
                 p.index, id, cfg.batch_timeout_ms);
    if (metrics) metrics->count_batch_timeout_replay();
    p.down_reason = "replaying after micro-batch " + std::to_string(id) + " was lost";
    restart_pipeline(p);  // clears p.batches
    send_assignments(p);
  }
}

void Coordinator::Impl::engine_loop() {
  auto open = [this](const Pipeline& p) { return pipeline_ready(p) && !has_leaver(p); };
  auto capacity = [this](const Pipeline& p) { return pipeline_kv_capacity(p); };
  while (!stopping) {
    auto got = channel->recv(std::chrono::milliseconds(2));
    const auto arrived = Clock::now();
    std::unique_lock lk(mu);
    if (!got) {
      spdlog::warn("coordinator: data plane: {}", got.error());
      for (Pipeline& p : pipelines) check_own_endpoints(p, got.error());
    } else if (got->has_value()) {
      const auto& h = (**got).header;
      auto res = decode_batch_result(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
      if (!res) {
        spdlog::error("coordinator: {}", res.error());
      } else {
        std::optional<Clock::time_point> sent_at;
        if (res->pipeline < pipelines.size()) {
          Pipeline& p = pipelines[res->pipeline];
          if (auto it = p.batches.find(res->batch_id); it != p.batches.end() && res->epoch == p.epoch) {
            sent_at = it->second.sent;
            p.result_at = arrived;
            p.result_pending_send = true;
          }
        }
        Pipeline* replay = scheduler->on_result(*res);
        // What the result made possible leaves before its tokens become text and updates.
        if (!replay && sent_at) launch(pipelines[res->pipeline]);
        const auto taken = Clock::now();
        scheduler->deliver();
        if (trace && sent_at) {
          json line = {{"ev", "result"},
                       {"t", std::chrono::duration<double>(arrived.time_since_epoch()).count()},
                       {"pipeline", res->pipeline}, {"batch", res->batch_id}, {"seqs", res->seqs.size()},
                       {"rtt", std::chrono::duration<double, std::milli>(arrived - *sent_at).count()},
                       {"deliver", std::chrono::duration<double, std::milli>(Clock::now() - taken).count()}};
          if (!res->error.empty()) line["error"] = res->error;
          trace->write(line.dump());
        }
        if (replay) {
          restart_pipeline(*replay);
          send_assignments(*replay);  // every stage learns the new epoch, drops its cache, re-wires
        }
      }
    }
    reshape_if_pending();
    replay_lost_batches();
    scheduler->refuse_unserved(serviceable());
    for (Pipeline& p : pipelines) {
      p.figures = pipeline_figures(p);
      p.limits = Scheduler::batch_limits(cfg, p.figures, int(p.workers.size()), in_flight_depth(p));
    }
    scheduler->admit(open, capacity);
    for (Pipeline& p : pipelines) launch(p);
  }
}

// ---------------------------------------------------------------- public calls

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() { stop(); }

Expected<std::unique_ptr<Coordinator>> Coordinator::start(ClusterConfig config,
                                                          std::shared_ptr<const Tokenizer> tokenizer,
                                                          Metrics* metrics) {
  auto impl = std::make_unique<Impl>();
  transport::ControlServerOptions copt;
  copt.curve_secret_key = config.curve_secret_key;
  const std::string endpoint = "tcp://" + config.control_host + ":" + std::to_string(config.control_port);
  auto server = transport::ControlServer::bind(endpoint, copt);
  if (!server) return Status::error("coordinator: cannot bind the control plane on " + endpoint + ": " + server.error());
  transport::UcxChannelOptions uopt;
  uopt.name = "coordinator";
  // The data plane on control.host's interface (`lo` for 127.0.0.1; every one for 0.0.0.0),
  // unless control.data_interface or UCX_NET_DEVICES says otherwise.
  auto iface = transport::choose_data_interface(config.control_host, config.data_interface);
  if (!iface)
    return Status::error("coordinator: the data plane's interface (control.host " + config.control_host + "): " +
                         iface.error());
  uopt.net_devices = iface->net_devices;
  spdlog::info("coordinator: data plane on {} ({})", iface->shown, iface->source);
  auto ch = transport::UcxChannel::create(uopt);
  if (!ch) return Status::error("coordinator: cannot create the UCX data plane: " + ch.error());
  impl->cfg = std::move(config);
  impl->tokenizer = std::move(tokenizer);
  impl->metrics = metrics;
  impl->control = std::move(server).value();
  impl->channel = std::move(ch).value();
  impl->target = impl->current_shape();
  for (int r = 0; r < impl->cfg.replicas; ++r) {
    Pipeline p;
    p.index = r;
    p.workers.assign(size_t(impl->cfg.stages), "");
    impl->pipelines.push_back(std::move(p));
  }
  impl->scheduler = std::make_unique<Scheduler>(impl->cfg, impl->tokenizer, impl->pipelines);
  if (auto trace = BatchTrace::from_environment(); !trace)
    spdlog::warn("coordinator: no batch trace: {}", trace.error());
  else
    impl->trace = std::move(trace).value();
  Impl* raw = impl.get();
  impl->control_thread = std::thread([raw] { raw->control_loop(); });
  impl->engine_thread = std::thread([raw] { raw->engine_loop(); });
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

CoreStatus Coordinator::submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  if (m.stopping || !m.accepting)
    return CoreStatus::retry_later(CoreError::Unavailable, "the coordinator is shutting down",
                                   Scheduler::kRetryUnavailableSeconds);
  // With no pipeline able to serve, the request still queues: a worker may join within
  // scheduler.pipeline_wait_ms (the engine loop refuses it after that). A wait of 0 refuses now.
  if (m.cfg.pipeline_wait_ms == 0 && !m.serviceable())
    return CoreStatus::retry_later(CoreError::Unavailable, "no pipeline can serve: " + m.health_reason(),
                                   Scheduler::kRetryUnavailableSeconds);
  return m.scheduler->submit(std::move(request), std::move(sink));
}

int Coordinator::control_port() const { return impl_->control->port(); }

AdminReply Coordinator::drain(const std::string& name) {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  auto it = m.workers.find(name);
  if (it == m.workers.end() || !it->second.alive())
    return {CoreStatus::refuse(CoreError::NotFound, "no live worker named '" + name + "'"), {}};
  return m.take_out(it->second, false, "drained by the operator");
}

AdminReply Coordinator::plan(const PlanRequest& request) {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  Shape shape;
  if (CoreStatus s = shape_from_request(request, m.cfg.model, m.target, shape); !s.ok()) return {s, {}};
  auto placement = place(m.workers, m.plan_model(), shape);
  if (!placement) return {CoreStatus::refuse(CoreError::Conflict, "cannot run that plan: " + placement.error()), {}};
  m.target = shape;
  json out = {{"plan", shape_json(shape)}, {"workers", *placement}};
  if (shape == m.current_shape() && m.whole()) {
    out["changed"] = false;
    return {{}, out};
  }
  m.apply_placement({shape, std::move(placement).value()}, "re-planned by the operator");
  out["changed"] = true;
  return {{}, out};
}

size_t Coordinator::quiesce(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.accepting = false;
  m.scheduler->wait_idle(lk, timeout);
  return m.scheduler->outstanding();
}

std::pair<bool, json> Coordinator::health() const {
  const Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  json pj = json::array();
  bool any = false;
  for (const Pipeline& p : m.pipelines) {
    const bool ready = m.pipeline_ready(p);
    any = any || ready;
    json e = {{"pipeline", p.index}, {"ready", ready}};
    if (!ready) {
      const auto missing = std::count(p.workers.begin(), p.workers.end(), "");
      e["reason"] = missing ? std::to_string(missing) + " stage(s) without a worker" +
                                  (p.down_reason.empty() ? "" : " (" + p.down_reason + ")")
                            : "stages loading";
      if (!m.pipeline_recoverable(p)) e["recoverable"] = false;
    }
    pj.push_back(e);
  }
  if (!m.accepting) return {false, {{"status", "shutting down"}, {"pipelines", pj}}};
  return {any, {{"status", any ? "ok" : "unavailable"}, {"pipelines", pj}}};
}

json Coordinator::cluster() const {
  const Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  json wj = json::array();
  for (const auto& [_, w] : m.workers) wj.push_back(worker_json(w));
  json pj = json::array();
  for (const Pipeline& p : m.pipelines) {
    json stages = json::array();
    for (size_t s = 0; s < p.workers.size(); ++s)
      stages.push_back({{"stage", s}, {"layers", {m.cfg.layers[s].first, m.cfg.layers[s].second}},
                        {"worker", p.workers[s].empty() ? json(nullptr) : json(p.workers[s])}});
    const BatchLimits& l = p.limits;
    pj.push_back({{"pipeline", p.index}, {"epoch", p.epoch}, {"ready", m.pipeline_ready(p)},
                  {"in_flight", p.in_flight}, {"in_flight_depth", m.in_flight_depth(p)},
                  {"kv_reserved_tokens", p.kv_reserved},
                  {"kv_budget_tokens", m.pipeline_kv_capacity(p)}, {"admitted", p.admitted},
                  {"running_sequences", m.scheduler->running_on(p.index)},
                  {"limits", {{"backend", p.figures.backends}, {"max_running", l.max_running},
                              {"max_sequences_per_batch", l.max_sequences}, {"max_batch_tokens", l.max_tokens},
                              {"prefill_chunk", l.prefill_chunk}, {"prefill_tokens_per_batch", l.prefill_tokens}}},
                  {"stages", stages}});
  }
  return {{"model", m.cfg.model_name}, {"workers", wj}, {"pipelines", pj}, {"queue", m.scheduler->queue_size()},
          {"queue_wait", queue_wait_name(m.scheduler->queue_wait())}, {"max_queue", m.cfg.max_queue},
          {"in_flight_depth", m.pipelines.empty() ? 0 : m.in_flight_depth(m.pipelines.front())},
          {"plan", shape_json(m.current_shape())},
          {"target", shape_json(m.target)}};
}

void Coordinator::stop() {
  Impl& m = *impl_;
  if (m.stopping.exchange(true)) return;
  if (m.engine_thread.joinable()) m.engine_thread.join();
  if (m.control_thread.joinable()) m.control_thread.join();
  std::lock_guard lk(m.mu);
  // Workers keep their layers for the next coordinator; one waiting to hand its stage over
  // need not wait any longer.
  for (auto& [name, w] : m.workers)
    if (w.alive()) m.send_control(name, transport::GoodbyeMsg{"the coordinator is stopping"});
  // Both loops are joined: this thread is the control socket's now. What they posted last
  // goes out first, then the goodbyes.
  (void)m.control->flush_posted();  // failures are logged there
  m.scheduler->fail_all("the coordinator is shutting down");
}

}  // namespace conveyor

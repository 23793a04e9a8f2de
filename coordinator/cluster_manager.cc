// The cluster manager's own part: its thread, its snapshots, the state's questions and the
// calls from the engine and the REST layer. Control messages are in control.cc, carrying out
// plans in placement.cc.
#include "coordinator/cluster_manager.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include <spdlog/spdlog.h>

#include "coordinator/engine.h"

namespace conveyor {

using json = nlohmann::json;

ClusterManager::ClusterManager(ClusterConfig config, Metrics* metrics_sink, transport::ControlServer& control_server,
                               transport::UcxChannel& data_channel)
    : cfg(std::move(config)), metrics(metrics_sink), control(&control_server), channel(&data_channel) {
  target = current_shape();
  for (int r = 0; r < cfg.replicas; ++r) {
    Pipeline p;
    p.index = r;
    p.workers.assign(size_t(cfg.stages), "");
    pipelines.push_back(std::move(p));
  }
}

ClusterManager::~ClusterManager() { stop(); }

void ClusterManager::connect_engine(Engine* e) {
  SnapshotPtr first;
  {
    std::lock_guard lk(mu);
    engine = e;
    first = snapshot_if_changed();
  }
  publish(std::move(first));
}

void ClusterManager::start() { control_thread = std::thread([this] { control_loop(); }); }

void ClusterManager::stop() {
  stopping = true;
  if (control_thread.joinable()) control_thread.join();
}

void ClusterManager::say_goodbye() {
  std::lock_guard lk(mu);
  // Workers keep their layers for the next coordinator; one waiting to hand its stage over
  // need not wait any longer.
  for (auto& [name, w] : workers)
    if (w.alive()) send_control(name, transport::GoodbyeMsg{"the coordinator is stopping"});
  // The control thread is joined: this thread is the control socket's now. What was posted
  // last goes out first, then the goodbyes.
  (void)control->flush_posted();  // failures are logged there
}

// ---------------------------------------------------------------- snapshots

template <class F>
auto ClusterManager::changing(F&& change) {
  std::lock_guard lk(mu);
  holding_posts = true;
  if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
    change();
    settle();
  } else {
    auto out = change();
    settle();
    return out;
  }
}

// The engine's snapshot_mu_ (post_snapshot) is taken under ours: the engine never takes ours
// while it holds its own (its asks and stats are made without it).
void ClusterManager::settle() {
  holding_posts = false;
  publish(snapshot_if_changed());
  for (auto& [peer, message] : held_posts) control->post(peer, std::move(message));
  held_posts.clear();
}

SnapshotPtr ClusterManager::snapshot_if_changed() {
  auto s = std::make_shared<ClusterSnapshot>();
  s->plan_generation = plan_generation;
  for (const Pipeline& p : pipelines) {
    const bool ready = pipeline_ready(p);
    s->pipelines.push_back({.index = p.index, .epoch = p.epoch, .workers = p.workers, .first_peer = p.first_peer,
                            .last_peer = p.last_peer, .ready = ready, .open = ready && !has_leaver(p),
                            .recoverable = pipeline_recoverable(p), .kv_capacity = pipeline_kv_capacity(p),
                            .figures = pipeline_figures(p), .depth = in_flight_depth(p),
                            .step_ahead = steps_ahead(p), .down_reason = p.down_reason});
  }
  s->serviceable = serviceable();
  s->health_reason = health_reason();
  if (published && published->same_state(*s)) return nullptr;
  s->version = (published ? published->version : 0) + 1;
  published = s;
  return s;
}

void ClusterManager::publish(SnapshotPtr s) {
  if (s && engine) engine->post_snapshot(std::move(s));
}

SnapshotPtr ClusterManager::snapshot() const {
  std::lock_guard lk(mu);
  return published;
}

// ---------------------------------------------------------------- the state's questions

bool ClusterManager::pipeline_ready(const Pipeline& p) const {
  if (!p.wired) return false;
  for (const std::string& w : p.workers) {
    auto it = workers.find(w);
    if (w.empty() || it == workers.end() || it->second.state != MemberState::Ready || it->second.epoch != p.epoch)
      return false;
  }
  return true;
}

int64_t ClusterManager::pipeline_kv_capacity(const Pipeline& p) const {
  int64_t cap = std::numeric_limits<int64_t>::max();
  for (const std::string& w : p.workers) {
    auto it = workers.find(w);
    cap = std::min(cap, it == workers.end() ? 0 : it->second.kv_capacity_tokens);
  }
  return cap;
}

bool ClusterManager::pipeline_recoverable(const Pipeline& p) const {
  int missing = 0;
  for (const std::string& w : p.workers)
    if (w.empty() || !workers.count(w) || !workers.at(w).alive()) ++missing;
  int spares = 0;
  for (const auto& [_, w] : workers) spares += w.state == MemberState::Spare;
  return missing <= spares;
}

bool ClusterManager::serviceable() const {
  return std::any_of(pipelines.begin(), pipelines.end(),
                     [&](const Pipeline& p) { return pipeline_ready(p) || pipeline_recoverable(p); });
}

bool ClusterManager::has_leaver(const Pipeline& p) const {
  return std::any_of(p.workers.begin(), p.workers.end(), [&](const std::string& n) {
    auto it = workers.find(n);
    return it != workers.end() && it->second.leaving;
  });
}

bool ClusterManager::has_spare() const {
  return std::any_of(workers.begin(), workers.end(), [](const auto& e) { return e.second.state == MemberState::Spare; });
}

StageFigures ClusterManager::pipeline_figures(const Pipeline& p) const {
  std::vector<const WorkerInfo*> stages;
  for (const std::string& name : p.workers) {
    auto it = workers.find(name);
    stages.push_back(it == workers.end() ? nullptr : &it->second);
  }
  return stage_figures_of(stages);
}

int ClusterManager::in_flight_depth(const Pipeline& p) const {
  // Auto: a micro-batch per stage, and on a pipeline of several stages the extra its workers
  // ask for (a CPU stage's step costs less a row at fewer rows, so it gains from finding its
  // next input waiting; a single stage gains nothing: its input waits on its own result).
  if (!cfg.in_flight_auto) return std::max(1, cfg.in_flight);
  const int stages = std::max(1, int(p.workers.size()));
  return stages + (stages == 1 ? 0 : pipeline_figures(p).extra_in_flight);
}

bool ClusterManager::whole() const {
  return std::all_of(pipelines.begin(), pipelines.end(), [](const Pipeline& p) { return p.filled(); });
}

std::string ClusterManager::health_reason() const {
  std::string why;
  for (const Pipeline& p : pipelines)
    why += (why.empty() ? "" : "; ") + ("pipeline " + std::to_string(p.index) + ": " +
                                        (p.down_reason.empty() ? "waiting for workers" : p.down_reason));
  return why;
}

// ---------------------------------------------------------------- the control thread

void ClusterManager::control_loop() {
  while (!stopping) {
    auto m = control->recv(std::chrono::milliseconds(20));
    EngineStats stats = engine ? engine->stats() : EngineStats{};  // the engine's mutex alone, before ours
    changing([&] {
      engine_stats = std::move(stats);
      if (!m) spdlog::warn("coordinator: control plane: {}", m.error());
      else if (m->has_value()) handle_control((*m)->peer, (*m)->message);
      check_liveness();
      release_leavers();
      reshape_if_pending();
      update_gauges();
    });
  }
}

void ClusterManager::update_gauges() {
  if (!metrics) return;
  const EngineStats& e = engine_stats;
  metrics->set_queue_depth(int64_t(e.queue));
  metrics->set_queue_wait(queue_wait_name(e.queue_wait), int64_t(e.queue));
  metrics->set_running_sequences(e.running_sequences);
  metrics->set_prefix_cache(e.prefix);
  metrics->clear_stage_gauges();
  for (const Pipeline& p : pipelines) {
    const EngineStats::Run run = size_t(p.index) < e.pipelines.size() ? e.pipelines[size_t(p.index)] : EngineStats::Run{};
    metrics->set_pipeline_admission(p.index, run.limits.max_running, run.running, run.kv_reserved,
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

// ---------------------------------------------------------------- calls from the other parts

void ClusterManager::on_engine_ask(const ClusterAsk& ask) {
  changing([&] {
    if (ask.kind == ClusterAsk::Kind::CheckEndpoints) {
      for (Pipeline& p : pipelines) check_own_endpoints(p, ask.why);
      return;
    }
    if (ask.pipeline < 0 || size_t(ask.pipeline) >= pipelines.size()) return;
    Pipeline& p = pipelines[size_t(ask.pipeline)];
    if (p.epoch != ask.epoch) return;  // it has moved on since the engine saw it
    if (ask.kind == ClusterAsk::Kind::StageUnreachable) {
      auto it = workers.find(p.workers.front());
      if (it != workers.end() && it->second.alive()) return mark_dead(it->second, ask.why);
    }
    // A replay: every stage learns the new epoch, drops its cache, re-wires. After a lost
    // micro-batch every connection of the pipeline is dialled again, ours first.
    p.down_reason = ask.why;
    if (ask.kind == ClusterAsk::Kind::LostBatch) redial(p);
    restart_pipeline(p);
    p.replayed_from = ask.epoch;
    send_assignments(p);
  });
}

void ClusterManager::redial(Pipeline& p) {
  spdlog::warn("coordinator: pipeline {}: dialling its data-plane connections again", p.index);
  for (auto* peer : {&p.first_peer, &p.last_peer})
    if (*peer != transport::kNoPeer) (void)channel->disconnect(std::exchange(*peer, transport::kNoPeer));
  p.first_address.clear();
  p.last_address.clear();
  p.redial = true;
}

AdminReply ClusterManager::drain(const std::string& name) {
  return changing([&]() -> AdminReply {
    auto it = workers.find(name);
    if (it == workers.end() || !it->second.alive())
      return {CoreStatus::refuse(CoreError::NotFound, "no live worker named '" + name + "'"), {}};
    return take_out(it->second, false, "drained by the operator");
  });
}

AdminReply ClusterManager::plan(const PlanRequest& request) {
  return changing([&]() -> AdminReply {
    Shape shape;
    if (CoreStatus s = shape_from_request(request, cfg.model, target, shape); !s.ok()) return {s, {}};
    auto placement = place(workers, plan_model(), shape);
    if (!placement) return {CoreStatus::refuse(CoreError::Conflict, "cannot run that plan: " + placement.error()), {}};
    target = shape;
    json out = {{"plan", shape_json(shape)}, {"workers", *placement}};
    if (shape == current_shape() && whole()) {
      out["changed"] = false;
      return {{}, out};
    }
    apply_placement({shape, std::move(placement).value()}, "re-planned by the operator");
    out["changed"] = true;
    return {{}, out};
  });
}

json ClusterManager::cluster_json(const EngineStats& e) const {
  std::lock_guard lk(mu);
  json wj = json::array();
  for (const auto& [_, w] : workers) wj.push_back(worker_json(w));
  json pj = json::array();
  for (const Pipeline& p : pipelines) {
    json stages = json::array();
    for (size_t s = 0; s < p.workers.size(); ++s)
      stages.push_back({{"stage", s}, {"layers", {cfg.layers[s].first, cfg.layers[s].second}},
                        {"worker", p.workers[s].empty() ? json(nullptr) : json(p.workers[s])}});
    // The engine's side, as it last took the snapshot (zeros for a pipeline it has not seen).
    const EngineStats::Run run = size_t(p.index) < e.pipelines.size() ? e.pipelines[size_t(p.index)] : EngineStats::Run{};
    const BatchLimits& l = run.limits;
    pj.push_back({{"pipeline", p.index}, {"epoch", p.epoch}, {"ready", pipeline_ready(p)},
                  {"in_flight", run.in_flight}, {"in_flight_depth", in_flight_depth(p)},
                  {"step_ahead", steps_ahead(p)},
                  {"kv_reserved_tokens", run.kv_reserved},
                  {"kv_budget_tokens", pipeline_kv_capacity(p)}, {"admitted", run.admitted},
                  {"running_sequences", run.running},
                  {"limits", {{"backend", pipeline_figures(p).backends}, {"max_running", l.max_running},
                              {"max_sequences_per_batch", l.max_sequences}, {"max_batch_tokens", l.max_rows},
                              {"prefill_chunk", l.prefill_chunk}, {"prefill_tokens_per_batch", l.prefill_tokens}}},
                  {"stages", stages}});
  }
  return {{"model", cfg.model_name}, {"objective", objective_name(cfg.objective)}, {"workers", wj}, {"pipelines", pj},
          {"queue", e.queue}, {"outstanding", e.outstanding},
          {"queue_wait", queue_wait_name(e.queue_wait)}, {"max_queue", cfg.max_queue},
          {"in_flight_depth", pipelines.empty() ? 0 : in_flight_depth(pipelines.front())},
          {"plan", shape_json(current_shape())},
          {"target", shape_json(target)}};
}

}  // namespace conveyor

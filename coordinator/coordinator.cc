#include "coordinator/coordinator.h"

#include <algorithm>
#include <limits>

#include <spdlog/spdlog.h>

#include "coordinator/coordinator_impl.h"
#include "model/microbatch.h"

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

int Coordinator::Impl::in_flight_depth() const {
  return std::max(1, cfg.in_flight_auto ? cfg.stages : cfg.in_flight);
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
  metrics->set_running_sequences(scheduler->running_sequences());
  metrics->clear_stage_gauges();
  for (const Pipeline& p : pipelines)
    for (size_t s = 0; s < p.workers.size(); ++s) {
      auto it = workers.find(p.workers[s]);
      if (it == workers.end()) continue;
      metrics->set_stage_busy_fraction(p.index, int(s), it->first, it->second.busy_fraction);
      metrics->set_kv_cache_tokens(p.index, int(s), it->second.kv_used_tokens, it->second.kv_capacity_tokens);
    }
}

// Forms and sends micro-batches for `p` while it has room in flight.
void Coordinator::Impl::launch(Pipeline& p) {
  const int depth = in_flight_depth();
  while (p.in_flight < depth && pipeline_ready(p)) {
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
    Scheduler::sent(p, std::move(*formed));
  }
}

void Coordinator::Impl::engine_loop() {
  auto open = [this](const Pipeline& p) { return pipeline_ready(p) && !has_leaver(p); };
  auto capacity = [this](const Pipeline& p) { return pipeline_kv_capacity(p); };
  while (!stopping) {
    auto got = channel->recv(std::chrono::milliseconds(2));
    std::unique_lock lk(mu);
    if (!got) {
      spdlog::warn("coordinator: data plane: {}", got.error());
      for (Pipeline& p : pipelines) check_own_endpoints(p, got.error());
    } else if (got->has_value()) {
      const auto& h = (**got).header;
      auto res = decode_batch_result(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
      if (!res) {
        spdlog::error("coordinator: {}", res.error());
      } else if (Pipeline* replay = scheduler->on_result(*res)) {
        restart_pipeline(*replay);
        send_assignments(*replay);  // every stage learns the new epoch, drops its cache, re-wires
      }
    }
    reshape_if_pending();
    scheduler->refuse_unserved(serviceable());
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
    pj.push_back({{"pipeline", p.index}, {"epoch", p.epoch}, {"ready", m.pipeline_ready(p)},
                  {"in_flight", p.in_flight}, {"kv_reserved_tokens", p.kv_reserved}, {"admitted", p.admitted},
                  {"stages", stages}});
  }
  return {{"model", m.cfg.model_name}, {"workers", wj}, {"pipelines", pj}, {"queue", m.scheduler->queue_size()},
          {"in_flight_depth", m.in_flight_depth()}, {"plan", shape_json(m.current_shape())},
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
  m.scheduler->fail_all("the coordinator is shutting down");
}

}  // namespace conveyor

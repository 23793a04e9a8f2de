// The coordinator: a thin owner of its two parts and what they share (the control socket and
// the data-plane channel, both thread-safe carriers), wired together at start.
#include "coordinator/coordinator.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "common/options.h"
#include "coordinator/cluster_manager.h"
#include "coordinator/engine.h"
#include "transport/net_interface.h"

namespace conveyor {

using json = nlohmann::json;

struct Coordinator::Impl {
  std::unique_ptr<transport::ControlServer> control;
  std::unique_ptr<transport::UcxChannel> channel;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ClusterManager> cluster;
  std::atomic<bool> stopped{false};
};

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
  uopt.auth_secret = config.join_token;  // only channels that prove they know it may send (data_auth.h)
  uopt.spin_when_idle = std::chrono::microseconds(process_options().data_idle_spin_us);
  uopt.spin_in_calls = uopt.spin_when_idle;  // its callers' sends and receives poll as long
  uopt.host_shared_memory = process_options().data_shared_memory;
  auto ch = transport::UcxChannel::create(uopt);
  if (!ch) return Status::error("coordinator: cannot create the UCX data plane: " + ch.error());
  impl->control = std::move(server).value();
  impl->channel = std::move(ch).value();
  impl->engine = std::make_unique<Engine>(config, std::move(tokenizer), metrics, *impl->channel);
  impl->cluster = std::make_unique<ClusterManager>(std::move(config), metrics, *impl->control, *impl->channel);
  impl->engine->connect_cluster(impl->cluster.get());
  impl->cluster->connect_engine(impl->engine.get());  // publishes the first snapshot
  impl->engine->start();
  impl->cluster->start();
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

CoreStatus Coordinator::submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink) {
  return impl_->engine->submit(std::move(request), std::move(sink));
}

void Coordinator::cancel(const CompletionRequest& request) { impl_->engine->cancel(request); }

int Coordinator::control_port() const { return impl_->control->port(); }

AdminReply Coordinator::drain(const std::string& name) { return impl_->cluster->drain(name); }

AdminReply Coordinator::plan(const PlanRequest& request) { return impl_->cluster->plan(request); }

size_t Coordinator::quiesce(std::chrono::milliseconds timeout) { return impl_->engine->quiesce(timeout); }

// ok: some pipeline serves and none with work has stalled; degraded: a ready pipeline has had
// work and made no progress for scheduler.batch_timeout_ms (HTTP 503 when no other serves);
// unavailable: none ready.
std::pair<bool, json> Coordinator::health() const {
  const EngineStats stats = impl_->engine->stats();  // the engine's mutex, then the snapshot: never both
  const SnapshotPtr snap = impl_->cluster->snapshot();
  json pj = json::array();
  bool any = false, stalled = false;
  for (const PipelineView& p : snap->pipelines) {
    const int64_t stalled_ms =
        size_t(p.index) < stats.pipelines.size() ? stats.pipelines[size_t(p.index)].stalled_ms : 0;
    stalled = stalled || (p.ready && stalled_ms > 0);
    any = any || (p.ready && stalled_ms == 0);
    json e = {{"pipeline", p.index}, {"ready", p.ready}};
    if (p.ready && stalled_ms > 0) {
      e["stalled_ms"] = stalled_ms;
      e["reason"] = "work admitted and no token for " + std::to_string(stalled_ms) + " ms";
    }
    if (!p.ready) {
      const auto missing = std::count(p.workers.begin(), p.workers.end(), "");
      e["reason"] = missing ? std::to_string(missing) + " stage(s) without a worker" +
                                  (p.down_reason.empty() ? "" : " (" + p.down_reason + ")")
                            : "stages loading";
      if (!p.recoverable) e["recoverable"] = false;
    }
    pj.push_back(e);
  }
  if (!stats.accepting) return {false, {{"status", "shutting down"}, {"pipelines", pj}}};
  return {any, {{"status", stalled ? "degraded" : any ? "ok" : "unavailable"}, {"pipelines", pj}}};
}

json Coordinator::cluster() const {
  const EngineStats stats = impl_->engine->stats();  // the engine's mutex, then the manager's: never both
  return impl_->cluster->cluster_json(stats);
}

void Coordinator::stop() {
  Impl& m = *impl_;
  if (m.stopped.exchange(true)) return;
  m.engine->stop();   // no more asks of the cluster, nothing more sent
  m.cluster->stop();  // the control thread joined: the socket is this thread's
  m.cluster->say_goodbye();
  m.engine->fail_all("the coordinator is shutting down");
}

}  // namespace conveyor

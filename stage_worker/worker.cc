// The worker's control thread (registering, heartbeats, control messages), its loader and
// start-up; worker_step.cc is the compute thread.
#include "stage_worker/worker.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "common/service.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "stage/backend_factory.h"
#include "stage/stage_executor.h"
#include "stage_worker/handoff.h"
#include "stage_worker/step_trace.h"
#include "stage_worker/worker_impl.h"
#include "transport/channel.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
#include "transport/endpoint.h"
#include "transport/net_interface.h"
#include "transport/ucx_channel.h"

namespace conveyor {

using Clock = std::chrono::steady_clock;
using transport::AssignMsg;
using transport::ControlMessage;
using transport::PeerId;
using transport::WorkerState;

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// What register names as still loaded: the assignment without its wiring.
transport::HeldStage held_stage(const AssignMsg& a) {
  return {.epoch = a.epoch, .pipeline = a.pipeline, .stage = a.stage, .num_stages = a.num_stages,
          .layer_begin = a.layer_begin, .layer_end = a.layer_end, .model = a.model};
}

}  // namespace


void Worker::Impl::stop_threads() {
  // The loader first: it starts the compute thread when it is done (send_ready).
  loader.join();
  if (compute.joinable()) {
    ask_compute_to_stop();
    compute.join();
  }
  handoff.reset();  // sends what is queued first
}

nlohmann::json Worker::Impl::data_plane_json() const {
  const bool cuda = opt.stage.backend == Backend::Cuda;
  const bool direct = direct_capable();
  return {{"path", direct ? "direct" : "staged"},
          {"staging", cuda ? "page-locked host" : "host"},
          {"receive", direct ? "device" : (cuda ? "page-locked host" : "host")},
          {"ucx_cuda_memory", channel->supports_cuda_memory()}};
}

void Worker::Impl::send_register() {
  const StageOptions& stage = opt.stage;
  const bool cuda = stage.backend == Backend::Cuda;
  transport::RegisterMsg m{
      .name = opt.name, .host = host, .pid = ::getpid(), .token = opt.join_token,
      .backend = std::string(backend_name(stage.backend)), .tensor_parallel = stage.tensor_parallel,
      .gpus = cuda ? stage.gpus : std::vector<int>{}, .memory_bytes = stage_memory_bytes(stage),
      .capabilities = stage_capabilities(stage),
      .data_plane = data_plane_json(),
      .data_address = channel->address()};
  {
    std::lock_guard lk(stage_mu);
    if (assignment && executor) m.holding = held_stage(*assignment);
    m.last_epoch = last_epoch;
  }
  send(m);
  last_register = Clock::now();
}

void Worker::Impl::drain_handoff() {
  wait_heartbeating([&](std::chrono::milliseconds slice) { return handoff->drain_for(slice); });
}

void Worker::Impl::join_loader() {
  wait_heartbeating([&](std::chrono::milliseconds slice) { return loader.join_for(slice); });
}

void Worker::Impl::ask_compute_to_stop() {
  compute_stop = true;
  handoff->interrupt_waits();
  channel->interrupt();
}

void Worker::Impl::stop_compute() {
  ask_compute_to_stop();
  wait_heartbeating([&](std::chrono::milliseconds slice) { return compute.join_for(slice); });
}

bool Worker::Impl::superseded(uint32_t epoch) {
  std::lock_guard lk(stage_mu);
  return epoch < assigned_epoch;
}

void Worker::Impl::send_heartbeat() {
  const auto now = Clock::now();
  const int64_t busy = busy_ns.load();
  const double window = std::chrono::duration<double>(now - heartbeat_window_start).count();
  const double busy_fraction = window > 0 ? double(busy - busy_ns_at_last_heartbeat) * 1e-9 / window : 0.0;
  busy_ns_at_last_heartbeat = busy;
  heartbeat_window_start = now;
  transport::WorkerFigures f{.busy_fraction = std::min(1.0, busy_fraction),
                             .batches = int64_t(batches.load()),
                             .busy_seconds_total = double(busy) * 1e-9,
                             .clock_seconds = std::chrono::duration<double>(now.time_since_epoch()).count(),
                             .wait_input_seconds_total = double(wait_input_ns.load()) * 1e-9,
                             .idle_ready_seconds_total = double(idle_ready_ns.load()) * 1e-9};
  {
    std::lock_guard lk(stage_mu);
    f.state = state;
    f.load_fraction = load_fraction;
    if (executor) {  // figures the compute thread publishes: the executor is its alone
      f.kv_used_tokens = kv_used_stat.load();
      f.kv_capacity_tokens = kv_capacity_stat.load();
      f.sequences = sequences_stat.load();
    }
  }
  send(transport::HeartbeatMsg{.figures = f});
  last_heartbeat = now;
}

void Worker::Impl::explain_not_joined() {
  constexpr auto kEvery = std::chrono::seconds(3);
  const auto now = Clock::now();
  if (now - unwelcomed_since < kEvery || now - last_explained < kEvery) return;
  last_explained = now;
  const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - unwelcomed_since).count();
  if (Status reach = transport::probe_tcp(coordinator_at, std::chrono::milliseconds(500)); !reach)
    spdlog::warn("{}: cannot reach the coordinator at {}: {}; retrying (for {} s now)", opt.name,
                 coordinator_at.text(), reach.message(), waited);
  else
    spdlog::warn("{}: the coordinator at {} accepts connections but has not welcomed this worker in {} s (is it a "
                 "Conveyor coordinator, with the CURVE key this worker was given?); retrying",
                 opt.name, coordinator_at.text(), waited);
}

Status Worker::Impl::wire(const AssignMsg& a) {
  const std::string prev_name = a.stage == 0 ? "coordinator" : "stage" + std::to_string(a.stage - 1);
  if (Status s = transport::keep_or_connect(*channel, next_peer, next_address, a.next_address,
                                            "stage" + std::to_string(a.stage + 1));
      !s)
    return s;
  if (Status s = transport::keep_or_connect(*channel, prev_peer, prev_address, a.prev_address, prev_name); !s) return s;
  return transport::keep_or_connect(*channel, coord_peer, coord_address, a.coordinator_address, "coordinator");
}

void Worker::Impl::on(const AssignMsg& a) {
  // A next stage that is replaced may be cut off rather than dead: sends to it would hold
  // the handoff, and with it this thread (and its heartbeats), until they time out, and the
  // coordinator would take this healthy worker for dead too. Disconnect it first: the sends
  // queued for it fail at once (tests/netns: a link cut longer than the liveness window).
  // A redial (the replay of a lost micro-batch) drops every connection, so that wire() dials
  // them again: the old ones may be dead without an error (an interface that went away).
  {
    std::lock_guard lk(stage_mu);
    assigned_epoch = a.epoch;  // before the drops: what they make fail is of the old epoch
    auto drop = [&](PeerId& peer, std::vector<std::byte>& address) {
      if (peer != transport::kNoPeer) (void)channel->disconnect(peer);
      peer = transport::kNoPeer;
      address.clear();
    };
    if (a.redial || !std::equal(next_address.begin(), next_address.end(), a.next_address.begin(), a.next_address.end()))
      drop(next_peer, next_address);
    if (a.redial) {
      spdlog::info("{}: epoch {}: dialling the data-plane peers again (a micro-batch was lost)", opt.name, a.epoch);
      drop(prev_peer, prev_address);
      drop(coord_peer, coord_address);
    }
  }
  // Same layers of the same model already loaded: only the wiring changes.
  bool reuse = false;
  {
    std::lock_guard lk(stage_mu);
    reuse = executor && assignment && assignment->model == a.model &&
            assignment->layer_begin == a.layer_begin && assignment->layer_end == a.layer_end &&
            state != WorkerState::Loading;
  }
  join_loader();
  if (reuse) {
    std::unique_lock run(run_mu, std::defer_lock);  // no micro-batch is running while the cache goes
    wait_heartbeating([&](std::chrono::milliseconds slice) { return run.try_lock_for(slice); });
    drain_handoff();  // nor being sent (a failed send takes stage_mu)
    std::lock_guard lk(stage_mu);
    executor->drop_all();
    publish_stats();
    assignment = a;
    last_epoch = std::max(last_epoch, a.epoch);
    if (Status s = wire(a); !s) {
      report_wiring_failure(a, s);
      return;
    }
    state = WorkerState::Ready;
    send_ready(0, 0);
    return;
  }
  stop_compute();
  drain_handoff();
  {
    std::lock_guard lk(stage_mu);
    executor.reset();
    assignment = a;
    last_epoch = std::max(last_epoch, a.epoch);
    state = WorkerState::Loading;
    load_fraction = 0;
  }
  loader.start([this, a] { load(a); });
}

StageOptions Worker::Impl::stage_options(const AssignMsg& a) const {
  StageOptions o = opt.stage;
  o.name = opt.name + " stage " + std::to_string(a.stage) + " (layers " + std::to_string(a.layer_begin) + ".." +
           std::to_string(a.layer_end) + ")";
  return o;
}

void Worker::Impl::report_wiring_failure(const AssignMsg& a, const Status& s) {
  spdlog::warn("{}: cannot wire epoch {}: {}", opt.name, a.epoch, s.message());
  send(transport::DataErrorMsg{.error = "wiring: " + s.message(), .epoch = a.epoch});
}

void Worker::Impl::report_data_error(const std::string& error, const std::string& peer, uint32_t epoch) {
  transport::DataErrorMsg m{.error = error, .peer = peer};
  if (epoch != 0) {
    m.epoch = epoch;
  } else {
    std::lock_guard lk(stage_mu);
    if (assignment) m.epoch = assignment->epoch;
  }
  send(m);
}

void Worker::Impl::publish_stats() {
  StageBackend& st = executor->backend();
  kv_used_stat = st.kv_used_tokens();
  kv_capacity_stat = st.kv_capacity_tokens();
  sequences_stat = st.num_sequences();
}

void Worker::Impl::send_ready(double seconds, int64_t bytes) {
  publish_stats();
  send(transport::ReadyMsg{.epoch = assignment->epoch, .pipeline = assignment->pipeline,
                           .stage = assignment->stage, .layer_begin = assignment->layer_begin,
                           .layer_end = assignment->layer_end,
                           .kv_bytes_per_token = executor->backend().kv_bytes_per_token(),
                           .kv_capacity_tokens = kv_capacity_stat.load(),
                           .backend = executor->backend().describe(),
                           .load_seconds = seconds, .load_bytes = bytes});
  compute_stop = false;
  handoff->resume_waits();
  if (!compute.joinable()) compute.start([this] { compute_loop(); });
}

void Worker::Impl::load(AssignMsg a) {
  const auto t0 = Clock::now();
  auto last_report = t0;
  spdlog::info("{}: loading layers [{}, {}) of {}", opt.name, a.layer_begin, a.layer_end, a.model);
  // Built without stage_mu: placing a large stage on a GPU can outlast the coordinator's
  // liveness window, and the heartbeats need that lock. A GPU stage reads the checkpoint's
  // bytes straight to its GPUs; a CPU stage converts them to fp32 first.
  auto loaded = load_stage_backend(a.model, a.layer_begin, a.layer_end, stage_options(a),
                                   [&](int64_t done, int64_t total) {
    const double f = total > 0 ? double(done) / double(total) : 1.0;
    {
      std::lock_guard lk(stage_mu);
      load_fraction = f;
    }
    if (Clock::now() - last_report > std::chrono::milliseconds(200) || done == total) {
      last_report = Clock::now();
      send(transport::LoadProgressMsg{.fraction = f, .bytes_done = done, .bytes_total = total});
    }
  });
  const double load_secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::lock_guard lk(stage_mu);
  if (!loaded) {
    state = WorkerState::Idle;
    assignment.reset();
    spdlog::error("{}: load failed: {}", opt.name, loaded.error());
    send(transport::LoadFailedMsg{.error = loaded.error()});
    return;
  }
  const int64_t bytes = loaded->checkpoint_bytes;
  executor = std::make_shared<StageExecutor>(std::move(loaded->backend));
  if (Status s = wire(a); !s) {
    state = WorkerState::Ready;  // the layers are loaded and kept; the next assignment re-wires
    report_wiring_failure(a, s);
    return;
  }
  state = WorkerState::Ready;
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const double gbps = load_secs > 0 ? double(bytes) / load_secs / 1e9 : 0.0;
  spdlog::info("{}: layers [{}, {}) loaded in {:.2f} s ({:.1f} MB of checkpoint at {:.2f} GB/s, on {}; wired in {:.2f} s)",
               opt.name, a.layer_begin, a.layer_end, load_secs, double(bytes) / 1e6, gbps,
               executor->backend().describe(), secs - load_secs);
  service::status(fmt::format("stage {}, layers [{}, {}): loaded in {:.2f} s at {:.2f} GB/s", a.stage, a.layer_begin,
                              a.layer_end, load_secs, gbps));
  send_ready(secs, bytes);
}

void Worker::Impl::unassign() {
  join_loader();
  stop_compute();
  drain_handoff();
  std::lock_guard lk(stage_mu);
  executor.reset();
  assignment.reset();
  state = WorkerState::Idle;
}

void Worker::Impl::handle(const ControlMessage& m) {
  last_from_coordinator = Clock::now();
  auto msg = transport::decode_control(m);
  if (!msg) {
    spdlog::warn("{}: ignoring a malformed control message: {}", opt.name, msg.error());
    // The coordinator waits for an answer to an assign: a refusal vacates the stage.
    if (transport::control_kind_from_name(m.type()) == transport::ControlKind::Assign)
      send(transport::LoadFailedMsg{.error = msg.error()});
    return;
  }
  std::visit([this](const auto& x) { on(x); }, *msg);
}

void Worker::Impl::on(const transport::WelcomeMsg& m) {
  welcomed = true;
  service::ready("joined " + opt.coordinator + " as " + opt.name);
  spdlog::info("{}: joined the coordinator", opt.name);
  if (m.model) send_footprint(*m.model);
}

void Worker::Impl::send_footprint(const transport::ModelShape& model) {
  StageOptions o = opt.stage;
  o.name = opt.name;
  auto f = stage_footprint(transport::model_config(model), o);
  if (!f) spdlog::error("{}: cannot hold the coordinator's model: {}", opt.name, f.error());
  send(f ? transport::FootprintMsg{.footprint = *f} : transport::FootprintMsg{.error = f.error()});
}

void Worker::Impl::on(const transport::RejectedMsg& m) {
  spdlog::error("{}: the coordinator refused this worker: {}", opt.name, m.reason);
  exit_code = 3;
}

void Worker::Impl::on(const transport::DrainMsg&) {
  std::lock_guard lk(stage_mu);
  if (state == WorkerState::Ready) state = WorkerState::Draining;
}

void Worker::Impl::on(const transport::GoodbyeMsg& m) {
  spdlog::info("{}: the coordinator says goodbye: {}", opt.name, m.reason);
  welcomed = false;
  unwelcomed_since = Clock::now();
}

void Worker::Impl::on(const transport::HeartbeatMsg& m) {
  if (m.register_again && welcomed) {  // a restarted coordinator does not know us
    spdlog::info("{}: the coordinator does not know this worker; registering again (keeping its layers)", opt.name);
    welcomed = false;
    unwelcomed_since = Clock::now();
    last_register = {};
  }
}

int Worker::Impl::run(const std::atomic<bool>& stop) {
  send_register();
  std::optional<Clock::time_point> leave_by;
  while (exit_code < 0) {
    const auto now = Clock::now();
    if (stop && !leave_by) {
      service::stopping();
      if (!welcomed || !has_stage()) break;
      spdlog::info("{}: asked to stop: handing the stage over (waiting up to {} ms)", opt.name, opt.drain_timeout.count());
      send(transport::DrainingMsg{.reason = "signal"});
      leave_by = now + opt.drain_timeout;
    }
    if (leave_by && (!has_stage() || !welcomed || now > *leave_by)) {  // !welcomed: it is gone
      if (has_stage()) spdlog::warn("{}: the stage was not taken over in time; leaving anyway", opt.name);
      break;
    }
    auto m = control->recv(std::chrono::milliseconds(50));
    if (!m) spdlog::warn("{}: control plane: {}", opt.name, m.error());
    else if (m->has_value()) handle(**m);
    if (welcomed && Clock::now() - last_from_coordinator > opt.coordinator_liveness) {
      spdlog::warn("{}: coordinator silent for {} ms; keeping weights and registering again", opt.name,
                   opt.coordinator_liveness.count());
      welcomed = false;
      unwelcomed_since = Clock::now();
    }
    if (!welcomed && !leave_by) explain_not_joined();
    if (!welcomed && !leave_by && Clock::now() - last_register > std::chrono::seconds(1)) send_register();
    if (welcomed && Clock::now() - last_heartbeat > opt.heartbeat_interval) send_heartbeat();
    service::watchdog_tick();
  }
  if (exit_code < 0) {  // stopped by a signal: tell the coordinator we are going
    send(transport::LeavingMsg{.reason = "signal"});
    (void)control->flush_posted();
    exit_code = 0;
  }
  stop_threads();
  return exit_code;
}


Worker::Worker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;

Expected<std::unique_ptr<Worker>> Worker::create(WorkerOptions options) {
  auto impl = std::make_unique<Impl>();
  if (options.name.empty()) options.name = host_name() + "-" + std::to_string(::getpid());
  if (options.join_token.empty()) return Status::error("worker: a join token is required (--join-token or CONVEYOR_JOIN_TOKEN)");
  // The coordinator's address is checked here, once: a name that does not resolve will not
  // start to (ZeroMQ would retry it silently for ever).
  auto coordinator = transport::parse_host_port(options.coordinator);
  if (!coordinator) return Status::error("worker: --coordinator " + coordinator.error());
  if (auto ip = transport::resolve_host(coordinator->host); !ip)
    return Status::error("worker: the coordinator's address (--coordinator " + options.coordinator + "): " + ip.error());
  const std::string endpoint = "tcp://" + coordinator->text();
  transport::ControlClientOptions copt;
  copt.identity = options.name;
  copt.curve_server_key = options.curve_server_key;
  auto client = transport::ControlClient::connect(endpoint, copt);
  if (!client) return Status::error("worker: cannot set up the control connection to " + endpoint + ": " + client.error());
  transport::UcxChannelOptions uopt;
  uopt.name = options.name;
  // --host: the data plane on that address's interface alone (`lo` for 127.0.0.1); without
  // it, on the interface the route to the coordinator leaves from (the control connection's);
  // unless --data-interface or UCX_NET_DEVICES says otherwise.
  auto iface = transport::choose_data_interface(options.host, options.data_interface, *coordinator);
  if (!iface)
    return Status::error("worker: the data plane's interface" +
                         (options.host.empty() ? " (no --host: the route to the coordinator)"
                                               : " (--host " + options.host + ")") +
                         ": " + iface.error());
  uopt.net_devices = iface->net_devices;
  spdlog::info("{}: data plane on {} ({})", options.name, iface->shown, iface->source);
  uopt.auth_secret = options.join_token;  // only channels that prove they know it may send (data_auth.h)
  uopt.receive_allocator = receive_allocator(options.stage);
  // A GPU stage takes activations into its GPU's memory when its UCX moves CUDA memory.
  impl->device = device_memory(options.stage);
  uopt.device_allocator = impl->device.allocator;
  uopt.progress_thread_init = impl->device.bind_thread;
  uopt.spin_when_idle = std::chrono::microseconds(options.data_idle_spin_us);
  uopt.spin_in_calls = uopt.spin_when_idle;  // the receive and sender threads poll as long
  uopt.host_shared_memory = options.data_shared_memory;
  auto ch = transport::UcxChannel::create(uopt);
  if (!ch) return Status::error("worker: cannot create the UCX data plane: " + ch.error());
  impl->coordinator_at = *coordinator;
  impl->host = options.host.empty() ? host_name() : options.host;
  impl->opt = std::move(options);
  impl->control = std::move(client).value();
  impl->channel = std::move(ch).value();
  impl->handoff = std::make_unique<Handoff>(*impl->channel, 2, std::chrono::milliseconds(10000));
  if (auto trace = StepTrace::from_environment(impl->opt.name); !trace)
    spdlog::warn("{}: no step trace: {}", impl->opt.name, trace.error());
  else
    impl->trace = std::move(trace).value();
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

int Worker::run(const std::atomic<bool>& stop) { return impl_->run(stop); }

}  // namespace conveyor

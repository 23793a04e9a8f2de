#include "stage_worker/worker.h"

#include <unistd.h>

#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "common/service.h"
#include "model/microbatch.h"
#include "model/stage_executor.h"
#include "model/weights.h"
#include "stage_worker/handoff.h"
#ifdef CONVEYOR_HAVE_CUDA
#include "kernels/cuda/check.h"
#include "kernels/cuda/gpu_stage_backend.h"
#endif
#include "transport/channel.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using transport::ControlMessage;
using transport::PeerId;

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// The memory a stage's weights live in: the GPU's on the CUDA backend, else the host's.
// The coordinator checks a stage's size against it before it gives this worker more layers.
int64_t memory_bytes(const WorkerOptions& opt) {
#ifdef CONVEYOR_HAVE_CUDA
  if (opt.backend == "cuda") {  // a tensor-parallel stage spreads its weights over all its GPUs
    int64_t total = 0;
    for (int gpu : opt.gpus) {
      try {
        cuda::DeviceGuard on(gpu);
        total += int64_t(cuda::device_memory_info().second);
      } catch (const std::exception& e) {
        spdlog::warn("{}: cannot read the memory of GPU {}: {}", opt.name, gpu, e.what());
        return 0;
      }
    }
    return total;
  }
#else
  (void)opt;
#endif
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : 0;
}

}  // namespace

int usable_gpus() {
#ifdef CONVEYOR_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error here, the CPU serves
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

namespace {

#ifdef CONVEYOR_HAVE_CUDA
// Page-locked receive buffers, so a GPU stage's copy of the received activations to its GPU
// is DMA. They are allocated on the data plane's progress thread, which does no other CUDA
// work: making the stage's GPU current there keeps a context off GPU 0.
transport::HostAllocator pinned_receive_buffers(int device) {
  return {[device](size_t n) -> void* { return cudaSetDevice(device) == cudaSuccess ? cuda::pinned_alloc(n) : nullptr; },
          [](void* p) { cuda::pinned_free(p); }};
}
#endif

// What the coordinator assigned: a stage of a pipeline, and where its neighbours are.
struct Assignment {
  uint32_t epoch = 0;
  uint32_t pipeline = 0;
  int stage = 0;
  int num_stages = 0;
  int64_t layer_begin = 0, layer_end = 0;
  std::string model;
  std::vector<std::byte> next, prev, coordinator;  // data-plane addresses (next empty on the last stage)

  json describe() const {
    return {{"epoch", epoch}, {"pipeline", pipeline}, {"stage", stage}, {"num_stages", num_stages},
            {"layers", {layer_begin, layer_end}}, {"model", model}};
  }
};

Expected<Assignment> parse_assign(const json& b) {
  try {
    Assignment a;
    a.epoch = b.at("epoch").get<uint32_t>();
    a.pipeline = b.at("pipeline").get<uint32_t>();
    a.stage = b.at("stage").get<int>();
    a.num_stages = b.at("num_stages").get<int>();
    a.layer_begin = b.at("layers").at(0).get<int64_t>();
    a.layer_end = b.at("layers").at(1).get<int64_t>();
    a.model = b.at("model").get<std::string>();
    auto addr = [&](const char* key) -> Expected<std::vector<std::byte>> {
      const std::string s = b.value(key, std::string());
      if (s.empty()) return std::vector<std::byte>{};
      return transport::from_base64(s);
    };
    for (auto [key, out] : {std::pair{"next", &a.next}, {"prev", &a.prev}, {"coordinator", &a.coordinator}}) {
      auto v = addr(key);
      if (!v) return Status::error(std::string("assign: bad ") + key + " address: " + v.error());
      *out = std::move(v).value();
    }
    if (a.coordinator.empty()) return Status::error("assign: no coordinator data-plane address");
    return a;
  } catch (const std::exception& e) {
    return Status::error(std::string("malformed assign message: ") + e.what());
  }
}

}  // namespace

struct Worker::Impl {
  WorkerOptions opt;
  std::unique_ptr<transport::ControlClient> control;
  std::unique_ptr<transport::UcxChannel> channel;
  std::string host = host_name();

  // Control-thread state.
  bool welcomed = false;
  Clock::time_point last_from_coordinator = Clock::now();
  Clock::time_point last_register{};
  Clock::time_point last_heartbeat{};
  int exit_code = -1;

  // The stage: written by the loader, read by compute; guarded by stage_mu.
  std::mutex run_mu;    // the executor is used by one thread at a time: taken before stage_mu
  std::mutex stage_mu;
  std::atomic<int64_t> kv_used_stat{0}, kv_capacity_stat{0}, sequences_stat{0};
  std::optional<Assignment> assignment;      // what is loaded (or loading)
  std::shared_ptr<StageExecutor> executor;   // null until loaded
  PeerId next_peer = transport::kNoPeer, prev_peer = transport::kNoPeer, coord_peer = transport::kNoPeer;
  std::vector<std::byte> next_address, prev_address, coord_address;  // whom those peers reach
  std::string state = "idle";                // idle | loading | ready | draining
  double load_fraction = 0;

  std::thread loader, compute;
  // The compute thread's outgoing activations, sent on by the handoff's own thread; two slots.
  std::unique_ptr<Handoff> handoff;
  std::atomic<bool> compute_stop{false};
  std::atomic<uint64_t> batches{0};
  std::atomic<int64_t> busy_ns{0};
  int64_t busy_ns_at_last_heartbeat = 0;
  Clock::time_point heartbeat_window_start = Clock::now();

  ~Impl() { stop_threads(); }

  void stop_threads() {
    compute_stop = true;
    if (compute.joinable()) compute.join();
    if (loader.joinable()) loader.join();
    handoff.reset();  // sends what is queued first
  }

  void send(ControlMessage m) { control->post(std::move(m)); }

  void send_register() {
    json body = {{"name", opt.name}, {"host", host}, {"pid", ::getpid()}, {"token", opt.join_token},
                 {"backend", opt.backend}, {"tensor_parallel", opt.tensor_parallel}, {"gpus", opt.backend == "cuda" ? json(opt.gpus) : json::array()},
                 {"memory_bytes", memory_bytes(opt)},
                 {"kv_cache_bytes", opt.kv_cache_bytes},
                 {"int8_weights", opt.backend == "cuda" && opt.int8_weights},
                 {"data_plane", {{"staging", opt.backend == "cuda" ? "page-locked host" : "host"},
                                 {"ucx_cuda_memory", channel->supports_cuda_memory()}}}};
    {
      std::lock_guard lk(stage_mu);
      if (assignment && executor) body["holding"] = assignment->describe();
    }
    send(ControlMessage::make("register", body, channel->address()));
    last_register = Clock::now();
  }

  void send_heartbeat() {
    const auto now = Clock::now();
    const int64_t busy = busy_ns.load();
    const double window = std::chrono::duration<double>(now - heartbeat_window_start).count();
    const double busy_fraction = window > 0 ? double(busy - busy_ns_at_last_heartbeat) * 1e-9 / window : 0.0;
    busy_ns_at_last_heartbeat = busy;
    heartbeat_window_start = now;
    json body = {{"busy_fraction", std::min(1.0, busy_fraction)}, {"batches", batches.load()},
                 {"busy_seconds_total", double(busy) * 1e-9},
                 {"clock_seconds", std::chrono::duration<double>(now.time_since_epoch()).count()}};
    {
      std::lock_guard lk(stage_mu);
      body["state"] = state;
      body["load_fraction"] = load_fraction;
      if (executor) {  // figures the compute thread publishes: the executor is its alone
        body["kv_used_tokens"] = kv_used_stat.load();
        body["kv_capacity_tokens"] = kv_capacity_stat.load();
        body["sequences"] = sequences_stat.load();
      }
    }
    send(ControlMessage::make("heartbeat", body));
    last_heartbeat = now;
  }

  // Connects the data-plane peers of an assignment (under stage_mu).
  // Endpoints to peers that keep their place are kept (transport::keep_or_connect).
  Status wire(const Assignment& a) {
    const std::string prev_name = a.stage == 0 ? "coordinator" : "stage" + std::to_string(a.stage - 1);
    if (Status s = transport::keep_or_connect(*channel, next_peer, next_address, a.next,
                                              "stage" + std::to_string(a.stage + 1));
        !s)
      return s;
    if (Status s = transport::keep_or_connect(*channel, prev_peer, prev_address, a.prev, prev_name); !s) return s;
    return transport::keep_or_connect(*channel, coord_peer, coord_address, a.coordinator, "coordinator");
  }

  void on_assign(const json& body) {
    auto a = parse_assign(body);
    if (!a) {
      send(ControlMessage::make("load_failed", {{"error", a.error()}}));
      return;
    }
    // Same layers of the same model already loaded: only the wiring changes.
    bool reuse = false;
    {
      std::lock_guard lk(stage_mu);
      reuse = executor && assignment && assignment->model == a->model &&
              assignment->layer_begin == a->layer_begin && assignment->layer_end == a->layer_end &&
              state != "loading";
    }
    if (loader.joinable()) loader.join();
    if (reuse) {
      std::unique_lock run(run_mu);  // no micro-batch is running while the cache goes
      handoff->drain();              // nor being sent (a failed send takes stage_mu)
      std::lock_guard lk(stage_mu);
      executor->drop_all();
      publish_stats();
      assignment = *a;
      if (Status s = wire(*a); !s) {
        report_wiring_failure(*a, s);
        return;
      }
      state = "ready";
      send_ready(0, 0);
      return;
    }
    compute_stop = true;
    if (compute.joinable()) compute.join();
    handoff->drain();
    {
      std::lock_guard lk(stage_mu);
      executor.reset();
      assignment = *a;
      state = "loading";
      load_fraction = 0;
    }
    loader = std::thread([this, a = *a] { load(a); });
  }

  // The K/V budget: what the GPU stage allocated, or on the CPU the configured bytes.
  int64_t kv_capacity_tokens(const StageBackend& st) const {
    const int64_t n = st.kv_capacity_tokens();
    return n >= 0 ? n : opt.kv_cache_bytes / std::max<int64_t>(1, st.kv_bytes_per_token());
  }

  // The backend this worker was started with, holding `weights`.
  Expected<std::unique_ptr<StageBackend>> make_backend(StageWeights weights, const Assignment& a) {
    if (opt.backend == "cpu") {
      try {  // CpuStage refuses a --tp the model cannot split
        return std::unique_ptr<StageBackend>(std::make_unique<CpuStageBackend>(std::move(weights), opt.tensor_parallel));
      } catch (const Error& e) {
        return Status::error(e.what());
      }
    }
#ifdef CONVEYOR_HAVE_CUDA
    cuda::GpuStageOptions o;
    o.dtype = opt.dtype == "bf16" ? DType::BF16 : DType::F16;
    o.int8_weights = opt.int8_weights;
    o.name = opt.name + " stage " + std::to_string(a.stage) + " (layers " + std::to_string(a.layer_begin) + ".." +
             std::to_string(a.layer_end) + ")";
    o.kv_cache_fraction = opt.gpu_memory_fraction;
    auto b = cuda::GpuStageBackend::create(weights, opt.gpus, o);
    if (!b) return b.status();
    return std::unique_ptr<StageBackend>(std::move(b).value());
#else
    (void)a;
    return Status::error("this conveyor-worker was built without the CUDA backend");
#endif
  }

  // A neighbour could not be reached (most often it has just died). That is not this
  // worker's failure: it keeps its layers and does not confirm the epoch, so the pipeline
  // stays down until the coordinator, having found the dead neighbour, assigns again.
  void report_wiring_failure(const Assignment& a, const Status& s) {
    spdlog::warn("{}: cannot wire epoch {}: {}", opt.name, a.epoch, s.message());
    send(ControlMessage::make("data_error", {{"error", "wiring: " + s.message()}, {"epoch", a.epoch}}));
  }

  // Tells the coordinator that the data plane failed under the current assignment; it
  // replays the pipeline on fresh connections (once per epoch).
  void report_data_error(const std::string& error, const std::string& peer) {
    json body = {{"error", error}, {"peer", peer}};
    {
      std::lock_guard lk(stage_mu);
      if (assignment) body["epoch"] = assignment->epoch;
    }
    send(ControlMessage::make("data_error", body));
  }

  // Under run_mu, or while no compute thread runs.
  void publish_stats() {
    StageBackend& st = executor->backend();
    kv_used_stat = st.kv_used_tokens();
    kv_capacity_stat = kv_capacity_tokens(st);
    sequences_stat = st.num_sequences();
  }

  void send_ready(double seconds, int64_t bytes) {  // under stage_mu
    publish_stats();
    const int64_t per_token = executor->backend().kv_bytes_per_token();
    send(ControlMessage::make(
        "ready", {{"epoch", assignment->epoch}, {"pipeline", assignment->pipeline}, {"stage", assignment->stage},
                  {"layers", {assignment->layer_begin, assignment->layer_end}},
                  {"kv_bytes_per_token", per_token},
                  {"kv_capacity_tokens", kv_capacity_stat.load()},
                  {"backend", executor->backend().describe()},
                  {"load_seconds", seconds}, {"load_bytes", bytes}}));
    compute_stop = false;
    if (!compute.joinable()) compute = std::thread([this] { compute_loop(); });
  }

  void load(Assignment a) {
    const auto t0 = Clock::now();
    auto last_report = t0;
    spdlog::info("{}: loading layers [{}, {}) of {}", opt.name, a.layer_begin, a.layer_end, a.model);
    auto weights = load_stage_weights(a.model, a.layer_begin, a.layer_end, [&](int64_t done, int64_t total) {
      const double f = total > 0 ? double(done) / double(total) : 1.0;
      {
        std::lock_guard lk(stage_mu);
        load_fraction = f;
      }
      if (Clock::now() - last_report > std::chrono::milliseconds(200) || done == total) {
        last_report = Clock::now();
        send(ControlMessage::make("load_progress", {{"fraction", f}, {"bytes_done", done}, {"bytes_total", total}}));
      }
    });
    std::lock_guard lk(stage_mu);
    auto fail = [&](const std::string& why) {
      state = "idle";
      assignment.reset();
      spdlog::error("{}: load failed: {}", opt.name, why);
      send(ControlMessage::make("load_failed", {{"error", why}}));
    };
    if (!weights) return fail(weights.error());
    const int64_t bytes = weights->checkpoint_bytes_read;
    const double read_secs = std::chrono::duration<double>(Clock::now() - t0).count();
    auto backend = make_backend(std::move(weights).value(), a);
    if (!backend) return fail(backend.error());
    executor = std::make_shared<StageExecutor>(std::move(backend).value());
    if (Status s = wire(a); !s) {
      state = "ready";  // the layers are loaded and kept; the next assignment re-wires
      report_wiring_failure(a, s);
      return;
    }
    state = "ready";
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    spdlog::info("{}: layers [{}, {}) loaded in {:.2f} s ({:.1f} MB; read and converted in {:.2f} s, placed on {} in {:.2f} s)",
                 opt.name, a.layer_begin, a.layer_end, secs, double(bytes) / 1e6, read_secs,
                 executor->backend().describe(), secs - read_secs);
    send_ready(secs, bytes);
  }

  void unassign() {
    if (loader.joinable()) loader.join();
    compute_stop = true;
    if (compute.joinable()) compute.join();
    handoff->drain();
    std::lock_guard lk(stage_mu);
    executor.reset();
    assignment.reset();
    state = "idle";
  }

  // The compute thread: one micro-batch at a time, in arrival order; the handoff's thread
  // sends the activations on while the next one runs.
  void compute_loop() {
#ifdef CONVEYOR_HAVE_CUDA
    if (opt.backend == "cuda" && !opt.gpus.empty())  // else a guard's restore would make a context on GPU 0
      if (cudaError_t e = cudaSetDevice(opt.gpus[0]); e != cudaSuccess)
        spdlog::warn("{}: cannot make GPU {} current on the compute thread: {}", opt.name, opt.gpus[0], cudaGetErrorString(e));
#endif
    while (!compute_stop) {
      auto got = channel->recv(std::chrono::milliseconds(100));
      if (!got) {
        spdlog::warn("{}: data plane: {}", opt.name, got.error());
        report_data_error(got.error(), "");
        continue;
      }
      if (!got->has_value()) continue;
      transport::Message& msg = **got;
      spdlog::debug("{}: message of {} + {} bytes", opt.name, msg.header.size(), msg.payload.size());
      std::shared_ptr<StageExecutor> ex;
      Assignment a;
      PeerId next, coord;
      // Held until the batch has been handed on: a re-assignment waits for it.
      std::unique_lock run_lock(run_mu);
      {
        std::lock_guard lk(stage_mu);
        if (!executor || state != "ready") continue;
        ex = executor, a = *assignment, next = next_peer, coord = coord_peer;
      }
      auto header = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg.header.data()), msg.header.size());
      auto batch = decode_microbatch(header);
      BatchResult result;
      if (!batch) {
        result.error = opt.name + ": " + batch.error();
        send_result(coord, result);
        continue;
      }
      if (batch->epoch != a.epoch) continue;  // a batch from before a re-plan: dropped by design
      result.batch_id = batch->batch_id, result.pipeline = batch->pipeline, result.epoch = batch->epoch;
      const auto t0 = Clock::now();
      Status s = ex->run(*batch, msg.payload.view(), a.next.empty() ? &result : nullptr);
      auto busy = Clock::now() - t0;
      int slot = -1;
      size_t out_bytes = 0;
      if (s && !a.next.empty()) {  // the outgoing activations into a free slot (waiting is not busy)
        out_bytes = ex->activation_bytes(*batch);
        try {
          slot = handoff->acquire(out_bytes, [&](size_t n) { return ex->backend().allocate_host(n); });
        } catch (const std::bad_alloc&) {
          s = Status::error("no host memory for " + std::to_string(out_bytes) + " bytes of outgoing activations");
        }
        if (slot >= 0) {
          const auto t1 = Clock::now();
          s = ex->read_activations(*batch, handoff->slot(slot));
          busy += Clock::now() - t1;
          if (!s) handoff->cancel(slot);
        }
      }
      busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(busy).count();
      ++batches;
      publish_stats();
      if (!s) {
        result.error = opt.name + " (stage " + std::to_string(a.stage) + "): " + s.message();
        send_result(coord, result);
        continue;
      }
      if (a.next.empty()) {
        result.busy_seconds = std::chrono::duration<double>(busy).count();
        send_result(coord, result);
        continue;
      }
      std::vector<std::byte> out_header = std::move(msg.header);
      if (batch->activation_dtype != ex->activation_dtype()) {  // say what the payload now holds
        batch->activation_dtype = ex->activation_dtype();
        const std::vector<uint8_t> bytes = encode(*batch);
        out_header.assign(reinterpret_cast<const std::byte*>(bytes.data()),
                      reinterpret_cast<const std::byte*>(bytes.data()) + bytes.size());
      }
      handoff->submit(slot, next, std::move(out_header), out_bytes, [this, next, coord, result](const Status& sent) mutable {
        {
          std::lock_guard lk(stage_mu);
          if (next_peer == next) next_address.clear();  // the next wiring connects afresh
        }
        report_data_error(sent.message(), "next");
        result.error = opt.name + ": could not hand batch to the next stage: " + sent.message();
        send_result(coord, result);
      });
    }
  }

  void send_result(PeerId coord, const BatchResult& r) {
    const std::vector<uint8_t> bytes = encode(r);
    Status s = channel->send(coord, std::as_bytes(std::span(bytes)), {}, std::chrono::milliseconds(10000));
    if (!s) report_data_error(s.message(), "coordinator");
  }

  void handle(const ControlMessage& m) {
    last_from_coordinator = Clock::now();
    const std::string type = m.type();
    if (type == "welcome") {
      welcomed = true;
      service::ready("joined " + opt.coordinator + " as " + opt.name);
      spdlog::info("{}: joined the coordinator", opt.name);
    } else if (type == "rejected") {
      spdlog::error("{}: the coordinator refused this worker: {}", opt.name, m.body.value("reason", std::string("?")));
      exit_code = 3;
    } else if (type == "assign") {
      on_assign(m.body);
    } else if (type == "unassign") {
      unassign();
    } else if (type == "drain") {
      std::lock_guard lk(stage_mu);
      if (state == "ready") state = "draining";
    } else if (type == "shutdown") {
      exit_code = 0;
    } else if (type == "goodbye") {  // it stops; a new one will find us holding our layers
      spdlog::info("{}: the coordinator says goodbye: {}", opt.name, m.body.value("reason", std::string("?")));
      welcomed = false;
    } else if (type == "heartbeat") {
      if (m.body.value("register", false) && welcomed) {  // a restarted coordinator does not know us
        spdlog::info("{}: the coordinator does not know this worker; registering again (keeping its layers)", opt.name);
        welcomed = false;
        last_register = {};
      }
    } else {
      spdlog::warn("{}: ignoring unknown control message '{}'", opt.name, type);
    }
  }

  bool has_stage() {
    std::lock_guard lk(stage_mu);
    return assignment.has_value();
  }

  // Until `stop` (a signal): serve. Then, holding a stage, ask the coordinator to take it
  // away (a spare or a smaller plan takes over, or the pipeline finishes its running
  // requests first) and leave once told to drop it, or after `drain_timeout`.
  int run(const std::atomic<bool>& stop) {
    send_register();
    std::optional<Clock::time_point> leave_by;
    while (exit_code < 0) {
      const auto now = Clock::now();
      if (stop && !leave_by) {
        service::stopping();
        if (!welcomed || !has_stage()) break;
        spdlog::info("{}: asked to stop: handing the stage over (waiting up to {} ms)", opt.name, opt.drain_timeout.count());
        send(ControlMessage::make("draining", {{"reason", "signal"}}));
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
      }
      if (!welcomed && !leave_by && Clock::now() - last_register > std::chrono::seconds(1)) send_register();
      if (welcomed && Clock::now() - last_heartbeat > opt.heartbeat_interval) send_heartbeat();
      service::watchdog_tick();
    }
    if (exit_code < 0) {  // stopped by a signal: tell the coordinator we are going
      control->post(ControlMessage::make("leaving", {{"reason", "signal"}}));
      (void)control->flush_posted();
      exit_code = 0;
    }
    stop_threads();
    return exit_code;
  }
};

Worker::Worker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;

Expected<std::unique_ptr<Worker>> Worker::create(WorkerOptions options) {
  auto impl = std::make_unique<Impl>();
  if (options.name.empty()) options.name = host_name() + "-" + std::to_string(::getpid());
  if (options.join_token.empty()) return Status::error("worker: a join token is required (--join-token or CONVEYOR_JOIN_TOKEN)");
  std::string endpoint = options.coordinator;
  if (endpoint.rfind("tcp://", 0) != 0) endpoint = "tcp://" + endpoint;
  transport::ControlClientOptions copt;
  copt.identity = options.name;
  copt.curve_server_key = options.curve_server_key;
  auto client = transport::ControlClient::connect(endpoint, copt);
  if (!client) return Status::error("worker: cannot set up the control connection to " + endpoint + ": " + client.error());
  transport::UcxChannelOptions uopt;
  uopt.name = options.name;
#ifdef CONVEYOR_HAVE_CUDA
  if (options.backend == "cuda" && !options.gpus.empty()) uopt.receive_allocator = pinned_receive_buffers(options.gpus[0]);
#endif
  auto ch = transport::UcxChannel::create(uopt);
  if (!ch) return Status::error("worker: cannot create the UCX data plane: " + ch.error());
  impl->opt = std::move(options);
  impl->control = std::move(client).value();
  impl->channel = std::move(ch).value();
  impl->handoff = std::make_unique<Handoff>(*impl->channel, 2, std::chrono::milliseconds(10000));
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

int Worker::run(const std::atomic<bool>& stop) { return impl_->run(stop); }

}  // namespace conveyor

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
#include "model/weights.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "stage/backend_factory.h"
#include "stage/stage_executor.h"
#include "stage_worker/handoff.h"
#include "stage_worker/step_trace.h"
#include "transport/channel.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
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

int64_t nanoseconds(Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); }
double milliseconds(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

struct Worker::Impl {
  WorkerOptions opt;
  std::unique_ptr<transport::ControlClient> control;
  std::unique_ptr<transport::UcxChannel> channel;
  std::string host = host_name();
  // A GPU stage's device memory for the direct path (empty on a CPU stage).
  DeviceMemory device;

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
  std::optional<AssignMsg> assignment;       // what is loaded (or loading)
  uint32_t last_epoch = 0;                   // the highest epoch ever assigned (register tells it)
  std::shared_ptr<StageExecutor> executor;   // null until loaded
  PeerId next_peer = transport::kNoPeer, prev_peer = transport::kNoPeer, coord_peer = transport::kNoPeer;
  std::vector<std::byte> next_address, prev_address, coord_address;  // whom those peers reach
  WorkerState state = WorkerState::Idle;
  double load_fraction = 0;

  std::thread loader, compute;
  // The compute thread's outgoing activations, sent on by the handoff's own thread; two slots.
  std::unique_ptr<Handoff> handoff;
  std::atomic<bool> compute_stop{false};
  std::atomic<uint64_t> batches{0};
  std::atomic<int64_t> busy_ns{0};
  // Between steps (StepTrace's wait_input and idle_ready, cumulative): waiting for an input
  // that had not arrived, and sitting with one that had.
  std::atomic<int64_t> wait_input_ns{0}, idle_ready_ns{0};
  std::unique_ptr<StepTrace> trace;  // CONVEYOR_TRACE_DIR; the compute thread's alone
  // The compute thread's: whether the hop to the next stage is open to the direct path
  // (logged on change; micro-batches under direct_min_bytes still go staged).
  std::optional<bool> direct_to_next;
  // Micro-batches smaller than this go staged even where the direct path is open. On one H100
  // a direct handoff took about 300 us whatever its size (UCX's rendezvous over TCP loopback
  // and its CUDA-event polling), a staged one 200-330 us up to 256 KiB and 436 us at 1 MiB,
  // where direct took 332 (docs/PERFORMANCE.md, "Activations GPU to GPU").
  // CONVEYOR_DIRECT_MIN_BYTES overrides it (0: every micro-batch direct).
  size_t direct_min_bytes() const { return size_t(opt.direct_min_bytes); }
  int64_t busy_ns_at_last_heartbeat = 0;
  Clock::time_point heartbeat_window_start = Clock::now();

  ~Impl() { stop_threads(); }

  void stop_threads() {
    // The loader first: it starts the compute thread when it is done (send_ready).
    if (loader.joinable()) loader.join();
    compute_stop = true;
    if (compute.joinable()) compute.join();
    handoff.reset();  // sends what is queued first
  }

  template <class Msg>
  void send(const Msg& m) { control->post(transport::encode(m)); }

  // Whether this worker moves activations GPU to GPU: its UCX moves CUDA memory and it is a
  // GPU stage. Each hop is direct when both its ends are; otherwise staged through host memory.
  bool direct_capable() const { return channel->takes_device_memory() && channel->sends_device_memory(); }

  // What register's data_plane says (shown per worker in /v1/cluster): the path its
  // activations take, where it receives them, and whether its UCX moves CUDA memory.
  nlohmann::json data_plane_json() const {
    const bool cuda = opt.stage.backend == Backend::Cuda;
    const bool direct = direct_capable();
    return {{"path", direct ? "direct" : "staged"},
            {"staging", cuda ? "page-locked host" : "host"},
            {"receive", direct ? "device" : (cuda ? "page-locked host" : "host")},
            {"ucx_cuda_memory", channel->supports_cuda_memory()}};
  }

  void send_register() {
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

  void send_heartbeat() {
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

  // Connects the data-plane peers of an assignment (under stage_mu).
  // Endpoints to peers that keep their place are kept (transport::keep_or_connect).
  Status wire(const AssignMsg& a) {
    const std::string prev_name = a.stage == 0 ? "coordinator" : "stage" + std::to_string(a.stage - 1);
    if (Status s = transport::keep_or_connect(*channel, next_peer, next_address, a.next_address,
                                              "stage" + std::to_string(a.stage + 1));
        !s)
      return s;
    if (Status s = transport::keep_or_connect(*channel, prev_peer, prev_address, a.prev_address, prev_name); !s) return s;
    return transport::keep_or_connect(*channel, coord_peer, coord_address, a.coordinator_address, "coordinator");
  }

  void on(const AssignMsg& a) {
    // A next stage that is replaced may be cut off rather than dead: sends to it would hold
    // the handoff, and with it this thread (and its heartbeats), until they time out, and the
    // coordinator would take this healthy worker for dead too. Disconnect it first: the sends
    // queued for it fail at once (tests/netns: a link cut longer than the liveness window).
    {
      std::lock_guard lk(stage_mu);
      if (next_peer != transport::kNoPeer &&
          !std::equal(next_address.begin(), next_address.end(), a.next_address.begin(), a.next_address.end())) {
        (void)channel->disconnect(next_peer);
        next_peer = transport::kNoPeer;
        next_address.clear();
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
    if (loader.joinable()) loader.join();
    if (reuse) {
      std::unique_lock run(run_mu);  // no micro-batch is running while the cache goes
      handoff->drain();              // nor being sent (a failed send takes stage_mu)
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
    compute_stop = true;
    if (compute.joinable()) compute.join();
    handoff->drain();
    {
      std::lock_guard lk(stage_mu);
      executor.reset();
      assignment = a;
      last_epoch = std::max(last_epoch, a.epoch);
      state = WorkerState::Loading;
      load_fraction = 0;
    }
    loader = std::thread([this, a] { load(a); });
  }

  // The backend this worker was started with, holding `weights`.
  Expected<std::unique_ptr<StageBackend>> make_backend(StageWeights weights, const AssignMsg& a) {
    StageOptions o = opt.stage;
    o.name = opt.name + " stage " + std::to_string(a.stage) + " (layers " + std::to_string(a.layer_begin) + ".." +
             std::to_string(a.layer_end) + ")";
    return make_stage_backend(std::move(weights), o);
  }

  // A neighbour could not be reached (most often it has just died). That is not this
  // worker's failure: it keeps its layers and does not confirm the epoch, so the pipeline
  // stays down until the coordinator, having found the dead neighbour, assigns again.
  void report_wiring_failure(const AssignMsg& a, const Status& s) {
    spdlog::warn("{}: cannot wire epoch {}: {}", opt.name, a.epoch, s.message());
    send(transport::DataErrorMsg{.error = "wiring: " + s.message(), .epoch = a.epoch});
  }

  // Tells the coordinator that the data plane failed under the current assignment; it
  // replays the pipeline on fresh connections (once per epoch).
  void report_data_error(const std::string& error, const std::string& peer) {
    transport::DataErrorMsg m{.error = error, .peer = peer};
    {
      std::lock_guard lk(stage_mu);
      if (assignment) m.epoch = assignment->epoch;
    }
    send(m);
  }

  // Under run_mu, or while no compute thread runs.
  void publish_stats() {
    StageBackend& st = executor->backend();
    kv_used_stat = st.kv_used_tokens();
    kv_capacity_stat = st.kv_capacity_tokens();
    sequences_stat = st.num_sequences();
  }

  void send_ready(double seconds, int64_t bytes) {  // under stage_mu
    publish_stats();
    send(transport::ReadyMsg{.epoch = assignment->epoch, .pipeline = assignment->pipeline,
                             .stage = assignment->stage, .layer_begin = assignment->layer_begin,
                             .layer_end = assignment->layer_end,
                             .kv_bytes_per_token = executor->backend().kv_bytes_per_token(),
                             .kv_capacity_tokens = kv_capacity_stat.load(),
                             .backend = executor->backend().describe(),
                             .load_seconds = seconds, .load_bytes = bytes});
    compute_stop = false;
    if (!compute.joinable()) compute = std::thread([this] { compute_loop(); });
  }

  void load(AssignMsg a) {
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
        send(transport::LoadProgressMsg{.fraction = f, .bytes_done = done, .bytes_total = total});
      }
    });
    const int64_t bytes = weights ? weights->checkpoint_bytes_read : 0;
    const double read_secs = std::chrono::duration<double>(Clock::now() - t0).count();
    // The backend is built without stage_mu: placing a large stage on a GPU can outlast the
    // coordinator's liveness window, and the heartbeats need that lock.
    std::optional<Expected<std::unique_ptr<StageBackend>>> backend;
    if (weights) backend = make_backend(std::move(weights).value(), a);
    std::lock_guard lk(stage_mu);
    auto fail = [&](const std::string& why) {
      state = WorkerState::Idle;
      assignment.reset();
      spdlog::error("{}: load failed: {}", opt.name, why);
      send(transport::LoadFailedMsg{.error = why});
    };
    if (!weights) return fail(weights.error());
    if (!*backend) return fail(backend->error());
    executor = std::make_shared<StageExecutor>(std::move(*backend).value());
    if (Status s = wire(a); !s) {
      state = WorkerState::Ready;  // the layers are loaded and kept; the next assignment re-wires
      report_wiring_failure(a, s);
      return;
    }
    state = WorkerState::Ready;
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
    state = WorkerState::Idle;
  }

  using Received = Expected<std::optional<transport::Message>>;

  // The compute thread: one micro-batch at a time, in arrival order; the handoff's thread
  // sends the activations on while the next one runs. Between steps it tells apart waiting
  // for an input that has not arrived and sitting with one that has (StepTrace): right after
  // a step it looks, without waiting, whether the next input is there.
  void compute_loop() {
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

  // What a step reads of the stage, copied under stage_mu.
  struct StepStage {
    std::shared_ptr<StageExecutor> ex;
    AssignMsg a;
    PeerId next, coord;
  };

  // Where a step's outgoing activations went: the handoff slot (-1: none asked for), its
  // size in bytes, and how long the step waited for the slot (not busy time).
  struct StepOutput {
    int slot = -1;
    size_t bytes = 0;
    Clock::duration waited{};
  };

  // A step's times: between steps (StepTrace's wait_input and idle_ready) and in it.
  struct StepTiming {
    Clock::time_point start;
    Clock::duration wait_input{}, idle_ready{}, busy{};
    int64_t sent_ns_before = 0;  // the handoff's send_ns_total when the step began
  };

  // Runs the micro-batch `msg` (under run_mu) and sends on what it made. `prev_end` is when
  // the previous step ended; `ready_at_end` gets what the look for the next input found.
  void run_step(transport::Message& msg, bool was_ready, Clock::time_point arrived, Clock::time_point& prev_end,
                std::optional<Received>& ready_at_end) {
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
    if (batch->epoch != st->a.epoch) {  // a batch from before a re-plan or failover: fenced off
      spdlog::info("{}: dropped a stale micro-batch (batch {}, epoch {}; this stage runs epoch {})", opt.name,
                   batch->batch_id, batch->epoch, st->a.epoch);
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
    busy_ns += nanoseconds(timing.busy);
    ++batches;
    publish_stats();
    StepRecord rec;
    if (trace) rec = step_record(st->a, *batch, *st->ex, timing, out);
    if (!s) {
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

  // The stage as a step sees it; none (the micro-batch dropped) when it is not ready.
  std::optional<StepStage> ready_stage() {
    std::lock_guard lk(stage_mu);
    if (!executor || state != WorkerState::Ready) {  // cannot happen while the compute thread runs
      spdlog::warn("{}: dropped a micro-batch: the stage is {}", opt.name, executor ? "not ready" : "not loaded");
      return std::nullopt;
    }
    return StepStage{.ex = executor, .a = *assignment, .next = next_peer, .coord = coord_peer};
  }

  // Counts the time before the step that begins now: waiting for its input, or sitting with it.
  StepTiming start_step(bool was_ready, Clock::time_point arrived, Clock::time_point prev_end) {
    StepTiming t{.start = Clock::now()};
    t.wait_input = was_ready ? Clock::duration{} : std::max(Clock::duration{}, arrived - prev_end);
    t.idle_ready = t.start - (was_ready ? prev_end : std::max(prev_end, arrived));
    wait_input_ns += nanoseconds(t.wait_input);
    idle_ready_ns += nanoseconds(t.idle_ready);
    t.sent_ns_before = handoff->send_ns_total();
    return t;
  }

  // Whether activations to `next` take the direct path: device slots when this worker and the
  // next stage both move CUDA memory. Logs when that changes.
  bool direct_to(PeerId next) {
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

  // Where `ex` writes a step's outgoing activations: a free send slot (a device one on the
  // direct path), recorded in `out`.
  ActivationSink activation_sink(bool direct, StageExecutor& ex, StepOutput& out) {
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

  // Looks, without waiting, whether the next input is there; none when nothing is waiting
  // or the thread is stopping.
  std::optional<Received> peek_next_input() {
    if (compute_stop) return std::nullopt;
    Received got = channel->recv(std::chrono::milliseconds(0));
    if (got && !got->has_value()) return std::nullopt;  // nothing waiting
    return std::optional<Received>(std::move(got));
  }

  // The trace line of a step that has run (send_ms is filled in by write_trace).
  StepRecord step_record(const AssignMsg& a, const MicroBatch& batch, const StageExecutor& ex,
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

  void write_trace(StepRecord& rec, const StepTiming& t, Clock::duration send) {
    if (!trace) return;
    // What the handoff thread spent sending since this step began (mostly the previous
    // step's activations, or on the last stage its result); a failed step's error result
    // is sent on this thread (`send`).
    rec.send_ms = milliseconds(send) + double(handoff->send_ns_total() - t.sent_ns_before) * 1e-6;
    trace->write(rec);
  }

  // The last stage sends the step's result to the coordinator. With the next input already
  // waiting, the result goes out on the handoff's thread (like activations) so the next step
  // starts at once; with none waiting this thread has nothing else to do, and sends it itself,
  // sparing the wake-up of another thread (a one-stage pipeline's next input cannot come
  // before the coordinator has this).
  void finish_last_stage(const StepStage& st, BatchResult& result, StepRecord& rec, const StepTiming& t,
                         bool next_waiting) {
    result.busy_seconds = std::chrono::duration<double>(t.busy).count();
    const auto s0 = Clock::now();
    if (next_waiting) {
      queue_result(st.coord, result, st.ex);
      if (trace) rec.slot_wait_ms += milliseconds(Clock::now() - s0);
      write_trace(rec, t, {});
    } else {
      if (!handoff->idle()) handoff->drain();  // results leave in order
      send_result(st.coord, result);
      write_trace(rec, t, Clock::now() - s0);
    }
  }

  // Queues the step's activations (slot `out`) to the next stage, with `header`. The header
  // goes on as it came (admissions unread), saying what the payload now holds.
  void hand_on(const StepStage& st, std::vector<std::byte> header, const MicroBatch& batch,
               BatchResult result, const StepOutput& out) {
    if (batch.activation_dtype != st.ex->activation_dtype())
      (void)patch_activation_dtype(header, st.ex->activation_dtype());  // it decoded: it is a header
    handoff->submit(out.slot, st.next, std::move(header), out.bytes,
                    [this, next = st.next, coord = st.coord, result = std::move(result)](const Status& sent) mutable {
                      {
                        std::lock_guard lk(stage_mu);
                        if (next_peer == next) next_address.clear();  // the next wiring connects afresh
                      }
                      report_data_error(sent.message(), "next");
                      result.error = opt.name + ": could not hand batch to the next stage: " + sent.message();
                      send_result(coord, result);
                    });
  }

  // A device slot of `bytes` on this stage's GPU (the direct path); null when none is left.
  std::shared_ptr<std::byte[]> device_slot(size_t bytes) {
    auto* p = static_cast<std::byte*>(device.allocator.allocate(bytes));
    if (!p) return nullptr;
    return std::shared_ptr<std::byte[]>(p, [release = device.allocator.release](std::byte* q) { release(q); });
  }

  // A last stage's result, sent by the handoff's thread in order with nothing else (a
  // header, no payload); a failed send is a data-plane error, as send_result's.
  void queue_result(PeerId coord, const BatchResult& r, const std::shared_ptr<StageExecutor>& ex) {
    auto slot = handoff->acquire(0, [&](size_t n) { return ex->backend().allocate_host(n); });
    if (!slot) {  // no slot memory cannot happen for 0 bytes; send here all the same
      send_result(coord, r);
      return;
    }
    const std::vector<uint8_t> bytes = encode(r);
    std::vector<std::byte> header(reinterpret_cast<const std::byte*>(bytes.data()),
                                  reinterpret_cast<const std::byte*>(bytes.data()) + bytes.size());
    handoff->submit(*slot, coord, std::move(header), 0,
                    [this](const Status& sent) { report_data_error(sent.message(), "coordinator"); });
  }

  void send_result(PeerId coord, const BatchResult& r) {
    const std::vector<uint8_t> bytes = encode(r);
    Status s = channel->send(coord, std::as_bytes(std::span(bytes)), {}, std::chrono::milliseconds(10000));
    if (!s) report_data_error(s.message(), "coordinator");
  }

  // Decodes once and dispatches to the on(...) overload of the message's kind.
  void handle(const ControlMessage& m) {
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

  void on(const transport::WelcomeMsg& m) {
    welcomed = true;
    service::ready("joined " + opt.coordinator + " as " + opt.name);
    spdlog::info("{}: joined the coordinator", opt.name);
    if (m.model) send_footprint(*m.model);
  }

  // What the coordinator's model takes in this worker's format: the planner's figures for it.
  void send_footprint(const transport::ModelShape& model) {
    StageOptions o = opt.stage;
    o.name = opt.name;
    auto f = stage_footprint(transport::model_config(model), o);
    if (!f) spdlog::error("{}: cannot hold the coordinator's model: {}", opt.name, f.error());
    send(f ? transport::FootprintMsg{.footprint = *f} : transport::FootprintMsg{.error = f.error()});
  }

  void on(const transport::RejectedMsg& m) {
    spdlog::error("{}: the coordinator refused this worker: {}", opt.name, m.reason);
    exit_code = 3;
  }

  void on(const transport::UnassignMsg&) { unassign(); }

  void on(const transport::DrainMsg&) {
    std::lock_guard lk(stage_mu);
    if (state == WorkerState::Ready) state = WorkerState::Draining;
  }

  void on(const transport::ShutdownMsg&) { exit_code = 0; }

  void on(const transport::GoodbyeMsg& m) {  // it stops; a new one will find us holding our layers
    spdlog::info("{}: the coordinator says goodbye: {}", opt.name, m.reason);
    welcomed = false;
  }

  void on(const transport::HeartbeatMsg& m) {
    if (m.register_again && welcomed) {  // a restarted coordinator does not know us
      spdlog::info("{}: the coordinator does not know this worker; registering again (keeping its layers)", opt.name);
      welcomed = false;
      last_register = {};
    }
  }

  // Kinds only a worker sends.
  template <class Msg>
  void on(const Msg&) {
    spdlog::warn("{}: ignoring '{}', a message a worker does not expect", opt.name,
                 transport::control_kind_name(Msg::kind));
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
      }
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
  // --host: the data plane on that address's interface alone (`lo` for 127.0.0.1), unless
  // --data-interface or UCX_NET_DEVICES says otherwise; neither: every interface.
  auto iface = transport::choose_data_interface(options.host, options.data_interface);
  if (!iface)
    return Status::error("worker: the data plane's interface" +
                         (options.host.empty() ? std::string() : " (--host " + options.host + ")") + ": " +
                         iface.error());
  uopt.net_devices = iface->net_devices;
  spdlog::info("{}: data plane on {} ({})", options.name, iface->shown, iface->source);
  uopt.receive_allocator = receive_allocator(options.stage);
  // A GPU stage takes activations into its GPU's memory when its UCX moves CUDA memory.
  impl->device = device_memory(options.stage);
  uopt.device_allocator = impl->device.allocator;
  uopt.progress_thread_init = impl->device.bind_thread;
  auto ch = transport::UcxChannel::create(uopt);
  if (!ch) return Status::error("worker: cannot create the UCX data plane: " + ch.error());
  if (!options.host.empty()) impl->host = options.host;
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

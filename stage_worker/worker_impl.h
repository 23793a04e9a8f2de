// The worker's state and its threads' work, shared by worker.cc (control thread, loader,
// start-up) and worker_step.cc (the compute thread: one micro-batch per step, handed on).
// Private to stage_worker/.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "stage/backend_factory.h"
#include "stage/stage_executor.h"
#include "stage_worker/handoff.h"
#include "stage_worker/step_trace.h"
#include "stage_worker/waitable_thread.h"
#include "stage_worker/worker.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
#include "transport/endpoint.h"
#include "transport/ucx_channel.h"

namespace conveyor {

struct Worker::Impl {
  using Clock = std::chrono::steady_clock;
  using AssignMsg = transport::AssignMsg;
  using ControlMessage = transport::ControlMessage;
  using PeerId = transport::PeerId;
  using WorkerState = transport::WorkerState;

  WorkerOptions opt;
  std::unique_ptr<transport::ControlClient> control;
  std::unique_ptr<transport::UcxChannel> channel;
  std::string host;  // --host, or the host name
  // A GPU stage's device memory for the direct path (empty on a CPU stage).
  DeviceMemory device;

  transport::HostPort coordinator_at;  // --coordinator, parsed (and resolved once) at start

  // Control-thread state.
  bool welcomed = false;
  Clock::time_point unwelcomed_since = Clock::now();  // when `welcomed` last turned false
  Clock::time_point last_explained{};                 // explain_not_joined's last line
  Clock::time_point last_from_coordinator = Clock::now();
  Clock::time_point last_register{};
  Clock::time_point last_heartbeat{};
  int exit_code = -1;

  // The stage: written by the loader, read by compute; guarded by stage_mu.
  // The executor is used by one thread at a time: taken before stage_mu. Timed: the control
  // thread takes it in slices, heartbeating between them (a step may wait on a send).
  std::timed_mutex run_mu;
  std::mutex stage_mu;
  std::atomic<int64_t> kv_used_stat{0}, kv_capacity_stat{0}, sequences_stat{0};
  std::optional<AssignMsg> assignment;       // what is loaded (or loading)
  uint32_t last_epoch = 0;  // the highest epoch ever assigned (register tells it)
  // The epoch of the newest assign, set as soon as it arrives, before it is applied: a step of
  // an older epoch is of a plan the coordinator has left, and what fails in it (most often a
  // send to a neighbour the re-wiring has just dropped) is not reported.
  uint32_t assigned_epoch = 0;
  std::shared_ptr<StageExecutor> executor;   // null until loaded
  PeerId next_peer = transport::kNoPeer, prev_peer = transport::kNoPeer, coord_peer = transport::kNoPeer;
  std::vector<std::byte> next_address, prev_address, coord_address;  // whom those peers reach
  WorkerState state = WorkerState::Idle;
  double load_fraction = 0;

  WaitableThread loader, compute;
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
  // Micro-batches smaller than this go staged even where the direct path is open. Between two
  // H200s over NVLink (a worker a GPU, the deployment) a direct handoff took 57-73 us whatever
  // its size up to 1 MiB (UCX's rendezvous over TCP loopback, the data by cuda_ipc), a staged one
  // 39-62 us at 16 KiB, 85-99 at 64 KiB and 343-384 at 1 MiB (docs/PERFORMANCE.md, "Tensor
  // parallel's fix on two GPUs, the handoff with UCX's CUDA transports, ...").
  // CONVEYOR_DIRECT_MIN_BYTES overrides it (0: every micro-batch direct).
  size_t direct_min_bytes() const { return size_t(opt.direct_min_bytes); }
  int64_t busy_ns_at_last_heartbeat = 0;
  Clock::time_point heartbeat_window_start = Clock::now();

  ~Impl() { stop_threads(); }

  void stop_threads();

  template <class Msg>
  void send(const Msg& m) { control->post(transport::encode(m)); }

  // Whether this worker moves activations GPU to GPU: its UCX moves CUDA memory and it is a
  // GPU stage. Each hop is direct when both its ends are; otherwise staged through host memory.
  bool direct_capable() const { return channel->takes_device_memory() && channel->sends_device_memory(); }

  // What register's data_plane says (shown per worker in /v1/cluster): the path its
  // activations take, where it receives them, and whether its UCX moves CUDA memory.
  nlohmann::json data_plane_json() const;

  void send_register();

  void send_heartbeat();

  // The control thread's waits for the other threads: `done(slice)` waits up to one slice (the
  // heartbeat interval) and says whether the wait is over; between slices the worker
  // heartbeats. One wait may last a send's whole timeout (a neighbour that stopped taking
  // micro-batches), longer than the coordinator's liveness window: a worker that only waited
  // was taken for dead (a drained one, or the healthy upstream of an unreachable stage).
  // This thread owns the control socket: what it posts leaves only when it flushes.
  template <class Done>
  void wait_heartbeating(Done&& done) {
    while (!done(opt.heartbeat_interval)) {
      if (welcomed) send_heartbeat();
      (void)control->flush_posted();  // it says itself when it cannot send
    }
  }
  void drain_handoff();
  void join_loader();
  // Tells the compute thread to end: its waits for a send slot end at once and its receive
  // within its poll; a send it makes itself ends by its timeout.
  void ask_compute_to_stop();
  // ask_compute_to_stop(), then waits for the thread's end heartbeating.
  void stop_compute();

  // Whether a step of `epoch` belongs to a plan the coordinator has since left.
  bool superseded(uint32_t epoch);

  // Not welcomed for a few seconds: says why every few seconds, naming the coordinator's
  // address ("connection refused", "no answer within 500 ms", or that it accepts connections
  // and does not answer).
  void explain_not_joined();

  // Connects the data-plane peers of an assignment (under stage_mu).
  // Endpoints to peers that keep their place are kept (transport::keep_or_connect).
  Status wire(const AssignMsg& a);

  void on(const AssignMsg& a);

  // The stage options of an assignment: the worker's, named for the stage.
  StageOptions stage_options(const AssignMsg& a) const;

  // A neighbour could not be reached (most often it has just died). That is not this
  // worker's failure: it keeps its layers and does not confirm the epoch, so the pipeline
  // stays down until the coordinator, having found the dead neighbour, assigns again.
  void report_wiring_failure(const AssignMsg& a, const Status& s);

  // Tells the coordinator that the data plane failed in `epoch` (0: the current assignment's);
  // it replays the pipeline on fresh connections (once per epoch) when that is its epoch, and
  // weighs a report of the epoch it replayed from as evidence of an unreachable peer.
  void report_data_error(const std::string& error, const std::string& peer, uint32_t epoch = 0);

  // Under run_mu, or while no compute thread runs.
  void publish_stats();

  // Under stage_mu: says the stage is ready and starts the compute thread.
  void send_ready(double seconds, int64_t bytes);

  void load(AssignMsg a);

  void unassign();

  using Received = Expected<std::optional<transport::Message>>;

  // The compute thread: one micro-batch at a time, in arrival order; the handoff's thread
  // sends the activations on while the next one runs. Between steps it tells apart waiting
  // for an input that has not arrived and sitting with one that has (StepTrace): right after
  // a step it looks, without waiting, whether the next input is there.
  void compute_loop();

  // What a step reads of the stage, copied under stage_mu.
  struct StepStage {
    std::shared_ptr<StageExecutor> ex;
    AssignMsg a;
    PeerId next, coord;
    uint32_t assigned_epoch = 0;  // above a.epoch while a new assignment is being applied
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
                std::optional<Received>& ready_at_end);

  // The stage as a step sees it; none (the micro-batch dropped) when it is not ready.
  std::optional<StepStage> ready_stage();

  // After a failed step: ends the process (Worker::kExitBackendLost) when `ex`'s backend can
  // run no other step (StageBackend::health); returns otherwise.
  void leave_if_backend_lost(StageExecutor& ex, const Status& step);

  // Counts the time before the step that begins now: waiting for its input, or sitting with it.
  StepTiming start_step(bool was_ready, Clock::time_point arrived, Clock::time_point prev_end);

  // Whether activations to `next` take the direct path: device slots when this worker and the
  // next stage both move CUDA memory. Logs when that changes.
  bool direct_to(PeerId next);

  // Where `ex` writes a step's outgoing activations: a free send slot (a device one on the
  // direct path), recorded in `out`.
  ActivationSink activation_sink(bool direct, StageExecutor& ex, StepOutput& out);

  // Looks, without waiting, whether the next input is there; none when nothing is waiting
  // or the thread is stopping.
  std::optional<Received> peek_next_input();

  // The trace line of a step that has run (send_ms is filled in by write_trace).
  StepRecord step_record(const AssignMsg& a, const MicroBatch& batch, const StageExecutor& ex,
                         const StepTiming& t, const StepOutput& out) const;

  void write_trace(StepRecord& rec, const StepTiming& t, Clock::duration send);

  // The last stage sends the step's result to the coordinator. With the next input already
  // waiting, the result goes out on the handoff's thread (like activations) so the next step
  // starts at once; with none waiting this thread has nothing else to do, and sends it itself,
  // sparing the wake-up of another thread (a one-stage pipeline's next input cannot come
  // before the coordinator has this).
  void finish_last_stage(const StepStage& st, BatchResult& result, StepRecord& rec, const StepTiming& t,
                         bool next_waiting);

  // Queues the step's activations (slot `out`) to the next stage, with `header`. The header
  // goes on as it came (admissions unread), saying what the payload now holds.
  void hand_on(const StepStage& st, std::vector<std::byte> header, const MicroBatch& batch,
               BatchResult result, const StepOutput& out);

  // A device slot of `bytes` on this stage's GPU (the direct path); null when none is left.
  std::shared_ptr<std::byte[]> device_slot(size_t bytes);

  // A last stage's result, sent by the handoff's thread in order with nothing else (a
  // header, no payload); a failed send is a data-plane error, as send_result's.
  void queue_result(PeerId coord, const BatchResult& r, const std::shared_ptr<StageExecutor>& ex);

  void send_result(PeerId coord, const BatchResult& r);

  // A step's hand-on that failed after the stage was re-assigned (often to the neighbour the
  // re-wiring dropped): reported with its own epoch, but no error result goes for it, since
  // the coordinator has left that epoch (an engine that had not yet heard of the new one took
  // such a result for a failure of its own and replayed the new plan).
  void log_superseded(const BatchResult& r, const Status& sent);

  // Decodes once and dispatches to the on(...) overload of the message's kind.
  void handle(const ControlMessage& m);

  void on(const transport::WelcomeMsg& m);

  // What the coordinator's model takes in this worker's format: the planner's figures for it.
  void send_footprint(const transport::ModelShape& model);

  void on(const transport::RejectedMsg& m);

  void on(const transport::UnassignMsg&) { unassign(); }

  void on(const transport::DrainMsg&);

  void on(const transport::ShutdownMsg&) { exit_code = 0; }

  // It stops; a new one will find us holding our layers.
  void on(const transport::GoodbyeMsg& m);

  void on(const transport::HeartbeatMsg& m);

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
  int run(const std::atomic<bool>& stop);
};

}  // namespace conveyor

// The coordinator's state and its parts, private to coordinator/. One mutex guards it all;
// every method here runs with it held. The parts, each in its own file:
//   coordinator.cc  the threads (control loop, engine loop), the public calls, the views
//   control.cc      control messages from workers: membership and liveness
//   placement.cc    carrying out plans: pipelines, assignments, wiring, failover, drains
// The planner (planner.h) decides where stages go; the scheduler (scheduler.h) runs requests.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "coordinator/batch_trace.h"
#include "coordinator/cluster_config.h"
#include "coordinator/coordinator.h"
#include "coordinator/membership.h"
#include "coordinator/metrics.h"
#include "coordinator/pipeline.h"
#include "coordinator/planner.h"
#include "coordinator/scheduler.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor {

struct Coordinator::Impl {
  ClusterConfig cfg;
  std::shared_ptr<const Tokenizer> tokenizer;
  Metrics* metrics = nullptr;
  // The control socket belongs to the control thread (transport/control_plane.h): only
  // control_loop() calls its recv(), and stop() its flush_posted() once that thread has been
  // joined. Every other use is send_control(), which posts.
  std::unique_ptr<transport::ControlServer> control;
  std::unique_ptr<transport::UcxChannel> channel;

  mutable std::mutex mu;
  Workers workers;
  std::vector<Pipeline> pipelines;
  std::unique_ptr<Scheduler> scheduler;  // over `pipelines`
  std::unique_ptr<BatchTrace> trace;     // CONVEYOR_TRACE_DIR; the engine thread's

  std::atomic<bool> stopping{false};
  bool accepting = true;  // false once a shutdown drain began (quiesce)
  std::thread control_thread, engine_thread;

  // The plan's shape. `target` is what the operator asked for (the cluster file, then
  // POST /v1/cluster/plan); cfg.stages/replicas/layers is what runs. While workers are
  // missing the coordinator may run a smaller shape over the survivors, and it grows back
  // when workers join. Reshaping happens at the top of the control and engine loops
  // (reshape_pending), never while something iterates over `pipelines`.
  Shape target;
  bool reshape_pending = false;
  bool ever_whole = false;  // a plan is not shrunk while its workers are still joining
  // The highest epoch a worker said it holds or was last assigned (register's `holding` and
  // `last_epoch`, the latter covering a stage it was still loading). A restarted coordinator
  // counts epochs from 1 again while its workers may still have the last one's micro-batches
  // queued (a reloading worker's wait in its channel until it runs again), fenced only by
  // their epoch: send_assignments starts a pipeline above this (next_epoch), so no stale
  // micro-batch passes for one of ours, nor its result for our batch of the same id.
  uint32_t held_epoch = 0;

  // ---- the state's questions (coordinator.cc)
  bool pipeline_ready(const Pipeline& p) const;
  // The K/V tokens a pipeline holds: its smallest stage's.
  int64_t pipeline_kv_capacity(const Pipeline& p) const;
  // A pipeline is recoverable when each missing stage can be filled by a spare or is loading.
  bool pipeline_recoverable(const Pipeline& p) const;
  // Some pipeline serves or is being repaired: requests queue for it (scheduler.pipeline_wait_ms
  // bounds their wait while none is).
  bool serviceable() const;
  bool has_leaver(const Pipeline& p) const;
  bool has_spare() const;
  // Micro-batches kept in flight on `p`: scheduler.in_flight, or auto (its stages, plus the
  // extra its workers ask for when it has several: p.figures).
  int in_flight_depth(const Pipeline& p) const;
  // What the pipeline's workers say of their steps, together (StageFigures).
  StageFigures pipeline_figures(const Pipeline& p) const;
  Shape current_shape() const { return {cfg.stages, cfg.replicas, cfg.layers}; }
  PlanModel plan_model() const { return {cfg.model, cfg.model_path}; }
  bool whole() const;
  std::string health_reason() const;

  // ---- the loops (coordinator.cc)
  void control_loop();
  void engine_loop();
  void launch(Pipeline& p);
  void replay_lost_batches();
  void trace_sent(const Pipeline& p, const Scheduler::Formed& formed, size_t header_bytes, double form_ms,
                  std::optional<double> gap_ms);
  void update_gauges();

  // ---- control messages (control.cc)
  void handle_control(const std::string& peer, const transport::ControlMessage& m);
  void on_register(const std::string& peer, transport::RegisterMsg m);
  transport::WelcomeMsg welcome() const;
  void on_worker_message(WorkerInfo& w, const transport::AnyControlMsg& m);
  void on_data_error(WorkerInfo& w, const transport::DataErrorMsg& m);
  template <class Msg>
  void send_control(const std::string& peer, const Msg& m);
  // Our own endpoint to a pipeline's first or last stage failed: that worker is dead to us.
  // Returns whether one was found.
  bool check_own_endpoints(Pipeline& p, const std::string& why);
  void mark_dead(WorkerInfo& w, const std::string& why);
  void check_liveness();

  // ---- carrying out plans (placement.cc)
  void apply_placement(const Placement& placement, const std::string& why);
  void reshape_if_pending();
  void assign(Pipeline& p, int stage, WorkerInfo& w);
  void send_assignments(Pipeline& p);
  void wire(Pipeline& p);
  void fill_from_spares();
  void fail_stage(Pipeline& p, const std::string& worker, const std::string& why);
  // A new epoch for `p` (next_epoch: above every pipeline's and held_epoch); its work in
  // flight is void and its sequences are fed again.
  void restart_pipeline(Pipeline& p);
  uint32_t next_epoch() const;

  // ---- taking workers out (placement.cc)
  using Served = std::vector<std::pair<Pipeline*, size_t>>;
  Served stages_served_by(const std::string& name);
  AdminReply take_out(WorkerInfo& w, bool wait, const std::string& why);
  nlohmann::json retire(WorkerInfo& w, const std::string& why, const Served& served, const Placement* smaller);
  void release_leavers();
};

// Any thread (the control loop, the engine, REST handlers): the message is posted to the
// control thread, which sends it from its recv() (woken at once) or, once it has stopped,
// from stop(). Everything goes through the one queue, so messages to a worker keep their
// order; a failure is logged by the control plane with the message's type and peer.
template <class Msg>
void Coordinator::Impl::send_control(const std::string& peer, const Msg& m) {
  control->post(peer, transport::encode(m));
}

}  // namespace conveyor

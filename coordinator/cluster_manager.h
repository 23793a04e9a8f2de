// The cluster manager: the coordinator's membership and placement. It owns the workers
// (membership.h) and the pipelines as placed (pipeline.h), handles the workers' control
// messages and liveness (control.cc), carries out the planner's decisions (placement.cc:
// assignments, wiring, failover, drains, re-plans) and answers the state's questions
// (cluster_manager.cc). After every change it publishes an immutable ClusterSnapshot
// (cluster_snapshot.h) to the engine; it never touches the engine's state, and learns what it
// needs of the engine's work from Engine::stats() (taken before its own mutex).
//
// Threads: the control thread (run by start()) owns the ZeroMQ ROUTER: only it calls its
// recv() (and say_goodbye(), once that thread is joined, sends what is left). Every other
// thread (the engine through on_engine_ask, REST handlers through drain/plan) sends through
// send_control, which posts the message to the control thread (transport/control_plane.h,
// "the ownership rule"). One mutex (its own) guards the state. A change's snapshot is posted
// to the engine before the control messages the change made (held until then): a worker
// acts on an assign only once the engine knows the epoch it starts, so the engine never takes
// what the old epoch's stages did in answer (an error from their re-wiring) for its own.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/between_parts.h"
#include "coordinator/cluster_config.h"
#include "coordinator/cluster_snapshot.h"
#include "coordinator/core_status.h"
#include "coordinator/membership.h"
#include "coordinator/metrics.h"
#include "coordinator/pipeline.h"
#include "coordinator/planner.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor {

class Engine;

class ClusterManager {
 public:
  // `control`, `channel`, `metrics` (may be null) must outlive it. Makes cfg.replicas empty
  // pipelines of cfg.stages stages.
  ClusterManager(ClusterConfig cfg, Metrics* metrics, transport::ControlServer& control,
                 transport::UcxChannel& channel);
  ~ClusterManager();
  ClusterManager(const ClusterManager&) = delete;
  ClusterManager& operator=(const ClusterManager&) = delete;

  // Where snapshots go and stats come from (before start()); publishes the first snapshot.
  void connect_engine(Engine* engine);
  void start();  // the control thread
  void stop();   // joins it
  // After stop(): tells live workers we go (they keep their layers), and sends what was posted.
  void say_goodbye();

  // The latest snapshot published.
  SnapshotPtr snapshot() const;
  // The engine's asks (ClusterAsk), made without its mutex: ignored when the pipeline has left
  // the epoch they name.
  void on_engine_ask(const ClusterAsk& ask);
  // Coordinator::drain and Coordinator::plan.
  AdminReply drain(const std::string& worker);
  AdminReply plan(const PlanRequest& request);
  // /v1/cluster: workers and pipelines, with the engine's figures from `engine`.
  nlohmann::json cluster_json(const EngineStats& engine) const;

 private:
  // Runs `change` under mu, then publishes the snapshot if the state changed and posts the
  // control messages `change` sent (held until then), still under mu, in order.
  template <class F>
  auto changing(F&& change);
  void settle();                      // under mu: the end of a change
  SnapshotPtr snapshot_if_changed();  // under mu: a new snapshot, or null when nothing changed
  void publish(SnapshotPtr s);

  // ---- the state's questions (cluster_manager.cc)
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
  // extra its workers ask for when it has several: their figures).
  int in_flight_depth(const Pipeline& p) const;
  // Whether its steps go ahead (scheduler.step_ahead, on a pipeline of one stage).
  bool steps_ahead(const Pipeline& p) const { return cfg.step_ahead && p.workers.size() == 1; }
  // What the pipeline's workers say of their steps, together (StageFigures).
  StageFigures pipeline_figures(const Pipeline& p) const;
  Shape current_shape() const { return {cfg.stages, cfg.replicas, cfg.layers}; }
  PlanModel plan_model() const { return {cfg.model, cfg.model_path}; }
  bool whole() const;
  std::string health_reason() const;
  void update_gauges();

  // ---- the control thread (cluster_manager.cc) and control messages (control.cc)
  void control_loop();
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
  // After a lost micro-batch: closes our connections to `p`'s first and last stages and has
  // its next assignments tell the workers to dial theirs again (AssignMsg::redial).
  void redial(Pipeline& p);
  // A send failed on connections dialled afresh (an epoch after a lost micro-batch, or the
  // replay of that same send's failure): the peer the reporter could not reach (its next
  // stage, or for "coordinator" the reporter itself) is replaced like a dead one. Returns
  // whether it was.
  bool replace_unreachable(Pipeline& p, WorkerInfo& reporter, const transport::DataErrorMsg& m);
  // "w1>w2" for a failed send from w1 to its next stage w2 ("w1>coordinator"); "" otherwise.
  std::string failed_link(const Pipeline& p, const WorkerInfo& reporter, const transport::DataErrorMsg& m) const;
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
  // A new epoch for `p` (next_epoch: above every pipeline's and held_epoch): the engine voids
  // its work in flight and feeds its sequences again when the snapshot shows it.
  void restart_pipeline(Pipeline& p);
  uint32_t next_epoch() const;

  // ---- taking workers out (placement.cc)
  using Served = std::vector<std::pair<Pipeline*, size_t>>;
  Served stages_served_by(const std::string& name);
  AdminReply take_out(WorkerInfo& w, bool wait, const std::string& why);
  nlohmann::json retire(WorkerInfo& w, const std::string& why, const Served& served, const Placement* smaller);
  void release_leavers();

  ClusterConfig cfg;
  Metrics* const metrics;
  transport::ControlServer* const control;
  transport::UcxChannel* const channel;
  Engine* engine = nullptr;

  mutable std::mutex mu;  // everything below
  Workers workers;
  std::vector<Pipeline> pipelines;
  // The engine's account, read at the top of each control-loop pass (before mu): whether a
  // pipeline is busy, what is outstanding, whether we still accept requests (drains).
  EngineStats engine_stats;
  // The plan's shape. `target` is what the operator asked for (the cluster file, then
  // POST /v1/cluster/plan); cfg.stages/replicas/layers is what runs. While workers are
  // missing the coordinator may run a smaller shape over the survivors, and it grows back
  // when workers join. Reshaping happens at the top of the control loop (reshape_pending),
  // never while something iterates over `pipelines`.
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
  uint64_t plan_generation = 0;  // apply_placement's count (the engine redistributes on a new one)
  SnapshotPtr published;         // the latest snapshot (the first from connect_engine)
  // Inside changing(): send_control holds its messages here until the snapshot is published.
  bool holding_posts = false;
  std::vector<std::pair<std::string, transport::ControlMessage>> held_posts;

  std::atomic<bool> stopping{false};
  std::thread control_thread;
};

// Any thread (the control loop, the engine's asks, REST handlers), under mu: the message is
// posted to the control thread, which sends it from its recv() (woken at once) or, once it
// has stopped, from say_goodbye(); inside changing(), once the change's snapshot is published.
// Everything goes through the one queue, so messages to a worker keep their order; a failure
// is logged by the control plane with the message's type and peer.
template <class Msg>
void ClusterManager::send_control(const std::string& peer, const Msg& m) {
  if (holding_posts) held_posts.emplace_back(peer, transport::encode(m));
  else control->post(peer, transport::encode(m));
}

}  // namespace conveyor

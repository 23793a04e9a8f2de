// Carrying out plans: the pipelines' workers, assignments and wiring, failover (a lost stage
// goes to a spare, or the plan shrinks over the survivors) and taking workers out of service.
// Where stages go is the planner's (planner.h) decision; this file applies it.
#include <algorithm>
#include <set>

#include <spdlog/spdlog.h>

#include "coordinator/cluster_manager.h"

namespace conveyor {

using json = nlohmann::json;
using namespace transport;

// Runs `placement.shape` with the workers it names: new pipelines in a new epoch, workers
// that keep their layers only re-wire, the others load, workers left out become spares (told
// to drop their stage), and every running sequence is replayed from its first token on the
// pipeline with the fewest reserved tokens.
void ClusterManager::apply_placement(const Placement& placement, const std::string& why) {
  const Shape& shape = placement.shape;
  const uint32_t epoch = next_epoch();
  std::vector<Pipeline> next(size_t(shape.replicas));
  for (size_t r = 0; r < next.size(); ++r) {
    Pipeline& p = next[r];
    p.index = int(r);
    p.epoch = epoch;
    p.workers.assign(size_t(shape.stages), "");
    if (r < pipelines.size()) {  // keep the data-plane endpoints: wire() reuses those still right
      Pipeline& old = pipelines[r];
      p.first_peer = old.first_peer, p.last_peer = old.last_peer;
      p.first_address = std::move(old.first_address), p.last_address = std::move(old.last_address);
    }
  }
  for (size_t r = next.size(); r < pipelines.size(); ++r)
    for (PeerId peer : {pipelines[r].first_peer, pipelines[r].last_peer})
      if (peer != kNoPeer) (void)channel->disconnect(peer);
  const std::set<std::string> placed(placement.workers.begin(), placement.workers.end());
  for (auto& [name, w] : workers)
    if (w.stage >= 0 && !placed.count(name)) {
      w.pipeline = w.stage = -1;
      if (w.plannable()) {
        w.state = MemberState::Spare;
        send_control(name, UnassignMsg{});
      }
    }
  cfg.stages = shape.stages, cfg.replicas = shape.replicas, cfg.layers = shape.layers;
  pipelines = std::move(next);
  for (size_t slot = 0; slot < placement.workers.size(); ++slot)
    assign(pipelines[slot / size_t(shape.stages)], int(slot % size_t(shape.stages)), workers.at(placement.workers[slot]));
  for (Pipeline& p : pipelines) p.down_reason = why;
  ++plan_generation;  // the engine redistributes every running request over the new pipelines
  spdlog::info("coordinator: the plan is now {} stage(s) x {} replica(s) ({})", shape.stages, shape.replicas, why);
  for (Pipeline& p : pipelines) send_assignments(p);
}

// Called at the end of each control-loop pass: when a pipeline misses a stage that no
// spare can fill, or the plan runs smaller than the target, runs the largest shape the
// workers allow.
void ClusterManager::reshape_if_pending() {
  if (!reshape_pending) return;
  reshape_pending = false;
  const bool is_whole = whole();
  if (!ever_whole || (is_whole && current_shape() == target)) return;
  auto feasible = largest_feasible(workers, plan_model(), target);
  if (!feasible) {
    for (Pipeline& p : pipelines)
      if (!p.filled()) p.down_reason += "; no smaller plan fits either: " + feasible.error();
    return;
  }
  if (is_whole && feasible->shape == current_shape()) return;
  apply_placement(*feasible, is_whole ? "grown back toward the requested plan" : "re-planned over the surviving workers");
}

void ClusterManager::assign(Pipeline& p, int stage, WorkerInfo& w) {
  w.pipeline = p.index;
  w.stage = stage;
  w.epoch = p.epoch;
  w.layers = cfg.layers[size_t(stage)];
  w.state = MemberState::Loading;
  w.load_fraction = 0;
  w.holding.reset();  // from now on `layers` says what it holds
  p.workers[size_t(stage)] = w.name;
  spdlog::info("coordinator: pipeline {} stage {} (layers [{}, {})) -> {}", p.index, stage, w.layers.first,
               w.layers.second, w.name);
}

// Sends `assign` to every worker of a pipeline whose stages are all filled, with the
// neighbours' addresses. Workers that already hold the layers only re-wire.
void ClusterManager::send_assignments(Pipeline& p) {
  if (!p.filled()) return;
  if (p.epoch <= held_epoch) restart_pipeline(p);  // after a restart: above every epoch the workers knew
  const int S = int(p.workers.size());
  for (int s = 0; s < S; ++s) {
    WorkerInfo& w = workers.at(p.workers[size_t(s)]);
    AssignMsg m;
    m.epoch = p.epoch;
    m.pipeline = uint32_t(p.index);
    m.stage = s;
    m.num_stages = S;
    m.layer_begin = w.layers.first, m.layer_end = w.layers.second;
    m.model = cfg.model_path;
    m.coordinator_address = channel->address();
    if (s + 1 < S) m.next_address = workers.at(p.workers[size_t(s + 1)]).data_address;
    m.prev_address = s > 0 ? workers.at(p.workers[size_t(s - 1)]).data_address : m.coordinator_address;
    m.redial = p.redial;
    w.epoch = p.epoch;
    if (w.state == MemberState::Ready) w.state = MemberState::Loading;  // until it confirms the new epoch
    send_control(w.name, m);
  }
  if (p.redial) p.redialed_epoch = p.epoch;
  p.redial = false;
  wire(p);
}

// Connects the first and last stages, keeping endpoints to workers that keep their place
// (transport::keep_or_connect), so one repair does not cascade into the next.
void ClusterManager::wire(Pipeline& p) {
  p.wired = false;
  const std::string &first = p.workers.front(), &last = p.workers.back();
  Status s = keep_or_connect(*channel, p.first_peer, p.first_address, workers.at(first).data_address, first);
  if (s) s = keep_or_connect(*channel, p.last_peer, p.last_address, workers.at(last).data_address, last);
  if (!s) {
    p.down_reason = "cannot connect the data plane: " + s.message();
    return;
  }
  p.wired = true;
}

// Fills every empty stage from the spares; a worker that says it holds a stage's layers is
// preferred for that stage (a coordinator restart then needs no reload). What spares cannot
// fix (a stage nobody can take, a plan below its target) is left to reshape_if_pending.
// Never called while iterating over `pipelines`' elements' slots.
void ClusterManager::fill_from_spares() {
  for (Pipeline& p : pipelines) {
    bool changed = false;
    // Two passes: first every hole its layers' holder (after a coordinator restart the workers
    // come back one by one, each with its layers, and must not be given each other's), then
    // the holes left to any spare, which loads them.
    for (const bool holders_only : {true, false}) {
      for (int s = 0; s < int(p.workers.size()); ++s) {
        if (!p.workers[size_t(s)].empty()) continue;
        WorkerInfo* pick = nullptr;
        for (auto& [_, w] : workers) {
          if (w.state != MemberState::Spare || !w.plannable()) continue;
          if (holders_only && !w.holds(cfg.layers[size_t(s)], cfg.model_path)) continue;
          pick = &w;
          break;
        }
        if (!pick) continue;
        assign(p, s, *pick);
        changed = true;
      }
    }
    if (changed) send_assignments(p);
  }
  const bool is_whole = whole();
  ever_whole = ever_whole || is_whole;
  reshape_pending = reshape_pending || !is_whole || current_shape() != target;
}

// A stage of `p` is lost: new epoch, the work in flight is void, sequences restart.
// Surviving workers keep their layers; they get the new epoch's wiring once the stage is
// filled (the caller fills it when it is done with `pipelines`).
void ClusterManager::fail_stage(Pipeline& p, const std::string& worker, const std::string& why) {
  spdlog::warn("coordinator: pipeline {} loses {}: {}", p.index, worker, why);
  for (std::string& w : p.workers)
    if (w == worker) w.clear();
  p.down_reason = worker + ": " + why;
  restart_pipeline(p);
}

// Epochs only grow, over all pipelines together, and start above every epoch a worker said it
// holds: a worker's stale micro-batches (queued while it reloaded, or from before it moved
// between pipelines or coordinators) never carry the epoch of its new assignment.
uint32_t ClusterManager::next_epoch() const {
  uint32_t epoch = held_epoch;
  for (const Pipeline& p : pipelines) epoch = std::max(epoch, p.epoch);
  return epoch + 1;
}

void ClusterManager::restart_pipeline(Pipeline& p) {
  p.epoch = next_epoch();
  p.wired = false;
  p.replayed_from = 0;
}

// ---------------------------------------------------------------- taking workers out

ClusterManager::Served ClusterManager::stages_served_by(const std::string& name) {
  Served served;
  for (Pipeline& p : pipelines)
    if (auto slot = std::find(p.workers.begin(), p.workers.end(), name); slot != p.workers.end())
      served.emplace_back(&p, size_t(slot - p.workers.begin()));
  return served;
}

// Takes `w` out of service without failing anything (the operator's drain, a worker's
// SIGTERM): a spare takes its stage, or else the plan shrinks over the other workers when
// their memory allows; every running sequence of its pipeline is replayed. When neither can
// be done: Conflict, or with `wait` its pipeline takes no new requests and it is let go once
// its running ones are done (release_leavers).
AdminReply ClusterManager::take_out(WorkerInfo& w, bool wait, const std::string& why) {
  const std::string name = w.name;
  if (w.state == MemberState::Drained) return {{}, {{"worker", name}, {"state", "drained"}}};
  Served served = stages_served_by(name);
  if (wait && !engine_stats.accepting && engine_stats.outstanding == 0) served.clear();  // we stop too: no re-plan
  std::optional<Placement> smaller;
  if (!served.empty() && !has_spare()) {
    auto feasible = largest_feasible(workers, plan_model(), target, name);
    if (!feasible) {
      const std::string msg = "worker '" + name + "' serves pipeline " + std::to_string(served[0].first->index) +
                              " stage " + std::to_string(served[0].second) +
                              ", no spare worker can take it and the others cannot run the model without it (" +
                              feasible.error() + "): start another worker first";
      if (!wait) return {CoreStatus::refuse(CoreError::Conflict, msg), {}};
      if (!w.leaving) spdlog::warn("coordinator: {}; its pipeline takes no new requests until it can go", msg);
      w.leaving = true;
      return {{}, {{"worker", name}, {"state", "leaving"}, {"reason", msg}}};
    }
    smaller = std::move(feasible).value();
  }
  return {{}, retire(w, why, served, smaller ? &*smaller : nullptr)};
}

// Takes `w` off the stages it serves for good (Drained: never planned again; a
// re-registration makes it a spare) and tells it to drop them; the stages go to the smaller
// plan when one is given, else to spares. Returns the drain's body.
json ClusterManager::retire(WorkerInfo& w, const std::string& why, const Served& served, const Placement* smaller) {
  const std::string name = w.name;
  json body = {{"worker", name}, {"state", "drained"}};
  w.state = MemberState::Drained;
  w.leaving = false;
  for (auto [p, stage] : served) fail_stage(*p, name, why);
  w.pipeline = w.stage = -1;
  send_control(name, UnassignMsg{});
  if (smaller) {
    apply_placement(*smaller, "re-planned without " + name);
    body["replanned"] = shape_json(smaller->shape);
  } else {
    fill_from_spares();
    for (auto [p, stage] : served)
      if (!p->workers[stage].empty()) body["replaced_by"] = p->workers[stage];
  }
  spdlog::info("coordinator: {} drained ({}): {}", name, why, body.dump());
  return body;
}

// Lets go of workers waiting to leave once a spare or a smaller plan can take over, or once
// their pipeline has no running sequence.
void ClusterManager::release_leavers() {
  for (auto& [name, w] : workers) {
    if (!w.leaving || !w.alive()) continue;
    const Served served = stages_served_by(name);
    const bool busy =
        std::any_of(served.begin(), served.end(), [&](const auto& ps) { return engine_stats.busy(ps.first->index); });
    if (busy) take_out(w, true, "leaving");
    else retire(w, "left when its work was done", served, nullptr);
  }
}

}  // namespace conveyor

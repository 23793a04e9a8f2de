// Membership: the workers the coordinator knows, what each said of itself (register,
// heartbeat, load progress) and where each stands. Plain data and small pure functions; the
// coordinator (coordinator.cc) owns the map and changes states under its mutex.
//
// A worker's life:  Spare -> Loading -> Ready -> (Loading on a new epoch) ...
//                   any -> Dead (silent past the liveness window, left, or its data plane broke)
//                   Loading -> Failed (its load failed)      serving -> Drained (taken out)
// A worker that registers again starts over as a Spare (or keeps its stage, when it is the
// same process still on it).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "transport/control_messages.h"

namespace conveyor {

// The coordinator's view of a worker (the worker reports its own, transport::WorkerState, in
// its heartbeats).
enum class MemberState {
  Spare,    // joined, no stage: the planner may give it one
  Loading,  // assigned; loading its layers or confirming a new epoch
  Ready,    // serving its stage in the current epoch
  Dead,     // gone (silent, left, or unreachable)
  Failed,   // its load failed; not planned again until it registers again
  Drained,  // taken out by the operator or its own SIGTERM; a re-registration makes it a Spare
};

// "spare", "loading", ...: the state's name in /v1/cluster.
const char* member_state_name(MemberState s);

using LayerRange = std::pair<int64_t, int64_t>;  // [begin, end)

struct WorkerInfo {
  std::string name, host;
  std::string backend = "cpu";  // its register's word for its backend: shown, never compared
  int64_t pid = 0;
  std::vector<int> gpus;
  int64_t memory_bytes = 0;    // its GPUs' memory, or the host's (shown)
  // What it said of itself: its stage before any model (register), and what the cluster's
  // model takes in its format (footprint, the answer to its welcome). The planner and the
  // scheduler compute from these alone; a worker without a footprint is not planned.
  StageCapabilities caps;
  std::optional<StageFootprint> footprint;
  nlohmann::json data_plane;   // how its activations travel (staging memory, UCX CUDA support)
  std::vector<std::byte> data_address;

  MemberState state = MemberState::Spare;
  bool leaving = false;  // it asked to go (SIGTERM) and nobody can take its stage yet
  int pipeline = -1, stage = -1;
  uint32_t epoch = 0;
  LayerRange layers{0, 0};
  std::optional<transport::HeldStage> holding;  // a Spare's loaded layers, from its registration

  // Its own figures, from heartbeats and load progress.
  double load_fraction = 0;
  int64_t load_bytes_done = 0, load_bytes_total = 0;
  double load_seconds = 0;  // of its last load (0 when it kept its layers)
  double busy_fraction = 0;
  double busy_seconds_total = 0, clock_seconds = 0;  // cumulative busy time, at its clock
  // Cumulative, between its steps: waiting for input that had not come, sitting with input that had.
  double wait_input_seconds_total = 0, idle_ready_seconds_total = 0;
  double idle_ready_fraction = 0;  // of the last heartbeat window (the heartbeat's busy_fraction's twin)
  int64_t kv_used_tokens = 0, kv_capacity_tokens = 0, sequences = 0;
  // What went wrong with it, while that still stands. Once it is ready again in a later
  // epoch (a failover re-wired it) the error is over: it moves to resolved_error, with the
  // epoch and what the re-wire was for (`cause`: most often a neighbour's death, which is
  // what a wiring error during a failover comes from), so a healthy worker does not show a
  // neighbour's death as a fault of its own.
  std::string last_error;
  std::string resolved_error;
  void error_resolved(uint32_t ready_epoch, const std::string& cause) {
    if (last_error.empty()) return;
    resolved_error = last_error + " (resolved: ready again in epoch " + std::to_string(ready_epoch) +
                     (cause.empty() ? "" : "; its pipeline was re-wired after " + cause) + ")";
    last_error.clear();
  }
  std::chrono::steady_clock::time_point last_seen = std::chrono::steady_clock::now();

  bool alive() const { return state != MemberState::Dead; }
  // May be given a stage: alive, not failed, not drained, not on its way out, and it said what
  // the model takes in its format.
  bool plannable() const {
    return !leaving && footprint &&
           (state == MemberState::Spare || state == MemberState::Loading || state == MemberState::Ready);
  }
  // Whether it has `layers` of the model at `model_path` loaded (or loading), so it can
  // serve them at once.
  bool holds(LayerRange layers, const std::string& model_path) const;
  // Room for a stage's weights, as it said (StageCapabilities::weight_memory_bytes).
  // Unknown (0): no limit.
  int64_t weight_room() const;
};

using Workers = std::map<std::string, WorkerInfo>;

// The worker's row in GET /v1/cluster.
nlohmann::json worker_json(const WorkerInfo& w);

}  // namespace conveyor

// What the cluster manager (cluster_manager.h) tells the engine (engine.h): an immutable
// snapshot of the pipelines as placed, published after every change and read without a lock.
// The engine keeps the latest one it took, and that is all it knows of membership: which peer
// is each pipeline's first and last stage, whether it is ready and open for admission, its
// K/V budget, what its workers say of their steps, and its epoch. An epoch it has not seen
// restarts the pipeline's runtime (its work in flight is void); a new plan generation (a
// re-plan: other pipelines, other stages) redistributes every running request.
//
//   cluster manager --ClusterSnapshot--> engine --StepPlan--> stage 0 ... --result--> engine
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coordinator/membership.h"
#include "transport/channel.h"

namespace conveyor {

// What a pipeline's workers say of their steps (their register's StageCapabilities), taken
// together: the hard limits are the smallest stage's, the batching figures the largest any
// stage asks for (a pipeline with one GPU stage batches like a GPU, and its depth hides the
// rest), the K/V granule one that is whole pages on every stage.
struct StageFigures {
  int64_t max_rows = 0;      // rows a step may carry (0: no stage limits them)
  int64_t sequences = 0;     // sequences a step should carry
  int64_t prompt_rows = 0;   // prompt rows a step should carry, per stage
  int extra_in_flight = 0;   // micro-batches beyond one per stage (the smallest any stage asks)
  int64_t kv_page_tokens = 1;  // the least common multiple of the stages' K/V pages
  std::string backends;      // "cpu", "cuda", "cpu+cuda": shown in /v1/cluster
  bool operator==(const StageFigures&) const = default;
};

// The figures of the workers serving a pipeline's stages; null entries (stages nobody
// serves) are skipped.
StageFigures stage_figures_of(std::span<const WorkerInfo* const> stages);

// One pipeline replica as placed.
struct PipelineView {
  int index = 0;
  uint32_t epoch = 0;
  std::vector<std::string> workers;  // per stage; "" = unfilled
  transport::PeerId first_peer = transport::kNoPeer, last_peer = transport::kNoPeer;
  bool ready = false;        // wired, and every stage's worker ready in this epoch
  bool open = false;         // ready and no worker on its way out: takes new requests
  bool recoverable = false;  // each missing stage can be filled by a spare or is loading
  int64_t kv_capacity = 0;   // K/V tokens it holds: its smallest stage's
  StageFigures figures;
  int depth = 1;             // micro-batches kept in flight (scheduler.in_flight, or auto)
  // One stage and scheduler.step_ahead: one more micro-batch may go, of steps ahead
  // (Scheduler::next_step).
  bool step_ahead = false;
  std::string down_reason;   // why it is not serving, for /health
  bool operator==(const PipelineView&) const = default;
};

struct ClusterSnapshot {
  uint64_t version = 0;          // grows with every snapshot published
  uint64_t plan_generation = 0;  // grows with every re-plan (apply_placement)
  std::vector<PipelineView> pipelines;
  bool serviceable = false;      // some pipeline serves or is being repaired
  std::string health_reason;     // per pipeline, why it is not serving
  // The same cluster state (the version aside).
  bool same_state(const ClusterSnapshot& o) const {
    return plan_generation == o.plan_generation && pipelines == o.pipelines && serviceable == o.serviceable &&
           health_reason == o.health_reason;
  }
};

using SnapshotPtr = std::shared_ptr<const ClusterSnapshot>;

}  // namespace conveyor

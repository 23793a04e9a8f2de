// What passes between the coordinator's two parts besides the cluster snapshots
// (cluster_snapshot.h): the engine's asks of the cluster manager, and the engine's stats that
// the manager reads. Neither part ever touches the other's state; each calls the other only
// with its own mutex released.
//
//   engine --ClusterAsk (naming the epoch it saw)--> cluster manager
//   cluster manager --Engine::stats() (the engine's mutex alone)--> EngineStats
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/metrics.h"
#include "coordinator/pipeline_run.h"

namespace conveyor {

// The engine needs the cluster to act on a pipeline. `epoch` is the one the engine saw: the
// manager ignores an ask about an epoch the pipeline has left (someone acted already). Until a
// snapshot brings a newer epoch the engine launches nothing more on that pipeline.
struct ClusterAsk {
  enum class Kind {
    Replay,            // a stage failed a micro-batch: a new epoch
    LostBatch,         // a micro-batch never came back: a new epoch on freshly dialled connections
    StageUnreachable,  // a send to its first stage failed: that worker is dead to us
    CheckEndpoints,    // the channel reported a failed peer (no pipeline named): check ours
  };
  Kind kind = Kind::Replay;
  int pipeline = -1;
  uint32_t epoch = 0;
  std::string why;
};

// The engine's account of its work, taken under its mutex alone (Engine::stats()): for drains
// (busy, outstanding, accepting), the gauges and GET /v1/cluster.
struct EngineStats {
  bool accepting = true;      // false once a shutdown drain began (quiesce)
  size_t outstanding = 0;     // requests accepted and not finished
  size_t queue = 0;
  QueueWait queue_wait = QueueWait::None;
  int64_t running_sequences = 0;
  Metrics::PrefixCacheFigures prefix;
  struct Run {
    int index = 0;
    uint32_t epoch = 0;
    bool busy = false;         // a sequence still runs on it
    int in_flight = 0;
    int64_t kv_reserved = 0, admitted = 0, running = 0;
    BatchLimits limits;
    std::string backends;
    // Work admitted and no progress (no result, no step leaving an idle ring) for longer than
    // scheduler.batch_timeout_ms: for how long (ms); 0 while it progresses or has no work.
    int64_t stalled_ms = 0;
  };
  std::vector<Run> pipelines;  // by index, as the engine last took the cluster's snapshot

  bool busy(int index) const {
    return index >= 0 && size_t(index) < pipelines.size() && pipelines[size_t(index)].busy;
  }
};

}  // namespace conveyor

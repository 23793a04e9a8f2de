// A pipeline replica as the cluster manager places it: which worker serves each stage in the
// current epoch, and the coordinator's data-plane endpoints to its ends. Plain data, the
// cluster manager's alone (cluster_manager.h), changed under its mutex; the engine sees it
// only through the snapshots the manager publishes (cluster_snapshot.h), and keeps its own
// account of the work on it (pipeline_run.h).
//
// Epochs: a pipeline that loses a stage, is re-wired or re-planned starts a new epoch;
// results of an older epoch are ignored and its sequences are fed again from their first
// token. Epochs grow over all pipelines together and start above any a worker holds from an
// earlier coordinator (ClusterManager::next_epoch): a worker fences stale micro-batches by
// epoch alone, so its new assignment's epoch must be one no earlier micro-batch carries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/channel.h"

namespace conveyor {

struct Pipeline {
  int index = 0;
  uint32_t epoch = 1;
  std::vector<std::string> workers;  // per stage; "" = unfilled
  transport::PeerId first_peer = transport::kNoPeer, last_peer = transport::kNoPeer;
  std::vector<std::byte> first_address, last_address;  // whom first_peer / last_peer reach
  bool wired = false;
  // The next assignments tell the workers to dial their data-plane peers again (the replay of
  // a lost micro-batch: the connections it went over may be dead without an error).
  bool redial = false;
  // The epoch whose connections were dialled afresh that way: a send that fails in it means
  // the peer stays unreachable, and that worker is replaced like a dead one (control.cc).
  uint32_t redialed_epoch = 0;
  // A send that failed ("w1>w2": from w1 to w2) and the epoch that replays it (on a new
  // connection for the failed one): the same send failing again in that epoch means w2
  // stays unreachable (control.cc).
  std::string suspect_link;
  uint32_t suspect_epoch = 0;
  // The epoch a replay (the same workers, a new epoch) left; 0 after any other restart. A
  // worker's report of the failure that caused it may arrive after the replay has begun (the
  // engine replays on the failed micro-batch's error result, which travels on the data plane,
  // and the report on the control plane): it still counts as this run's (control.cc).
  uint32_t replayed_from = 0;
  std::string down_reason;  // why it is not serving, for /health

  bool filled() const {
    for (const std::string& w : workers)
      if (w.empty()) return false;
    return true;
  }
};

}  // namespace conveyor

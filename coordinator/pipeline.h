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
  std::string down_reason;  // why it is not serving, for /health

  bool filled() const {
    for (const std::string& w : workers)
      if (w.empty()) return false;
    return true;
  }
};

}  // namespace conveyor

// A pipeline replica as the coordinator runs it: which worker serves each stage in the
// current epoch, the coordinator's data-plane endpoints to its ends, and the scheduler's
// account of it (micro-batches in flight, K/V tokens reserved). Plain data: the coordinator
// changes the membership side, the scheduler (scheduler.h) the work side, both under the
// coordinator's mutex.
//
// Epochs: a pipeline that loses a stage, is re-wired or re-planned starts a new epoch;
// results of an older epoch are ignored and its sequences are fed again from their first
// token.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/channel.h"

namespace conveyor {

struct InFlightBatch {
  uint32_t epoch = 0;
  std::vector<uint64_t> seq_ids;
  std::chrono::steady_clock::time_point sent;
};

struct Pipeline {
  int index = 0;
  uint32_t epoch = 1;
  std::vector<std::string> workers;  // per stage; "" = unfilled
  transport::PeerId first_peer = transport::kNoPeer, last_peer = transport::kNoPeer;
  std::vector<std::byte> first_address, last_address;  // whom first_peer / last_peer reach
  bool wired = false;
  std::string down_reason;  // why it is not serving, for /health

  // The scheduler's side.
  int in_flight = 0;                     // micro-batches on the ring
  std::unordered_map<uint64_t, InFlightBatch> batches;  // by batch id
  std::vector<uint64_t> pending_frees;   // sequences whose K/V the next micro-batch frees
  int64_t kv_reserved = 0;               // tokens its admitted requests may grow to
  int64_t admitted = 0;                  // requests given to it, for the balance between replicas

  bool filled() const {
    for (const std::string& w : workers)
      if (w.empty()) return false;
    return true;
  }
};

}  // namespace conveyor

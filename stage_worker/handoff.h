// Handoff: the outgoing side of a stage worker. The compute thread writes a micro-batch's
// activations into a slot and queues it; a sender thread of its own hands it to the channel,
// so the next micro-batch computes while this one crosses the wire. The slots' memory comes
// from the stage's backend (StageBackend::allocate_host): page-locked for a GPU stage, so the
// copy off the device is DMA and UCX sends from the slot without another copy. With two
// slots (double buffering) a third micro-batch waits for the first slot to come back, which
// is the back-pressure a pipeline needs: a stalled next stage stalls this one.
//
// The direct path: when the channel sends device memory and the next stage takes it
// (transport::Channel::sends_device_memory, peer_takes_device_memory), a GPU stage asks for a
// device slot instead (cudaMalloc on its GPU). The stage copies its rows into it on its stream
// and synchronises that stream before it returns (GpuStage::download_hidden), so a submitted
// slot holds finished rows: UCX then sends them GPU to GPU (cuda_ipc on one node, RDMA between
// nodes) with no trip through host memory. The same two slots and the same back-pressure.
//
// A last stage whose next input is already waiting queues its result to the coordinator here
// too (a header and no payload, in a slot of 0 bytes), so that step need not wait for the send.
//
// Sends go out in the order they were queued. A failed send calls the closure queued with
// it, on the sender thread. Where the peer may still read its payload
// (transport::Channel::peer_reads_failed_payloads: a device slot, or a peer over shared
// memory), the slot's memory is retired: kept, never written again, until the Handoff goes,
// and the slot takes fresh memory for the next micro-batch. A failed send is a failed
// neighbour, so this costs a slot's memory per failover at most.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "common/status.h"
#include "transport/channel.h"

namespace conveyor {

class Handoff {
 public:
  using Allocate = std::function<std::shared_ptr<std::byte[]>(size_t)>;  // null: no memory
  using OnFailure = std::function<void(const Status&)>;

  Handoff(transport::Channel& channel, int slots, std::chrono::milliseconds send_timeout);
  // Sends what is queued (each within the send timeout), then stops.
  ~Handoff();
  Handoff(const Handoff&) = delete;
  Handoff& operator=(const Handoff&) = delete;

  // A free slot of at least `bytes` (memory from `allocate` when the slot is smaller, or holds
  // the other kind of memory), as an index for slot()/submit()/cancel(). `device`: `allocate`
  // gives CUDA device memory, and the slot's send says so. Waits while every slot is being
  // sent. Fails, holding no slot, when `allocate` has no memory, or when the waits are
  // interrupted (interrupt_waits) while every slot is taken.
  Expected<int> acquire(size_t bytes, const Allocate& allocate, bool device = false);
  std::span<std::byte> slot(int index);
  // Queues `bytes` of slot `index` with `header` to `peer`; the slot is free again once the
  // send returns.
  void submit(int index, transport::PeerId peer, std::vector<std::byte> header, size_t bytes, OnFailure on_failure);
  // Gives an acquired slot back unsent.
  void cancel(int index);
  // Returns once every queued send has returned: true; false at once when the waits are
  // interrupted.
  bool drain();
  // The same within `timeout`: true when every queued send has returned.
  bool drain_for(std::chrono::milliseconds timeout);
  // Nothing queued or being sent: a send made now by the caller goes out in order.
  bool idle();
  // The stage is stopping: acquire() and drain() no longer wait for sends in flight (each may
  // take the whole send timeout), so the compute thread ends promptly; what is queued is still
  // sent. Until resume_waits().
  void interrupt_waits();
  void resume_waits();

  int slots() const { return int(slots_.size()); }
  // Nanoseconds the sender thread has spent in the channel's send, over every send so far
  // (the step trace reports its growth per micro-batch).
  int64_t send_ns_total() const { return send_ns_total_.load(std::memory_order_relaxed); }
  // Sends made from device slots (the direct path), over every send so far.
  int64_t device_sends() const { return device_sends_.load(std::memory_order_relaxed); }

 private:
  struct Slot {
    std::shared_ptr<std::byte[]> data;
    size_t capacity = 0;
    bool device = false;  // CUDA device memory
    bool busy = false;
  };
  struct Send {
    int slot = 0;
    transport::PeerId peer = transport::kNoPeer;
    std::vector<std::byte> header;
    size_t bytes = 0;
    OnFailure on_failure;
  };
  void run();
  void retire(Slot& s);  // under mu_, by the sender thread

  transport::Channel& channel_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<Slot> slots_;   // guarded by mu_ (busy); data/capacity by the slot's holder
  std::deque<Send> queue_;    // guarded by mu_
  bool sending_ = false;      // the sender thread holds a send; guarded by mu_
  bool stop_ = false;         // guarded by mu_
  bool interrupted_ = false;  // guarded by mu_
  std::atomic<int64_t> send_ns_total_{0};
  std::atomic<int64_t> device_sends_{0};
  // The memory of slots whose send failed (retire), and its total.
  std::vector<std::shared_ptr<std::byte[]>> retired_;
  size_t retired_bytes_ = 0;
  std::thread sender_;
};

}  // namespace conveyor

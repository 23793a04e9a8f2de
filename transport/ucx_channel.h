// UcxChannel: the data plane between processes and hosts, on UCX's ucp tag API.
//
// Each channel owns a ucp context, one ucp worker and one progress thread. The progress
// thread is the only thread that touches the worker (UCS_THREAD_MODE_SINGLE): caller
// threads hand it work through a queue and an eventfd, and wait for the result. When idle it
// sleeps in epoll on the worker's event fd (ucp_worker_arm) and its own eventfd, waking
// every `idle_tick` to run UCX's keepalive and this channel's timers, so an idle channel
// costs no CPU. Every method is thread-safe; several threads may send at once.
//
// Messages follow wire_format.h. The progress thread posts a receive for every incoming
// message into buffers it allocates at the advertised size, up to `max_queued_bytes` of
// messages not yet taken by recv(); beyond that it stops accepting, which holds senders
// back (their send() waits, up to its timeout).
//
// Failures: endpoints use UCP_ERR_HANDLING_MODE_PEER, so a peer that dies shows up as an
// error (a TCP reset at once; a vanished host through TCP's keepalive once idle): sends
// to it fail, and recv() reports what it had completed, then one error per message it had
// under way, then its failure (once). No call waits without a bound.
//
// Transports: the environment's UCX_* variables win; otherwise `transports` (UCX_TLS)
// applies when set, else UCX's default selection: RDMA or TCP; likewise `net_devices`
// (UCX_NET_DEVICES) keeps a daemon that knows its cluster address on that interface. UCX 1.13 will not use its
// shared-memory transports with peer-failure detection, so two processes on one host talk
// over TCP loopback, unless both set host_shared_memory: then over shared memory, each
// watching the other's process itself (README.md).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/buffer_pool.h"
#include "transport/channel.h"

namespace conveyor::transport {

struct UcxChannelOptions {
  std::string name = "conveyor";  // worker name in UCX logs
  std::uint32_t channel_id = 0;   // 0: a random id
  std::string transports{};       // UCX_TLS when the environment sets none ("tcp", "rc,tcp")
  // UCX_NET_DEVICES when the environment sets none ("eth0", see net_interface.h): the only
  // network interfaces whose addresses the channel publishes and uses. Empty: all of them.
  std::string net_devices{};
  // UCX's endpoint keepalive period, unless UCX_KEEPALIVE_INTERVAL is set; 0: off (the default).
  // On TCP it adds no failure detection (a dead process resets its connections, TCP's own
  // keepalive finds a vanished host on an idle connection, sends have timeouts), and its check
  // of an endpoint this channel closed while the peer lives crashes UCX 1.13 (README.md).
  std::chrono::milliseconds keepalive_interval{0};
  std::size_t inline_payload_bytes = 8 * 1024;          // larger payloads go as their own message
  std::size_t max_queued_bytes = std::size_t{1} << 30;  // received, not yet recv()'d
  // Idle receive buffers kept for reuse once recv()'d messages are freed (buffer_pool.h).
  std::size_t buffer_cache_bytes = std::size_t{512} << 20;
  // Where those receive buffers come from (buffer_pool.h): the heap unless set; a GPU stage
  // worker gives page-locked memory.
  HostAllocator receive_allocator{};
  // The direct path: CUDA device memory (cudaMalloc on the stage's GPU) for payloads peers
  // send from their GPUs. Used only when this UCX supports CUDA memory; the channel's address
  // then says it takes device memory, and senders that can send it from their GPUs do so.
  HostAllocator device_allocator{};
  std::size_t device_cache_bytes = std::size_t{256} << 20;  // idle device buffers kept
  // Runs first on the progress thread when the channel takes device memory (a GPU worker
  // makes its GPU current there: UCX's CUDA transports work in the thread's CUDA context).
  std::function<void()> progress_thread_init{};
  // A payload that has not arrived this long after its envelope is given up (sender gone).
  std::chrono::milliseconds stalled_receive_timeout{30000};
  // The cluster's secret (its join token). Set: the channel takes messages only from channels
  // that proved, by a handshake at connect, that they know it, each message with a valid MAC
  // (data_auth.h); it connects only to channels whose address says they do the same. Others'
  // messages are dropped, counted (refused_messages) and logged. Empty: anyone may send.
  std::string auth_secret{};
  std::chrono::milliseconds idle_tick{50};        // idle wake-up period of the progress thread
  // While a send or a receive is under way, the progress thread polls UCX instead of sleeping
  // in epoll, for up to this long since it last made progress: a payload past the eager
  // limit takes a rendezvous (several messages each way), and a sleeping thread pays a
  // wake-up for each. 0: sleep whenever there is nothing to do.
  std::chrono::microseconds spin_while_pending{200};
  // The progress thread polls UCX instead of sleeping for this long after it last made
  // progress, even with nothing under way: a reply that comes back within it (a pipeline's next
  // micro-batch, a ping-pong's answer) is taken without the epoll wake-up. It costs a core
  // while it spins. 0: sleep as soon as nothing is under way.
  std::chrono::microseconds spin_when_idle{0};
  // send() and recv() poll for their result for this long before they block on a condition
  // variable: a send's completion or a message that comes within it is taken without the
  // futex wake-up the progress thread would otherwise pay for the caller. It costs the
  // caller's core while it spins. 0: block at once.
  std::chrono::microseconds spin_in_calls{0};
  // Talk over shared memory (UCX's sysv/posix/cma, and cuda_ipc for device payloads) with the
  // channels of this host that do too: a message of a few KiB then crosses in a third of the
  // time TCP loopback takes. UCX 1.13's shared memory cannot detect a dead peer, so such an
  // endpoint has no peer-failure handling (UCP_ERR_HANDLING_MODE_NONE) and the channel watches
  // the peer's process itself (a pidfd; the address names the process by boot id, pid and start
  // time). Both channels must set it; otherwise, or on another host, TCP or RDMA as before.
  bool host_shared_memory = false;
  std::chrono::milliseconds close_timeout{2000};  // bound on the destructor's clean-up
};

class UcxChannel final : public Channel {
 public:
  static Expected<std::unique_ptr<UcxChannel>> create(UcxChannelOptions options = {});
  ~UcxChannel() override;
  UcxChannel(const UcxChannel&) = delete;
  UcxChannel& operator=(const UcxChannel&) = delete;

  std::uint32_t id() const override;
  std::vector<std::byte> address() const override;
  Expected<PeerId> connect(std::span<const std::byte> peer_address, std::string name) override;
  Status disconnect(PeerId peer) override;
  Status send(PeerId peer, std::span<const std::byte> header, PayloadView payload,
              std::chrono::milliseconds timeout) override;
  Expected<std::optional<Message>> recv(std::chrono::milliseconds timeout) override;
  void interrupt() override;
  Status peer_status(PeerId peer) const override;

  // Whether this UCX can send from and receive into CUDA device memory (ucp_context_query's
  // memory types): a build with CUDA support (scripts/setup.sh builds one). Debian's UCX has
  // none, so a GPU stage then stages its activations through page-locked host memory.
  bool supports_cuda_memory() const;
  // supports_cuda_memory() and a device_allocator: peers may send device payloads here.
  bool takes_device_memory() const;
  bool sends_device_memory() const override { return supports_cuda_memory(); }
  bool peer_takes_device_memory(PeerId peer) const override;
  // A device payload (cuda_ipc lets the peer read it, over any transport of the tags), and any
  // payload to a peer over shared memory (cma). A host payload over TCP or RDMA is pushed by
  // the sender's UCX, which a forced close stops.
  bool peer_reads_failed_payloads(PeerId peer, bool device) const override;

  // Messages dropped because their sender had not proved it belongs (no handshake, a wrong
  // key, a replayed handshake) or their MAC was wrong; 0 on a channel without auth_secret.
  std::uint64_t refused_messages() const;
  // Separate payloads whose envelope is in and whose bytes are still arriving, as of the
  // progress thread's last round (a transfer a sender's death would cut off).
  std::size_t receives_under_way() const;
  // Peers that left the channel (a disconnect that closed their endpoint) and are still held
  // while that close completes, as of the progress thread's last round; 0 once it has.
  std::size_t closed_peers_held() const;

  // The transports and thresholds UCX chose for the endpoint to `peer` (ucp_ep_print_info).
  Expected<std::string> transport_info(PeerId peer);

 private:
  struct Impl;
  explicit UcxChannel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  bool interrupted_ = false;  // interrupt() was called and no recv() has returned since; impl_->mu
  std::atomic<bool> interrupt_seen_{false};  // interrupted_, for recv()'s polling (spin_in_calls)
};

}  // namespace conveyor::transport

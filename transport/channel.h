// The data plane: a Channel moves messages of (small header, tensor payload) between
// pipeline stages. One interface, two implementations: UcxChannel (ucx_channel.h, between
// processes and hosts) and InProcChannel (inproc_channel.h, inside one process, for tests).
//
// Ownership is explicit: send() borrows the caller's header and payload and returns only
// when both may be reused (or freed), with one exception: the payload of a send that failed,
// where peer_reads_failed_payloads says so (below); recv() hands back a Message that owns its
// buffers.
//
// Peers: a channel publishes address() (bytes the control plane carries to other workers);
// connect(address) turns a peer's address into a local PeerId to send to. A channel
// receives from anyone who connected to it; it hears of a peer's failure only for peers it
// connected to itself (a stage therefore connects to both its next and its previous stage).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

// A channel's local handle for a connected peer. Never reused within one channel.
using PeerId = std::uint32_t;
inline constexpr PeerId kNoPeer = 0;

namespace detail {
struct BufferCache;  // buffer_pool.h
// How an OwnedBuffer frees its memory: back to a BufferPool's cache, or to the system.
struct ReleaseBuffer {
  std::shared_ptr<BufferCache> cache;  // null: back to the system
  std::size_t capacity = 0;
  void operator()(std::byte* p) const;
};
}  // namespace detail

// A heap buffer with one owner, aligned for tensors (kAlignment bytes). Buffers from a
// BufferPool (buffer_pool.h) return their memory to it when freed.
class OwnedBuffer {
 public:
  static constexpr std::size_t kAlignment = 64;
  OwnedBuffer() = default;
  // Uninitialised storage of `bytes` bytes; throws std::bad_alloc when memory is short.
  static OwnedBuffer allocate(std::size_t bytes);
  static OwnedBuffer copy_of(const void* data, std::size_t bytes);

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() { return {data_.get(), size_}; }
  std::span<const std::byte> view() const { return {data_.get(), size_}; }

  // The allocation behind data() (at least size() bytes).
  std::size_t capacity() const { return data_.get_deleter().capacity; }

 private:
  friend class BufferPool;
  using Release = detail::ReleaseBuffer;
  std::unique_ptr<std::byte, Release> data_;
  std::size_t size_ = 0;
};

// A borrowed tensor: `bytes` bytes at `data`, host memory unless `device`: CUDA device
// memory, which only a channel whose UCX moves CUDA memory can send, and only to a peer that
// takes it (Channel::peer_takes_device_memory; the direct path between GPU stages).
struct PayloadView {
  const void* data = nullptr;
  std::size_t bytes = 0;
  bool device = false;
};

// One received data-plane message.
struct Message {
  PeerId from = kNoPeer;        // the connected peer that sent it; kNoPeer when this
                                // channel never connected to the sender
  std::uint32_t sender_id = 0;  // the sending channel's id()
  std::uint64_t seq = 0;        // the sender's message counter (over all its peers)
  std::vector<std::byte> header;
  OwnedBuffer payload;
  // The payload is CUDA device memory (the sender sent it from its GPU and this channel
  // takes device memory); otherwise host memory.
  bool payload_on_device = false;
};

class Channel {
 public:
  virtual ~Channel() = default;

  // This channel's id (carried in every message it sends) and its address blob.
  virtual std::uint32_t id() const = 0;
  virtual std::vector<std::byte> address() const = 0;

  // Creates a local handle for the channel at `peer_address` (another channel's address()).
  // `name` is used in errors and logs ("stage1"). Does not wait for the peer to answer: an
  // unreachable peer shows up as a send error or a peer failure.
  virtual Expected<PeerId> connect(std::span<const std::byte> peer_address, std::string name) = 0;
  // Forgets a peer; later sends to it fail, and so does one still under way. Unknown ids are
  // an error. (A UCX channel keeps a working, idle connection open for the next connect() to
  // that channel: ucx_channel_impl.h, `parked`.)
  virtual Status disconnect(PeerId peer) = 0;

  // Sends one message and returns when `header` and `payload` may be reused. Fails when the
  // peer is unknown or has failed, or when the transfer does not complete within `timeout`
  // (the peer is then marked failed: a stuck peer is treated like a dead one).
  //
  // Where peer_reads_failed_payloads(peer, device) says so, a payload whose send failed may
  // still be read by the peer, however its send ended: the peer reads a large payload from
  // the sender's memory (UCX's rendezvous: cma between the processes of one host, cuda_ipc for
  // device memory), and nothing can take that access back from a peer that was only stopped,
  // not dead. A caller must then not write such a payload's memory again, nor free it, while
  // the peer lives; it takes fresh memory for the next send (the stage worker's Handoff
  // retires the slot). Without that, a resumed peer could receive bytes written after the
  // failure: an altered message. The header is safe to reuse at once (the channel sends its
  // own copy where it could be read late).
  virtual Status send(PeerId peer, std::span<const std::byte> header, PayloadView payload,
                      std::chrono::milliseconds timeout) = 0;

  // The next message, delivered in send order per sender; std::nullopt when none arrives
  // within `timeout`. An error reports one event: a connected peer failed (each failure is
  // reported once, even if a send already returned it) or a message was lost in flight.
  // The channel stays usable after an error.
  virtual Expected<std::optional<Message>> recv(std::chrono::milliseconds timeout) = 0;

  // Makes a recv() that is waiting return at once with no message (std::nullopt), or, when
  // none is waiting, the next one: an interrupt is kept until a recv() returns (with or
  // without a message), so one made just before the receiver starts to wait is not lost.
  // Any thread. A loop that waits on its channel and on other events (the coordinator's
  // engine: a submitted request, a new cluster snapshot) wakes through it.
  virtual void interrupt() = 0;

  // Ok while the peer is usable; otherwise the reason it failed.
  virtual Status peer_status(PeerId peer) const = 0;

  // The direct path: whether this channel can send payloads from CUDA device memory, and
  // whether `peer` receives them into its GPU's memory (its address says so). A sender
  // sends device payloads only when both hold; otherwise it stages through host memory.
  virtual bool sends_device_memory() const { return false; }
  virtual bool peer_takes_device_memory(PeerId /*peer*/) const { return false; }
  // Whether `peer` may still read a payload (in device memory when `device`) after a send of
  // it to that peer failed (send above). Ask before the send: an unknown peer reads nothing.
  virtual bool peer_reads_failed_payloads(PeerId /*peer*/, bool /*device*/) const { return false; }
};

// Views of common header types as bytes.
inline std::span<const std::byte> as_bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
inline std::string_view as_string_view(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// Points `peer` at `address` (named `name`): an endpoint that already reaches that address
// and has not failed is kept, since closing it would reset the remote side's paired
// endpoint, which the remote would report as a failure; otherwise the old endpoint is
// closed and a new one made. An empty address leaves no endpoint. `current` is the address
// `peer` reaches (kept by the caller beside it).
Status keep_or_connect(Channel& channel, PeerId& peer, std::vector<std::byte>& current,
                       std::span<const std::byte> address, const std::string& name);

}  // namespace conveyor::transport

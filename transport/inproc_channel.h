// InProcChannel: the Channel interface inside one process, for tests of the daemons' logic
// without a network. Channels that should reach each other share one InProcFabric (the
// registry that resolves addresses). send() copies header and payload into the receiver's
// queue, so it never blocks; the queue is unbounded. Destroying a channel is how a test
// "kills" a peer: sends to it fail, and every channel that connected to it gets a failure
// from recv(), as a UCX peer would report a dead process.
//
// Thread-safe: any thread may call any method.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "transport/channel.h"

namespace conveyor::transport {

struct InProcMailbox;

class InProcFabric {
 public:
  static std::shared_ptr<InProcFabric> create() { return std::make_shared<InProcFabric>(); }

 private:
  friend class InProcChannel;
  std::mutex mu_;
  std::unordered_map<std::uint64_t, std::weak_ptr<InProcMailbox>> mailboxes_;
};

class InProcChannel final : public Channel {
 public:
  // `channel_id` 0 picks a random one.
  explicit InProcChannel(std::shared_ptr<InProcFabric> fabric, std::string name = "inproc",
                         std::uint32_t channel_id = 0);
  ~InProcChannel() override;
  InProcChannel(const InProcChannel&) = delete;
  InProcChannel& operator=(const InProcChannel&) = delete;

  std::uint32_t id() const override;
  std::vector<std::byte> address() const override;
  Expected<PeerId> connect(std::span<const std::byte> peer_address, std::string name) override;
  Status disconnect(PeerId peer) override;
  Status send(PeerId peer, std::span<const std::byte> header, PayloadView payload,
              std::chrono::milliseconds timeout) override;
  Expected<std::optional<Message>> recv(std::chrono::milliseconds timeout) override;
  void interrupt() override;
  Status peer_status(PeerId peer) const override;

 private:
  struct Peer {
    std::string name;
    std::uint32_t channel_id = 0;
    std::weak_ptr<InProcMailbox> mailbox;
  };
  Status peer_status_locked(PeerId peer) const;

  std::shared_ptr<InProcFabric> fabric_;
  std::shared_ptr<InProcMailbox> mailbox_;
  mutable std::mutex mu_;  // guards peers_, next_peer_, seq_
  std::unordered_map<PeerId, Peer> peers_;
  PeerId next_peer_ = 1;
  std::uint64_t seq_ = 0;
};

}  // namespace conveyor::transport

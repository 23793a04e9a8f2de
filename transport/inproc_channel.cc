#include "transport/inproc_channel.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <vector>

#include "transport/channel_address.h"

namespace conveyor::transport {

// One channel's receive queue. Items are messages or failure reports, in arrival order.
struct InProcMailbox {
  struct Item {
    std::optional<Message> message;
    PeerId failed_peer = kNoPeer;  // for a failure report: the receiver's id of the peer
    std::string reason;
  };
  std::uint64_t number = 0;
  std::uint32_t channel_id = 0;
  std::string name;

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::deque<Item> queue;
  bool closed = false;
  bool interrupted = false;  // interrupt() was called and no recv() has returned since
  // Channels that connected to this one, with their id for it: told when this one closes.
  std::vector<std::pair<std::weak_ptr<InProcMailbox>, PeerId>> watchers;
};

InProcChannel::InProcChannel(std::shared_ptr<InProcFabric> fabric, std::string name,
                             std::uint32_t channel_id)
    : fabric_(std::move(fabric)), mailbox_(std::make_shared<InProcMailbox>()) {
  mailbox_->channel_id = channel_id ? channel_id : random_channel_id();
  mailbox_->name = std::move(name);
  // Numbers are unique in the process, so an address from another fabric is not found.
  static std::atomic<std::uint64_t> next_number{1};
  mailbox_->number = next_number++;
  std::lock_guard lock(fabric_->mu_);
  fabric_->mailboxes_[mailbox_->number] = mailbox_;
}

InProcChannel::~InProcChannel() {
  {
    std::lock_guard lock(fabric_->mu_);
    fabric_->mailboxes_.erase(mailbox_->number);
  }
  std::vector<std::pair<std::weak_ptr<InProcMailbox>, PeerId>> watchers;
  {
    std::lock_guard lock(mailbox_->mu);
    mailbox_->closed = true;
    watchers.swap(mailbox_->watchers);
  }
  for (auto& [weak, peer_id] : watchers) {
    auto watcher = weak.lock();
    if (!watcher) continue;
    std::lock_guard lock(watcher->mu);
    watcher->queue.push_back({std::nullopt, peer_id, "channel closed"});
    watcher->cv.notify_all();
  }
}

std::uint32_t InProcChannel::id() const { return mailbox_->channel_id; }

std::vector<std::byte> InProcChannel::address() const {
  std::byte body[8];
  std::memcpy(body, &mailbox_->number, 8);
  return encode_channel_address(ChannelKind::kInProc, mailbox_->channel_id, body);
}

Expected<PeerId> InProcChannel::connect(std::span<const std::byte> peer_address, std::string name) {
  auto parsed = parse_channel_address(peer_address);
  if (!parsed.ok()) return Status::error("connect to '" + name + "': " + parsed.error());
  if (parsed->kind != ChannelKind::kInProc || parsed->body.size() != 8)
    return Status::error("connect to '" + name +
                         "': not an in-process channel address (a UCX one?)");
  std::uint64_t number = 0;
  std::memcpy(&number, parsed->body.data(), 8);
  std::shared_ptr<InProcMailbox> target;
  {
    std::lock_guard lock(fabric_->mu_);
    if (auto it = fabric_->mailboxes_.find(number); it != fabric_->mailboxes_.end())
      target = it->second.lock();
  }
  if (!target)
    return Status::error("connect to '" + name + "': no in-process channel #" +
                         std::to_string(number) + " (closed, or from another fabric)");
  PeerId id;
  {
    std::lock_guard lock(mu_);
    id = next_peer_++;
    peers_[id] = Peer{name, parsed->channel_id, target};
  }
  bool closed;
  {
    std::lock_guard lock(target->mu);
    closed = target->closed;
    if (!closed) target->watchers.emplace_back(mailbox_, id);
  }
  if (closed) {
    // Closed between lookup and now: report it like any later failure.
    std::lock_guard lock(mailbox_->mu);
    mailbox_->queue.push_back({std::nullopt, id, "channel closed"});
    mailbox_->cv.notify_all();
  }
  return id;
}

Status InProcChannel::disconnect(PeerId peer) {
  std::lock_guard lock(mu_);
  if (peers_.erase(peer) == 0)
    return Status::error("disconnect: unknown peer id " + std::to_string(peer));
  return ok_status();
}

Status InProcChannel::peer_status_locked(PeerId peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Status::error("unknown peer id " + std::to_string(peer));
  auto target = it->second.mailbox.lock();
  bool closed = !target;
  if (target) {
    std::lock_guard lock(target->mu);
    closed = target->closed;
  }
  if (closed) return Status::error("peer '" + it->second.name + "' failed: channel closed");
  return ok_status();
}

Status InProcChannel::peer_status(PeerId peer) const {
  std::lock_guard lock(mu_);
  return peer_status_locked(peer);
}

Status InProcChannel::send(PeerId peer, std::span<const std::byte> header, PayloadView payload,
                           std::chrono::milliseconds /*timeout: never blocks*/) {
  std::shared_ptr<InProcMailbox> target;
  std::string name;
  std::uint64_t seq;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::error("send: unknown peer id " + std::to_string(peer));
    target = it->second.mailbox.lock();
    name = it->second.name;
    seq = seq_++;
  }
  Message m;
  m.sender_id = mailbox_->channel_id;
  m.seq = seq;
  m.header.assign(header.begin(), header.end());
  m.payload = OwnedBuffer::copy_of(payload.data, payload.bytes);
  if (target) {
    std::lock_guard lock(target->mu);
    if (!target->closed) {
      target->queue.push_back({std::move(m), kNoPeer, {}});
      target->cv.notify_one();
      return ok_status();
    }
  }
  return Status::error("send to '" + name + "' failed: channel closed");
}

void InProcChannel::interrupt() {
  {
    std::lock_guard lock(mailbox_->mu);
    mailbox_->interrupted = true;
  }
  mailbox_->cv.notify_all();
}

Expected<std::optional<Message>> InProcChannel::recv(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    InProcMailbox::Item item;
    {
      std::unique_lock lock(mailbox_->mu);
      const bool ready =
          mailbox_->cv.wait_until(lock, deadline, [&] { return !mailbox_->queue.empty() || mailbox_->interrupted; });
      mailbox_->interrupted = false;  // consumed by this recv, with a message or without
      if (!ready || mailbox_->queue.empty()) return std::optional<Message>();
      item = std::move(mailbox_->queue.front());
      mailbox_->queue.pop_front();
    }
    std::lock_guard lock(mu_);
    if (item.message) {
      for (const auto& [id, p] : peers_)
        if (p.channel_id == item.message->sender_id) item.message->from = id;
      return std::move(item.message);
    }
    auto it = peers_.find(item.failed_peer);
    if (it == peers_.end()) continue;  // a peer disconnected since: nobody to tell
    return Status::error("peer '" + it->second.name + "' failed: " + item.reason);
  }
}

}  // namespace conveyor::transport

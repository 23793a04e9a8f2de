// UcxChannel's authenticated data plane (data_auth.h), on the progress thread: the handshake
// connect() sends first, the MAC on every later envelope, and the receiver's admission of
// each envelope before its payload is fetched.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "transport/ucx_channel_impl.h"

namespace conveyor::transport {

using namespace ucx_detail;

namespace {

// Sessions kept per sender channel: one channel may hold two connections to this one (a
// stage 0 reaches the coordinator as its previous stage and for results; the coordinator
// reaches a one-stage pipeline's worker as first and last stage), and after a redial the
// messages still under way on the old ones are checked against their old sessions.
constexpr std::size_t kSessionsKept = 4;

std::span<const std::byte> bytes_of(const wire::WirePrefix& p) { return {reinterpret_cast<const std::byte*>(&p), sizeof(p)}; }

// The MAC of an envelope: its prefix with the MAC field zero, its header, its inline payload.
auth::Mac envelope_mac(const auth::Key& session, wire::WirePrefix prefix, std::span<const std::byte> header,
                       std::span<const std::byte> inline_payload) {
  std::memset(prefix.mac, 0, sizeof(prefix.mac));
  const std::span<const std::byte> parts[] = {bytes_of(prefix), header, inline_payload};
  return auth::message_mac(session, parts);
}

}  // namespace

void UcxChannel::Impl::sign(SendOp& op, const Peer& peer, bool inline_payload) {
  const std::span<const std::byte> payload =
      inline_payload && op.payload.bytes ? std::span(static_cast<const std::byte*>(op.payload.data), op.payload.bytes)
                                         : std::span<const std::byte>();
  const auth::Mac mac = envelope_mac(*peer.session, op.prefix, op.header, payload);
  std::memcpy(op.prefix.mac, mac.data(), mac.size());
}

// Nobody waits for the handshake's send: a failure shows as the peer's (its endpoint fails,
// or the receiver, having no session, refuses what follows and logs why).
void UcxChannel::Impl::send_hello(Peer& peer) {
  auto op = std::make_shared<SendOp>();
  op->peer = peer.id;
  op->header = peer.hello;
  op->hello = true;
  op->redial = replaces_closed(peer);
  op->timeout = kTaskTimeout;
  op->deadline = Clock::now() + kTaskTimeout;
  start_send(op);
}

bool UcxChannel::Impl::admitted(Incoming& in, std::uint32_t sender) {
  switch (admit(in, sender)) {
    case Admission::kAdmit: return true;
    case Admission::kDefer: return false;  // its sender's handshake is still arriving: next round
    case Admission::kConsumed:
    case Admission::kRefused: break;
  }
  in.stage = Incoming::kDropped;
  return false;
}

UcxChannel::Impl::Admission UcxChannel::Impl::admit(Incoming& in, std::uint32_t sender) {
  const wire::WirePrefix& p = in.prefix;
  if (p.flags & wire::kFlagHello) {
    take_hello(in, sender);
    return Admission::kConsumed;
  }
  auto it = sessions.find(sender);
  if (it == sessions.end()) {
    if (earlier_envelope_pending(sender, in)) return Admission::kDefer;
    refuse(sender, "it has not proved it belongs to this cluster (no handshake, or one with the wrong key)");
    return Admission::kRefused;
  }
  const std::span<const std::byte> payload = wire::tag_inline(in.tag) ? in.message.payload.view() : std::span<const std::byte>();
  for (const auth::Key& session : it->second) {
    const auth::Mac want = envelope_mac(session, p, in.message.header, payload);
    if (auth::equal(want, std::span<const std::uint8_t>(p.mac, sizeof(p.mac)))) return Admission::kAdmit;
  }
  refuse(sender, "a wrong MAC (forged, altered, or not from the channel that shook hands with this id)");
  return Admission::kRefused;
}

void UcxChannel::Impl::take_hello(Incoming& in, std::uint32_t sender) {
  const std::vector<std::byte>& header = in.message.header;
  if (header.size() != auth::kHelloBytes || in.prefix.payload_bytes != 0) {
    refuse(sender, "a malformed handshake");
    return;
  }
  auth::Handshake h{.sender_id = sender, .receiver_id = channel_id, .receiver_nonce = nonce, .sender_nonce = {}};
  auth::Proof proof{};
  std::memcpy(h.sender_nonce.data(), header.data(), h.sender_nonce.size());
  std::memcpy(proof.data(), header.data() + h.sender_nonce.size(), proof.size());
  if (!auth::equal(auth::hello_proof(*key, h), proof)) {
    refuse(sender, "a handshake with the wrong key (not a member of this cluster)");
    return;
  }
  if (!seen_hellos.insert(h.sender_nonce).second) {
    refuse(sender, "a handshake replayed (seen before)");
    return;
  }
  std::deque<auth::Key>& keys = sessions[sender];
  keys.push_front(auth::session_key(*key, h));
  if (keys.size() > kSessionsKept) keys.pop_back();
  spdlog::debug("ucx channel '{}': {} proved it belongs to the cluster", opt.name, sender_name(sender));
  // Connections are not ordered with each other: after two quick redials the older handshake
  // may come second. The floor only rises, and a handshake cuts off only what was sent before it.
  if (in.prefix.flags & wire::kFlagRedial) {
    std::uint64_t& newest = redial_seq[sender];
    newest = std::max(newest, in.prefix.seq);
    cut_off_payloads(sender, in.prefix.seq,
                     "its sender dialled this channel again, having closed the connection it came on");
  }
}

bool UcxChannel::Impl::before_redial(std::uint32_t sender, std::uint64_t seq) const {
  auto it = redial_seq.find(sender);
  return it != redial_seq.end() && seq < it->second;
}

bool UcxChannel::Impl::replaces_closed(const Peer& peer) {
  bool closed = false;
  std::lock_guard lock(mu);
  for (const auto& [id, other] : peers) {
    if (other.get() == &peer || other->channel_id != peer.channel_id) continue;
    if (other->failure.ok()) return false;  // another connection to that channel still works
    closed = true;
  }
  return closed || closed_channels.count(peer.channel_id) > 0;
}

// A payload UCX is still receiving from `sender` would otherwise hold every later message of
// that sender (they are handed out in order) until stalled_receive_timeout.
void UcxChannel::Impl::cut_off_payloads(std::uint32_t sender, std::uint64_t before_seq, const std::string& why) {
  auto it = incoming.find(sender);
  if (it == incoming.end()) return;
  int n = 0;
  for (auto& other : it->second)
    if (other->stage == Incoming::kPayload && other->in_flight && other->prefix.seq < before_seq)
      abandon(*other, "cut off (" + why + ")"), ++n;
  if (n > 0)
    spdlog::info("ucx channel '{}': gave up {} payload(s) from {} still arriving: {}", opt.name, n, sender_name(sender),
                 why);
}

// Whether an envelope before `in` from the same sender is still arriving (its handshake may
// be among them: messages from one sender are admitted in order).
bool UcxChannel::Impl::earlier_envelope_pending(std::uint32_t sender, const Incoming& in) {
  auto it = incoming.find(sender);
  if (it == incoming.end()) return false;
  for (const auto& other : it->second) {
    if (other.get() == &in) return false;
    if (other->stage == Incoming::kEnvelope) return true;
  }
  return false;
}

void UcxChannel::Impl::refuse(std::uint32_t sender, const std::string& why) {
  ++refused;
  if (refusals_logged.size() < 1024 && refusals_logged.emplace(sender, why).second)
    spdlog::warn("ucx channel '{}': refused a message from {}: {}; dropped (further ones like it are counted, not "
                 "logged)",
                 opt.name, sender_name(sender), why);
}

}  // namespace conveyor::transport

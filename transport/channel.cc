#include "transport/channel.h"

#include <algorithm>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>

#include "transport/buffer_pool.h"
#include "transport/channel_address.h"

namespace conveyor::transport {

static_assert(std::endian::native == std::endian::little,
              "the address and wire formats are little-endian");

void detail::ReleaseBuffer::operator()(std::byte* p) const {
  if (cache)
    cache->put(p, capacity);
  else
    std::free(p);
}

OwnedBuffer OwnedBuffer::allocate(std::size_t bytes) {
  OwnedBuffer b;
  if (bytes == 0) return b;
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) throw std::bad_alloc();
  b.data_ =
      std::unique_ptr<std::byte, Release>(static_cast<std::byte*>(p), Release{nullptr, rounded});
  b.size_ = bytes;
  return b;
}

OwnedBuffer OwnedBuffer::copy_of(const void* data, std::size_t bytes) {
  OwnedBuffer b = allocate(bytes);
  if (bytes) std::memcpy(b.data(), data, bytes);
  return b;
}

namespace {
constexpr char kMagic[4] = {'C', 'V', 'Y', 'A'};
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kPrefixBytes = 16;
}  // namespace

std::vector<std::byte> encode_channel_address(ChannelKind kind, std::uint32_t channel_id,
                                              std::span<const std::byte> body, std::uint16_t flags,
                                              const AddressNonce* nonce, const HostIdentity* host) {
  const std::size_t nonce_bytes = nonce ? nonce->size() : 0;
  const std::size_t host_bytes = host ? kHostIdentityBytes : 0;
  if (nonce) flags |= kAddressAuthenticated;
  if (host) flags |= kAddressHostSharedMemory;
  std::vector<std::byte> out(kPrefixBytes + nonce_bytes + host_bytes + body.size());
  std::memcpy(out.data(), kMagic, 4);
  out[4] = std::byte{kVersion};
  out[5] = std::byte{static_cast<std::uint8_t>(kind)};
  std::memcpy(out.data() + 6, &flags, 2);
  const auto body_bytes = static_cast<std::uint32_t>(body.size());
  std::memcpy(out.data() + 8, &channel_id, 4);
  std::memcpy(out.data() + 12, &body_bytes, 4);
  if (nonce) std::memcpy(out.data() + kPrefixBytes, nonce->data(), nonce_bytes);
  if (host) {
    std::byte* h = out.data() + kPrefixBytes + nonce_bytes;
    std::memcpy(h, host->boot_id.data(), 16);
    std::memcpy(h + 16, &host->pid, 4);
    std::memcpy(h + 20, &host->start_ticks, 8);
    std::memcpy(h + 28, &host->net_ns, 8);
    std::memcpy(h + 36, &host->ipc_ns, 8);
    std::memcpy(h + 44, &host->uid, 4);
  }
  if (!body.empty()) std::memcpy(out.data() + kPrefixBytes + nonce_bytes + host_bytes, body.data(), body.size());
  return out;
}

Expected<ChannelAddress> parse_channel_address(std::span<const std::byte> blob) {
  if (blob.size() < kPrefixBytes || std::memcmp(blob.data(), kMagic, 4) != 0)
    return Status::error("not a channel address (" + std::to_string(blob.size()) +
                         " bytes, bad magic)");
  if (std::to_integer<std::uint8_t>(blob[4]) != kVersion)
    return Status::error("channel address version " +
                         std::to_string(std::to_integer<int>(blob[4])) + ", expected " +
                         std::to_string(kVersion));
  const auto kind = std::to_integer<std::uint8_t>(blob[5]);
  if (kind != static_cast<std::uint8_t>(ChannelKind::kUcx) &&
      kind != static_cast<std::uint8_t>(ChannelKind::kInProc))
    return Status::error("channel address of unknown kind " + std::to_string(kind));
  ChannelAddress a;
  a.kind = static_cast<ChannelKind>(kind);
  std::memcpy(&a.flags, blob.data() + 6, 2);
  std::uint32_t body_bytes = 0;
  std::memcpy(&a.channel_id, blob.data() + 8, 4);
  std::memcpy(&body_bytes, blob.data() + 12, 4);
  const std::size_t nonce_bytes = (a.flags & kAddressAuthenticated) ? a.nonce.size() : 0;
  const std::size_t host_bytes = (a.flags & kAddressHostSharedMemory) ? kHostIdentityBytes : 0;
  if (blob.size() != kPrefixBytes + nonce_bytes + host_bytes + body_bytes)
    return Status::error("channel address length " + std::to_string(blob.size()) +
                         " does not match its body length " + std::to_string(body_bytes));
  if (nonce_bytes) std::memcpy(a.nonce.data(), blob.data() + kPrefixBytes, nonce_bytes);
  if (host_bytes) {
    const std::byte* h = blob.data() + kPrefixBytes + nonce_bytes;
    std::memcpy(a.host.boot_id.data(), h, 16);
    std::memcpy(&a.host.pid, h + 16, 4);
    std::memcpy(&a.host.start_ticks, h + 20, 8);
    std::memcpy(&a.host.net_ns, h + 28, 8);
    std::memcpy(&a.host.ipc_ns, h + 36, 8);
    std::memcpy(&a.host.uid, h + 44, 4);
  }
  a.body = blob.subspan(kPrefixBytes + nonce_bytes + host_bytes);
  return a;
}

std::uint32_t random_channel_id() {
  static thread_local std::mt19937 rng{std::random_device{}()};
  std::uint32_t id = 0;
  while (id == 0) id = rng();
  return id;
}

Status keep_or_connect(Channel& channel, PeerId& peer, std::vector<std::byte>& current,
                       std::span<const std::byte> address, const std::string& name) {
  if (peer != kNoPeer && std::ranges::equal(current, address) && channel.peer_status(peer).ok()) return ok_status();
  if (peer != kNoPeer) (void)channel.disconnect(peer), peer = kNoPeer;
  current.clear();
  if (address.empty()) return ok_status();
  auto p = channel.connect(address, name);
  if (!p) return p.status();
  peer = *p;
  current.assign(address.begin(), address.end());
  return ok_status();
}

}  // namespace conveyor::transport

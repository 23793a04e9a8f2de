// The address blob a channel publishes (Channel::address()) and peers pass to connect():
//
//   offset  bytes  field
//   0       4      magic "CVYA"
//   4       1      version (1)
//   5       1      kind: 1 = UCX worker address, 2 = in-process mailbox
//   6       2      flags: bit 0 = takes payloads into CUDA device memory (the direct path);
//                  bit 1 = authenticated: takes messages only after a handshake (data_auth.h);
//                  bit 2 = talks over shared memory with channels of its host that do too
//                  (UcxChannelOptions::host_shared_memory): its process's identity follows
//   8       4      channel id (the id carried in every message the channel sends)
//   12      4      body length in bytes
//  [        16     with flags bit 1: the channel's nonce for handshakes (data_auth.h)]
//  [        48     with flags bit 2: its process (host_identity.h): boot id 16, pid 4, start 8,
//                  network namespace 8, IPC namespace 8, user 4]
//           n      body: the ucp worker address (kind 1) or the mailbox number (kind 2)
//
// Little-endian, like the data-plane wire format (wire_format.h).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "transport/host_identity.h"

namespace conveyor::transport {

enum class ChannelKind : std::uint8_t { kUcx = 1, kInProc = 2 };

inline constexpr std::uint16_t kAddressTakesDeviceMemory = 1;  // flags bit 0
inline constexpr std::uint16_t kAddressAuthenticated = 2;      // flags bit 1: a nonce follows
inline constexpr std::uint16_t kAddressHostSharedMemory = 4;   // flags bit 2: an identity follows

using AddressNonce = std::array<std::uint8_t, 16>;

struct ChannelAddress {
  ChannelKind kind = ChannelKind::kUcx;
  std::uint16_t flags = 0;  // kAddressTakesDeviceMemory, kAddressAuthenticated
  std::uint32_t channel_id = 0;
  AddressNonce nonce{};             // with kAddressAuthenticated; zero otherwise
  HostIdentity host{};              // with kAddressHostSharedMemory; zero otherwise
  std::span<const std::byte> body;  // a view into the parsed blob
};

// `nonce`: given, the address says the channel is authenticated (flags bit 1) and carries it.
// `host`: given, it says the channel talks over shared memory on its host (bit 2) and who it is.
std::vector<std::byte> encode_channel_address(ChannelKind kind, std::uint32_t channel_id,
                                              std::span<const std::byte> body,
                                              std::uint16_t flags = 0,
                                              const AddressNonce* nonce = nullptr,
                                              const HostIdentity* host = nullptr);
// Checks magic, version, kind and length; the result views into `blob`.
Expected<ChannelAddress> parse_channel_address(std::span<const std::byte> blob);

// A random non-zero channel id (channel ids only need to differ between the channels that
// send to one receiver; 32 random bits make a clash among hundreds of workers unlikely).
std::uint32_t random_channel_id();

}  // namespace conveyor::transport

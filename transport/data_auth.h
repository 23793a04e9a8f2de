// The authenticated data plane (issue 28): who may send micro-batches to a channel.
//
// Every member of a cluster knows its secret (the join token); a UcxChannel given it
// (UcxChannelOptions::auth_secret) derives a 32-byte key from it and takes messages only from
// channels that proved they know that key, and only with a valid MAC:
//
//   - A channel's address carries a random nonce of its own (channel_address.h, flags bit 1),
//     fresh in every process.
//   - connect() sends the peer a handshake first ("hello": the sender's own nonce and a proof,
//     HMAC-SHA256(key, "hello" | sender id | receiver id | receiver nonce | sender nonce)).
//     The receiver checks the proof and that it never saw that sender nonce (a recorded hello
//     replayed to it is refused), and both ends derive the session key HMAC-SHA256(key,
//     "session" | the same fields).
//   - Every later envelope carries a 16-byte MAC of (prefix | header | inline payload) keyed
//     by the session key, in its prefix (wire_format.h): keyed BLAKE2b (libsodium's
//     crypto_generichash), about three times HMAC-SHA256's speed here (8 KiB: 12 us against
//     34 us on the 2-core VM, loaded), as every envelope pays it once on each side. The
//     sender id inside the MAC is what recv() reports, so a stranger cannot take a member's
//     id either.
//
// A message without a session (no handshake, a wrong key) or with a wrong MAC is dropped,
// counted and logged: the channel, and the stage that owns it, go on. A payload sent as its
// own message (over 8 KiB) is bound to its envelope by sender, sequence number and length,
// not by a MAC of its bytes (a MAC at memory speed would cost more than the transfer; device
// payloads never pass through the CPU): the data plane is authenticated, not encrypted, and
// an attacker on the path can still read or alter such payloads (docs/OPERATIONS.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace conveyor::transport::auth {

using Key = std::array<std::uint8_t, 32>;
using Nonce = std::array<std::uint8_t, 16>;
using Proof = std::array<std::uint8_t, 32>;
using Mac = std::array<std::uint8_t, 16>;

// The data-plane key of a cluster: HMAC-SHA256(secret, "conveyor data plane v1").
Key derive_key(std::string_view secret);

// A random nonce (libsodium's randombytes).
Nonce random_nonce();

// The handshake of `sender` to `receiver`, and the session key it opens.
struct Handshake {
  std::uint32_t sender_id = 0, receiver_id = 0;
  Nonce receiver_nonce{}, sender_nonce{};
};
Proof hello_proof(const Key& key, const Handshake& h);
Key session_key(const Key& key, const Handshake& h);

// What a hello message's header holds: the sender's nonce and the proof.
inline constexpr std::size_t kHelloBytes = sizeof(Nonce) + sizeof(Proof);

// Keyed BLAKE2b of parts..., 16 bytes.
Mac message_mac(const Key& session, std::span<const std::span<const std::byte>> parts);

// Compares in constant time.
bool equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b);

}  // namespace conveyor::transport::auth

// The data-plane wire format of UcxChannel: how one message (header, payload) travels as
// UCX tagged messages. Little-endian; both ends are the same build of Conveyor.
//
// A message is an *envelope*, optionally followed by a separate *payload* message:
//
//   envelope = WirePrefix (48 bytes) | header bytes | [payload bytes, when inline]
//   payload  = payload bytes (only when not inline)
//
// Payloads up to the inline limit ride inside the envelope (one eager message, gathered
// from the caller's buffers with an iov: no extra copy), unless they are in device memory. Larger payloads go as their own
// contiguous tagged message so that UCX can use zero-copy rendezvous; the receiver posts a
// receive for it into a buffer of exactly the advertised size as soon as the envelope is in.
//
// 64-bit tags:
//   envelope: bit 63 = 1 | bit 62 = inline | bits 56..61 = version | bits 32..55 = header
//             length in bytes (< 16 MiB) | bits 0..31 = sender channel id
//   payload:  bit 63 = 0 | bits 56..62 = version | bits 32..55 = low 24 bits of the message
//             seq | bits 0..31 = sender channel id
// The receiver probes for envelopes only (mask = bit 63 + version bits), learns the header
// length from the tag and the total length from the probe, and so can receive the envelope
// straight into separate header and payload buffers. Payloads are matched exactly by
// (sender id, seq): unique while fewer than 2^24 messages from one sender are in flight.
#pragma once

#include <cstdint>

namespace conveyor::transport::wire {

inline constexpr std::uint32_t kMagic = 0x31595643;  // "CVY1"
inline constexpr std::uint16_t kVersion = 2;            // 2: the MAC (data_auth.h)

struct WirePrefix {
  std::uint32_t magic = kMagic;
  std::uint16_t version = kVersion;
  std::uint16_t flags = 0;  // kFlagInline, kFlagDevicePayload, kFlagHello, kFlagRedial
  std::uint32_t sender_id = 0;
  std::uint32_t header_bytes = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t seq = 0;
  // On an authenticated channel: the MAC of (this prefix with `mac` zero | header | inline
  // payload) under the session key (data_auth.h: keyed BLAKE2b, 16 bytes); zero otherwise.
  std::uint8_t mac[16] = {};
};
static_assert(sizeof(WirePrefix) == 48);

inline constexpr std::uint16_t kFlagInline = 1;
// The payload was sent from CUDA device memory (never inline): a receiver that takes device
// memory (its address says so) receives it into its GPU's memory. Nothing else about the
// message changes, so a receiver that ignores the bit still gets the same bytes.
inline constexpr std::uint16_t kFlagDevicePayload = 2;
// A handshake (data_auth.h): the header is the sender's nonce and its proof; no payload.
// Taken by the channel itself, never handed to recv().
inline constexpr std::uint16_t kFlagHello = 4;
// On a handshake: the sender has closed every earlier connection of its to this channel (it
// gave the peer up and dialled it again), so a payload of its still arriving here never will
// (transport/README.md, "Closing an endpoint"). Set only where the sender holds no other
// working connection to this channel.
inline constexpr std::uint16_t kFlagRedial = 8;
inline constexpr std::uint64_t kMaxHeaderBytes = (1ull << 24) - 1;

inline constexpr std::uint64_t kEnvelopeBit = 1ull << 63;
inline constexpr std::uint64_t kInlineBit = 1ull << 62;
inline constexpr std::uint64_t kVersionShift = 56;
inline constexpr std::uint64_t kEnvelopeVersionMask = 0x3full << kVersionShift;  // 6 bits
inline constexpr std::uint64_t kPayloadVersionMask = 0x7full << kVersionShift;   // 7 bits

inline constexpr std::uint64_t kProbeTag =
    kEnvelopeBit | (std::uint64_t{kVersion} << kVersionShift);
inline constexpr std::uint64_t kProbeMask = kEnvelopeBit | kEnvelopeVersionMask;
inline constexpr std::uint64_t kFullMask = ~0ull;

inline std::uint64_t envelope_tag(std::uint32_t sender_id, std::uint32_t header_bytes,
                                  bool payload_inline) {
  return kProbeTag | (payload_inline ? kInlineBit : 0) |
         (std::uint64_t{header_bytes & 0xffffffu} << 32) | sender_id;
}
inline std::uint64_t payload_tag(std::uint32_t sender_id, std::uint64_t seq) {
  return (std::uint64_t{kVersion} << kVersionShift) | ((seq & 0xffffffu) << 32) | sender_id;
}
inline bool tag_inline(std::uint64_t tag) { return tag & kInlineBit; }
inline std::uint32_t tag_header_bytes(std::uint64_t tag) { return (tag >> 32) & 0xffffffu; }
inline std::uint32_t tag_sender(std::uint64_t tag) { return static_cast<std::uint32_t>(tag); }

}  // namespace conveyor::transport::wire

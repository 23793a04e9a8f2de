// The authenticated data plane (transport/data_auth.h) on UcxChannel: channels that share the
// cluster's secret talk as before (every size, in order); a channel with another secret, one
// posing under a member's channel id, and one with no secret at all get nothing through, and
// the receiver counts and logs what it refused and goes on.
#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include "tests/transport/ucx_test_util.h"
#include "transport/channel_address.h"
#include "transport/data_auth.h"

namespace conveyor::transport {
namespace {

using namespace ucx_test;

std::unique_ptr<UcxChannel> keyed(const std::string& name, const std::string& secret, std::uint32_t id = 0) {
  return make_channel("", name, {.channel_id = id, .net_devices = "lo", .auth_secret = secret});
}

Status send_bytes(UcxChannel& from, PeerId to, const std::string& header, std::span<const std::byte> payload = {},
                  std::chrono::milliseconds timeout = 5s) {
  return from.send(to, std::as_bytes(std::span(header)), {payload.data(), payload.size()}, timeout);
}

// Nothing arrives within `wait` (the receiver's progress thread has taken and dropped it).
bool nothing_arrives(UcxChannel& ch, std::chrono::milliseconds wait = 300ms) {
  auto r = ch.recv(wait);
  EXPECT_TRUE(r.ok()) << r.error();
  return r.ok() && !r->has_value();
}

TEST(DataAuth, KeysDifferBySecretAndHandshakesBySessions) {
  EXPECT_EQ(auth::derive_key("s"), auth::derive_key("s"));
  EXPECT_NE(auth::derive_key("s"), auth::derive_key("t"));
  EXPECT_NE(auth::random_nonce(), auth::random_nonce());
  const auth::Key k = auth::derive_key("s");
  auth::Handshake h{.sender_id = 1, .receiver_id = 2, .receiver_nonce = auth::random_nonce(),
                    .sender_nonce = auth::random_nonce()};
  const auth::Proof p = auth::hello_proof(k, h);
  EXPECT_NE(auth::session_key(k, h), p) << "the proof on the wire must not be the session key";
  auth::Handshake other = h;
  other.sender_id = 3;
  EXPECT_NE(auth::hello_proof(k, other), p);
  EXPECT_TRUE(auth::equal(p, p));
  EXPECT_FALSE(auth::equal(p, auth::hello_proof(auth::derive_key("t"), h)));
}

TEST(DataAuth, TheAddressSaysTheChannelIsAuthenticatedAndCarriesItsNonce) {
  auto a = keyed("a", "s");
  auto plain = make_channel("", "plain", {.net_devices = "lo"});
  ASSERT_TRUE(a && plain);
  auto pa = parse_channel_address(a->address());
  ASSERT_TRUE(pa.ok()) << pa.error();
  EXPECT_TRUE(pa->flags & kAddressAuthenticated);
  EXPECT_NE(pa->nonce, AddressNonce{});
  auto pp = parse_channel_address(plain->address());
  ASSERT_TRUE(pp.ok()) << pp.error();
  EXPECT_FALSE(pp->flags & kAddressAuthenticated);
  // Only both or neither: each side says which is missing.
  auto to_keyed = plain->connect(a->address(), "a");
  ASSERT_FALSE(to_keyed.ok());
  EXPECT_NE(to_keyed.error().find("authenticated and this one has no cluster secret"), std::string::npos)
      << to_keyed.error();
  auto to_plain = a->connect(plain->address(), "plain");
  ASSERT_FALSE(to_plain.ok());
  EXPECT_NE(to_plain.error().find("not authenticated"), std::string::npos) << to_plain.error();
}

TEST(DataAuth, MembersTalkAtEverySizeAndInOrder) {
  auto a = keyed("a", "s"), b = keyed("b", "s");
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  for (std::size_t bytes : {std::size_t{0}, 100 * std::size_t{1}, 8 * KiB, 8 * KiB + 1, 1 * MiB}) {
    std::vector<std::byte> payload(bytes);
    fill_pattern(payload.data(), bytes, bytes);
    ASSERT_TRUE(send_bytes(*a, *to_b, "h" + std::to_string(bytes), payload).ok());
    Message m = recv_one(*b);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.header.data()), m.header.size()), "h" + std::to_string(bytes));
    ASSERT_EQ(m.payload.size(), bytes);
    EXPECT_EQ(check_pattern(m.payload.data(), bytes, bytes), -1);
    EXPECT_EQ(m.sender_id, a->id());
  }
  EXPECT_EQ(b->refused_messages(), 0u);
}

TEST(DataAuth, AStrangerGetsNothingThroughAndTheReceiverGoesOn) {
  auto member = keyed("member", "s"), receiver = keyed("receiver", "s");
  ASSERT_TRUE(member && receiver);
  auto from_member = member->connect(receiver->address(), "receiver");
  ASSERT_TRUE(from_member.ok()) << from_member.error();
  ASSERT_TRUE(send_bytes(*member, *from_member, "before").ok());
  EXPECT_EQ(recv_one(*receiver).header.size(), 6u);

  // Another secret: its handshake and its message are refused (2).
  auto stranger = keyed("stranger", "not-s");
  auto from_stranger = stranger->connect(receiver->address(), "receiver");
  ASSERT_TRUE(from_stranger.ok()) << from_stranger.error();
  ASSERT_TRUE(send_bytes(*stranger, *from_stranger, "injected").ok());
  EXPECT_TRUE(nothing_arrives(*receiver));
  EXPECT_EQ(receiver->refused_messages(), 2u);

  // Posing under the member's channel id, large payload and all: its MAC is wrong (2 more),
  // and the receiver never fetches the payload (the impostor's send does not complete).
  auto impostor = keyed("impostor", "not-s", member->id());
  auto from_impostor = impostor->connect(receiver->address(), "receiver");
  ASSERT_TRUE(from_impostor.ok()) << from_impostor.error();
  std::vector<std::byte> big(64 * KiB);
  EXPECT_FALSE(send_bytes(*impostor, *from_impostor, "forged", big, 1s).ok());
  EXPECT_TRUE(nothing_arrives(*receiver));
  EXPECT_EQ(receiver->refused_messages(), 4u);

  // The member goes on.
  ASSERT_TRUE(send_bytes(*member, *from_member, "after").ok());
  Message m = recv_one(*receiver);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.header.data()), m.header.size()), "after");
  EXPECT_EQ(m.sender_id, member->id());
}

// A member that connects again (a redial) opens a new session; what it sent on the old
// connection still counts.
// The second connect takes back the endpoint the disconnect parked (ucx_channel_impl.h) and
// sends a new handshake on it: its messages carry the new session's MACs.
TEST(DataAuth, AReconnectedMemberOpensANewSession) {
  auto a = keyed("a", "s"), b = keyed("b", "s");
  ASSERT_TRUE(a && b);
  auto first = a->connect(b->address(), "b");
  ASSERT_TRUE(first.ok()) << first.error();
  ASSERT_TRUE(send_bytes(*a, *first, "one").ok());
  EXPECT_EQ(recv_one(*b).header.size(), 3u);
  ASSERT_TRUE(a->disconnect(*first).ok());
  auto second = a->connect(b->address(), "b");
  ASSERT_TRUE(second.ok()) << second.error();
  ASSERT_TRUE(send_bytes(*a, *second, "two!").ok());
  EXPECT_EQ(recv_one(*b).header.size(), 4u);
  EXPECT_EQ(b->refused_messages(), 0u);
}

}  // namespace
}  // namespace conveyor::transport

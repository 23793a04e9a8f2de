// InProcChannel: the in-process Channel used by daemon tests.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "tests/transport/transport_test_util.h"
#include "transport/inproc_channel.h"

namespace conveyor::transport {
namespace {

using namespace std::chrono_literals;
using conveyor::testing::check_pattern;
using conveyor::testing::fill_pattern;

Message recv_one(Channel& ch) {
  auto r = ch.recv(5s);
  EXPECT_TRUE(r.ok()) << r.error();
  if (!r.ok() || !r->has_value()) {
    ADD_FAILURE() << "no message within 5 s";
    return {};
  }
  return std::move(**r);
}

TEST(InProcChannel, RoundTripOwnsCopies) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric, "a"), b(fabric, "b");
  auto to_b = a.connect(b.address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  auto to_a = b.connect(a.address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();

  std::vector<unsigned char> payload(1 << 20);
  fill_pattern(payload.data(), payload.size(), 7);
  std::string header = "batch 1";
  ASSERT_TRUE(a.send(*to_b, as_bytes(header), {payload.data(), payload.size()}, 1s).ok());
  // The caller's buffers may be reused as soon as send returns.
  header = "clobbered";
  std::fill(payload.begin(), payload.end(), 0);

  Message m = recv_one(b);
  EXPECT_EQ(as_string_view(m.header), "batch 1");
  ASSERT_EQ(m.payload.size(), std::size_t{1} << 20);
  EXPECT_EQ(check_pattern(m.payload.data(), m.payload.size(), 7), -1);
  EXPECT_EQ(m.from, *to_a);
  EXPECT_EQ(m.sender_id, a.id());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(m.payload.data()) % OwnedBuffer::kAlignment, 0u);
}

// As UcxChannel's (test_ucx_channel.cc): an interrupt ends a waiting recv, or is kept for the
// next one, and a message waiting with it still arrives.
TEST(InProcChannel, InterruptEndsAWaitingRecvOrTheNextOne) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric, "a"), b(fabric, "b");
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    auto r = a.recv(std::chrono::hours(1));
    EXPECT_TRUE(r.ok() && !r->has_value());
    returned = true;
  });
  const auto guard = std::chrono::steady_clock::now() + 60s;  // a hang guard, not a timing
  while (!returned && std::chrono::steady_clock::now() < guard) {
    a.interrupt();
    std::this_thread::sleep_for(10ms);
  }
  waiter.join();
  ASSERT_TRUE(returned.load());
  a.interrupt();
  auto kept = a.recv(std::chrono::hours(1));
  ASSERT_TRUE(kept.ok() && !kept->has_value());
  auto after = a.recv(20ms);
  ASSERT_TRUE(after.ok() && !after->has_value());
  auto to_a = b.connect(a.address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();
  ASSERT_TRUE(b.send(*to_a, as_bytes(std::string("hello")), {}, 1s).ok());
  a.interrupt();
  Message m = recv_one(a);
  EXPECT_EQ(as_string_view(m.header), "hello");
}

TEST(InProcChannel, EmptyHeaderAndPayload) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric), b(fabric);
  auto to_b = a.connect(b.address(), "b");
  ASSERT_TRUE(to_b.ok());
  ASSERT_TRUE(a.send(*to_b, {}, {}, 1s).ok());
  Message m = recv_one(b);
  EXPECT_TRUE(m.header.empty());
  EXPECT_TRUE(m.payload.empty());
  EXPECT_EQ(m.from, kNoPeer);  // b never connected to a
}

TEST(InProcChannel, ManyMessagesInOrder) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric), b(fabric);
  auto to_b = a.connect(b.address(), "b");
  ASSERT_TRUE(to_b.ok());
  constexpr int kCount = 5000;
  std::thread sender([&] {
    std::vector<unsigned char> buf(300);
    for (int i = 0; i < kCount; ++i) {
      fill_pattern(buf.data(), buf.size(), i);
      const std::string h = std::to_string(i);
      ASSERT_TRUE(a.send(*to_b, as_bytes(h), {buf.data(), buf.size()}, 1s).ok());
    }
  });
  std::uint64_t last_seq = 0;
  for (int i = 0; i < kCount; ++i) {
    Message m = recv_one(b);
    ASSERT_EQ(as_string_view(m.header), std::to_string(i));
    ASSERT_EQ(check_pattern(m.payload.data(), m.payload.size(), i), -1);
    if (i) {
      EXPECT_GT(m.seq, last_seq);
    }
    last_seq = m.seq;
  }
  sender.join();
}

TEST(InProcChannel, ConcurrentSendersToOneReceiver) {
  auto fabric = InProcFabric::create();
  InProcChannel s1(fabric, "s1"), s2(fabric, "s2"), r(fabric, "r");
  constexpr int kCount = 2000;
  auto run = [&](InProcChannel& s, int tag) {
    auto to_r = s.connect(r.address(), "r");
    ASSERT_TRUE(to_r.ok());
    for (int i = 0; i < kCount; ++i) {
      const std::string h = std::to_string(tag) + ":" + std::to_string(i);
      ASSERT_TRUE(s.send(*to_r, as_bytes(h), {}, 1s).ok());
    }
  };
  std::thread t1(run, std::ref(s1), 1), t2(run, std::ref(s2), 2);
  int next[3] = {0, 0, 0};
  for (int i = 0; i < 2 * kCount; ++i) {
    Message m = recv_one(r);
    const std::string h(as_string_view(m.header));
    const int tag = h[0] - '0';
    ASSERT_TRUE(tag == 1 || tag == 2) << h;
    EXPECT_EQ(m.sender_id, tag == 1 ? s1.id() : s2.id());
    ASSERT_EQ(h.substr(2), std::to_string(next[tag]++)) << "out of order from sender " << tag;
  }
  t1.join();
  t2.join();
}

TEST(InProcChannel, RecvTimesOut) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = a.recv(100ms);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
  EXPECT_GE(waited, 100ms);
  EXPECT_LT(waited, 2s);
}

TEST(InProcChannel, DestroyedPeerIsReportedOnceAndSendsFail) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric, "a");
  auto b = std::make_unique<InProcChannel>(fabric, "b");
  auto to_b = a.connect(b->address(), "stage1");
  ASSERT_TRUE(to_b.ok());
  ASSERT_TRUE(a.peer_status(*to_b).ok());
  b.reset();  // the "process" dies

  auto r = a.recv(1s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().find("stage1"), std::string::npos) << r.error();
  auto again = a.recv(50ms);  // reported once
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->has_value());

  EXPECT_FALSE(a.peer_status(*to_b).ok());
  Status s = a.send(*to_b, as_bytes("x"), {}, 1s);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("stage1"), std::string::npos) << s.message();
}

TEST(InProcChannel, DisconnectedPeerIsForgotten) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric);
  auto b = std::make_unique<InProcChannel>(fabric);
  auto to_b = a.connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok());
  ASSERT_TRUE(a.disconnect(*to_b).ok());
  EXPECT_FALSE(a.disconnect(*to_b).ok());
  EXPECT_FALSE(a.send(*to_b, {}, {}, 1s).ok());
  b.reset();
  auto r = a.recv(100ms);  // no failure report for a peer already let go
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
}

TEST(InProcChannel, RejectsBadAddresses) {
  auto fabric = InProcFabric::create();
  InProcChannel a(fabric);
  EXPECT_FALSE(a.connect(as_bytes("not an address"), "x").ok());
  // A channel of another fabric is unknown here.
  auto other = InProcFabric::create();
  InProcChannel c(other);
  EXPECT_FALSE(a.connect(c.address(), "c").ok());
  EXPECT_FALSE(a.send(12345, {}, {}, 1s).ok());
}

}  // namespace
}  // namespace conveyor::transport

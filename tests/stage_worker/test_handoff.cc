// The stage worker's outgoing side (stage_worker/handoff.h): sends leave in the order they
// were queued, from slots that are reused only once their send has returned; with every slot
// in flight the compute thread waits (a stalled next stage stalls this one, over real UCX on
// loopback); a failed send reaches the closure queued with it; drain() returns once all is
// sent.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>

#include "stage_worker/handoff.h"
#include "transport/inproc_channel.h"
#include "transport/ucx_channel.h"

namespace conveyor {
namespace {

using namespace std::chrono_literals;
using transport::Channel;

std::shared_ptr<std::byte[]> heap(size_t n) { return std::shared_ptr<std::byte[]>(new std::byte[n]); }

// Writes `value` into every byte of an acquired slot and queues it.
void send_filled(Handoff& h, transport::PeerId to, uint8_t value, size_t bytes, Handoff::OnFailure on_failure = {}) {
  const int slot = *h.acquire(bytes, heap);
  std::memset(h.slot(slot).data(), value, bytes);
  const std::byte tag{value};
  h.submit(slot, to, {tag}, bytes, std::move(on_failure));
}

TEST(Handoff, SendsInOrderFromReusedSlots) {
  auto fabric = transport::InProcFabric::create();
  transport::InProcChannel a(fabric, "a"), b(fabric, "b");
  auto to_b = a.connect(b.address(), "b");
  ASSERT_TRUE(to_b) << to_b.error();
  {
    Handoff h(a, 2, 1s);
    for (int i = 0; i < 10; ++i) send_filled(h, *to_b, uint8_t(i), 1000 + size_t(i) * 100);
    h.drain();
  }
  for (int i = 0; i < 10; ++i) {
    auto m = b.recv(1s);
    ASSERT_TRUE(m && m->has_value());
    ASSERT_EQ((*m)->header.size(), 1u);
    EXPECT_EQ(uint8_t((*m)->header[0]), i);
    ASSERT_EQ((*m)->payload.size(), 1000 + size_t(i) * 100);
    EXPECT_EQ(uint8_t((*m)->payload.data()[999]), i) << "slot overwritten before its send returned";
  }
}

// A last stage's result: a header with no payload, from a slot of 0 bytes (no memory asked
// for); idle() says whether anything is still queued or being sent, and counts the send time.
TEST(Handoff, HeaderOnlySendsAndIdle) {
  auto fabric = transport::InProcFabric::create();
  transport::InProcChannel a(fabric, "a"), b(fabric, "b");
  auto to_b = a.connect(b.address(), "b");
  ASSERT_TRUE(to_b) << to_b.error();
  Handoff h(a, 2, 1s);
  EXPECT_TRUE(h.idle());
  int allocations = 0;
  for (uint8_t i = 0; i < 4; ++i) {
    auto slot = h.acquire(0, [&](size_t n) { ++allocations; return heap(n); });
    ASSERT_TRUE(slot.ok()) << slot.error();
    h.submit(*slot, *to_b, {std::byte{i}}, 0, {});
  }
  h.drain();
  EXPECT_TRUE(h.idle());
  EXPECT_EQ(allocations, 0);
  EXPECT_GT(h.send_ns_total(), 0);  // four sends took some time
  for (uint8_t i = 0; i < 4; ++i) {
    auto m = b.recv(1s);
    ASSERT_TRUE(m && m->has_value());
    EXPECT_EQ(uint8_t((*m)->header.at(0)), i);
    EXPECT_EQ((*m)->payload.size(), 0u);
  }
}

TEST(Handoff, AFailedSendReachesItsClosure) {
  auto fabric = transport::InProcFabric::create();
  transport::InProcChannel a(fabric, "a");
  auto b = std::make_unique<transport::InProcChannel>(fabric, "b");
  auto to_b = a.connect(b->address(), "b");
  ASSERT_TRUE(to_b) << to_b.error();
  b.reset();  // the next stage dies
  Handoff h(a, 2, 1s);
  std::promise<std::string> failed;
  send_filled(h, *to_b, 1, 64, [&](const Status& s) { failed.set_value(s.message()); });
  auto f = failed.get_future();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  EXPECT_FALSE(f.get().empty());
  h.drain();
  // The slot came back: both can be taken again.
  const int x = *h.acquire(64, heap), y = *h.acquire(64, heap);
  EXPECT_NE(x, y);
  h.cancel(x), h.cancel(y);
}

// Over UCX, a receiver holding one message it has not read takes no more (its back-pressure
// cap is below one message), so the second send stays in flight, and with the second slot
// also taken a third acquire waits until the receiver reads.
TEST(Handoff, WaitsWhileEverySlotIsInFlight) {
  transport::UcxChannelOptions ro;
  ro.name = "receiver";
  ro.max_queued_bytes = 64 << 10;
  auto rx = transport::UcxChannel::create(ro);
  ASSERT_TRUE(rx) << rx.error();
  auto tx = transport::UcxChannel::create({.name = "sender"});
  ASSERT_TRUE(tx) << tx.error();
  auto peer = (*tx)->connect((*rx)->address(), "receiver");
  ASSERT_TRUE(peer) << peer.error();
  constexpr size_t kBytes = 1 << 20;
  Handoff h(**tx, 2, 20s);
  send_filled(h, *peer, 1, kBytes);
  h.drain();  // received: the receiver's queue is now over its cap
  std::this_thread::sleep_for(100ms);
  send_filled(h, *peer, 2, kBytes);
  const int held = *h.acquire(kBytes, heap);  // the other slot
  std::atomic<bool> got_third{false};
  std::thread third([&] {
    const int slot = *h.acquire(kBytes, heap);
    got_third = true;
    h.cancel(slot);
  });
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(got_third) << "a slot was handed out while both were taken";
  h.cancel(held);  // hand one back: the waiting acquire takes it at once
  third.join();
  EXPECT_TRUE(got_third);
  got_third = false;
  std::thread fourth([&] {
    const int a = *h.acquire(kBytes, heap), b = *h.acquire(kBytes, heap);  // the second waits for send 2
    got_third = true;
    h.cancel(a), h.cancel(b);
  });
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(got_third) << "the slot of a send still in flight was handed out";
  for (int i = 1; i <= 2; ++i) {
    auto m = (*rx)->recv(10s);
    ASSERT_TRUE(m && m->has_value()) << (m ? "timed out" : m.error());
    EXPECT_EQ(uint8_t((*m)->payload.data()[kBytes - 1]), i);
  }
  fourth.join();
  EXPECT_TRUE(got_third);
  h.drain();
}

}  // namespace
}  // namespace conveyor

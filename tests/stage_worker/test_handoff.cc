// The stage worker's outgoing side (stage_worker/handoff.h): sends leave in the order they
// were queued, from slots that are reused only once their send has returned; with every slot
// in flight the compute thread waits (a stalled next stage stalls this one, over real UCX on
// loopback); a failed send reaches the closure queued with it and its slot's memory is never
// written again (the peer may still read it); drain() returns once all is
// sent; interrupted waits (a stopping stage) end at once. Device slots (the direct path): a slot changes kind when asked for the other kind, a
// channel that cannot move device memory refuses its send, and on a GPU with a UCX built with
// CUDA two device slots carry micro-batches GPU to GPU in order.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>
#endif

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
  // The slot came back: both can be taken again. Its memory is reused: an in-process peer
  // never reads a payload after its send (the channel copies it).
  int allocations = 0;
  auto count = [&](size_t n) { ++allocations; return heap(n); };
  const int x = *h.acquire(64, count), y = *h.acquire(64, count);
  EXPECT_NE(x, y);
  EXPECT_EQ(allocations, 1) << "only the slot never used asks for memory";
  h.cancel(x), h.cancel(y);
}

// A peer over shared memory may still read a payload after its send failed (a stopped peer,
// resumed): the slot's memory is retired, kept alive and never written again, and the slot
// asks for fresh memory. Here the peer's channel goes away with a rendezvous send (256 KiB)
// under way, so the send ends by its timeout.
TEST(Handoff, AFailedSendThePeerMayStillReadRetiresTheSlot) {
  transport::UcxChannelOptions o;
  o.net_devices = "lo";
  o.host_shared_memory = true;
  o.name = "sender";
  auto tx = transport::UcxChannel::create(o);
  ASSERT_TRUE(tx) << tx.error();
  o.name = "receiver";
  auto rx = transport::UcxChannel::create(o);
  ASSERT_TRUE(rx) << rx.error();
  auto peer = (*tx)->connect((*rx)->address(), "receiver");
  ASSERT_TRUE(peer) << peer.error();
  if (!(*tx)->peer_reads_failed_payloads(*peer, false))
    GTEST_SKIP() << "no shared memory between this process's channels (no pidfd here?)";
  rx->reset();  // the next stage goes, with nothing taken
  constexpr size_t kBytes = 256 << 10;
  Handoff h(**tx, 2, 500ms);
  std::weak_ptr<std::byte[]> failed_memory;
  const int first = *h.acquire(kBytes, [&](size_t n) {
    auto p = heap(n);
    failed_memory = p;
    return p;
  });
  std::promise<std::string> failed;
  h.submit(first, *peer, {std::byte{1}}, kBytes, [&](const Status& s) { failed.set_value(s.message()); });
  auto f = failed.get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "the send to a gone peer did not fail";
  EXPECT_FALSE(f.get().empty());
  h.drain();
  int allocations = 0;
  auto count = [&](size_t n) { ++allocations; return heap(n); };
  const int x = *h.acquire(kBytes, count), y = *h.acquire(kBytes, count);
  EXPECT_NE(x, y);
  EXPECT_EQ(allocations, 2) << "the failed slot's memory was handed out again";
  EXPECT_FALSE(failed_memory.expired()) << "a failed send's memory was freed while the peer may read it";
  for (int i : {x, y}) EXPECT_NE(h.slot(i).data(), failed_memory.lock().get());
  h.cancel(x), h.cancel(y);
}

// A stopping stage: with every slot taken, an acquire that waits fails once the waits are
// interrupted (and one made while they are fails at once); after resume_waits it waits again.
TEST(Handoff, InterruptedWaitsEndAtOnceUntilResumed) {
  auto fabric = transport::InProcFabric::create();
  transport::InProcChannel a(fabric, "a");
  Handoff h(a, 2, 1s);
  const int x = *h.acquire(64, heap), y = *h.acquire(64, heap);
  std::promise<Expected<int>> waited;
  std::thread waiter([&] { waited.set_value(h.acquire(64, heap)); });
  auto got = waited.get_future();
  EXPECT_EQ(got.wait_for(200ms), std::future_status::timeout) << "a slot was handed out while both were taken";
  h.interrupt_waits();
  ASSERT_EQ(got.wait_for(5s), std::future_status::ready);
  waiter.join();
  const Expected<int> refused = got.get();
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().find("the stage is stopping"), std::string::npos) << refused.error();
  EXPECT_FALSE(h.acquire(64, heap).ok());
  EXPECT_TRUE(h.drain());  // nothing queued: drained, interrupted or not
  h.resume_waits();
  h.cancel(x);
  const auto again = h.acquire(64, heap);  // a free slot, taken as before
  ASSERT_TRUE(again.ok()) << again.error();
  h.cancel(*again), h.cancel(y);
}

// Over UCX, a receiver holding one message it has not read takes no more (its back-pressure
// cap is below one message), so the second send stays in flight, and with the second slot
// also taken a third acquire waits until the receiver reads.
TEST(Handoff, WaitsWhileEverySlotIsInFlight) {
  transport::UcxChannelOptions ro;
  ro.name = "receiver";
  ro.net_devices = "lo";  // loopback, as conveyor local (ucx_test_util.h says why)
  ro.max_queued_bytes = 64 << 10;
  auto rx = transport::UcxChannel::create(ro);
  ASSERT_TRUE(rx) << rx.error();
  auto tx = transport::UcxChannel::create({.name = "sender", .net_devices = "lo"});
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

// A slot asked for the other kind of memory gets it from the allocator given; a UcxChannel
// whose UCX cannot move CUDA memory, or whose peer does not take it, refuses the device
// send, and the failure reaches the closure (the worker then reports a data-plane error; it
// asks for device slots only when both ends take device memory).
TEST(Handoff, DeviceSlotsChangeKindAndAreRefusedWhereUcxCannotMoveThem) {
  auto rx = transport::UcxChannel::create({.name = "receiver", .net_devices = "lo"});
  ASSERT_TRUE(rx) << rx.error();
  auto tx = transport::UcxChannel::create({.name = "sender", .net_devices = "lo"});
  ASSERT_TRUE(tx) << tx.error();
  auto peer = (*tx)->connect((*rx)->address(), "receiver");
  ASSERT_TRUE(peer) << peer.error();
  ASSERT_FALSE((*tx)->peer_takes_device_memory(*peer)) << "a receiver without a device allocator";
  int host_allocations = 0, device_allocations = 0;
  auto host = [&](size_t n) { ++host_allocations; return heap(n); };
  auto device = [&](size_t n) { ++device_allocations; return heap(n); };  // stands in: never sent
  Handoff h(**tx, 1, 5s);
  const int a = *h.acquire(4096, host);
  h.cancel(a);
  const int b = *h.acquire(4096, device, /*device=*/true);
  EXPECT_EQ(host_allocations, 1);
  EXPECT_EQ(device_allocations, 1) << "a host slot was handed out for device rows";
  std::promise<Status> failed;
  h.submit(b, *peer, {std::byte{7}}, 4096, [&](const Status& s) { failed.set_value(s); });
  auto f = failed.get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "the device send was not refused";
  EXPECT_NE(f.get().message().find("device memory"), std::string::npos);
  h.drain();
  EXPECT_EQ(h.device_sends(), 0);
  const int c = *h.acquire(4096, host);  // back to host memory
  EXPECT_EQ(host_allocations, 2);
  h.cancel(c);
}

#ifdef CONVEYOR_HAVE_CUDA
// On a GPU with a UCX built with CUDA: micro-batches leave from two device slots and arrive in
// the receiver's device memory, in order, each slot reused once its send has returned.
TEST(Handoff, DeviceSlotsCarryMicroBatchesGpuToGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) GTEST_SKIP() << "no GPU";
  HostAllocator on_gpu{[](size_t n) -> void* {
                         void* p = nullptr;
                         return cudaSetDevice(0) == cudaSuccess && cudaMalloc(&p, n) == cudaSuccess ? p : nullptr;
                       },
                       [](void* p) { cudaFree(p); }};
  transport::UcxChannelOptions o;
  o.device_allocator = on_gpu;
  o.progress_thread_init = [] { cudaSetDevice(0); };
  o.net_devices = "lo";
  o.name = "receiver";
  auto rx = transport::UcxChannel::create(o);
  ASSERT_TRUE(rx) << rx.error();
  o.name = "sender";
  auto tx = transport::UcxChannel::create(o);
  ASSERT_TRUE(tx) << tx.error();
  if (!(*rx)->takes_device_memory()) GTEST_SKIP() << "this UCX cannot move CUDA memory";
  auto peer = (*tx)->connect((*rx)->address(), "receiver");
  ASSERT_TRUE(peer) << peer.error();
  ASSERT_TRUE((*tx)->peer_takes_device_memory(*peer));
  auto device_slot = [&](size_t n) {
    return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(on_gpu.allocate(n)), [&](std::byte* q) { on_gpu.release(q); });
  };
  constexpr size_t kBytes = 3 << 20;
  constexpr int kCount = 8;
  {
    Handoff h(**tx, 2, 20s);
    for (int i = 0; i < kCount; ++i) {
      const int slot = *h.acquire(kBytes, device_slot, /*device=*/true);
      ASSERT_EQ(cudaMemset(h.slot(slot).data(), i + 1, kBytes), cudaSuccess);
      h.submit(slot, *peer, {std::byte(i)}, kBytes, [](const Status& s) { ADD_FAILURE() << s.message(); });
    }
    h.drain();
    EXPECT_EQ(h.device_sends(), kCount);
  }
  std::vector<uint8_t> host(kBytes);
  for (int i = 0; i < kCount; ++i) {
    auto m = (*rx)->recv(10s);
    ASSERT_TRUE(m && m->has_value()) << (m ? "timed out" : m.error());
    EXPECT_EQ((*m)->header, std::vector<std::byte>{std::byte(i)});
    EXPECT_TRUE((*m)->payload_on_device);
    ASSERT_EQ(cudaMemcpy(host.data(), (*m)->payload.data(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(host.front(), i + 1);
    EXPECT_EQ(host.back(), i + 1);
  }
}
#endif

}  // namespace
}  // namespace conveyor

// UcxChannel: two channels in one process (test_ucx_processes.cc: across processes). Every
// test runs three times: with UCX's default transport choice, with UCX_TLS=tcp, and with
// host_shared_memory (shared memory, each channel watching the other's process; an environment
// UCX_TLS, when set, overrides all three). The wire-format and ordering tests (UcxPathTest) run
// over both data paths as well: staged (payloads in host memory) and direct (payloads sent
// from and received into CUDA device memory; skipped without a GPU or a UCX built with CUDA;
// "tcp" is then UCX_TLS=tcp,cuda_copy, as UCX needs cuda_copy to move device memory at all).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "tests/test_util.h"
#include "tests/transport/transport_test_util.h"
#include "tests/transport/ucx_test_util.h"
#include "transport/channel_address.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor::transport {
namespace {

using namespace ucx_test;

// ------------------------------------------------------------------ one process

TEST_P(UcxPathTest, SizesFromEmptyTo64MiB) {
  auto a = make_channel(transports(), "a", path_options(path()));
  auto b = make_channel(transports(), "b", path_options(path()));
  ASSERT_TRUE(a && b);
  if (skip_without_cuda_ucx(*b)) GTEST_SKIP() << "direct path: this UCX cannot move CUDA memory";
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  auto to_a = b->connect(a->address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();

  const std::size_t sizes[] = {0,        1,           1 * KiB,  8 * KiB, 8 * KiB + 1,
                               64 * KiB, 1 * MiB + 3, 16 * MiB, 64 * MiB};
  EXPECT_EQ(a->peer_takes_device_memory(*to_b), path() == Path::kDirect);
  PathBuffer buf(path(), 64 * MiB);
  std::uint64_t last_seq = 0;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    const std::size_t n = sizes[i];
    buf.fill(n, seed_of(1, i));
    const std::string header = "size " + std::to_string(n);
    Status s = a->send(*to_b, as_bytes(header), buf.view(n), 20s);
    ASSERT_TRUE(s.ok()) << s.message();
    Message m = recv_one(*b);
    EXPECT_EQ(as_string_view(m.header), header);
    ASSERT_EQ(m.payload.size(), n);
    EXPECT_EQ(check_received(path(), m, seed_of(1, i)), -1) << "size " << n;
    EXPECT_EQ(m.from, *to_a);
    EXPECT_EQ(m.sender_id, a->id());
    if (i) {
      EXPECT_GT(m.seq, last_seq);
    }
    last_seq = m.seq;
  }
  auto info = a->transport_info(*to_b);
  ASSERT_TRUE(info.ok()) << info.error();
  std::cout << "[ transports ] " << (transports().empty() ? "default" : transports())
            << (path() == Path::kDirect ? ", direct path" : ", staged path") << ", endpoint a->b in one process:\n"
            << *info;
}

// Payloads larger than one eager fragment and below the rendezvous threshold (here every
// payload: UCX_RNDV_THRESH=inf) arrive in several eager fragments, usually all before the
// receiver has read the envelope and posted the payload's receive. UCX 1.13 then completes
// that receive inside the call that posts it, callback included, and still returns its
// request; the channel took the request for one in flight and held the message forever
// (ucx_progress.cc, posted()). Fragments are 64 KiB over TCP by default, 8 KiB here.
TEST_P(UcxChannelTest, PayloadsOfManyEagerFragmentsArrive) {
  ::conveyor::testing::ScopedEnv rndv("UCX_RNDV_THRESH", "inf");
  ::conveyor::testing::ScopedEnv tx("UCX_TCP_TX_SEG_SIZE", "8k");
  ::conveyor::testing::ScopedEnv rx("UCX_TCP_RX_SEG_SIZE", "8k");
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  auto to_a = b->connect(a->address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();
  const std::size_t sizes[] = {8 * KiB + 1, 20 * KiB, 64 * KiB, 64 * KiB + 1, 200 * KiB, 1 * MiB + 3};
  std::vector<unsigned char> buf(1 * MiB + 3);
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      const std::size_t n = sizes[i];
      const std::uint64_t seed = seed_of(7, std::uint64_t(round * 16 + i));
      fill_pattern(buf.data(), n, seed);
      Status s = a->send(*to_b, as_bytes("eager"), {buf.data(), n}, 10s);
      ASSERT_TRUE(s.ok()) << "size " << n << ": " << s.message();
      Message m = recv_one(*b, 5s);
      ASSERT_EQ(m.payload.size(), n) << "round " << round;
      EXPECT_EQ(check_pattern(m.payload.data(), n, seed), -1) << "size " << n;
      // And back: both directions take the same path.
      ASSERT_TRUE(b->send(*to_a, as_bytes("back"), {m.payload.data(), n}, 10s).ok());
      Message back = recv_one(*a, 5s);
      ASSERT_EQ(back.payload.size(), n) << "round " << round << ", back";
      EXPECT_EQ(check_pattern(back.payload.data(), n, seed), -1) << "size " << n << " back";
    }
  }
}

// Receive buffers come from the channel's HostAllocator (a GPU worker's page-locked memory):
// large payloads land in its memory, are reused once freed, and all of it goes back through
// its release when the channel is gone. Small payloads stay on the heap.
TEST_P(UcxChannelTest, ReceiveBuffersComeFromTheGivenAllocator) {
  struct Counts {
    std::mutex mu;
    std::set<void*> live;
    int allocated = 0, released = 0;
  };
  auto counts = std::make_shared<Counts>();
  UcxChannelOptions o;
  o.receive_allocator.allocate = [counts](std::size_t n) -> void* {
    void* p = std::aligned_alloc(64, n);
    std::lock_guard lock(counts->mu);
    counts->live.insert(p), ++counts->allocated;
    return p;
  };
  o.receive_allocator.release = [counts](void* p) {
    std::lock_guard lock(counts->mu);
    EXPECT_EQ(counts->live.erase(p), 1u) << "released memory the allocator did not give";
    ++counts->released;
    std::free(p);
  };
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b", o);
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  std::vector<unsigned char> buf(1 * MiB);
  for (int i = 0; i < 4; ++i) {
    fill_pattern(buf.data(), buf.size(), seed_of(2, std::uint64_t(i)));
    ASSERT_TRUE(a->send(*to_b, as_bytes("big"), {buf.data(), buf.size()}, 10s).ok());
    Message m = recv_one(*b);
    ASSERT_EQ(m.payload.size(), buf.size());
    EXPECT_EQ(check_pattern(m.payload.data(), buf.size(), seed_of(2, std::uint64_t(i))), -1);
    std::lock_guard lock(counts->mu);
    EXPECT_TRUE(counts->live.count(m.payload.data())) << "payload not in the allocator's memory";
  }
  ASSERT_TRUE(a->send(*to_b, as_bytes("small"), {buf.data(), 100 * KiB}, 10s).ok());
  Message small = recv_one(*b);
  {
    std::lock_guard lock(counts->mu);
    EXPECT_FALSE(counts->live.count(small.payload.data()));
    EXPECT_EQ(counts->allocated, 1) << "a freed buffer was not reused";
  }
  // Debian's UCX has no CUDA support; a build with it reports CUDA memory.
  std::cout << "[ memory ] UCX reports CUDA memory support: " << (b->supports_cuda_memory() ? "yes" : "no") << "\n";
  b.reset();
  std::lock_guard lock(counts->mu);
  EXPECT_EQ(counts->released, counts->allocated);
  EXPECT_TRUE(counts->live.empty());
}

TEST_P(UcxPathTest, ManyMixedMessagesInOrder) {
  auto a = make_channel(transports(), "a", path_options(path()));
  auto b = make_channel(transports(), "b", path_options(path()));
  ASSERT_TRUE(a && b);
  if (skip_without_cuda_ucx(*b)) GTEST_SKIP() << "direct path: this UCX cannot move CUDA memory";
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok());
  // Small (inline on the staged path) and large (separate payload) messages interleaved, and
  // header-only ones: a small one sent after a large one must not overtake it.
  constexpr int kCount = 600;
  auto size_of = [](int i) -> std::size_t { return i % 3 == 0 ? 300 * KiB : i % 7 == 0 ? 0 : 100 + i; };
  std::thread sender([&] {
    PathBuffer buf(path(), 300 * KiB);
    for (int i = 0; i < kCount; ++i) {
      buf.fill(size_of(i), seed_of(1, i));
      const std::string h = std::to_string(i);
      Status s = a->send(*to_b, as_bytes(h), buf.view(size_of(i)), 10s);
      ASSERT_TRUE(s.ok()) << s.message();
    }
  });
  for (int i = 0; i < kCount; ++i) {
    Message m = recv_one(*b);
    ASSERT_EQ(as_string_view(m.header), std::to_string(i));
    ASSERT_EQ(m.payload.size(), size_of(i));
    ASSERT_EQ(check_received(path(), m, seed_of(1, i)), -1);
  }
  sender.join();
}

// Who takes device memory is settled by the addresses: a channel with a device allocator
// says so in its address only when its UCX moves CUDA memory; a sender sends a device payload
// only to a peer that takes it, and refuses one otherwise (the worker then stages). Runs
// everywhere: with Debian's UCX (no CUDA) it checks the staged side of the negotiation.
TEST_P(UcxChannelTest, DevicePathIsNegotiatedByAddress) {
  UcxChannelOptions with_device;
  with_device.device_allocator.allocate = [](std::size_t n) -> void* { return std::aligned_alloc(64, n); };
  with_device.device_allocator.release = [](void* p) { std::free(p); };
  auto plain = make_channel(transports(), "plain");
  auto gpu = make_channel(transports(), "gpu", with_device);
  ASSERT_TRUE(plain && gpu);
  EXPECT_FALSE(plain->takes_device_memory()) << "no device allocator, no device payloads";
  EXPECT_EQ(gpu->takes_device_memory(), gpu->supports_cuda_memory());
  auto gpu_address = parse_channel_address(gpu->address());
  ASSERT_TRUE(gpu_address.ok()) << gpu_address.error();
  EXPECT_EQ((gpu_address->flags & kAddressTakesDeviceMemory) != 0, gpu->takes_device_memory());
  auto plain_address = parse_channel_address(plain->address());
  ASSERT_TRUE(plain_address.ok());
  EXPECT_EQ(plain_address->flags & ~kAddressHostSharedMemory, 0);
  EXPECT_EQ((plain_address->flags & kAddressHostSharedMemory) != 0, transports() == kHostShm);

  auto to_plain = gpu->connect(plain->address(), "plain");
  auto to_gpu = plain->connect(gpu->address(), "gpu");
  ASSERT_TRUE(to_plain.ok() && to_gpu.ok());
  EXPECT_FALSE(gpu->peer_takes_device_memory(*to_plain));
  EXPECT_EQ(plain->peer_takes_device_memory(*to_gpu), gpu->takes_device_memory());
  std::vector<unsigned char> buf(64 * KiB);
  // A device payload to a peer that does not take one is refused, naming why; the staged
  // send of the same bytes goes through.
  Status refused = gpu->send(*to_plain, as_bytes("x"), {buf.data(), buf.size(), true}, 5s);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("device memory"), std::string::npos) << refused.message();
  fill_pattern(buf.data(), buf.size(), seed_of(4, 0));
  ASSERT_TRUE(gpu->send(*to_plain, as_bytes("staged"), {buf.data(), buf.size()}, 5s).ok());
  Message m = recv_one(*plain);
  EXPECT_FALSE(m.payload_on_device);
  EXPECT_EQ(check_pattern(m.payload.data(), m.payload.size(), seed_of(4, 0)), -1);
  std::cout << "[ memory ] UCX moves CUDA memory: " << (gpu->supports_cuda_memory() ? "yes" : "no") << "\n";
}

// Whose failed payloads a peer may still read (Channel::send): a device payload's (cuda_ipc
// reads the sender's memory over any transport), and over shared memory any payload's (cma);
// a host payload over TCP is pushed by the sender, whose forced close stops it. An unknown
// peer reads nothing.
TEST_P(UcxChannelTest, PeerReadsFailedPayloadsWhereItReadsTheSendersMemory) {
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  EXPECT_TRUE(a->peer_reads_failed_payloads(*to_b, /*device=*/true));
  EXPECT_EQ(a->peer_reads_failed_payloads(*to_b, /*device=*/false), transports() == kHostShm);
  EXPECT_FALSE(a->peer_reads_failed_payloads(*to_b + 100, true));
}

TEST_P(UcxChannelTest, ConcurrentSendersToOneReceiver) {
  auto r = make_channel(transports(), "r");
  auto s1 = make_channel(transports(), "s1");
  auto s2 = make_channel(transports(), "s2");
  ASSERT_TRUE(r && s1 && s2);
  constexpr int kCount = 200;
  // Two sending channels, and two threads sharing the second one.
  auto run = [&](UcxChannel& s, int who) {
    auto to_r = s.connect(r->address(), "r");
    ASSERT_TRUE(to_r.ok()) << to_r.error();
    std::vector<unsigned char> buf(2 * MiB);
    for (int i = 0; i < kCount; ++i) {
      const std::size_t n = (i % 4 == 0) ? 2 * MiB : 1000 + i;
      fill_pattern(buf.data(), n, seed_of(who, i));
      const std::string h = std::to_string(who) + " " + std::to_string(i);
      Status st = s.send(*to_r, as_bytes(h), {buf.data(), n}, 20s);
      ASSERT_TRUE(st.ok()) << st.message();
    }
  };
  std::thread t1(run, std::ref(*s1), 1), t2(run, std::ref(*s2), 2), t3(run, std::ref(*s2), 3);
  std::map<int, int> next;
  for (int k = 0; k < 3 * kCount; ++k) {
    Message m = recv_one(*r, 20s);
    int who = -1, i = -1;
    ASSERT_EQ(std::sscanf(std::string(as_string_view(m.header)).c_str(), "%d %d", &who, &i), 2);
    ASSERT_EQ(i, next[who]++) << "out of order from sender " << who;
    EXPECT_EQ(m.sender_id, who == 1 ? s1->id() : s2->id());
    ASSERT_EQ(check_pattern(m.payload.data(), m.payload.size(), seed_of(who, i)), -1);
  }
  t1.join();
  t2.join();
  t3.join();
}

TEST_P(UcxChannelTest, RecvTimesOutAndIdleChannelSleeps) {
  auto a = make_channel(transports(), "a");
  ASSERT_TRUE(a);
  const std::clock_t cpu0 = std::clock();
  const auto t0 = Clock::now();
  auto r = a->recv(500ms);
  const auto waited = Clock::now() - t0;
  const double cpu_s = double(std::clock() - cpu0) / CLOCKS_PER_SEC;
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_FALSE(r->has_value());
  EXPECT_GE(waited, 500ms);
  EXPECT_LT(waited, 3s);
  // The progress thread sleeps in epoll: far below one busy core over 0.5 s.
  EXPECT_LT(cpu_s, 0.2) << "an idle channel burned " << cpu_s << " s of CPU in 0.5 s";
}

// Connects a and b both ways, then `rounds` times b sends a "ping" to a and a a "pong" back,
// each with `payload`, checked on arrival (headers and bytes).
void ping_pong(UcxChannel& a, UcxChannel& b, int rounds, std::span<const std::byte> payload) {
  auto to_a = b.connect(a.address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();
  auto to_b = a.connect(b.address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  const PayloadView view{payload.data(), payload.size()};
  auto expect_payload = [&](const Message& m) {
    ASSERT_EQ(m.payload.size(), payload.size());
    if (!payload.empty()) {
      EXPECT_EQ(std::memcmp(m.payload.data(), payload.data(), payload.size()), 0);
    }
  };
  for (int i = 0; i < rounds; ++i) {
    const std::string header = "ping " + std::to_string(i);
    ASSERT_TRUE(b.send(*to_a, as_bytes(header), view, 10s).ok());
    Message m = recv_one(a);
    EXPECT_EQ(as_string_view(m.header), header);
    expect_payload(m);
    ASSERT_TRUE(a.send(*to_b, as_bytes("pong"), view, 10s).ok());
    Message back = recv_one(b);
    EXPECT_EQ(as_string_view(back.header), "pong");
    expect_payload(back);
  }
}

// spin_when_idle: the progress threads poll for a while after their last progress (a
// ping-pong's answer is taken without a wake-up), and sleep once it has passed: an exchange
// goes through, and the half second after it costs far less than a busy core.
TEST_P(UcxChannelTest, IdleSpinPollsAfterProgressThenSleeps) {
  UcxChannelOptions spin;
  spin.spin_when_idle = 20ms;
  auto a = make_channel(transports(), "a", spin);
  auto b = make_channel(transports(), "b", spin);
  ASSERT_TRUE(a && b);
  ASSERT_NO_FATAL_FAILURE(ping_pong(*a, *b, 20, {}));
  const std::clock_t cpu0 = std::clock();
  auto r = a->recv(500ms);
  const double cpu_s = double(std::clock() - cpu0) / CLOCKS_PER_SEC;
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_FALSE(r->has_value());
  // Two progress threads spin 20 ms each, then sleep in epoll.
  EXPECT_LT(cpu_s, 0.2) << "the idle channels burned " << cpu_s << " s of CPU in 0.5 s";
}

// spin_in_calls: send() and recv() poll for their result before they block. Messages with
// payloads past the eager limit (a send waits for the peer's rendezvous) go both ways; an
// idle recv() spins its window, then sleeps out its timeout; a timeout shorter than the
// window bounds the spin, and so does an interrupt.
TEST_P(UcxChannelTest, CallSpinTakesResultsThenBlocks) {
  UcxChannelOptions spin;
  spin.spin_in_calls = 200ms;  // long beside the bounds below, so that they tell
  auto a = make_channel(transports(), "a", spin);
  auto b = make_channel(transports(), "b", spin);
  ASSERT_TRUE(a && b);
  std::vector<std::byte> payload(64 << 10);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = std::byte(i * 7);
  ASSERT_NO_FATAL_FAILURE(ping_pong(*a, *b, 10, payload));
  const auto t0 = Clock::now();
  auto quick = a->recv(2ms);
  EXPECT_LT(Clock::now() - t0, 100ms) << "a 2 ms receive spun past its timeout";
  ASSERT_TRUE(quick.ok()) << quick.error();
  EXPECT_FALSE(quick->has_value());
  const std::clock_t cpu0 = std::clock();
  auto idle = a->recv(1500ms);
  const double cpu_s = double(std::clock() - cpu0) / CLOCKS_PER_SEC;
  ASSERT_TRUE(idle.ok()) << idle.error();
  EXPECT_FALSE(idle->has_value());
  EXPECT_LT(cpu_s, 0.6) << "an idle receive burned " << cpu_s << " s of CPU in 1.5 s (its window: 0.2 s)";
  // An interrupt ends the spin too, not only the wait after it (the 60 s is a hang guard).
  a->interrupt();
  const auto t1 = Clock::now();
  auto woken = a->recv(60s);
  EXPECT_LT(Clock::now() - t1, 100ms) << "an interrupted receive spun out its window";
  ASSERT_TRUE(woken.ok()) << woken.error();
  EXPECT_FALSE(woken->has_value());
}

// interrupt() wakes a recv() that waits (the coordinator's engine wakes so on a submitted
// request or a new cluster snapshot), and is kept for the next recv() when none waits: a
// wake-up made just before the receiver starts waiting is not lost. It is consumed by the
// recv() it ends, and messages flow as before. The waits are an hour:
// only the interrupt can end them, and the 60 s bounds are hang guards, not timings.
TEST_P(UcxChannelTest, InterruptEndsAWaitingRecvOrTheNextOne) {
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    auto r = a->recv(std::chrono::hours(1));
    EXPECT_TRUE(r.ok()) << r.error();
    EXPECT_FALSE(r.ok() && r->has_value());
    returned = true;
  });
  // Interrupt until the waiter is out: an interrupt before it waits ends its recv too.
  const auto guard = Clock::now() + 60s;
  while (!returned && Clock::now() < guard) {
    a->interrupt();
    std::this_thread::sleep_for(10ms);
  }
  waiter.join();
  EXPECT_TRUE(returned.load());
  // Kept for the next recv, and consumed by it.
  a->interrupt();
  auto kept = a->recv(std::chrono::hours(1));
  ASSERT_TRUE(kept.ok()) << kept.error();
  EXPECT_FALSE(kept->has_value());
  auto after = a->recv(50ms);
  ASSERT_TRUE(after.ok()) << after.error();
  EXPECT_FALSE(after->has_value());
  auto peer = b->connect(a->address(), "a");
  ASSERT_TRUE(peer.ok()) << peer.error();
  const std::string header = "hello";
  ASSERT_TRUE(b->send(*peer, as_bytes(header), {}, 10s).ok());
  Message m = recv_one(*a, 60s);
  EXPECT_EQ(as_string_view(m.header), header);
}

TEST_P(UcxChannelTest, SendTimesOutWhenReceiverStopsTaking) {
  UcxChannelOptions small_queue;
  small_queue.max_queued_bytes = 1 * MiB;
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b", small_queue);
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "slow");
  ASSERT_TRUE(to_b.ok());
  std::vector<unsigned char> buf(4 * MiB);
  // The first message is taken (the queue always takes one); b never calls recv().
  ASSERT_TRUE(a->send(*to_b, {}, {buf.data(), buf.size()}, 10s).ok());
  const auto t0 = Clock::now();
  Status s = a->send(*to_b, {}, {buf.data(), buf.size()}, 500ms);
  const auto waited = Clock::now() - t0;
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("slow"), std::string::npos) << s.message();
  EXPECT_LT(waited, 5s);
  EXPECT_FALSE(a->peer_status(*to_b).ok());
  EXPECT_FALSE(a->send(*to_b, {}, {}, 1s).ok()) << "a timed-out peer stays failed";
}

TEST_P(UcxChannelTest, RejectsBadInput) {
  auto a = make_channel(transports(), "a");
  ASSERT_TRUE(a);
  EXPECT_FALSE(a->connect(as_bytes("garbage"), "x").ok());
  EXPECT_FALSE(a->send(999, {}, {}, 1s).ok());
  EXPECT_FALSE(a->disconnect(999).ok());
  EXPECT_FALSE(a->peer_status(999).ok());
}

TEST_P(UcxChannelTest, DisconnectedPeerRefusesSends) {
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok());
  ASSERT_TRUE(a->send(*to_b, as_bytes("hi"), {}, 5s).ok());
  EXPECT_EQ(as_string_view(recv_one(*b).header), "hi");
  ASSERT_TRUE(a->disconnect(*to_b).ok());
  EXPECT_FALSE(a->send(*to_b, as_bytes("again"), {}, 1s).ok());
  // Connecting again gives a fresh, working peer.
  auto again = a->connect(b->address(), "b");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, *to_b);
  ASSERT_TRUE(a->send(*again, as_bytes("back"), {}, 5s).ok());
  EXPECT_EQ(as_string_view(recv_one(*b).header), "back");
}

// A disconnect that closes its endpoint (here: a second connection to a channel that has one
// parked) leaves the peer held only while the close completes; a channel whose links come and
// go does not grow. The next connect still works.
TEST_P(UcxChannelTest, ClosedPeersAreReleasedOnceTheirEndpointsClose) {
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  for (int round = 0; round < 20; ++round) {
    auto first = a->connect(b->address(), "b");
    auto second = a->connect(b->address(), "b");
    ASSERT_TRUE(first.ok() && second.ok()) << round;
    ASSERT_TRUE(a->send(*second, as_bytes("hi"), {}, 5s).ok()) << round;
    EXPECT_EQ(as_string_view(recv_one(*b).header), "hi");
    ASSERT_TRUE(a->disconnect(*first).ok());   // parked
    ASSERT_TRUE(a->disconnect(*second).ok());  // closed: the channel has one parked
  }
  const auto deadline = Clock::now() + 10s;
  while (a->closed_peers_held() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(a->closed_peers_held(), 0u);
  auto again = a->connect(b->address(), "b");
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE(a->send(*again, as_bytes("back"), {}, 5s).ok());
  EXPECT_EQ(as_string_view(recv_one(*b).header), "back");
}

// Two workers swap roles in a re-plan: a sent to b, now b sends to a and a no longer sends to
// b. UCX 1.13 hands b's new endpoint the one it made inside b when a's connection came in (the
// same connection pair, ucp_ep_create's "unexpected endpoint" reuse), so closing a's endpoint
// must not take b's with it: large payloads (a rendezvous, which needs a's side of the pair to
// answer) and small ones still arrive, in every order of b's connect and a's disconnect.
TEST_P(UcxChannelTest, RolesSwapBetweenTwoChannelsKeepsTheNewDirectionWorking) {
  for (bool disconnect_first : {false, true}) {
    SCOPED_TRACE(disconnect_first ? "a disconnects, then b connects" : "b connects, then a disconnects");
    auto a = make_channel(transports(), "a");
    auto b = make_channel(transports(), "b");
    ASSERT_TRUE(a && b);
    std::vector<unsigned char> buf(4 * MiB);
    fill_pattern(buf.data(), buf.size(), seed_of(1, 0));
    auto to_b = a->connect(b->address(), "b");
    ASSERT_TRUE(to_b.ok()) << to_b.error();
    ASSERT_TRUE(a->send(*to_b, as_bytes("before"), {buf.data(), buf.size()}, 10s).ok());
    EXPECT_EQ(as_string_view(recv_one(*b).header), "before");

    Expected<PeerId> to_a = Status::error("not connected");
    if (disconnect_first) {
      ASSERT_TRUE(a->disconnect(*to_b).ok());
      to_a = b->connect(a->address(), "a");
    } else {
      to_a = b->connect(a->address(), "a");
      ASSERT_TRUE(a->disconnect(*to_b).ok());
    }
    ASSERT_TRUE(to_a.ok()) << to_a.error();
    for (int i = 0; i < 4; ++i) {
      const std::size_t n = i % 2 ? 1 * KiB : buf.size();
      Status sent = b->send(*to_a, as_bytes("after"), {buf.data(), n}, 5s);
      ASSERT_TRUE(sent.ok()) << "message " << i << " of " << n << " bytes: " << sent.message();
      Message m = recv_one(*a, 5s);
      ASSERT_EQ(m.payload.size(), n) << "message " << i;
      EXPECT_EQ(check_pattern(m.payload.data(), n, seed_of(1, 0)), -1) << "message " << i;
    }
    EXPECT_TRUE(b->peer_status(*to_a).ok());
  }
}

// The data plane pinned to loopback, as every daemon of `conveyor local` is (net_devices
// "lo", from its address 127.0.0.1): UCX still connects (TCP over lo; its shared-memory
// transports are not used with peer-failure detection anyway) and moves every size, and
// the endpoint says lo.
TEST_P(UcxChannelTest, LoopbackDeviceAloneCarriesEverySize) {
  if (std::getenv("UCX_NET_DEVICES")) GTEST_SKIP() << "UCX_NET_DEVICES is set: it wins over net_devices";
  UcxChannelOptions on_lo;
  on_lo.net_devices = "lo";
  auto a = make_channel(transports(), "a", on_lo);
  auto b = make_channel(transports(), "b", on_lo);
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  auto to_a = b->connect(a->address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();
  std::vector<unsigned char> buf(8 * MiB);
  int i = 0;
  for (std::size_t n : {std::size_t{0}, 1 * KiB, 64 * KiB, 8 * MiB}) {
    fill_pattern(buf.data(), n, seed_of(1, i));
    ASSERT_TRUE(a->send(*to_b, as_bytes("there"), {buf.data(), n}, 10s).ok()) << n << " bytes";
    Message m = recv_one(*b);
    ASSERT_EQ(m.payload.size(), n);
    EXPECT_EQ(check_pattern(m.payload.data(), n, seed_of(1, i)), -1) << n << " bytes";
    ASSERT_TRUE(b->send(*to_a, as_bytes("back"), {m.payload.data(), n}, 10s).ok()) << n << " bytes";
    Message back = recv_one(*a);
    ASSERT_EQ(back.payload.size(), n);
    EXPECT_EQ(check_pattern(back.payload.data(), n, seed_of(1, i)), -1) << n << " bytes";
    ++i;
  }
  auto info = a->transport_info(*to_b);
  ASSERT_TRUE(info.ok()) << info.error();
  // With host_shared_memory the two channels of this process talk over shared memory instead.
  if (transports() == kHostShm) EXPECT_NE(info->find("memory"), std::string::npos) << *info;
  else EXPECT_NE(info->find("/lo"), std::string::npos) << *info;
  EXPECT_EQ(info->find("eth"), std::string::npos) << "an interface other than lo: " << *info;
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxChannelTest, ::testing::Values("", "tcp", kHostShm), transports_name);
INSTANTIATE_TEST_SUITE_P(Paths, UcxPathTest,
                         ::testing::Combine(::testing::Values("", "tcp", kHostShm),
                                            ::testing::Values(Path::kStaged, Path::kDirect)),
                         path_name);

}  // namespace
}  // namespace conveyor::transport

// UcxChannel: two channels in one process, and across processes (this test program
// re-executes itself as the peer: see UcxPeerProcess.DISABLED_Run at the end). Every test
// runs twice: with UCX's default transport choice and with UCX_TLS=tcp (an environment
// UCX_TLS, when set, overrides both). The wire-format and ordering tests (UcxPathTest) run
// over both data paths as well: staged (payloads in host memory) and direct (payloads sent
// from and received into CUDA device memory; skipped without a GPU or a UCX built with CUDA;
// "tcp" is then UCX_TLS=tcp,cuda_copy, as UCX needs cuda_copy to move device memory at all).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "tests/transport/transport_test_util.h"
#include "transport/channel_address.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor::transport {
namespace {

using namespace std::chrono_literals;
using conveyor::testing::check_pattern;
using conveyor::testing::ChildProcess;
using conveyor::testing::fill_pattern;
using Clock = std::chrono::steady_clock;

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

std::unique_ptr<UcxChannel> make_channel(const std::string& transports, const std::string& name,
                                         UcxChannelOptions options = {}) {
  options.name = name;
  options.transports = transports;
  auto ch = UcxChannel::create(options);
  EXPECT_TRUE(ch.ok()) << ch.error();
  return ch.ok() ? std::move(*ch) : nullptr;
}

Message recv_one(Channel& ch, std::chrono::milliseconds timeout = 10s) {
  auto r = ch.recv(timeout);
  EXPECT_TRUE(r.ok()) << r.error();
  if (!r.ok() || !r->has_value()) {
    ADD_FAILURE() << "no message within " << timeout.count() << " ms";
    return {};
  }
  return std::move(**r);
}

// Payload seed for message `i` of sender `who`.
std::uint64_t seed_of(int who, std::uint64_t i) { return (std::uint64_t(who) << 40) + i; }

class UcxChannelTest : public ::testing::TestWithParam<std::string> {
 protected:
  const std::string& transports() const { return GetParam(); }
};

// ------------------------------------------------------------------ the two data paths

enum class Path { kStaged, kDirect };
void PrintTo(Path path, std::ostream* os) { *os << (path == Path::kDirect ? "direct" : "staged"); }

// Whether this process can use the direct path at all: a CUDA build and a GPU. (The UCX's
// CUDA support is asked of a channel: UcxChannel::supports_cuda_memory.)
bool have_gpu() {
#ifdef CONVEYOR_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

// A channel's options for `path`: the direct path receives device payloads into GPU 0's
// memory (cudaMalloc), with GPU 0 current on the progress thread, as a GPU worker's channel.
UcxChannelOptions path_options(Path path, UcxChannelOptions o = {}) {
#ifdef CONVEYOR_HAVE_CUDA
  if (path == Path::kDirect) {
    o.device_allocator.allocate = [](std::size_t n) -> void* {
      void* p = nullptr;
      return cudaSetDevice(0) == cudaSuccess && cudaMalloc(&p, n) == cudaSuccess ? p : nullptr;
    };
    o.device_allocator.release = [](void* p) { cudaFree(p); };
    o.progress_thread_init = [] { cudaSetDevice(0); };
  }
#else
  (void)path;
#endif
  return o;
}

// A payload buffer on the path's side: host memory (staged) or GPU 0's memory (direct),
// filled and checked through host copies.
class PathBuffer {
 public:
  PathBuffer(Path path, std::size_t bytes) : path_(path), host_(bytes) {
#ifdef CONVEYOR_HAVE_CUDA
    if (path_ == Path::kDirect && bytes) {
      EXPECT_EQ(cudaMalloc(&device_, bytes), cudaSuccess);
    }
#endif
  }
  ~PathBuffer() {
#ifdef CONVEYOR_HAVE_CUDA
    if (device_) cudaFree(device_);
#endif
  }
  PathBuffer(const PathBuffer&) = delete;
  PathBuffer& operator=(const PathBuffer&) = delete;

  void fill(std::size_t n, std::uint64_t seed) {
    fill_pattern(host_.data(), n, seed);
#ifdef CONVEYOR_HAVE_CUDA
    if (device_) {
      EXPECT_EQ(cudaMemcpy(device_, host_.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    }
#endif
  }
  PayloadView view(std::size_t n) const {
    if (path_ == Path::kDirect) return {device_, n, true};
    return {host_.data(), n};
  }

 private:
  Path path_;
  std::vector<unsigned char> host_;
  void* device_ = nullptr;
};

// Where a received payload differs from fill_pattern(seed) (-1: nowhere). A message of the
// direct path must have its payload in device memory (unless empty), the staged path's in
// host memory.
long long check_received(Path path, const Message& m, std::uint64_t seed) {
  const std::size_t n = m.payload.size();
  if (path == Path::kStaged || n == 0) {
    EXPECT_FALSE(m.payload_on_device);
    return check_pattern(m.payload.data(), n, seed);
  }
  EXPECT_TRUE(m.payload_on_device) << "a device payload of " << n << " bytes arrived in host memory";
  if (!m.payload_on_device) return check_pattern(m.payload.data(), n, seed);
#ifdef CONVEYOR_HAVE_CUDA
  std::vector<unsigned char> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), m.payload.data(), n, cudaMemcpyDeviceToHost), cudaSuccess);
  return check_pattern(host.data(), n, seed);
#else
  return 0;
#endif
}

class UcxPathTest : public ::testing::TestWithParam<std::tuple<std::string, Path>> {
 protected:
  Path path() const { return std::get<1>(GetParam()); }
  std::string transports() const {
    const std::string& t = std::get<0>(GetParam());
    return path() == Path::kDirect && t == "tcp" ? "tcp,cuda_copy" : t;
  }
  void SetUp() override {
    if (path() == Path::kDirect && !have_gpu()) GTEST_SKIP() << "direct path: no GPU (or a build without CUDA)";
  }
  // Skips the direct path when this UCX cannot move CUDA memory (Debian's 1.13.1).
  // With CONVEYOR_EXPECT_UCX_CUDA=1 (a GPU run that ships the UCX built with CUDA) a UCX
  // without CUDA is a failure, not a skip.
  bool skip_without_cuda_ucx(const UcxChannel& ch) {
    if (path() != Path::kDirect || ch.takes_device_memory()) return false;
    const char* expected = std::getenv("CONVEYOR_EXPECT_UCX_CUDA");
    if (expected && std::string(expected) == "1")
      ADD_FAILURE() << "this UCX cannot move CUDA memory (CONVEYOR_EXPECT_UCX_CUDA=1)";
    return true;
  }
};

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
  EXPECT_EQ(plain_address->flags, 0);

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
  EXPECT_NE(info->find("/lo"), std::string::npos) << *info;
  EXPECT_EQ(info->find("eth"), std::string::npos) << "an interface other than lo: " << *info;
}

// ------------------------------------------------------------------ across processes

// A child process running UcxPeerProcess.DISABLED_Run in `role`. It registers over the
// control plane (its channel address as the binary frame) and is assigned this process's
// address, as a worker is by the coordinator.
struct Peer {
  ChildProcess process;
  PeerId id = kNoPeer;
};

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

std::unique_ptr<Peer> start_peer(ControlServer& server, UcxChannel& channel,
                                 const std::string& transports, const std::string& name,
                                 const std::string& role, std::size_t bytes = 0, int count = 0,
                                 bool connect_back = true, Path path = Path::kStaged) {
  auto peer = std::make_unique<Peer>();
  const bool started = peer->process.start(
      {self_exe(), "--gtest_filter=UcxPeerProcess.DISABLED_Run", "--gtest_also_run_disabled_tests"},
      {"CONVEYOR_UCX_PEER_ROLE=" + role, "CONVEYOR_UCX_PEER_NAME=" + name,
       "CONVEYOR_UCX_PEER_ENDPOINT=" + server.endpoint(), "CONVEYOR_UCX_PEER_TLS=" + transports,
       "CONVEYOR_UCX_PEER_BYTES=" + std::to_string(bytes),
       "CONVEYOR_UCX_PEER_COUNT=" + std::to_string(count),
       std::string("CONVEYOR_UCX_PEER_PATH=") + (path == Path::kDirect ? "direct" : "staged")});
  EXPECT_TRUE(started);
  if (!started) return nullptr;
  const auto deadline = Clock::now() + 20s;
  while (Clock::now() < deadline) {
    auto in = server.recv(500ms);
    if (!in.ok() || !in->has_value()) continue;
    if ((*in)->peer != name || (*in)->message.type() != "register") continue;
    if (connect_back) {
      auto id = channel.connect((*in)->message.blob, name);
      EXPECT_TRUE(id.ok()) << id.error();
      if (!id.ok()) return nullptr;
      peer->id = *id;
    }
    Status s = server.send(name, ControlMessage::make("assign", nullptr, channel.address()));
    EXPECT_TRUE(s.ok()) << s.message();
    return peer;
  }
  ADD_FAILURE() << "peer process '" << name << "' did not register within 20 s";
  return nullptr;
}

// Two processes (on one GPU for the direct path: there UCX's default choice moves the device
// payloads with cuda_ipc, which the endpoint's transports must show).
TEST_P(UcxPathTest, CrossProcessEcho1KiBTo64MiB) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.error();
  auto ch = make_channel(transports(), "parent", path_options(path()));
  ASSERT_TRUE(ch);
  if (skip_without_cuda_ucx(*ch)) GTEST_SKIP() << "direct path: this UCX cannot move CUDA memory";
  auto peer = start_peer(**server, *ch, transports(), "echo", "echo", 0, 0, true, path());
  ASSERT_TRUE(peer);
  EXPECT_EQ(ch->peer_takes_device_memory(peer->id), path() == Path::kDirect);

  PathBuffer buf(path(), 64 * MiB);
  int i = 0;
  for (std::size_t n : {1 * KiB, 4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB}) {
    buf.fill(n, seed_of(0, i));
    const std::string header = "echo " + std::to_string(i);
    Status s = ch->send(peer->id, as_bytes(header), buf.view(n), 30s);
    ASSERT_TRUE(s.ok()) << s.message();
    Message m = recv_one(*ch, 30s);
    EXPECT_EQ(as_string_view(m.header), header);
    EXPECT_EQ(m.from, peer->id);
    ASSERT_EQ(m.payload.size(), n);
    EXPECT_EQ(check_received(path(), m, seed_of(0, i)), -1) << n << " bytes";
    ++i;
  }
  auto info = ch->transport_info(peer->id);
  ASSERT_TRUE(info.ok()) << info.error();
  std::cout << "[ transports ] " << (transports().empty() ? "default" : transports())
            << (path() == Path::kDirect ? ", direct path" : ", staged path") << ", endpoint parent->child process:\n"
            << *info;
  if (path() == Path::kDirect && transports().empty()) {
    EXPECT_NE(info->find("cuda_ipc"), std::string::npos) << "the direct path between processes on one GPU uses no cuda_ipc";
  }
  ASSERT_TRUE(ch->send(peer->id, as_bytes("bye"), {}, 5s).ok());
  EXPECT_EQ(peer->process.wait_exit(10s), 0) << "the echo process reported a failure";
}

TEST_P(UcxChannelTest, KilledReceiverFailsTheSender) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.error();
  auto ch = make_channel(transports(), "parent");
  ASSERT_TRUE(ch);
  auto peer = start_peer(**server, *ch, transports(), "sink", "sink");
  ASSERT_TRUE(peer);

  std::vector<unsigned char> buf(8 * MiB);
  fill_pattern(buf.data(), buf.size(), 1);
  for (int i = 0; i < 5; ++i) {
    Status s = ch->send(peer->id, as_bytes("data"), {buf.data(), buf.size()}, 20s);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  // Kill it while a stream of sends is going on.
  Clock::time_point kill_time;
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    kill_time = Clock::now();
    ::kill(peer->process.pid(), SIGKILL);
  });
  Status s;
  const auto give_up = Clock::now() + 60s;
  while (Clock::now() < give_up) {
    s = ch->send(peer->id, as_bytes("data"), {buf.data(), buf.size()}, 20s);
    if (!s.ok()) break;
  }
  killer.join();  // kill_time is set (the send cannot fail before the kill)
  ASSERT_FALSE(s.ok()) << "sends to a killed process kept succeeding";
  const auto detect = Clock::now() - kill_time;
  std::cout << "send error "
            << std::chrono::duration_cast<std::chrono::milliseconds>(detect).count()
            << " ms after the kill: " << s.message() << "\n";
  EXPECT_LT(detect, 15s);
  EXPECT_NE(s.message().find("sink"), std::string::npos) << s.message();
  EXPECT_FALSE(ch->peer_status(peer->id).ok());
  auto r = ch->recv(5s);  // the failure is also reported to the receiving side, once
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().find("sink"), std::string::npos) << r.error();
}

TEST_P(UcxChannelTest, KilledSenderIsReportedToTheReceiver) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.error();
  auto ch = make_channel(transports(), "parent");
  ASSERT_TRUE(ch);
  auto peer = start_peer(**server, *ch, transports(), "source", "stream", 8 * MiB, 1 << 30);
  ASSERT_TRUE(peer);
  for (int i = 0; i < 3; ++i) {
    Message m = recv_one(*ch, 20s);
    ASSERT_EQ(m.payload.size(), 8 * MiB);
    EXPECT_EQ(check_pattern(m.payload.data(), m.payload.size(), seed_of(9, 0)), -1);
  }
  ::kill(peer->process.pid(), SIGKILL);
  const auto kill_time = Clock::now();
  // Messages already in flight may still arrive; then the failure must.
  Status failure;
  while (Clock::now() - kill_time < 30s) {
    auto r = ch->recv(1s);
    if (!r.ok()) {
      failure = r.status();
      break;
    }
  }
  ASSERT_FALSE(failure.ok()) << "no error within 30 s of killing the sender";
  const auto detect = Clock::now() - kill_time;
  std::cout << "recv error "
            << std::chrono::duration_cast<std::chrono::milliseconds>(detect).count()
            << " ms after the kill: " << failure.message() << "\n";
  EXPECT_LT(detect, 15s);
  EXPECT_FALSE(ch->peer_status(peer->id).ok());
}

// The receiver never connected to the sender, so it hears of no peer failure: what it had
// in flight from the dead sender fails or is given up (stalled_receive_timeout), and the
// channel keeps working for others.
TEST_P(UcxChannelTest, UnconnectedSenderKilledMidTransferDoesNotWedgeTheReceiver) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.error();
  UcxChannelOptions options;
  options.stalled_receive_timeout = 2s;
  auto ch = make_channel(transports(), "parent", options);
  ASSERT_TRUE(ch);
  auto doomed = start_peer(**server, *ch, transports(), "doomed", "stream", 32 * MiB, 1 << 30,
                           /*connect_back=*/false);
  ASSERT_TRUE(doomed);
  Message first = recv_one(*ch, 20s);
  EXPECT_EQ(first.from, kNoPeer);
  // Into the stream before the kill: right after a message has arrived the sender may not
  // yet have started the next one (on busy cores it often had not), and a kill between two
  // transfers cuts nothing off.
  std::this_thread::sleep_for(100ms);
  ::kill(doomed->process.pid(), SIGKILL);
  const auto kill_time = Clock::now();
  // Drain: messages that made it, then errors for what was cut off, then quiet.
  // (UCX fails the transfer at once: the endpoint it made for the sender's messages has
  // error handling too. stalled_receive_timeout is the backstop if it did not.)
  int quiet = 0;
  bool saw_error = false;
  while (quiet < 3 && Clock::now() - kill_time < 20s) {
    auto r = ch->recv(1s);
    if (!r.ok()) {
      std::cout << "after the kill: " << r.error() << "\n";
      saw_error = true;
      quiet = 0;
    } else {
      quiet = r->has_value() ? 0 : quiet + 1;
    }
  }
  EXPECT_LT(Clock::now() - kill_time, 20s) << "messages kept coming from a killed process";
  EXPECT_TRUE(saw_error) << "the transfer cut off by the kill was not reported";
  auto healthy = start_peer(**server, *ch, transports(), "healthy", "source", 0, 10,
                            /*connect_back=*/false);
  ASSERT_TRUE(healthy);
  for (int i = 0; i < 10; ++i) {
    Message m = recv_one(*ch, 20s);
    ASSERT_EQ(as_string_view(m.header), std::to_string(i));
    ASSERT_EQ(check_pattern(m.payload.data(), m.payload.size(), seed_of(9, i)), -1);
  }
  EXPECT_EQ(healthy->process.wait_exit(10s), 0);
}

TEST_P(UcxChannelTest, TwoSenderProcessesToOneReceiver) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.error();
  auto ch = make_channel(transports(), "parent");
  ASSERT_TRUE(ch);
  constexpr int kCount = 60;
  auto p1 = start_peer(**server, *ch, transports(), "src1", "source", 0, kCount);
  auto p2 = start_peer(**server, *ch, transports(), "src2", "source", 0, kCount);
  ASSERT_TRUE(p1 && p2);
  std::map<PeerId, int> next;
  for (int k = 0; k < 2 * kCount;) {
    auto r = ch->recv(30s);
    if (!r.ok()) {
      // A sender that finished exits; its failure comes after all of its messages.
      const bool first = r.error().find("src1") != std::string::npos;
      ASSERT_EQ(next[first ? p1->id : p2->id], kCount) << "early failure: " << r.error();
      continue;
    }
    ASSERT_TRUE(r->has_value()) << "nothing for 30 s";
    Message m = std::move(**r);
    ++k;
    ASSERT_TRUE(m.from == p1->id || m.from == p2->id);
    const int i = next[m.from]++;
    ASSERT_EQ(as_string_view(m.header), std::to_string(i)) << "out of order";
    ASSERT_EQ(check_pattern(m.payload.data(), m.payload.size(), seed_of(9, i)), -1);
  }
  EXPECT_EQ(p1->process.wait_exit(10s), 0);
  EXPECT_EQ(p2->process.wait_exit(10s), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxChannelTest, ::testing::Values("", "tcp"),
                         [](const auto& info) {
                           return info.param.empty() ? std::string("Default") : info.param;
                         });
INSTANTIATE_TEST_SUITE_P(Paths, UcxPathTest,
                         ::testing::Combine(::testing::Values("", "tcp"), ::testing::Values(Path::kStaged, Path::kDirect)),
                         [](const auto& info) {
                           const std::string& t = std::get<0>(info.param);
                           return (t.empty() ? std::string("Default") : t) +
                                  (std::get<1>(info.param) == Path::kDirect ? "_Direct" : "_Staged");
                         });

// ------------------------------------------------------------------ the peer process

// Not a test: the entry point of the peer processes above, started with
// --gtest_also_run_disabled_tests and its role in the environment.
//   echo:   send every message back; exit 0 on a "bye" header
//   sink:   take messages until killed
//   source: send COUNT messages (BYTES each, or mixed sizes when 0), header = index
//   stream: send COUNT copies of one BYTES-byte message, header = index
TEST(UcxPeerProcess, DISABLED_Run) {
  const char* role_env = std::getenv("CONVEYOR_UCX_PEER_ROLE");
  if (!role_env) GTEST_SKIP() << "only runs as a peer process";
  const std::string role = role_env;
  const std::string name = std::getenv("CONVEYOR_UCX_PEER_NAME");
  const std::size_t bytes = std::stoull(std::getenv("CONVEYOR_UCX_PEER_BYTES"));
  const long long count = std::stoll(std::getenv("CONVEYOR_UCX_PEER_COUNT"));

  const char* path_env = std::getenv("CONVEYOR_UCX_PEER_PATH");
  const Path path = path_env && std::string(path_env) == "direct" ? Path::kDirect : Path::kStaged;
  auto ch = make_channel(std::getenv("CONVEYOR_UCX_PEER_TLS"), name, path_options(path));
  ASSERT_TRUE(ch);
  ControlClientOptions co;
  co.identity = name;
  auto control = ControlClient::connect(std::getenv("CONVEYOR_UCX_PEER_ENDPOINT"), co);
  ASSERT_TRUE(control.ok()) << control.error();
  ASSERT_TRUE((*control)->send(ControlMessage::make("register", nullptr, ch->address()), 10s).ok());
  auto assign = (*control)->recv(20s);
  ASSERT_TRUE(assign.ok() && assign->has_value()) << "no assign from the parent";
  auto parent = ch->connect((**assign).blob, "parent");
  ASSERT_TRUE(parent.ok()) << parent.error();

  if (role == "echo" || role == "sink") {
    for (;;) {
      auto r = ch->recv(60s);
      ASSERT_TRUE(r.ok()) << r.error();
      ASSERT_TRUE(r->has_value()) << "nothing from the parent for 60 s";
      Message& m = **r;
      if (as_string_view(m.header) == "bye") return;
      if (role == "echo") {
        // Back as it came: from device memory when it arrived there (the direct path).
        Status s = ch->send(*parent, m.header, {m.payload.data(), m.payload.size(), m.payload_on_device}, 30s);
        ASSERT_TRUE(s.ok()) << s.message();
      }
    }
  }
  std::vector<unsigned char> buf(bytes ? bytes : 3 * MiB);
  if (role == "stream") {  // the same BYTES-byte message (seed 0) back to back, until killed
    fill_pattern(buf.data(), bytes, seed_of(9, 0));
    for (long long i = 0; i < count; ++i) {
      const std::string h = std::to_string(i);
      Status s = ch->send(*parent, as_bytes(h), {buf.data(), bytes}, 30s);
      ASSERT_TRUE(s.ok()) << s.message();
    }
    return;
  }
  ASSERT_EQ(role, "source");
  for (long long i = 0; i < count; ++i) {
    const std::size_t n = bytes ? bytes : (i % 3 == 0 ? 3 * MiB : 500 + i);
    fill_pattern(buf.data(), n, seed_of(9, i));
    const std::string h = std::to_string(i);
    Status s = ch->send(*parent, as_bytes(h), {buf.data(), n}, 30s);
    ASSERT_TRUE(s.ok()) << s.message();
  }
}

}  // namespace
}  // namespace conveyor::transport

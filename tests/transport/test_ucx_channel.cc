// UcxChannel: two channels in one process, and across processes (this test program
// re-executes itself as the peer: see UcxPeerProcess.DISABLED_Run at the end). Every test
// runs twice: with UCX's default transport choice and with UCX_TLS=tcp (an environment
// UCX_TLS, when set, overrides both).
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

#include "tests/transport/transport_test_util.h"
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

// ------------------------------------------------------------------ one process

TEST_P(UcxChannelTest, SizesFromEmptyTo64MiB) {
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok()) << to_b.error();
  auto to_a = b->connect(a->address(), "a");
  ASSERT_TRUE(to_a.ok()) << to_a.error();

  const std::size_t sizes[] = {0,        1,           1 * KiB,  8 * KiB, 8 * KiB + 1,
                               64 * KiB, 1 * MiB + 3, 16 * MiB, 64 * MiB};
  std::vector<unsigned char> buf(64 * MiB);
  std::uint64_t last_seq = 0;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    const std::size_t n = sizes[i];
    fill_pattern(buf.data(), n, seed_of(1, i));
    const std::string header = "size " + std::to_string(n);
    Status s = a->send(*to_b, as_bytes(header), {buf.data(), n}, 20s);
    ASSERT_TRUE(s.ok()) << s.message();
    Message m = recv_one(*b);
    EXPECT_EQ(as_string_view(m.header), header);
    ASSERT_EQ(m.payload.size(), n);
    EXPECT_EQ(check_pattern(m.payload.data(), n, seed_of(1, i)), -1) << "size " << n;
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
            << ", endpoint a->b in one process:\n"
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

TEST_P(UcxChannelTest, ManyMixedMessagesInOrder) {
  auto a = make_channel(transports(), "a");
  auto b = make_channel(transports(), "b");
  ASSERT_TRUE(a && b);
  auto to_b = a->connect(b->address(), "b");
  ASSERT_TRUE(to_b.ok());
  // Small (inline) and large (separate payload) messages interleaved: a small one sent
  // after a large one must not overtake it.
  constexpr int kCount = 600;
  auto size_of = [](int i) -> std::size_t { return i % 3 == 0 ? 300 * KiB : 100 + i; };
  std::thread sender([&] {
    std::vector<unsigned char> buf(300 * KiB);
    for (int i = 0; i < kCount; ++i) {
      fill_pattern(buf.data(), size_of(i), seed_of(1, i));
      const std::string h = std::to_string(i);
      Status s = a->send(*to_b, as_bytes(h), {buf.data(), size_of(i)}, 10s);
      ASSERT_TRUE(s.ok()) << s.message();
    }
  });
  for (int i = 0; i < kCount; ++i) {
    Message m = recv_one(*b);
    ASSERT_EQ(as_string_view(m.header), std::to_string(i));
    ASSERT_EQ(m.payload.size(), size_of(i));
    ASSERT_EQ(check_pattern(m.payload.data(), m.payload.size(), seed_of(1, i)), -1);
  }
  sender.join();
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
                                 bool connect_back = true) {
  auto peer = std::make_unique<Peer>();
  const bool started = peer->process.start(
      {self_exe(), "--gtest_filter=UcxPeerProcess.DISABLED_Run", "--gtest_also_run_disabled_tests"},
      {"CONVEYOR_UCX_PEER_ROLE=" + role, "CONVEYOR_UCX_PEER_NAME=" + name,
       "CONVEYOR_UCX_PEER_ENDPOINT=" + server.endpoint(), "CONVEYOR_UCX_PEER_TLS=" + transports,
       "CONVEYOR_UCX_PEER_BYTES=" + std::to_string(bytes),
       "CONVEYOR_UCX_PEER_COUNT=" + std::to_string(count)});
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

TEST_P(UcxChannelTest, CrossProcessEcho1KiBTo64MiB) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.error();
  auto ch = make_channel(transports(), "parent");
  ASSERT_TRUE(ch);
  auto peer = start_peer(**server, *ch, transports(), "echo", "echo");
  ASSERT_TRUE(peer);

  std::vector<unsigned char> buf(64 * MiB);
  int i = 0;
  for (std::size_t n : {1 * KiB, 4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB}) {
    fill_pattern(buf.data(), n, seed_of(0, i));
    const std::string header = "echo " + std::to_string(i);
    Status s = ch->send(peer->id, as_bytes(header), {buf.data(), n}, 30s);
    ASSERT_TRUE(s.ok()) << s.message();
    Message m = recv_one(*ch, 30s);
    EXPECT_EQ(as_string_view(m.header), header);
    EXPECT_EQ(m.from, peer->id);
    ASSERT_EQ(m.payload.size(), n);
    EXPECT_EQ(check_pattern(m.payload.data(), n, seed_of(0, i)), -1) << n << " bytes";
    ++i;
  }
  auto info = ch->transport_info(peer->id);
  ASSERT_TRUE(info.ok()) << info.error();
  std::cout << "[ transports ] " << (transports().empty() ? "default" : transports())
            << ", endpoint parent->child process:\n"
            << *info;
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

  auto ch = make_channel(std::getenv("CONVEYOR_UCX_PEER_TLS"), name);
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
        Status s = ch->send(*parent, m.header, {m.payload.data(), m.payload.size()}, 30s);
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

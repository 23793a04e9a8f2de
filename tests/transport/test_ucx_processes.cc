// UcxChannel across processes: this test program re-executes itself as the peer (see
// UcxPeerProcess.DISABLED_Run at the end), which registers over the control plane as a
// worker does. Every test runs with UCX's default transport choice and with UCX_TLS=tcp;
// CrossProcessEcho over both data paths (test_ucx_channel.cc says what they are). Killed
// peers must fail or be reported, never wedge the survivor.
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
#include "tests/transport/ucx_test_util.h"
#include "transport/channel_address.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor::transport {
namespace {

using namespace ucx_test;

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
  // The kill must land inside a transfer (one between two transfers cuts nothing off, and on
  // busy cores the sender is often between two): stop the sender, let what it had written
  // arrive, and kill it only if the channel is then still receiving a payload; else resume
  // it and try again. A stopped sender cannot finish a 32 MiB payload, so the state holds.
  bool mid_transfer = false;
  for (int attempt = 0; attempt < 200 && !mid_transfer; ++attempt) {
    ::kill(doomed->process.pid(), SIGSTOP);
    std::this_thread::sleep_for(50ms);
    mid_transfer = ch->receives_under_way() > 0;
    if (!mid_transfer) {
      ::kill(doomed->process.pid(), SIGCONT);
      // Take what arrived, so that the channel's back-pressure never stops the stream.
      for (auto r = ch->recv(std::chrono::milliseconds(5 + attempt % 20)); r.ok() && r->has_value(); r = ch->recv(0ms)) {
      }
    }
  }
  ASSERT_TRUE(mid_transfer) << "the sender was never stopped inside a transfer in 200 tries";
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

INSTANTIATE_TEST_SUITE_P(Transports, UcxChannelTest, ::testing::Values("", "tcp", kHostShm), transports_name);
INSTANTIATE_TEST_SUITE_P(Paths, UcxPathTest,
                         ::testing::Combine(::testing::Values("", "tcp", kHostShm),
                                            ::testing::Values(Path::kStaged, Path::kDirect)),
                         path_name);

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

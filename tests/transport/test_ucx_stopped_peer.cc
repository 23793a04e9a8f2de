// UcxChannel peers that stop and resume, across processes (issue 28). Two "chatter"
// processes talk both ways as neighbouring stages do: each connects to the other and sends a
// stream of mixed sizes (inline, eager, rendezvous), with a short send timeout. The test stops
// one of them (SIGSTOP) past that timeout, so the other gives it up (marks it failed, closes
// its endpoint), then resumes it (SIGCONT) while the other's traffic goes on; each chatter
// dials again a peer it lost, as a stage worker re-wires. Neither process may crash, every
// message that arrives must be intact, traffic must flow again both ways after each resume,
// and at the end (both quiet, then their channels destroyed) both must exit cleanly. With UCX's
// endpoint keepalive on, as channels had it before the fix (run it with
// UCX_KEEPALIVE_INTERVAL=1s), a chatter dies of SIGSEGV inside UCX's TCP transport within a
// few rounds (transport/README.md, "Closing an endpoint"); with the fix alone and no guard in
// the channel's destructor, one aborted at its end in ucp_worker_destroy.
//
// The chatters are this program re-executed (UcxChatter.DISABLED_Run at the end), so a crash
// in either is a failed test, not a lost test program.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "tests/transport/transport_test_util.h"
#include "tests/transport/ucx_test_util.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor::transport {
namespace {

using namespace ucx_test;
using nlohmann::json;

constexpr auto kSendTimeout = 500ms;  // a chatter gives up a peer this long after a send stalls
constexpr auto kStopped = 2000ms;     // well past the send timeout

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

// A chatter's counters, as it reports them (status / done messages).
struct Counts {
  long long received = 0, corrupt = 0, sent = 0, send_errors = 0, redials = 0;
  static Counts from(const json& j) {
    return {j.value("received", 0LL), j.value("corrupt", 0LL), j.value("sent", 0LL), j.value("send_errors", 0LL),
            j.value("redials", 0LL)};
  }
};

// Starts the two chatters "a" and "b", and gives each the other's data-plane address.
struct Chatters {
  std::unique_ptr<ControlServer> server;
  ChildProcess a, b;
  bool ok = false;

  // `transports`: make_channel's ("" UCX's choice; kHostShm shared memory, each watching the
  // other's process instead of UCX's peer-failure handling).
  explicit Chatters(const std::string& transports = "") {
    auto bound = ControlServer::bind("tcp://127.0.0.1:0");
    EXPECT_TRUE(bound.ok()) << bound.error();
    if (!bound.ok()) return;
    server = std::move(*bound);
    for (auto [name, child] : {std::pair{"a", &a}, std::pair{"b", &b}}) {
      const bool started = child->start(
          {self_exe(), "--gtest_filter=UcxChatter.DISABLED_Run", "--gtest_also_run_disabled_tests"},
          {std::string("CONVEYOR_CHATTER_NAME=") + name, "CONVEYOR_CHATTER_ENDPOINT=" + server->endpoint(),
           "CONVEYOR_CHATTER_TLS=" + transports});
      EXPECT_TRUE(started) << name;
      if (!started) return;
    }
    std::map<std::string, std::vector<std::byte>> addresses;
    const auto deadline = Clock::now() + 20s;
    while (addresses.size() < 2 && Clock::now() < deadline) {
      auto in = server->recv(200ms);
      if (in.ok() && in->has_value() && (*in)->message.type() == "register")
        addresses[(*in)->peer] = (*in)->message.blob;
    }
    EXPECT_EQ(addresses.size(), 2u) << "the chatters did not register within 20 s";
    if (addresses.size() < 2) return;
    ok = server->send("a", ControlMessage::make("assign", nullptr, addresses["b"])).ok() &&
         server->send("b", ControlMessage::make("assign", nullptr, addresses["a"])).ok();
    EXPECT_TRUE(ok);
  }

  // Asks `name` for its counters: "status", or "done" (then it stops and exits).
  std::optional<Counts> ask(const std::string& name, const std::string& what) {
    if (!server->send(name, ControlMessage::make(what)).ok()) return std::nullopt;
    const auto deadline = Clock::now() + 10s;
    while (Clock::now() < deadline) {
      auto in = server->recv(200ms);
      if (in.ok() && in->has_value() && (*in)->peer == name && (*in)->message.type() == what)
        return Counts::from((*in)->message.body);
    }
    return std::nullopt;
  }
};

// How `child` ended ("killed by signal Segmentation fault"), or "" while it runs. It stays
// waitable (WNOWAIT): its ChildProcess reaps it.
std::string ended(const ChildProcess& child) {
  siginfo_t info{};
  ::waitid(P_PID, id_t(child.pid()), &info, WEXITED | WNOHANG | WNOWAIT);
  if (info.si_pid == 0) return "";
  if (info.si_code == CLD_EXITED) return "exited with status " + std::to_string(info.si_status);
  return std::string("killed by signal ") + strsignal(info.si_status) + " (its stderr above has UCX's backtrace)";
}

// Waits until both chatters have received `more` messages beyond `since` (by name); an error
// naming a chatter that ended or does not answer, or traffic that did not resume.
std::string traffic_flows(Chatters& c, const std::map<std::string, Counts>& since, long long more,
                          std::chrono::seconds within) {
  const auto deadline = Clock::now() + within;
  std::string counts;
  while (Clock::now() < deadline) {
    bool both = true;
    counts.clear();
    for (auto [name, child] : {std::pair{"a", &c.a}, std::pair{"b", &c.b}}) {
      if (std::string how = ended(*child); !how.empty()) return std::string("chatter '") + name + "' " + how;
      auto now = c.ask(name, "status");
      if (!now) return std::string("chatter '") + name + "' does not answer; " + ended(*child);
      counts += std::string(" ") + name + ": received " + std::to_string(now->received) + ", sent " +
                std::to_string(now->sent) + ", " + std::to_string(now->send_errors) + " send errors, " +
                std::to_string(now->redials) + " redials;";
      auto it = since.find(name);
      both &= now->received >= (it == since.end() ? 0 : it->second.received) + more;
    }
    if (both) return "";
    std::this_thread::sleep_for(200ms);
  }
  return "traffic did not resume within " + std::to_string(within.count()) + " s (" + counts + " )";
}

// Waits until neither chatter's received count moves for a second (after "quiet").
std::string settled(Chatters& c, std::chrono::seconds within) {
  const auto deadline = Clock::now() + within;
  std::map<std::string, long long> last;
  while (Clock::now() < deadline) {
    bool still = true;
    for (const char* name : {"a", "b"}) {
      auto now = c.ask(name, "status");
      if (!now) return std::string("chatter '") + name + "' does not answer; " + ended(name[0] == 'a' ? c.a : c.b);
      still &= last.count(name) && last[name] == now->received;
      last[name] = now->received;
    }
    if (still) return "";
    std::this_thread::sleep_for(1s);
  }
  return "messages kept arriving " + std::to_string(within.count()) + " s after the chatters stopped sending";
}

// Ten rounds of stopping one chatter past the other's send timeout and resuming it.
void stop_and_resume(Chatters& c) {
  ASSERT_TRUE(c.ok);
  const std::string started = traffic_flows(c, {}, 50, 20s);
  ASSERT_EQ(started, "") << "before the first stop";
  std::mt19937 rng(28);
  constexpr int kRounds = 10;
  for (int round = 0; round < kRounds; ++round) {
    ChildProcess& stopped = round % 2 == 0 ? c.b : c.a;  // each side is the stopped one in turn
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng() % 500));
    std::map<std::string, Counts> before;
    for (const char* name : {"a", "b"}) {
      auto counts = c.ask(name, "status");
      ASSERT_TRUE(counts) << "round " << round << ": chatter '" << name << "' does not answer";
      before[name] = *counts;
    }
    ::kill(stopped.pid(), SIGSTOP);
    std::this_thread::sleep_for(kStopped);
    ::kill(stopped.pid(), SIGCONT);
    const std::string resumed = traffic_flows(c, before, 20, 20s);
    ASSERT_EQ(resumed, "") << "round " << round << " (chatter '" << (&stopped == &c.a ? "a" : "b")
                           << "' was stopped)";
  }
  // The end, as daemons stop: nobody sends any more, what is under way arrives (or is given
  // up), then each channel is destroyed.
  for (const char* name : {"a", "b"}) ASSERT_TRUE(c.ask(name, "quiet")) << name;
  ASSERT_EQ(settled(c, 10s), "");
  long long redials = 0;
  for (const char* name : {"a", "b"}) {
    auto done = c.ask(name, "done");
    ASSERT_TRUE(done) << name;
    std::cout << "chatter " << name << ": received " << done->received << ", sent " << done->sent << ", "
              << done->send_errors << " send errors, " << done->redials << " redials\n";
    EXPECT_EQ(done->corrupt, 0) << name << " received altered messages";
    redials += done->redials;
  }
  EXPECT_GT(redials, 0) << "no chatter gave its peer up: the stops did not outlast the send timeout";
  EXPECT_EQ(c.a.wait_exit(10s), 0) << ended(c.a);
  EXPECT_EQ(c.b.wait_exit(10s), 0) << ended(c.b);
}

TEST(UcxStoppedPeer, StoppedAndResumedNeighbourCrashesNeither) {
  Chatters c;
  stop_and_resume(c);
}

// The same over shared memory (host_shared_memory): a stopped peer is given up by the send
// timeout alone (its process lives, so its pidfd says nothing), its endpoint cannot be closed
// by force, and the sends to it end in the channel, not in UCX. The resumed peer may still
// read what such a send left: the channel's copy of the header, and the payload, which the
// sender leaves unwritten (as Channel::send asks; a fresh-clone run that reused it saw one
// altered message in ten rounds).
TEST(UcxStoppedPeer, StoppedAndResumedNeighbourOverSharedMemoryCrashesNeither) {
  Chatters c(kHostShm);
  stop_and_resume(c);
}

// ------------------------------------------------------------------ the chatter process

// The size of message i: inline, eager and rendezvous on TCP (transport/README.md).
std::size_t size_of(long long i) {
  static constexpr std::size_t kSizes[] = {512, 16 * KiB, 256 * KiB, 2 * KiB, 64 * KiB};
  return kSizes[i % 5];
}

// One chatter: its channel, the peer it dials (again when lost), and its counters.
struct Chatter {
  std::unique_ptr<UcxChannel> ch;
  std::vector<std::byte> peer_address;
  bool lends_failed_payloads = false;  // over shared memory (kHostShm)
  std::atomic<bool> quiet{false}, stop{false};  // quiet: no more sends; stop: no more receives
  std::atomic<long long> received{0}, corrupt{0}, sent{0}, send_errors{0}, redials{0};

  json counts() const {
    return {{"received", received.load()}, {"corrupt", corrupt.load()}, {"sent", sent.load()},
            {"send_errors", send_errors.load()}, {"redials", redials.load()}};
  }

  // Sends message after message; a lost peer is disconnected and dialled again.
  void send_loop() {
    auto peer = ch->connect(peer_address, "other");
    EXPECT_TRUE(peer.ok()) << peer.error();
    if (!peer.ok()) return;
    PeerId id = *peer;
    std::vector<unsigned char> buf(256 * KiB);
    // Payloads of failed sends, never written again (Channel::send: the peer may still read
    // them, and over shared memory nothing takes that back from a peer that was only stopped).
    // Over TCP the buffer is reused at once: there the forced close fails such a read, which
    // this test holds too.
    std::vector<std::vector<unsigned char>> lent;
    for (long long i = 0; !quiet; ++i) {
      if (!ch->peer_status(id).ok()) {
        std::this_thread::sleep_for(200ms);  // as a worker waits for its next assignment
        (void)ch->disconnect(id);
        auto again = ch->connect(peer_address, "other");
        if (!again.ok()) {
          std::this_thread::sleep_for(50ms);
          continue;
        }
        id = *again;
        ++redials;
      }
      const std::size_t n = size_of(i);
      fill_pattern(buf.data(), n, seed_of(1, std::uint64_t(i)));
      const std::string header = std::to_string(i);
      if (ch->send(id, as_bytes(header), {buf.data(), n}, kSendTimeout).ok()) {
        ++sent;
        std::this_thread::sleep_for(1ms);  // a steady stream, not a flood of the two cores
      } else {
        ++send_errors;
        if (lends_failed_payloads) lent.push_back(std::exchange(buf, std::vector<unsigned char>(256 * KiB)));
        std::this_thread::sleep_for(20ms);
      }
    }
  }

  // Takes every message; checks its payload against its index (the header).
  void recv_loop() {
    while (!stop) {
      auto r = ch->recv(100ms);
      if (!r.ok() || !r->has_value()) continue;  // a peer's failure: the sender dials again
      const Message& m = **r;
      const long long i = std::stoll(std::string(as_string_view(m.header)));
      const bool intact = m.payload.size() == size_of(i) &&
                          check_pattern(m.payload.data(), m.payload.size(), seed_of(1, std::uint64_t(i))) == -1;
      ++(intact ? received : corrupt);
    }
  }
};

// Not a test: the chatter process above (started with --gtest_also_run_disabled_tests).
TEST(UcxChatter, DISABLED_Run) {
  const char* name = std::getenv("CONVEYOR_CHATTER_NAME");
  if (!name) GTEST_SKIP() << "only runs as a chatter process";
  Chatter c;
  UcxChannelOptions options;
  options.net_devices = "lo";          // as `conveyor local`'s workers
  options.auth_secret = "chatter-token";  // as the daemons' (their join token): a redial's handshake
                                          // cuts off what the closed connection left under way
  const char* tls = std::getenv("CONVEYOR_CHATTER_TLS");
  c.ch = make_channel(tls ? tls : "", name, options);
  c.lends_failed_payloads = tls && std::string(tls) == kHostShm;
  ASSERT_TRUE(c.ch);
  ControlClientOptions co;
  co.identity = name;
  auto control = ControlClient::connect(std::getenv("CONVEYOR_CHATTER_ENDPOINT"), co);
  ASSERT_TRUE(control.ok()) << control.error();
  ASSERT_TRUE((*control)->send(ControlMessage::make("register", nullptr, c.ch->address()), 10s).ok());
  auto assign = (*control)->recv(20s);
  ASSERT_TRUE(assign.ok() && assign->has_value()) << "no assign from the test";
  c.peer_address = (**assign).blob;
  std::thread sender([&] { c.send_loop(); });
  std::thread receiver([&] { c.recv_loop(); });
  for (auto last = Clock::now(); Clock::now() - last < 60s;) {
    auto in = (*control)->recv(200ms);
    if (!in.ok() || !in->has_value()) continue;
    last = Clock::now();
    const std::string type = (**in).type();
    if (type == "quiet" && sender.joinable()) c.quiet = true, sender.join();
    if (type == "done") {
      c.quiet = c.stop = true;
      if (sender.joinable()) sender.join();
      receiver.join();
    }
    ASSERT_TRUE((*control)->send(ControlMessage::make(type, c.counts()), 5s).ok());
    if (type == "done") return;
  }
  ADD_FAILURE() << "nothing from the test for 60 s";
  c.quiet = c.stop = true;
  if (sender.joinable()) sender.join();
  receiver.join();
}

}  // namespace
}  // namespace conveyor::transport

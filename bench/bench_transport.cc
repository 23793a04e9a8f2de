// UcxChannel latency and bandwidth between two processes on this machine.
//
//   conveyor-bench-transport [--transports tcp] [--min 4096] [--max 67108864] [--seconds 0.5]
//
// The program starts a copy of itself as the peer; the two exchange channel addresses over
// the control plane, as a worker and the coordinator do. For each message size it reports
//  - latency: half the round-trip time of a ping-pong (the peer sends every message back),
//    median and 99th percentile over the iterations;
//  - bandwidth: one sender thread calling send() back to back (each send returns when the
//    peer has the data), the peer acknowledging the last message; bytes / elapsed time.
// Receive-side costs are included: the receiver allocates a fresh buffer per message.
// UCX_TLS in the environment overrides --transports.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

extern char** environ;

namespace {

using namespace conveyor;
using namespace conveyor::transport;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_transport: %s\n", what.c_str());
  std::exit(1);
}

template <class T>
T check(Expected<T> e, const char* what) {
  if (!e.ok()) die(std::string(what) + ": " + e.error());
  return std::move(*e);
}

void check(const Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.message());
}

Message recv_message(Channel& ch) {
  auto m = check(ch.recv(60s), "recv");
  if (!m) die("no message for 60 s");
  return std::move(*m);
}

// The peer process: echo "ping" messages, count "bulk" ones and acknowledge "last".
int run_peer(const std::string& endpoint, const std::string& transports) {
  UcxChannelOptions options;
  options.name = "bench-peer";
  options.transports = transports;
  auto ch = check(UcxChannel::create(options), "create channel");
  ControlClientOptions co;
  co.identity = "bench-peer";
  auto control = check(ControlClient::connect(endpoint, co), "control connect");
  check(control->send(ControlMessage::make("register", nullptr, ch->address()), 10s), "register");
  auto assign = check(control->recv(20s), "assign");
  if (!assign) die("no assign");
  const PeerId parent = check(ch->connect(assign->blob, "bench"), "connect");
  for (;;) {
    Message m = recv_message(*ch);
    const auto kind = as_string_view(m.header);
    if (kind == "ping") {
      check(ch->send(parent, m.header, {m.payload.data(), m.payload.size()}, 60s), "echo");
    } else if (kind == "last") {
      check(ch->send(parent, as_bytes("ack"), {}, 60s), "ack");
    } else if (kind == "bye") {
      return 0;
    }
  }
}

struct Args {
  std::string transports;
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = 64u << 20;
  double seconds = 0.5;  // per size and measurement
};

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * (v.size() - 1) + 0.5))];
}

std::string size_text(std::size_t n) {
  if (n >= (1u << 20)) return std::to_string(n >> 20) + " MiB";
  return std::to_string(n >> 10) + " KiB";
}

int run_bench(const Args& args, const char* self) {
  auto server = check(ControlServer::bind("tcp://127.0.0.1:0"), "control bind");
  UcxChannelOptions options;
  options.name = "bench";
  options.transports = args.transports;
  auto ch = check(UcxChannel::create(options), "create channel");

  // Start the peer and wire the two channels up through the control plane.
  std::vector<std::string> argv_s = {self, "--peer", server->endpoint(), "--transports",
                                     args.transports};
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, self, nullptr, nullptr, argv.data(), environ) != 0) die("posix_spawn");
  PeerId peer = kNoPeer;
  const auto deadline = Clock::now() + 20s;
  while (peer == kNoPeer && Clock::now() < deadline) {
    auto in = check(server->recv(500ms), "control recv");
    if (!in || in->message.type() != "register") continue;
    peer = check(ch->connect(in->message.blob, "bench-peer"), "connect");
    check(server->send(in->peer, ControlMessage::make("assign", nullptr, ch->address())), "assign");
  }
  if (peer == kNoPeer) die("the peer process did not register");

  auto info = check(ch->transport_info(peer), "transport info");
  const char* env_tls = std::getenv("UCX_TLS");
  std::printf("UCX_TLS=%s\n%s\n",
              env_tls ? env_tls : (args.transports.empty() ? "(default)" : args.transports.c_str()),
              info.c_str());
  std::printf("| size | latency p50 (us) | latency p99 (us) | bandwidth (GB/s) |\n");
  std::printf("|---:|---:|---:|---:|\n");

  std::vector<unsigned char> buf(args.max_bytes);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 131);
  for (std::size_t n = args.min_bytes; n <= args.max_bytes; n *= 4) {
    const PayloadView payload{buf.data(), n};
    // Latency: ping-pong; a few warm-up rounds, then until the time budget is used.
    for (int i = 0; i < 3; ++i) {
      check(ch->send(peer, as_bytes("ping"), payload, 60s), "send");
      recv_message(*ch);
    }
    std::vector<double> half_rtt_us;
    const auto lat_end = Clock::now() + std::chrono::duration<double>(args.seconds);
    while (half_rtt_us.size() < 5 || (Clock::now() < lat_end && half_rtt_us.size() < 100000)) {
      const auto t0 = Clock::now();
      check(ch->send(peer, as_bytes("ping"), payload, 60s), "send");
      recv_message(*ch);
      half_rtt_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
                            2);
    }
    // Bandwidth: back-to-back sends, acknowledged at the end.
    const std::size_t count =
        std::clamp<std::size_t>(static_cast<std::size_t>(args.seconds * 2e9 / n), 4, 20000);
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i + 1 < count; ++i)
      check(ch->send(peer, as_bytes("bulk"), payload, 60s), "send");
    check(ch->send(peer, as_bytes("last"), payload, 60s), "send");
    recv_message(*ch);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("| %s | %.1f | %.1f | %.2f |\n", size_text(n).c_str(), percentile(half_rtt_us, 0.5),
                percentile(half_rtt_us, 0.99), double(n) * count / seconds / 1e9);
    std::fflush(stdout);
  }
  check(ch->send(peer, as_bytes("bye"), {}, 10s), "bye");
  int status = 0;
  waitpid(pid, &status, 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  std::string peer_endpoint;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--peer")
      peer_endpoint = next();
    else if (a == "--transports")
      args.transports = next();
    else if (a == "--min")
      args.min_bytes = std::stoull(next());
    else if (a == "--max")
      args.max_bytes = std::stoull(next());
    else if (a == "--seconds")
      args.seconds = std::stod(next());
    else
      die("unknown argument " + a + " (see the comment at the top of bench_transport.cc)");
  }
  if (!peer_endpoint.empty()) return run_peer(peer_endpoint, args.transports);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return run_bench(args, self.c_str());
}

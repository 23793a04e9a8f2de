// UcxChannel latency and bandwidth between two processes on this machine.
//
//   conveyor-bench-transport [--transports tcp] [--min 4096] [--max 67108864] [--seconds 0.5]
//                            [--auth off|on|both]
//
// The program starts a copy of itself as the peer; the two exchange channel addresses over
// the control plane, as a worker and the coordinator do. For each message size it reports
//  - latency: half the round-trip time of a ping-pong (the peer sends every message back),
//    median and 99th percentile over the iterations;
//  - bandwidth: bursts of back-to-back sends from one thread (each send returns when the peer
//    has the data; up to 40 MB or 256 messages a burst, at least 4), the peer acknowledging
//    each burst's last message; bytes / elapsed time of the median burst.
// Receive-side costs are included: the receiver allocates a fresh buffer per message.
// UCX_TLS in the environment overrides --transports. --spin-us N sets both channels'
// spin_while_pending (ucx_channel.h; 0: the progress threads sleep whenever idle), and
// --idle-spin-us N their spin_when_idle (the progress threads poll for N us after their last
// progress even with nothing under way; 0, the default: they sleep), and --call-spin-us N their
// spin_in_calls (send() and recv() poll for N us for their result before they block; 0, the
// default: they block at once). --host-shm sets both channels' host_shared_memory (shared memory
// between the two processes, each watching the other's process; ucx_channel.h).
//
// --auth: the channels without a secret (off, the default), with one as the daemons have
// theirs (on: the handshake at connect, a MAC on every envelope, transport/data_auth.h), or
// both, A/B in one run: two peer processes, one of each kind, measured interleaved so that
// both see the same machine (one ping-pong on each in turn, bursts in turn), with the ratio
// on/off. With auth the program first prints the floor: what the MAC alone costs on this CPU
// (keyed BLAKE2b over what an envelope carries: its 48-byte prefix, the header and an inline
// payload up to 8 KiB; a larger payload travels without a MAC of its bytes) and its rate over
// whole payloads; the table's "predicted" columns add two MACs a message (the sender's and
// the receiver's) to the plain channel's figures.
//
//   conveyor-bench-transport --handoff [--device 0] [--peer-device 1] [--min 16384] [--max 67108864]
//       [--seconds 0.5]
//
// (CUDA builds.) One micro-batch handoff between two GPU stage processes, on one GPU or (with
// --peer-device) on two, as the stage worker makes it, on both data paths in one run:
//  - staged: device rows -> page-locked slot (cudaMemcpy D2H) -> UCX (host memory) ->
//    page-locked receive buffer -> device rows (cudaMemcpy H2D);
//  - direct: device rows -> device slot (D2D) -> UCX (CUDA memory: cuda_ipc between two
//    processes on one GPU) -> device receive buffer -> device rows (D2D); only when the UCX
//    moves CUDA memory (a UCX built with CUDA: scripts/setup.sh), else reported as absent.
// Latency is half the round trip of a handoff and its way back, with the sender's side in
// phases (p50): the copy into the slot and its stream synchronisation, send() until it
// returns, the wait for the answer, and the copy into the rows; bandwidth is back-to-back
// handoffs of one sender, each waiting for its send (the handoff's back-pressure), the
// receiver copying every one into its rows, acknowledged at the end.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "transport/control_plane.h"
#include "transport/data_auth.h"
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
// The peer's side of start_peer: registers its channel's address with the parent's control
// server and connects to the address the parent assigns back.
PeerId register_with_parent(const std::string& endpoint, UcxChannel& ch) {
  ControlClientOptions co;
  co.identity = "bench-peer-" + std::to_string(::getpid());
  auto control = check(ControlClient::connect(endpoint, co), "control connect");
  check(control->send(ControlMessage::make("register", nullptr, ch.address()), 10s), "register");
  auto assign = check(control->recv(20s), "assign");
  if (!assign) die("no assign");
  return check(ch.connect(assign->blob, "bench"), "connect");
}

// Both ends of an authenticated pair know it, as a cluster's members know its join token.
constexpr const char* kBenchSecret = "conveyor-bench-transport";

struct Args {
  std::string transports;
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = 64u << 20;
  double seconds = 0.5;  // per size and measurement
  bool handoff = false;  // --handoff: the GPU stage handoff, staged and direct
  int device = 0;
  int peer_device = -1;  // --handoff: the peer process's GPU (-1: --device's)
  long spin_us = -1;     // --spin-us: both channels' spin_while_pending (-1: the default)
  long idle_spin_us = 0;  // --idle-spin-us: both channels' spin_when_idle
  long call_spin_us = 0;  // --call-spin-us: both channels' spin_in_calls
  bool host_shm = false;  // --host-shm: both channels' host_shared_memory
  std::string path;      // the handoff peer's path: "staged" or "direct"
  std::string auth = "off";  // off, on or both (the A/B)

  // The options both processes pass on to their peer: transports and spins.
  std::vector<std::string> peer_args() const {
    std::vector<std::string> a = {"--transports", transports, "--spin-us", std::to_string(spin_us), "--idle-spin-us",
                                  std::to_string(idle_spin_us), "--call-spin-us", std::to_string(call_spin_us)};
    if (host_shm) a.push_back("--host-shm");
    return a;
  }
};

// A channel's options as both processes of the bench set them; spin_us < 0: the default
// spin_while_pending.
UcxChannelOptions channel_options(const std::string& name, const Args& args, bool auth) {
  UcxChannelOptions options;
  options.name = name;
  options.transports = args.transports;
  if (auth) options.auth_secret = kBenchSecret;
  if (args.spin_us >= 0) options.spin_while_pending = std::chrono::microseconds(args.spin_us);
  options.spin_when_idle = std::chrono::microseconds(std::max(0L, args.idle_spin_us));
  options.spin_in_calls = std::chrono::microseconds(std::max(0L, args.call_spin_us));
  options.host_shared_memory = args.host_shm;
  return options;
}

int run_peer(const std::string& endpoint, const Args& args, bool auth) {
  auto ch = check(UcxChannel::create(channel_options("bench-peer", args, auth)), "create channel");
  const PeerId parent = register_with_parent(endpoint, *ch);
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

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * (v.size() - 1) + 0.5))];
}

std::string size_text(std::size_t n) {
  if (n >= (1u << 20)) return std::to_string(n >> 20) + " MiB";
  return std::to_string(n >> 10) + " KiB";
}

// Starts this program again as the peer (`peer_args` after its own path), and wires the two
// channels up through the control plane: the peer registers its address, gets `ch`'s back.
struct Peer {
  pid_t pid = -1;
  PeerId id = kNoPeer;
};
Peer start_peer(const char* self, ControlServer& server, UcxChannel& ch, std::vector<std::string> peer_args,
                std::chrono::seconds wait) {
  peer_args.insert(peer_args.begin(), self);
  std::vector<char*> argv;
  for (auto& a : peer_args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Peer peer;
  if (posix_spawn(&peer.pid, self, nullptr, nullptr, argv.data(), environ) != 0) die("posix_spawn");
  const auto deadline = Clock::now() + wait;
  while (peer.id == kNoPeer && Clock::now() < deadline) {
    auto in = check(server.recv(500ms), "control recv");
    if (!in || in->message.type() != "register") continue;
    peer.id = check(ch.connect(in->message.blob, "bench-peer"), "connect");
    check(server.send(in->peer, ControlMessage::make("assign", nullptr, ch.address())), "assign");
  }
  if (peer.id == kNoPeer) die("the peer process did not register");
  return peer;
}

// One message size's figures on one channel pair.
struct Row {
  double p50_us = 0, p99_us = 0, gb_per_s = 0;
};

// A channel and the peer process at its other end.
struct Side {
  std::unique_ptr<UcxChannel> ch;
  Peer peer;
};

// Latency: ping-pongs, one on each side in turn, a few warm-up rounds first, then until the
// time budget is used. Half round trips in microseconds, per side.
std::vector<std::vector<double>> measure_latency(std::vector<Side>& sides, const PayloadView payload, double budget_seconds) {
  auto ping = [&](Side& s) {
    check(s.ch->send(s.peer.id, as_bytes("ping"), payload, 60s), "send");
    recv_message(*s.ch);
  };
  for (int i = 0; i < 3; ++i)
    for (Side& s : sides) ping(s);
  std::vector<std::vector<double>> half_rtt_us(sides.size());
  const auto end = Clock::now() + std::chrono::duration<double>(budget_seconds);
  while (half_rtt_us[0].size() < 5 || (Clock::now() < end && half_rtt_us[0].size() < 100000))
    for (std::size_t k = 0; k < sides.size(); ++k) {
      const auto t0 = Clock::now();
      ping(sides[k]);
      half_rtt_us[k].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 2);
    }
  return half_rtt_us;
}

// Bandwidth: bursts of back-to-back sends (up to 40 MB or 256 messages, at least 4), the last
// one acknowledged, the sides taking turns until the budget is used. The median burst's GB/s
// per side (a burst the machine's other work descheduled counts as one).
std::vector<double> measure_bandwidth(std::vector<Side>& sides, const PayloadView payload, double budget_seconds) {
  const std::size_t n = payload.bytes;
  const std::size_t burst = std::clamp<std::size_t>(static_cast<std::size_t>(40e6 / double(n)), 4, 256);
  std::vector<std::vector<double>> rates(sides.size());
  const auto end = Clock::now() + std::chrono::duration<double>(budget_seconds);
  while (rates[0].size() < 3 || Clock::now() < end)
    for (std::size_t k = 0; k < sides.size(); ++k) {
      Side& s = sides[k];
      const auto t0 = Clock::now();
      for (std::size_t i = 0; i + 1 < burst; ++i) check(s.ch->send(s.peer.id, as_bytes("bulk"), payload, 60s), "send");
      check(s.ch->send(s.peer.id, as_bytes("last"), payload, 60s), "send");
      recv_message(*s.ch);
      rates[k].push_back(double(n) * double(burst) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
    }
  std::vector<double> gb_per_s;
  for (const auto& r : rates) gb_per_s.push_back(percentile(r, 0.5));
  return gb_per_s;
}

// Every side's row for one message size.
std::vector<Row> measure_size(std::vector<Side>& sides, const PayloadView payload, double budget_seconds) {
  const auto latency = measure_latency(sides, payload, budget_seconds);
  const auto bandwidth = measure_bandwidth(sides, payload, budget_seconds);
  std::vector<Row> rows;
  for (std::size_t k = 0; k < sides.size(); ++k)
    rows.push_back({percentile(latency[k], 0.5), percentile(latency[k], 0.99), bandwidth[k]});
  return rows;
}

// Microseconds per call of `f`, run for about `budget_seconds`.
template <class F>
double time_us(F&& f, double budget_seconds) {
  std::size_t calls = 0;
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration<double>(budget_seconds);
  do {
    for (int i = 0; i < 8; ++i) f();
    calls += 8;
  } while (Clock::now() < end);
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / double(calls);
}

// What the MAC costs alone, per size: per envelope (what UcxChannel MACs: the 48-byte prefix,
// the 4-byte header here, and the payload when it goes inline), and over the whole payload
// (its rate, against the wire's). Returns the per-envelope microseconds.
std::vector<double> mac_floor(const std::vector<std::size_t>& sizes, const unsigned char* buf, double budget_seconds) {
  constexpr std::size_t kPrefixBytes = 48, kHeaderBytes = 4;
  const std::size_t inline_limit = UcxChannelOptions{}.inline_payload_bytes;
  const auth::Key session = auth::derive_key(kBenchSecret);
  const auto* bytes = reinterpret_cast<const std::byte*>(buf);
  std::printf("The floor: the MAC alone (keyed BLAKE2b, 16 bytes; one thread, this CPU)\n");
  std::printf("| size | bytes MACed per envelope | MAC per envelope (us) | MAC over the whole payload (GB/s) |\n");
  std::printf("|---:|---:|---:|---:|\n");
  std::vector<double> per_envelope_us;
  volatile std::uint8_t sink = 0;
  for (std::size_t n : sizes) {
    const std::size_t inline_bytes = n <= inline_limit ? n : 0;
    const std::span<const std::byte> envelope[] = {{bytes, kPrefixBytes}, {bytes, kHeaderBytes}, {bytes, inline_bytes}};
    const std::span<const std::byte> whole[] = {{bytes, n}};
    const double env_us = time_us([&] { sink = sink ^ auth::message_mac(session, envelope)[0]; }, budget_seconds / 2);
    const double whole_us = time_us([&] { sink = sink ^ auth::message_mac(session, whole)[0]; }, budget_seconds / 2);
    per_envelope_us.push_back(env_us);
    std::printf("| %s | %zu | %.2f | %.2f |\n", size_text(n).c_str(), kPrefixBytes + kHeaderBytes + inline_bytes, env_us,
                double(n) / whole_us / 1e3);
  }
  std::printf("\n");
  return per_envelope_us;
}

// The sizes measured: powers of 4 from --min to --max; with auth, 8 KiB too (the largest
// payload that goes inline, so the most an envelope's MAC covers).
std::vector<std::size_t> bench_sizes(const Args& args) {
  std::vector<std::size_t> sizes;
  for (std::size_t n = args.min_bytes; n <= args.max_bytes; n *= 4) sizes.push_back(n);
  const std::size_t inline_limit = UcxChannelOptions{}.inline_payload_bytes;
  if (args.auth != "off" && inline_limit >= args.min_bytes && inline_limit <= args.max_bytes &&
      std::find(sizes.begin(), sizes.end(), inline_limit) == sizes.end()) {
    sizes.push_back(inline_limit);
    std::sort(sizes.begin(), sizes.end());
  }
  return sizes;
}

void print_table(const std::vector<std::size_t>& sizes, const std::vector<std::vector<Row>>& rows,
                 const std::vector<double>& mac_us) {
  if (rows.size() == 1) {
    std::printf("| size | latency p50 (us) | latency p99 (us) | bandwidth (GB/s) |\n|---:|---:|---:|---:|\n");
    for (std::size_t i = 0; i < sizes.size(); ++i)
      std::printf("| %s | %.1f | %.1f | %.2f |\n", size_text(sizes[i]).c_str(), rows[0][i].p50_us, rows[0][i].p99_us,
                  rows[0][i].gb_per_s);
    return;
  }
  // Predicted: each message pays two more MACs (sender's and receiver's) than the plain one.
  std::printf("| size | p50 off (us) | p50 on (us) | on/off | predicted | p99 off (us) | p99 on (us) | GB/s off | GB/s on "
              "| on/off | predicted |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const Row& off = rows[0][i];
    const Row& on = rows[1][i];
    const double message_us = double(sizes[i]) / (off.gb_per_s * 1e3);  // one bulk message, plain
    std::printf("| %s | %.1f | %.1f | %.3f | %.3f | %.1f | %.1f | %.2f | %.2f | %.3f | %.3f |\n", size_text(sizes[i]).c_str(),
                off.p50_us, on.p50_us, on.p50_us / off.p50_us, (off.p50_us + 2 * mac_us[i]) / off.p50_us, off.p99_us,
                on.p99_us, off.gb_per_s, on.gb_per_s, on.gb_per_s / off.gb_per_s,
                message_us / (message_us + 2 * mac_us[i]));
    std::fflush(stdout);
  }
}

int run_bench(const Args& args, const char* self) {
  auto server = check(ControlServer::bind("tcp://127.0.0.1:0"), "control bind");
  const std::vector<bool> auth_of = args.auth == "both" ? std::vector<bool>{false, true} : std::vector<bool>{args.auth == "on"};
  const std::vector<std::size_t> sizes = bench_sizes(args);
  std::vector<unsigned char> buf(args.max_bytes);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 131);
  std::vector<double> mac_us(sizes.size(), 0.0);
  if (args.auth != "off") mac_us = mac_floor(sizes, buf.data(), args.seconds);

  // A channel and a peer process per side, wired up through the control plane.
  std::vector<Side> sides;
  for (bool auth : auth_of) {
    Side s;
    s.ch = check(UcxChannel::create(channel_options("bench", args, auth)), "create channel");
    std::vector<std::string> peer_args = {"--peer", server->endpoint(), "--auth", auth ? "on" : "off"};
    for (auto& a : args.peer_args()) peer_args.push_back(a);
    s.peer = start_peer(self, *server, *s.ch, peer_args, 20s);
    sides.push_back(std::move(s));
  }
  auto info = check(sides[0].ch->transport_info(sides[0].peer.id), "transport info");
  const char* env_tls = std::getenv("UCX_TLS");
  std::printf("UCX_TLS=%s; auth %s\n%s\n", env_tls ? env_tls : (args.transports.empty() ? "(default)" : args.transports.c_str()),
              args.auth.c_str(), info.c_str());

  std::vector<std::vector<Row>> rows(sides.size());
  for (std::size_t n : sizes) {
    const std::vector<Row> r = measure_size(sides, {buf.data(), n}, args.seconds);
    for (std::size_t k = 0; k < sides.size(); ++k) rows[k].push_back(r[k]);
  }
  print_table(sizes, rows, mac_us);
  for (Side& s : sides) {
    check(s.ch->send(s.peer.id, as_bytes("bye"), {}, 10s), "bye");
    s.ch->disconnect(s.peer.id);  // before the peer exits, which would otherwise read as its failure
    int status = 0;
    waitpid(s.peer.pid, &status, 0);
  }
  return 0;
}

#ifdef CONVEYOR_HAVE_CUDA
// ------------------------------------------------------------------ --handoff (CUDA)

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

// One end of a GPU handoff: its stage's rows on the device and a stream, the slot it sends
// from (page-locked host memory staged, device memory direct), as a GPU worker has them.
struct GpuEnd {
  bool direct = false;
  std::size_t max_bytes = 0;
  cudaStream_t stream = nullptr;
  void* rows = nullptr;  // the stage's activations on the device
  void* slot = nullptr;  // where they go before the send

  GpuEnd(bool direct_path, std::size_t bytes, int device) : direct(direct_path), max_bytes(bytes) {
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaMalloc(&rows, bytes), "cudaMalloc rows");
    cuda_check(cudaMemset(rows, 0x5a, bytes), "cudaMemset");
    if (direct) cuda_check(cudaMalloc(&slot, bytes), "cudaMalloc slot");
    else cuda_check(cudaHostAlloc(&slot, bytes, cudaHostAllocPortable), "cudaHostAlloc slot");
  }
  ~GpuEnd() {
    if (direct) cudaFree(slot);
    else cudaFreeHost(slot);
    cudaFree(rows);
    cudaStreamDestroy(stream);
  }
  // The stage hands its rows on: into the slot, on its stream, synchronised (download_hidden).
  PayloadView hand_on(std::size_t n) {
    cuda_check(cudaMemcpyAsync(slot, rows, n, cudaMemcpyDefault, stream), "copy into the slot");
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return {slot, n, direct};
  }
  // The next stage takes received rows in (upload_hidden): from host or device memory.
  void take_in(const Message& m) {
    if (m.payload.size() > max_bytes) die("payload larger than the rows");
    cuda_check(cudaMemcpyAsync(rows, m.payload.data(), m.payload.size(), cudaMemcpyDefault, stream), "copy into the rows");
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
};

// A channel as a GPU worker's: page-locked receive buffers; on the direct path device receive
// buffers too, with the GPU current on the progress thread.
UcxChannelOptions gpu_channel_options(const std::string& name, const Args& args, bool direct) {
  UcxChannelOptions o = channel_options(name, args, /*auth=*/false);
  const int device = args.device;
  o.receive_allocator.allocate = [device](std::size_t n) -> void* {
    void* p = nullptr;
    return cudaSetDevice(device) == cudaSuccess && cudaHostAlloc(&p, n, cudaHostAllocPortable) == cudaSuccess ? p : nullptr;
  };
  o.receive_allocator.release = [](void* p) { cudaFreeHost(p); };
  if (direct) {
    o.device_allocator.allocate = [device](std::size_t n) -> void* {
      void* p = nullptr;
      return cudaSetDevice(device) == cudaSuccess && cudaMalloc(&p, n) == cudaSuccess ? p : nullptr;
    };
    o.device_allocator.release = [](void* p) { cudaFree(p); };
    o.progress_thread_init = [device] { cudaSetDevice(device); };
  }
  return o;
}

// The handoff peer: takes every micro-batch into its rows; sends "ping"s back the same way.
int run_handoff_peer(const std::string& endpoint, const Args& args) {
  const bool direct = args.path == "direct";
  GpuEnd end(direct, args.max_bytes, args.device);
  auto ch = check(UcxChannel::create(gpu_channel_options("bench-peer", args, direct)), "create channel");
  const PeerId parent = register_with_parent(endpoint, *ch);
  for (;;) {
    Message m = recv_message(*ch);
    const auto kind = as_string_view(m.header);
    if (kind == "bye") return 0;
    end.take_in(m);
    if (kind == "ping") check(ch->send(parent, m.header, end.hand_on(m.payload.size()), 60s), "echo");
    else if (kind == "last") check(ch->send(parent, as_bytes("ack"), {}, 60s), "ack");
  }
}

struct HandoffRow {
  double p50_us = 0, p99_us = 0, gb_per_s = 0;
};

// Measures every size on one path against a peer process of the same path. Empty when the
// direct path cannot run (a UCX without CUDA).
std::vector<HandoffRow> measure_handoff(const Args& args, const char* self, bool direct, const std::vector<std::size_t>& sizes) {
  auto server = check(ControlServer::bind("tcp://127.0.0.1:0"), "control bind");
  GpuEnd end(direct, args.max_bytes, args.device);
  auto ch = check(UcxChannel::create(gpu_channel_options("bench", args, direct)), "create channel");
  if (direct && !ch->takes_device_memory()) {
    std::printf("direct path: this UCX cannot move CUDA memory (ucp_context_query), so it is not measured\n");
    return {};
  }
  std::vector<std::string> peer_args = {"--peer", server->endpoint(), "--handoff", "--path", direct ? "direct" : "staged",
                                        "--device", std::to_string(args.peer_device), "--max",
                                        std::to_string(args.max_bytes)};
  for (auto& a : args.peer_args()) peer_args.push_back(a);
  const Peer started = start_peer(self, *server, *ch, peer_args, 30s);
  const pid_t pid = started.pid;
  const PeerId peer = started.id;
  if (direct && !ch->peer_takes_device_memory(peer)) die("the direct peer does not take device memory");

  std::vector<HandoffRow> rows;
  for (std::size_t n : sizes) {
    auto handoff = [&](const char* kind) { check(ch->send(peer, as_bytes(kind), end.hand_on(n), 60s), "send"); };
    for (int i = 0; i < 3; ++i) {  // warm-up: UCX maps the buffers (cuda_ipc) once
      handoff("ping");
      end.take_in(recv_message(*ch));
    }
    std::vector<double> half_rtt_us, phase_us[4];  // copy into the slot, send, wait, copy into the rows
    const auto lat_end = Clock::now() + std::chrono::duration<double>(args.seconds);
    auto us = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
    while (half_rtt_us.size() < 5 || (Clock::now() < lat_end && half_rtt_us.size() < 100000)) {
      const auto t0 = Clock::now();
      const PayloadView slot = end.hand_on(n);
      const auto t1 = Clock::now();
      check(ch->send(peer, as_bytes("ping"), slot, 60s), "send");
      const auto t2 = Clock::now();
      const Message back = recv_message(*ch);
      const auto t3 = Clock::now();
      end.take_in(back);
      const auto t4 = Clock::now();
      half_rtt_us.push_back(us(t0, t4) / 2);
      phase_us[0].push_back(us(t0, t1)), phase_us[1].push_back(us(t1, t2));
      phase_us[2].push_back(us(t2, t3)), phase_us[3].push_back(us(t3, t4));
    }
    std::printf("%s %s: round trip p50 %.1f us = copy into the slot %.1f + send %.1f + wait for the answer %.1f + "
                "copy into the rows %.1f\n",
                direct ? "direct" : "staged", size_text(n).c_str(), 2 * percentile(half_rtt_us, 0.5),
                percentile(phase_us[0], 0.5), percentile(phase_us[1], 0.5), percentile(phase_us[2], 0.5),
                percentile(phase_us[3], 0.5));
    const std::size_t count = std::clamp<std::size_t>(static_cast<std::size_t>(args.seconds * 5e9 / double(n)), 4, 20000);
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i + 1 < count; ++i) handoff("bulk");
    handoff("last");
    recv_message(*ch);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    rows.push_back({percentile(half_rtt_us, 0.5), percentile(half_rtt_us, 0.99), double(n) * double(count) / seconds / 1e9});
  }
  auto info = ch->transport_info(peer);
  std::printf("%s path, endpoint to the peer process:\n%s\n", direct ? "direct" : "staged",
              info.ok() ? info->c_str() : info.error().c_str());
  check(ch->send(peer, as_bytes("bye"), {}, 10s), "bye");
  ch->disconnect(peer);  // before the peer exits, which would otherwise read as its failure
  int status = 0;
  waitpid(pid, &status, 0);
  return rows;
}

int run_handoff_bench(Args args, const char* self) {
  if (args.min_bytes < 16384 && args.min_bytes == 4096) args.min_bytes = 16384;  // the default: 16 KiB
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, args.device), "cudaGetDeviceProperties");
  std::vector<std::size_t> sizes;
  for (std::size_t n = args.min_bytes; n <= args.max_bytes; n *= 4) sizes.push_back(n);
  const char* env_tls = std::getenv("UCX_TLS");
  if (args.peer_device < 0) args.peer_device = args.device;
  std::printf("GPU handoff, processes on GPU %d and GPU %d (%s); UCX_TLS=%s\n", args.device, args.peer_device, prop.name,
              env_tls ? env_tls : (args.transports.empty() ? "(default)" : args.transports.c_str()));
  const auto staged = measure_handoff(args, self, false, sizes);
  const auto direct = measure_handoff(args, self, true, sizes);
  std::printf("| size | staged p50 (us) | direct p50 (us) | staged p99 (us) | direct p99 (us) | staged (GB/s) | direct (GB/s) |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto cell = [&](const std::vector<HandoffRow>& v, double HandoffRow::*f, const char* fmt) {
      char b[32] = "-";
      if (i < v.size()) std::snprintf(b, sizeof(b), fmt, v[i].*f);
      return std::string(b);
    };
    std::printf("| %s | %s | %s | %s | %s | %s | %s |\n", size_text(sizes[i]).c_str(),
                cell(staged, &HandoffRow::p50_us, "%.1f").c_str(), cell(direct, &HandoffRow::p50_us, "%.1f").c_str(),
                cell(staged, &HandoffRow::p99_us, "%.1f").c_str(), cell(direct, &HandoffRow::p99_us, "%.1f").c_str(),
                cell(staged, &HandoffRow::gb_per_s, "%.2f").c_str(), cell(direct, &HandoffRow::gb_per_s, "%.2f").c_str());
  }
  return 0;
}
#endif

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
    else if (a == "--handoff")
      args.handoff = true;
    else if (a == "--device")
      args.device = std::stoi(next());
    else if (a == "--spin-us")
      args.spin_us = std::stol(next());
    else if (a == "--idle-spin-us")
      args.idle_spin_us = std::stol(next());
    else if (a == "--call-spin-us")
      args.call_spin_us = std::stol(next());
    else if (a == "--host-shm")
      args.host_shm = true;
    else if (a == "--peer-device")
      args.peer_device = std::stoi(next());
    else if (a == "--path")
      args.path = next();
    else if (a == "--auth")
      args.auth = next();
    else
      die("unknown argument " + a + " (see the comment at the top of bench_transport.cc)");
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  if (args.handoff) {
#ifdef CONVEYOR_HAVE_CUDA
    if (!peer_endpoint.empty()) return run_handoff_peer(peer_endpoint, args);
    return run_handoff_bench(args, self.c_str());
#else
    die("--handoff needs a build with the CUDA backend");
#endif
  }
  if (args.auth != "off" && args.auth != "on" && args.auth != "both")
    die("--auth must be off, on or both, not '" + args.auth + "'");
  if (!peer_endpoint.empty()) return run_peer(peer_endpoint, args, args.auth == "on");
  return run_bench(args, self.c_str());
}

// conveyor-netns-relay: the wire of a test "node" (tests/netns/netns_harness.h), with the
// faults the kernel's netem would give and this kernel lacks: delay, random loss, and a
// partition that hides chosen addresses from the node.
//
//   conveyor-netns-relay LINK=IFA,IFB [LINK=IFA,IFB ...]   relay Ethernet frames IFA <-> IFB
//   conveyor-netns-relay --plain IFNAME...                   turn off the interfaces' checksum
//                                                            and segmentation offloads, exit
//
// Each LINK joins two interfaces of this network namespace (the node's veth peer and a veth
// into the bridge) with two AF_PACKET sockets: every frame that arrives on one leaves by the
// other, after the link's delay, unless the loss draw or a block drops it. Frames keep their
// order (a wire does not reorder). Frames must be plain (one MTU, checksummed): the harness
// runs `--plain` on every interface that sends into a relay, so 5% loss means 5% of packets,
// not of 64 KiB segmentation batches.
//
// Commands, one per line on stdin; each is answered with one line on stdout ("ok ..." or
// "error ..."), after it takes effect:
//   set LINK [delay_ms=N] [loss=P] [block=IP,IP,...|block=]   change the link (P in [0,1))
//   stats LINK      ok LINK forwarded=N lost=N blocked=N send_errors=N queued=N
// The relay prints "relay: ready" once every socket is bound, and exits on EOF of stdin (its
// harness is gone) or SIGTERM. Bounded: at most 64 MiB of frames wait in a link's delay line;
// beyond that frames are dropped and counted as send_errors.
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/ethtool.h>
#include <linux/if_packet.h>
#include <linux/sockios.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxFrame = 65536 + 64;
constexpr size_t kMaxQueuedBytes = size_t{64} << 20;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "conveyor-netns-relay: %s\n", what.c_str());
  std::exit(2);
}
std::string errno_text(const std::string& call) { return call + ": " + std::strerror(errno); }

// The legacy ethtool calls, still served by every kernel: off for checksum offload,
// scatter-gather, TSO and GSO, so the interface sends only whole, checksummed frames.
int make_plain(const std::vector<std::string>& names) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) die(errno_text("socket"));
  for (const auto& name : names) {
    if (name.size() >= IFNAMSIZ) die("interface name too long: " + name);
    for (uint32_t cmd : {uint32_t(ETHTOOL_STSO), uint32_t(ETHTOOL_SGSO), uint32_t(ETHTOOL_SSG), uint32_t(ETHTOOL_STXCSUM)}) {
      ethtool_value v{};
      v.cmd = cmd;
      v.data = 0;
      ifreq ifr{};
      std::memcpy(ifr.ifr_name, name.c_str(), name.size());
      ifr.ifr_data = reinterpret_cast<char*>(&v);
      if (::ioctl(fd, SIOCETHTOOL, &ifr) != 0 && errno != EOPNOTSUPP)
        die(errno_text("ioctl(SIOCETHTOOL " + std::to_string(cmd) + ") on " + name));
    }
  }
  ::close(fd);
  return 0;
}

struct Frame {
  Clock::time_point due;
  std::vector<uint8_t> bytes;
};

// One direction of a link: frames read from `in` go out of `out`.
struct Direction {
  int in = -1, out = -1;
  std::deque<Frame> line;  // the delay line, in order
  size_t queued_bytes = 0;
};

struct Link {
  std::string name, if_a, if_b;
  Direction a_to_b, b_to_a;
  std::chrono::microseconds delay{0};
  double loss = 0;
  std::vector<uint32_t> blocked;  // IPv4 addresses, network order
  uint64_t forwarded = 0, lost = 0, blocked_frames = 0, send_errors = 0;
};

int packet_socket(const std::string& ifname) {
  const int fd = ::socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) die(errno_text("socket(AF_PACKET)"));
  const unsigned index = ::if_nametoindex(ifname.c_str());
  if (index == 0) die(errno_text("if_nametoindex(" + ifname + ")"));
  const int one = 1;
  if (::setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof(one)) != 0)
    die(errno_text("setsockopt(PACKET_IGNORE_OUTGOING) on " + ifname));
  const int buf = 8 << 20;
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof(buf)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof(buf)) != 0)
    die(errno_text("setsockopt(SO_RCVBUFFORCE/SO_SNDBUFFORCE) on " + ifname));
  sockaddr_ll sll{};
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  sll.sll_ifindex = int(index);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sll), sizeof(sll)) != 0) die(errno_text("bind(AF_PACKET " + ifname + ")"));
  packet_mreq mr{};
  mr.mr_ifindex = int(index);
  mr.mr_type = PACKET_MR_PROMISC;
  if (::setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof(mr)) != 0)
    die(errno_text("setsockopt(PACKET_ADD_MEMBERSHIP) on " + ifname));
  return fd;
}

// The IPv4 addresses a frame carries: source and destination of an IPv4 packet, sender and
// target of an ARP message. False when it carries none.
bool frame_addresses(const uint8_t* f, size_t n, uint32_t& a, uint32_t& b) {
  if (n < 14) return false;
  const uint16_t type = uint16_t(f[12] << 8 | f[13]);
  if (type == ETHERTYPE_IP && n >= 14 + 20) {
    std::memcpy(&a, f + 14 + 12, 4);
    std::memcpy(&b, f + 14 + 16, 4);
    return true;
  }
  if (type == ETHERTYPE_ARP && n >= 14 + 28) {
    std::memcpy(&a, f + 14 + 14, 4);
    std::memcpy(&b, f + 14 + 24, 4);
    return true;
  }
  return false;
}

void send_frame(Link& link, Direction& d, const uint8_t* bytes, size_t n) {
  while (true) {
    const ssize_t sent = ::send(d.out, bytes, n, 0);
    if (sent == ssize_t(n)) {
      ++link.forwarded;
      return;
    }
    if (sent < 0 && errno == EINTR) continue;
    // ENETDOWN (the link is cut), ENOBUFS (tbf's queue is full), EMSGSIZE: the frame is lost.
    ++link.send_errors;
    return;
  }
}

void read_side(Link& link, Direction& d, std::mt19937_64& rng, std::vector<uint8_t>& buf) {
  std::uniform_real_distribution<double> draw(0, 1);
  for (int k = 0; k < 256; ++k) {
    const ssize_t n = ::recv(d.in, buf.data(), buf.size(), MSG_TRUNC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ENETDOWN) continue;  // the link went down: the socket says so once
      die(errno_text("recv on " + link.name));
    }
    if (size_t(n) > buf.size()) {  // larger than any MTU: an interface was not made plain
      ++link.send_errors;
      continue;
    }
    uint32_t a = 0, b = 0;
    if (!link.blocked.empty() && frame_addresses(buf.data(), size_t(n), a, b) &&
        std::any_of(link.blocked.begin(), link.blocked.end(), [&](uint32_t x) { return x == a || x == b; })) {
      ++link.blocked_frames;
      continue;
    }
    if (link.loss > 0 && draw(rng) < link.loss) {
      ++link.lost;
      continue;
    }
    if (link.delay.count() == 0 && d.line.empty()) {
      send_frame(link, d, buf.data(), size_t(n));
      continue;
    }
    if (d.queued_bytes + size_t(n) > kMaxQueuedBytes) {
      ++link.send_errors;
      continue;
    }
    Clock::time_point due = Clock::now() + link.delay;
    if (!d.line.empty()) due = std::max(due, d.line.back().due);  // in order, as on a wire
    d.line.push_back({due, std::vector<uint8_t>(buf.begin(), buf.begin() + n)});
    d.queued_bytes += size_t(n);
  }
}

void flush_due(Link& link, Direction& d, Clock::time_point now) {
  while (!d.line.empty() && d.line.front().due <= now) {
    send_frame(link, d, d.line.front().bytes.data(), d.line.front().bytes.size());
    d.queued_bytes -= d.line.front().bytes.size();
    d.line.pop_front();
  }
}

std::string command(std::map<std::string, Link>& links, const std::string& line) {
  std::istringstream in(line);
  std::string verb, name;
  in >> verb >> name;
  auto it = links.find(name);
  if (verb.empty()) return "error empty command";
  if (it == links.end()) return "error no link '" + name + "'";
  Link& link = it->second;
  if (verb == "stats") {
    return "ok " + name + " forwarded=" + std::to_string(link.forwarded) + " lost=" + std::to_string(link.lost) +
           " blocked=" + std::to_string(link.blocked_frames) + " send_errors=" + std::to_string(link.send_errors) +
           " queued=" + std::to_string(link.a_to_b.line.size() + link.b_to_a.line.size());
  }
  if (verb != "set") return "error unknown command '" + verb + "' (set, stats)";
  for (std::string kv; in >> kv;) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) return "error '" + kv + "' is not key=value";
    const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
    try {
      if (key == "delay_ms") {
        size_t used = 0;
        const double ms = std::stod(value, &used);
        if (used != value.size() || ms < 0 || ms > 60000) return "error delay_ms must be in [0, 60000]: " + value;
        link.delay = std::chrono::microseconds(int64_t(ms * 1000));
      } else if (key == "loss") {
        size_t used = 0;
        const double p = std::stod(value, &used);
        if (used != value.size() || p < 0 || p >= 1) return "error loss must be in [0, 1): " + value;
        link.loss = p;
      } else if (key == "block") {
        std::vector<uint32_t> ips;
        std::istringstream list(value);
        for (std::string ip; std::getline(list, ip, ',');) {
          in_addr addr{};
          if (::inet_pton(AF_INET, ip.c_str(), &addr) != 1) return "error not an IPv4 address: '" + ip + "'";
          ips.push_back(addr.s_addr);
        }
        link.blocked = std::move(ips);
      } else {
        return "error unknown key '" + key + "' (delay_ms, loss, block)";
      }
    } catch (const std::exception&) {
      return "error not a number: " + kv;
    }
  }
  return "ok " + line;
}

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--plain") {
    if (argc < 3) die("--plain needs interface names");
    return make_plain(std::vector<std::string>(argv + 2, argv + argc));
  }
  if (argc < 2) die("usage: conveyor-netns-relay LINK=IFA,IFB ... | --plain IFNAME...");
  std::map<std::string, Link> links;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('='), comma = arg.find(',');
    if (eq == std::string::npos || comma == std::string::npos || comma < eq)
      die("'" + arg + "' is not LINK=IFA,IFB");
    Link link;
    link.name = arg.substr(0, eq);
    link.if_a = arg.substr(eq + 1, comma - eq - 1);
    link.if_b = arg.substr(comma + 1);
    if (links.count(link.name)) die("link '" + link.name + "' given twice");
    links[link.name] = std::move(link);
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  if (::sigaction(SIGTERM, &sa, nullptr) != 0 || ::sigaction(SIGINT, &sa, nullptr) != 0) die(errno_text("sigaction"));
  std::signal(SIGPIPE, SIG_IGN);

  // poll slots: stdin, then two per link.
  std::vector<pollfd> fds{{0, POLLIN, 0}};
  std::vector<std::pair<Link*, Direction*>> owner{{nullptr, nullptr}};
  for (auto& [name, link] : links) {
    const int a = packet_socket(link.if_a), b = packet_socket(link.if_b);
    link.a_to_b.in = a, link.a_to_b.out = b;
    link.b_to_a.in = b, link.b_to_a.out = a;
    fds.push_back({a, POLLIN, 0});
    owner.push_back({&link, &link.a_to_b});
    fds.push_back({b, POLLIN, 0});
    owner.push_back({&link, &link.b_to_a});
  }
  if (::fcntl(0, F_SETFL, ::fcntl(0, F_GETFL) | O_NONBLOCK) != 0) die(errno_text("fcntl(stdin)"));
  std::printf("relay: ready\n");
  std::fflush(stdout);

  std::mt19937_64 rng(0xC0FFEE);
  std::vector<uint8_t> buf(kMaxFrame);
  std::string pending;
  while (!g_stop) {
    // Sleep until the next frame is due (at most 50 ms: a changed setting applies soon).
    auto now = Clock::now();
    auto wake = now + std::chrono::milliseconds(50);
    for (auto& [name, link] : links)
      for (Direction* d : {&link.a_to_b, &link.b_to_a})
        if (!d->line.empty()) wake = std::min(wake, d->line.front().due);
    const int timeout_ms =
        int(std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(wake - now).count()));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) die(errno_text("poll"));
    if (ready > 0) {
      if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
        char chunk[4096];
        const ssize_t n = ::read(0, chunk, sizeof(chunk));
        if (n == 0) break;  // the harness is gone
        if (n < 0 && errno != EAGAIN && errno != EINTR) die(errno_text("read(stdin)"));
        if (n > 0) pending.append(chunk, size_t(n));
        for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
          const std::string reply = command(links, pending.substr(0, nl));
          pending.erase(0, nl + 1);
          std::printf("%s\n", reply.c_str());
          std::fflush(stdout);
        }
      }
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents & (POLLIN | POLLERR)) read_side(*owner[i].first, *owner[i].second, rng, buf);
    }
    now = Clock::now();
    for (auto& [name, link] : links) {
      flush_due(link, link.a_to_b, now);
      flush_due(link, link.b_to_a, now);
    }
  }
  return 0;
}

#include "transport/endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace conveyor::transport {

namespace {

// A socket closed when it goes out of scope.
struct Socket {
  int fd = -1;
  explicit Socket(int type) : fd(::socket(AF_INET, type | SOCK_CLOEXEC, 0)) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
};

Expected<sockaddr_in> socket_address(const HostPort& to) {
  auto addrs = resolve_ipv4(to.host);
  if (!addrs) return addrs.status();
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(to.port));
  a.sin_addr = addrs->front();
  return a;
}

std::string lower_first(std::string s) {
  if (!s.empty() && s[0] >= 'A' && s[0] <= 'Z') s[0] = char(s[0] - 'A' + 'a');
  return s;
}

}  // namespace

Expected<HostPort> parse_host_port(const std::string& endpoint) {
  std::string rest = endpoint;
  if (rest.rfind("tcp://", 0) == 0) rest = rest.substr(6);
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos)
    return Status::error("'" + endpoint + "' has no port: give HOST:PORT (for example 127.0.0.1:5555)");
  HostPort hp{.host = rest.substr(0, colon), .port = 0};
  const std::string port = rest.substr(colon + 1);
  if (hp.host.empty()) return Status::error("'" + endpoint + "' has no host before its port");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port) < 1 || std::stoi(port) > 65535)
    return Status::error("'" + endpoint + "': the port '" + port + "' is not a number in 1..65535");
  hp.port = std::stoi(port);
  return hp;
}

Expected<std::vector<in_addr>> resolve_ipv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* raw = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &raw); rc != 0)
    return Status::error("cannot resolve '" + host + "' to an IPv4 address: " + ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(raw, &::freeaddrinfo);
  std::vector<in_addr> out;
  for (const addrinfo* a = list.get(); a; a = a->ai_next)
    if (a->ai_family == AF_INET) out.push_back(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr);
  if (out.empty()) return Status::error("'" + host + "' resolves to no IPv4 address");
  return out;
}

Expected<std::string> resolve_host(const std::string& host) {
  auto addrs = resolve_ipv4(host);
  if (!addrs) return addrs.status();
  char buf[INET_ADDRSTRLEN] = {};
  if (!::inet_ntop(AF_INET, &addrs->front(), buf, sizeof(buf))) return Status::error("inet_ntop failed");
  return std::string(buf);
}

Expected<std::string> local_address_toward(const HostPort& to) {
  auto peer = socket_address(to);
  if (!peer) return peer.status();
  Socket s(SOCK_DGRAM);
  if (s.fd < 0) return Status::error(std::string("socket: ") + std::strerror(errno));
  // A UDP connect sends nothing: it only asks the routing table which address leaves for `to`.
  if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&*peer), sizeof(*peer)) != 0)
    return Status::error("no route to " + to.text() + ": " + lower_first(std::strerror(errno)));
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  if (::getsockname(s.fd, reinterpret_cast<sockaddr*>(&local), &len) != 0)
    return Status::error(std::string("getsockname: ") + std::strerror(errno));
  char buf[INET_ADDRSTRLEN] = {};
  if (!::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf))) return Status::error("inet_ntop failed");
  return std::string(buf);
}

Status probe_tcp(const HostPort& to, std::chrono::milliseconds timeout) {
  auto peer = socket_address(to);
  if (!peer) return peer.status();
  Socket s(SOCK_STREAM);
  if (s.fd < 0) return Status::error(std::string("socket: ") + std::strerror(errno));
  ::fcntl(s.fd, F_SETFL, ::fcntl(s.fd, F_GETFL) | O_NONBLOCK);
  if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&*peer), sizeof(*peer)) == 0) return ok_status();
  if (errno != EINPROGRESS) return Status::error(lower_first(std::strerror(errno)));
  pollfd p{s.fd, POLLOUT, 0};
  const int r = ::poll(&p, 1, int(timeout.count()));
  if (r == 0) return Status::error("no answer within " + std::to_string(timeout.count()) + " ms");
  int err = 0;
  socklen_t len = sizeof(err);
  if (r < 0 || ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  return err == 0 ? ok_status() : Status::error(lower_first(std::strerror(err)));
}

}  // namespace conveyor::transport

#include "transport/net_interface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <vector>

namespace conveyor::transport {

namespace {

// The IPv4 addresses `host` resolves to (numeric or by name), in resolver order.
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

std::string text(in_addr a) {
  char buf[INET_ADDRSTRLEN] = {};
  return ::inet_ntop(AF_INET, &a, buf, sizeof(buf)) ? buf : "?";
}

}  // namespace

bool is_wildcard_host(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "*" || host == "::"; }

bool is_loopback_host(const std::string& host) {
  auto addrs = resolve_ipv4(host);
  if (!addrs) return false;
  for (in_addr a : *addrs)
    if ((ntohl(a.s_addr) >> 24) == 127) return true;
  return false;
}

Expected<std::string> interface_with_address(const std::string& host) {
  auto addrs = resolve_ipv4(host);
  if (!addrs) return addrs.status();
  ifaddrs* raw = nullptr;
  if (::getifaddrs(&raw) != 0) return Status::error(std::string("getifaddrs: ") + std::strerror(errno));
  std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> list(raw, &::freeifaddrs);
  for (in_addr want : *addrs)
    for (const ifaddrs* i = list.get(); i; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
          reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want.s_addr)
        return std::string(i->ifa_name);
  std::string resolved, held;
  for (in_addr a : *addrs) resolved += (resolved.empty() ? "" : ", ") + text(a);
  for (const ifaddrs* i = list.get(); i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET)
      held += (held.empty() ? "" : ", ") + std::string(i->ifa_name) + " " +
              text(reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr);
  return Status::error("'" + host + "' (" + resolved + ") is not an address of this host (its interfaces: " +
                       (held.empty() ? "none with IPv4" : held) + ")");
}

Expected<std::string> data_plane_interface(const std::string& host) {
  if (is_wildcard_host(host) || is_loopback_host(host)) return std::string();
  return interface_with_address(host);
}

}  // namespace conveyor::transport

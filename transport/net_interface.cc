#include "transport/net_interface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <vector>

#include "common/options.h"
#include "transport/endpoint.h"

namespace conveyor::transport {

namespace {

std::string text(in_addr a) {
  char buf[INET_ADDRSTRLEN] = {};
  return ::inet_ntop(AF_INET, &a, buf, sizeof(buf)) ? buf : "?";
}

using IfaddrsList = std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)>;

Expected<IfaddrsList> list_interfaces() {
  ifaddrs* raw = nullptr;
  if (::getifaddrs(&raw) != 0) return Status::error(std::string("getifaddrs: ") + std::strerror(errno));
  return IfaddrsList(raw, &::freeifaddrs);
}

// "eth0, lo": every interface's name once, for messages.
std::string interface_names(const ifaddrs* list) {
  std::set<std::string> names;
  for (const ifaddrs* i = list; i; i = i->ifa_next) names.insert(i->ifa_name);
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
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
  auto interfaces = list_interfaces();
  if (!interfaces) return interfaces.status();
  const IfaddrsList& list = *interfaces;
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

Expected<std::string> loopback_interface() {
  auto interfaces = list_interfaces();
  if (!interfaces) return interfaces.status();
  const ifaddrs* down = nullptr;
  for (const ifaddrs* i = interfaces->get(); i; i = i->ifa_next) {
    if (!(i->ifa_flags & IFF_LOOPBACK)) continue;
    if (i->ifa_flags & IFF_UP) return std::string(i->ifa_name);
    if (!down) down = i;
  }
  if (down) return Status::error("the loopback interface " + std::string(down->ifa_name) + " is down");
  return Status::error("this host has no loopback interface (its interfaces: " + interface_names(interfaces->get()) +
                       ")");
}

Expected<std::string> data_plane_interface(const std::string& host) {
  if (is_wildcard_host(host)) return std::string();
  if (is_loopback_host(host)) {
    auto lo = loopback_interface();
    if (!lo) return Status::error("'" + host + "' is a loopback address, but " + lo.error());
    return lo;
  }
  return interface_with_address(host);
}

Expected<DataInterface> choose_data_interface(const std::string& host, const std::string& requested,
                                              const std::optional<HostPort>& toward) {
  if (const auto env = ucx_variable(UcxVariable::NetDevices); env && !env->empty())
    return DataInterface{.net_devices = "", .shown = *env, .source = "UCX_NET_DEVICES"};
  if (!requested.empty()) {
    if (requested == "any" || requested == "all")
      return DataInterface{.net_devices = "", .shown = "any", .source = "--data-interface"};
    // UCX_NET_DEVICES's syntax: names separated by commas; "mlx5_0:1" (an RDMA device and
    // port) and a leading "^" (all but these) are UCX's to judge.
    if (requested.back() == ',') return Status::error("--data-interface '" + requested + "': an empty name");
    if (requested[0] != '^') {
      std::stringstream items(requested);
      for (std::string item; std::getline(items, item, ',');) {
        if (item.empty()) return Status::error("--data-interface '" + requested + "': an empty name");
        if (item.find(':') != std::string::npos) continue;
        if (::if_nametoindex(item.c_str()) == 0) {
          auto interfaces = list_interfaces();
          return Status::error("--data-interface '" + requested + "': this host has no interface '" + item +
                               "' (its interfaces: " +
                               (interfaces ? interface_names(interfaces->get()) : interfaces.error()) + ")");
        }
      }
    }
    return DataInterface{.net_devices = requested, .shown = requested, .source = "--data-interface"};
  }
  if (is_wildcard_host(host) && toward) {
    auto local = local_address_toward(*toward);
    if (!local) return local.status();
    auto iface = data_plane_interface(*local);
    if (!iface) return Status::error("the route to " + toward->text() + " leaves from " + *local + ": " + iface.error());
    return DataInterface{.net_devices = *iface, .shown = *iface,
                         .source = "route to " + toward->text() + " (address " + *local + ")"};
  }
  auto iface = data_plane_interface(host);
  if (!iface) return iface.status();
  if (iface->empty())
    return DataInterface{.net_devices = "",
                         .shown = "any",
                         .source = host.empty() ? "no address given" : "wildcard address " + host};
  return DataInterface{.net_devices = *iface, .shown = *iface, .source = "address " + host};
}

}  // namespace conveyor::transport

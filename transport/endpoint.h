// Where a daemon's peer is on the network, and whether it answers: the coordinator's control
// endpoint as a worker is given it (`--coordinator HOST:PORT` or `tcp://HOST:PORT`).
//
// A worker resolves that name once at start (a name that does not resolve is a fatal error
// that names it), keeps its data plane on the interface its route to the coordinator leaves
// by (net_interface.h), and while the coordinator does not answer, says why in terms an
// operator can act on: "connection refused", "no route to host", "timed out".
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

struct HostPort {
  std::string host;  // a name or an IPv4 address, as given
  int port = 0;
  std::string text() const { return host + ":" + std::to_string(port); }
};

// "HOST:PORT" or "tcp://HOST:PORT" -> its parts. An error names the endpoint and what is wrong
// (no port, a port outside 1..65535, an empty host).
Expected<HostPort> parse_host_port(const std::string& endpoint);

// The IPv4 addresses `host` (a name or a numeric address) resolves to, in resolver order. An
// error names the host and the resolver's reason ("Name or service not known").
Expected<std::vector<in_addr>> resolve_ipv4(const std::string& host);

// The first of them, as text ("10.0.0.7").
Expected<std::string> resolve_host(const std::string& host);

// This host's address on the route to `to` (UDP connect, then getsockname: nothing is sent):
// "127.0.0.1" towards a loopback address, the address of the interface the kernel's routing
// table picks otherwise. An error names the peer and why (no route, unresolvable).
Expected<std::string> local_address_toward(const HostPort& to);

// Whether a TCP connection to `to` opens within `timeout` (then closed at once). The error
// is the reason in plain words: "connection refused", "no route to host", "no answer within
// 1000 ms", or the resolver's.
Status probe_tcp(const HostPort& to, std::chrono::milliseconds timeout);

}  // namespace conveyor::transport

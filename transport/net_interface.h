// Which network interface a daemon's data plane (UCX) uses. A daemon that knows its address
// on the cluster network (`conveyor-worker --host`, the coordinator's control.host, both
// 127.0.0.1 under `conveyor local`) keeps its data plane on the interface holding that
// address, so that no peer is offered an address it cannot reach and no stray interface (a
// container bridge that comes and goes) is ever picked: loopback `lo` for a loopback
// address, "eth0" for an address on eth0. A worker given no address (no `--host`) takes the
// one its route to the coordinator leaves from (endpoint.h, local_address_toward): the
// interface its control connection uses. Only a wildcard address with no peer to route to
// (a coordinator's control.host 0.0.0.0) leaves the choice to UCX (every interface). The
// operator's UCX_NET_DEVICES, or a daemon's explicit `--data-interface`, wins over both.
#pragma once

#include <optional>
#include <string>

#include "common/status.h"
#include "transport/endpoint.h"

namespace conveyor::transport {

// True for "", "0.0.0.0", "*" and "::": bind every interface.
bool is_wildcard_host(const std::string& host);

// The name of the interface ("eth0") holding `host`, an IPv4 address or a name that resolves
// to one (the first resolved address held by an interface wins). An error names the host,
// what it resolved to and the interfaces' addresses when none of them holds it.
Expected<std::string> interface_with_address(const std::string& host);

// True when `host` resolves to a loopback address (127.0.0.0/8).
bool is_loopback_host(const std::string& host);

// The name of this host's loopback interface ("lo"): the first one up with IFF_LOOPBACK.
Expected<std::string> loopback_interface();

// The interface a daemon at `host` keeps its data plane on: "" for a wildcard host (every
// interface, UCX's choice); the loopback interface ("lo") for any loopback address
// (127.0.0.0/8 is all on it, though only 127.0.0.1 is listed); else
// interface_with_address(host).
Expected<std::string> data_plane_interface(const std::string& host);

// What a daemon's data plane uses, and why; printed by --check and logged at start-up.
struct DataInterface {
  // For UcxChannelOptions::net_devices: "lo", "eth0", "mlx5_0:1,ib0" (UCX_NET_DEVICES's
  // syntax); "" to leave it to UCX (every interface) or to the environment's UCX_NET_DEVICES.
  std::string net_devices;
  // What is used: net_devices, UCX_NET_DEVICES's value when that is set, else "any".
  std::string shown;
  // Why: "UCX_NET_DEVICES", "--data-interface", "address 127.0.0.1", "route to
  // 10.0.0.1:5555 (address 10.0.0.7)", "wildcard address 0.0.0.0", "no address given".
  std::string source;
};

// The choice, in this order: the environment's UCX_NET_DEVICES when set (UcxChannel leaves
// it alone); then `requested` when not empty (a daemon's --data-interface: "any" for every
// interface, else UCX_NET_DEVICES's syntax, each plain interface name checked to exist);
// then, for a wildcard `host` with a peer `toward` (a worker's coordinator), the interface of
// local_address_toward(toward); else data_plane_interface(host). Errors name the address,
// peer or interface and why.
Expected<DataInterface> choose_data_interface(const std::string& host, const std::string& requested = "",
                                              const std::optional<HostPort>& toward = std::nullopt);

}  // namespace conveyor::transport

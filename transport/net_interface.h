// Which network interface of this host carries a given address: how a daemon told its
// address on the cluster network (`conveyor-worker --host`, the coordinator's control.host)
// keeps its data plane on that interface alone, so that no peer is offered a loopback or
// private address it cannot reach.
#pragma once

#include <string>

#include "common/status.h"

namespace conveyor::transport {

// True for "", "0.0.0.0", "*" and "::": bind every interface.
bool is_wildcard_host(const std::string& host);

// The name of the interface ("eth0") holding `host`, an IPv4 address or a name that resolves
// to one (the first resolved address held by an interface wins). An error names the host,
// what it resolved to and the interfaces' addresses when none of them holds it.
Expected<std::string> interface_with_address(const std::string& host);

// True when `host` resolves to a loopback address (127.0.0.0/8).
bool is_loopback_host(const std::string& host);

// The interface a daemon at `host` keeps its data plane on (UcxChannelOptions::net_devices):
// "" for a wildcard or a loopback host (every interface, UCX's choice: one machine), else
// interface_with_address(host).
Expected<std::string> data_plane_interface(const std::string& host);

}  // namespace conveyor::transport

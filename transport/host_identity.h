// Who a process is on its host, for channels that talk over shared memory with the processes
// of their own host (UcxChannelOptions::host_shared_memory): the host's boot id, the process's
// network and IPC namespaces, its user, its id and its start time. Two channels share memory
// when boot id, both namespaces and the user agree: processes in other namespaces (containers,
// or the netns tests' simulated nodes) count as other hosts, and another user's process may
// neither be read by cma nor, under hidepid, be seen in /proc (the two ends must decide alike). A process id names the process that published it when
// /proc/<pid>/stat's start time agrees (a reused pid, or one seen from another pid namespace,
// does not).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace conveyor::transport {

struct HostIdentity {
  std::array<std::uint8_t, 16> boot_id{};  // /proc/sys/kernel/random/boot_id
  std::uint32_t pid = 0;
  std::uint64_t start_ticks = 0;  // /proc/<pid>/stat's starttime: clock ticks after boot
  std::uint64_t net_ns = 0, ipc_ns = 0;  // the inodes of /proc/self/ns/net and /proc/self/ns/ipc
  std::uint32_t uid = 0;                 // the real user id

  bool same_host(const HostIdentity& o) const {
    return boot_id == o.boot_id && net_ns == o.net_ns && ipc_ns == o.ipc_ns && uid == o.uid;
  }
};

inline constexpr std::size_t kHostIdentityBytes = 16 + 4 + 8 + 8 + 8 + 4;

// This process's identity.
Expected<HostIdentity> this_process_identity();

// A pidfd (pidfd_open: readable once the process has exited) on the process `who` names, when
// it runs on the host of `me` (this process's identity) and is that process; the caller owns
// the descriptor. An error names why not (another host, no such process, another process with
// that pid, no pidfd_open).
Expected<int> open_process(const HostIdentity& me, const HostIdentity& who);

// The start time of process `pid` as /proc/<pid>/stat gives it.
Expected<std::uint64_t> process_start_ticks(std::uint32_t pid);

}  // namespace conveyor::transport

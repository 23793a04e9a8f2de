// A data-plane failure with both processes alive: every established TCP connection between
// two processes reset by the kernel (`ss -K`, iproute2). Used by the failover tests and by
// conveyor-bench-soak.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace conveyor::cluster_test {

// Resets every TCP connection between the processes `a` and `b` except those to `keep_port`
// (`ss -K`: a data-plane failure with both processes alive). Returns how many it reset.
inline int reset_connections(pid_t a, pid_t b, int keep_port) {
  // (local, peer) -> pid: a connection's other end is the socket whose local and peer are this
  // one's peer and local. Keyed by its local address alone, two sockets could collide: Linux
  // gives two outgoing connections the same local port when their destinations differ, so a
  // REST client's connection to `a` could pass for one of `b`'s (the likely cause of one
  // failure: a request of the load read "Connection reset by peer").
  std::map<std::pair<std::string, std::string>, pid_t> owner;
  std::vector<std::pair<std::string, std::string>> of_a;  // (local, peer) of a's sockets
  FILE* p = ::popen("ss -tnpH state established 2>/dev/null", "r");
  if (!p) return -1;
  char buf[1024];
  const std::regex pid_re("pid=([0-9]+)");
  while (std::fgets(buf, sizeof buf, p)) {
    std::istringstream line(buf);
    std::string recvq, sendq, local, peer;
    line >> recvq >> sendq >> local >> peer;
    std::smatch m;
    const std::string rest(buf);
    if (!std::regex_search(rest, m, pid_re)) continue;
    const pid_t pid = pid_t(std::stol(m[1]));
    owner[{local, peer}] = pid;
    if (pid == a) of_a.emplace_back(local, peer);
  }
  ::pclose(p);
  int n = 0;
  auto port = [](const std::string& addr) { return addr.substr(addr.rfind(':') + 1); };
  for (const auto& [local, peer] : of_a) {
    const auto other = owner.find({peer, local});
    if (other == owner.end() || other->second != b) continue;
    if (port(local) == std::to_string(keep_port) || port(peer) == std::to_string(keep_port)) continue;
    const std::string cmd = "ss -K -tn state established src " + local.substr(0, local.rfind(':')) + " sport = :" +
                            port(local) + " dst " + peer.substr(0, peer.rfind(':')) + " dport = :" + port(peer) +
                            " >/dev/null 2>&1";
    n += std::system(cmd.c_str()) == 0;
  }
  return n;
}

}  // namespace conveyor::cluster_test

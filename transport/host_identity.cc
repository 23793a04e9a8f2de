#include "transport/host_identity.h"

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace conveyor::transport {

namespace {

Expected<std::array<std::uint8_t, 16>> read_boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string text;
  if (!(in >> text)) return Status::error("cannot read /proc/sys/kernel/random/boot_id");
  std::array<std::uint8_t, 16> id{};
  size_t n = 0;
  for (size_t i = 0; i + 1 < text.size() && n < id.size();) {
    if (text[i] == '-') {
      ++i;
      continue;
    }
    const std::string byte = text.substr(i, 2);
    char* end = nullptr;
    const unsigned long v = std::strtoul(byte.c_str(), &end, 16);
    if (end != byte.c_str() + 2) return Status::error("boot_id '" + text + "' is not a UUID");
    id[n++] = std::uint8_t(v);
    i += 2;
  }
  if (n != id.size()) return Status::error("boot_id '" + text + "' is not a UUID");
  return id;
}

}  // namespace

Expected<std::uint64_t> process_start_ticks(std::uint32_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so fields count from the
  // last ')'. starttime is field 22 overall, the 20th after comm.
  const size_t close = stat.rfind(')');
  if (stat.empty() || close == std::string::npos) return Status::error("no process " + std::to_string(pid));
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 0; i < 20; ++i)
    if (!(fields >> field)) return Status::error("/proc/" + std::to_string(pid) + "/stat is short");
  return std::uint64_t(std::strtoull(field.c_str(), nullptr, 10));
}

Expected<HostIdentity> this_process_identity() {
  HostIdentity me;
  auto boot = read_boot_id();
  if (!boot) return boot.status();
  me.boot_id = *boot;
  me.pid = std::uint32_t(::getpid());
  me.uid = std::uint32_t(::getuid());
  auto start = process_start_ticks(me.pid);
  if (!start) return start.status();
  me.start_ticks = *start;
  for (auto [path, field] : {std::pair{"/proc/self/ns/net", &me.net_ns}, std::pair{"/proc/self/ns/ipc", &me.ipc_ns}}) {
    struct stat st {};
    if (::stat(path, &st) != 0) return Status::error(std::string("stat ") + path + ": " + std::strerror(errno));
    *field = std::uint64_t(st.st_ino);
  }
  return me;
}

Expected<int> open_process(const HostIdentity& me, const HostIdentity& who) {
  if (!me.same_host(who)) return Status::error("another host, other network or IPC namespaces, or another user");
  const int fd = int(::syscall(SYS_pidfd_open, pid_t(who.pid), 0));
  if (fd < 0) return Status::error("pidfd_open(" + std::to_string(who.pid) + "): " + std::strerror(errno));
  // Checked after the pidfd is open, so the descriptor is on the process whose start time agrees.
  auto start = process_start_ticks(who.pid);
  if (!start || *start != who.start_ticks) {
    ::close(fd);
    return Status::error("process " + std::to_string(who.pid) + " here is not the one that published the address");
  }
  return fd;
}

}  // namespace conveyor::transport

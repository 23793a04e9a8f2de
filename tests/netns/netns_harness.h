// Several "nodes" on one machine: each node is a network namespace of its own, with one
// interface (eth0) and its own address, joined to a bridge in the root namespace. Between a
// node's eth0 and the bridge sits its wire, the relay (conveyor-netns-relay), which can
// delay, drop at random or hide chosen addresses (a partition); `tc tbf` on both ends of the
// wire gives it a fabric's bandwidth, and `ip link set ... down` cuts it.
//
//   node ns:  eth0 (10.A.B.i) ==veth== cvPa<i> --relay-- cvPb<i> ==veth== cvPp<i> -- bridge cvPbr
//   root ns:  bridge cvPbr (10.A.B.254): the test's own clients reach the nodes through it
//
// P is this test process's pid, in every name (namespaces "conveyor-P-<node>"), so parallel
// runs never collide; names of a pid no longer alive are swept when a topology is made.
// Everything is torn down by the destructor, on every path, each step bounded in time: the
// processes inside the namespaces (by their pid), the relay, the namespaces, the veths, the
// bridge. Needs root and iproute2; `netns_unavailable()` says why not, for GTEST_SKIP.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor::netns_test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

inline std::string errno_text(const std::string& call) { return call + ": " + std::strerror(errno); }

// The full path of `name` in PATH or the sbin folders, or "".
inline std::string find_program(const std::string& name) {
  std::string dirs = std::getenv("PATH") ? std::getenv("PATH") : "";
  dirs += ":/usr/sbin:/sbin:/usr/local/sbin:/usr/bin:/bin";
  std::stringstream ss(dirs);
  for (std::string d; std::getline(ss, d, ':');)
    if (!d.empty() && ::access((fs::path(d) / name).c_str(), X_OK) == 0) return (fs::path(d) / name).string();
  return "";
}

inline std::string relay_path() { return std::string(CONVEYOR_BINARY_DIR) + "/tests/conveyor-netns-relay"; }

// ---------------------------------------------------------------------------- processes

// A process, in a network namespace or the root one: its own process group, stdout to a
// pipe the test reads (and to `log`), stderr to `log`, stdin from a pipe when asked (the
// relay's commands) or /dev/null; killed with its group when the object goes, and by the
// kernel if the test dies (PR_SET_PDEATHSIG).
class Process {
 public:
  // `netns`: the namespace's name ("" for the root namespace). Null, with `error` set, when
  // it cannot be started.
  static std::unique_ptr<Process> start(const std::string& netns, const std::vector<std::string>& argv,
                                        const std::string& log, bool with_stdin, std::string& error,
                                        const std::vector<std::string>& env = {}) {
    int ns_fd = -1;
    if (!netns.empty()) {
      ns_fd = ::open(("/run/netns/" + netns).c_str(), O_RDONLY | O_CLOEXEC);
      if (ns_fd < 0) {
        error = errno_text("open /run/netns/" + netns);
        return nullptr;
      }
    }
    int out[2] = {-1, -1}, in[2] = {-1, -1};
    const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    auto close_all = [&] {
      for (int fd : {ns_fd, out[0], out[1], in[0], in[1], log_fd})
        if (fd >= 0) ::close(fd);
    };
    if (log_fd < 0 || ::pipe2(out, O_CLOEXEC) != 0 || (with_stdin && ::pipe2(in, O_CLOEXEC) != 0)) {
      error = errno_text("open " + log + " / pipe2");
      close_all();
      return nullptr;
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.push_back(*e);
    env_strings.insert(env_strings.end(), env.begin(), env.end());
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {  // async-signal-safe calls only, up to exec
      const int null_fd = with_stdin ? -1 : ::open("/dev/null", O_RDONLY);
      if (::setpgid(0, 0) != 0 || ::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(126);
      if (ns_fd >= 0 && ::setns(ns_fd, CLONE_NEWNET) != 0) ::_exit(125);
      if (::dup2(with_stdin ? in[0] : null_fd, 0) < 0 || ::dup2(out[1], 1) < 0 || ::dup2(log_fd, 2) < 0) ::_exit(124);
      ::execve(args[0], args.data(), envp.data());
      ::_exit(127);
    }
    const int fork_errno = errno;
    if (pid < 0) {
      error = "fork: " + std::string(std::strerror(fork_errno));
      close_all();
      return nullptr;
    }
    auto p = std::unique_ptr<Process>(new Process(pid, argv[0], log));
    p->out_ = out[0];
    out[0] = -1;
    if (with_stdin) {
      p->in_ = in[1];
      in[1] = -1;
    }
    close_all();
    ::fcntl(p->out_, F_SETFL, ::fcntl(p->out_, F_GETFL) | O_NONBLOCK);
    return p;
  }
  ~Process() {
    stop(milliseconds(3000));
    if (out_ >= 0) ::close(out_);
    if (in_ >= 0) ::close(in_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  bool alive() { return testing::child_running(pid_); }
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  // SIGTERM to the group, SIGKILL to it after `grace`; reaps the process.
  void stop(milliseconds grace) {
    if (!alive()) return;
    const pid_t group = pid_;
    ::kill(-group, SIGTERM);
    const auto deadline = Clock::now() + grace;
    while (alive() && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(10));
    ::kill(-group, SIGKILL);
    const auto hard = Clock::now() + seconds(5);
    while (alive() && Clock::now() < hard) std::this_thread::sleep_for(milliseconds(10));
  }
  // The next stdout line containing `pattern` (lines before it are consumed); "" at the
  // deadline or when the process ends first.
  std::string read_line_matching(const std::string& pattern, milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      for (size_t nl; (nl = buffer_.find('\n')) != std::string::npos;) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (line.find(pattern) != std::string::npos) return line;
      }
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return "";
      pollfd p{out_, POLLIN, 0};
      const int r = ::poll(&p, 1, int(std::min<int64_t>(left, 100)));
      if (r > 0) {
        char chunk[4096];
        const ssize_t n = ::read(out_, chunk, sizeof(chunk));
        if (n > 0) buffer_.append(chunk, size_t(n));
        else if (n == 0) return "";  // the process closed its stdout: ended
      }
    }
  }
  // What it has written to stdout and nobody read yet (does not wait).
  std::string drain() {
    char chunk[4096];
    for (ssize_t n; (n = ::read(out_, chunk, sizeof(chunk))) > 0;) buffer_.append(chunk, size_t(n));
    std::string out;
    out.swap(buffer_);
    return out;
  }
  // Writes a line to its stdin; false when it cannot.
  bool write_line(const std::string& line) {
    const std::string s = line + "\n";
    size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = ::write(in_, s.data() + done, s.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += size_t(n);
    }
    return true;
  }
  const std::string& log() const { return log_; }

 private:
  Process(pid_t pid, std::string name, std::string log) : pid_(pid), name_(std::move(name)), log_(std::move(log)) {}
  pid_t pid_;
  std::string name_, log_;
  int out_ = -1, in_ = -1;
  std::string buffer_;
};

// Runs a command to its end, bounded by `limit` (then SIGKILL); rc -1 when it did not exit.
struct CommandResult {
  int rc = -1;
  std::string output;  // stdout and stderr
};
inline CommandResult run_command(const std::vector<std::string>& argv, milliseconds limit = milliseconds(10000)) {
  CommandResult r;
  char path[] = "/tmp/conveyor-netns-cmd-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) {
    r.output = errno_text("mkstemp");
    return r;
  }
  ::close(fd);
  std::string error;
  {
    auto p = Process::start("", argv, path, false, error);
    if (!p) {
      r.output = error;
      ::unlink(path);
      return r;
    }
    const auto deadline = Clock::now() + limit;
    int status = 0;
    pid_t got = 0;
    std::string out;
    while ((got = ::waitpid(p->pid(), &status, WNOHANG)) == 0 && Clock::now() < deadline) {
      out += p->drain();  // stdout goes to a pipe: keep it from filling
      std::this_thread::sleep_for(milliseconds(2));
    }
    out += p->drain();
    if (got == p->pid() && WIFEXITED(status)) r.rc = WEXITSTATUS(status);
    if (got != p->pid()) r.output = "(killed after " + std::to_string(limit.count()) + " ms) ";
    r.output += out;
  }
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output += ss.str();
  ::unlink(path);
  return r;
}

inline ::testing::AssertionResult ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {find_program("ip")};
  argv.insert(argv.end(), args.begin(), args.end());
  const CommandResult r = run_command(argv);
  if (r.rc == 0) return ::testing::AssertionSuccess();
  std::string line;
  for (const auto& a : argv) line += a + " ";
  return ::testing::AssertionFailure() << line << "failed (" << r.rc << "): " << r.output;
}

// Why this machine cannot run namespace tests, or "" when it can: root, iproute2, tc, the
// relay, and a namespace and a veth pair that can really be made.
inline std::string netns_unavailable() {
  if (::geteuid() != 0) return "network namespaces need root";
  for (const char* p : {"ip", "tc"})
    if (find_program(p).empty()) return std::string(p) + " is not installed (iproute2; scripts/setup.sh installs it)";
  if (::access(relay_path().c_str(), X_OK) != 0) return relay_path() + " is not built";
  const std::string probe = "conveyor-" + std::to_string(::getpid()) + "-probe";
  auto made = ip({"netns", "add", probe});
  if (!made) return std::string("cannot make a network namespace: ") + made.message();
  const std::string va = "cv" + std::to_string(::getpid()) + "x", vb = va + "y";
  auto veth = ip({"link", "add", va, "type", "veth", "peer", "name", vb});
  std::string why;
  if (!veth) why = std::string("cannot make a veth pair: ") + veth.message();
  else (void)ip({"link", "del", va});
  (void)ip({"netns", "del", probe});
  return why;
}

// ------------------------------------------------------------------------------ topology

struct Node {
  std::string name;    // as the operator's inventory names it ("coord", "n1", ...)
  std::string netns;   // conveyor-PID-NAME
  std::string address; // on eth0
  std::string wire_node_side, wire_bridge_side, bridge_port;  // root-namespace interfaces
};

// The link a fault is applied to, as the relay and tc see it.
struct LinkShape {
  double delay_ms = 0;
  double loss = 0;
  std::vector<std::string> blocked;  // addresses hidden from the node (a partition)
};

class Topology {
 public:
  Topology() = default;
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;
  ~Topology() { teardown(); }

  // Makes one namespace per name, each with its wire (relay) to one bridge, and writes the
  // inventory (name, address, namespace: one line each) to `dir`/nodes.txt. `rate`: tbf's
  // rate on both ends of every wire ("10gbit"; "" for none).
  ::testing::AssertionResult create(const fs::path& dir, const std::vector<std::string>& names,
                                    const std::string& rate = "10gbit") {
    dir_ = dir;
    sweep_stale();
    // The pid, then this topology's number in the process (a namespace being destroyed by
    // the kernel may still hold the names of the one before).
    static std::atomic<int> made{0};
    const std::string pid = std::to_string(::getpid()) + "t" + std::to_string(made++ % 100);
    if (auto r = pick_subnet(); !r) return r;
    bridge_ = "cv" + pid + "br";
    if (auto r = ip({"link", "add", bridge_, "type", "bridge"}); !r) return r;
    made_bridge_ = true;
    if (auto r = ip({"addr", "add", host_address_ + "/24", "dev", bridge_}); !r) return r;
    if (auto r = ip({"link", "set", bridge_, "up"}); !r) return r;
    std::vector<std::string> relay_args = {relay_path()};
    for (size_t i = 0; i < names.size(); ++i) {
      Node n;
      n.name = names[i];
      n.netns = "conveyor-" + pid + "-" + names[i];  // "conveyor-PIDtN-name"
      n.address = subnet_ + "." + std::to_string(i + 1);
      const std::string k = std::to_string(i);
      if (names.size() > 10) return ::testing::AssertionFailure() << "at most 10 nodes (interface names are short)";
      n.wire_node_side = "cv" + pid + "a" + k;
      n.wire_bridge_side = "cv" + pid + "b" + k;
      n.bridge_port = "cv" + pid + "p" + k;
      const std::string inside = "cv" + pid + "e" + k;
      if (auto r = ip({"netns", "add", n.netns}); !r) return r;
      nodes_.push_back(n);
      for (const auto& cmd : std::vector<std::vector<std::string>>{
               {"link", "add", n.wire_node_side, "type", "veth", "peer", "name", inside},
               {"link", "set", inside, "netns", n.netns},
               {"-n", n.netns, "link", "set", inside, "name", "eth0"},
               {"-n", n.netns, "addr", "add", n.address + "/24", "dev", "eth0"},
               {"-n", n.netns, "link", "set", "lo", "up"},
               {"-n", n.netns, "link", "set", "eth0", "up"},
               {"link", "add", n.wire_bridge_side, "type", "veth", "peer", "name", n.bridge_port},
               {"link", "set", n.bridge_port, "master", bridge_},
               {"link", "set", n.wire_node_side, "up"},
               {"link", "set", n.wire_bridge_side, "up"},
               {"link", "set", n.bridge_port, "up"}})
        if (auto r = ip(cmd); !r) return r;
      // Whole, checksummed frames from the node, so the relay's loss is per packet.
      if (auto r = in_netns(n.netns, {relay_path(), "--plain", "eth0"}); !r) return r;
      if (!rate.empty())
        for (const auto& dev : {n.wire_node_side, n.wire_bridge_side})
          if (auto r = tc({"qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"}); !r)
            return r;
      relay_args.push_back(n.name + "=" + n.wire_node_side + "," + n.wire_bridge_side);
    }
    // The root namespace's own frames (the test's clients) enter the wires through the bridge.
    if (auto r = run_ok({relay_path(), "--plain", bridge_}); !r) return r;
    std::string error;
    relay_ = Process::start("", relay_args, (dir_ / "relay.log").string(), true, error);
    if (!relay_) return ::testing::AssertionFailure() << "cannot start the relay: " << error;
    if (relay_->read_line_matching("relay: ready", seconds(10)).empty())
      return ::testing::AssertionFailure() << "the relay did not start: " << read(dir_ / "relay.log");
    std::ofstream inv(dir_ / "nodes.txt");
    inv << "# node address netns (made by tests/netns/netns_harness.h)\n";
    for (const auto& n : nodes_) inv << n.name << " " << n.address << " " << n.netns << "\n";
    if (!inv) return ::testing::AssertionFailure() << "cannot write " << (dir_ / "nodes.txt");
    return ::testing::AssertionSuccess();
  }

  const Node& node(const std::string& name) const {
    for (const auto& n : nodes_)
      if (n.name == name) return n;
    throw std::runtime_error("no node " + name);
  }
  const std::vector<Node>& nodes() const { return nodes_; }
  pid_t relay_pid() const { return relay_ ? relay_->pid() : -1; }
  // The root namespace's address on the bridge (where the test's clients come from).
  const std::string& host_address() const { return host_address_; }

  // Cuts the node's wire (the veth at its end goes down: carrier lost on its eth0), or
  // restores it.
  ::testing::AssertionResult cut(const std::string& name) { return ip({"link", "set", node(name).wire_node_side, "down"}); }
  ::testing::AssertionResult restore(const std::string& name) { return ip({"link", "set", node(name).wire_node_side, "up"}); }

  // Sets the delay, loss and hidden addresses of the node's wire (both directions).
  ::testing::AssertionResult shape(const std::string& name, const LinkShape& s) {
    std::string blocked;
    for (const auto& b : s.blocked) blocked += (blocked.empty() ? "" : ",") + b;
    std::ostringstream cmd;
    cmd << "set " << name << " delay_ms=" << s.delay_ms << " loss=" << s.loss << " block=" << blocked;
    return relay_command(cmd.str()).first;
  }
  // The relay's counters for the node's wire: "forwarded=N lost=N blocked=N send_errors=N queued=N".
  std::map<std::string, int64_t> stats(const std::string& name) {
    std::map<std::string, int64_t> out;
    auto [ok, line] = relay_command("stats " + name);
    if (!ok) return out;
    std::istringstream in(line);
    for (std::string kv; in >> kv;)
      if (const size_t eq = kv.find('='); eq != std::string::npos) out[kv.substr(0, eq)] = std::stoll(kv.substr(eq + 1));
    return out;
  }

  // Runs a program inside the node's namespace to its end; fails with its output.
  static ::testing::AssertionResult in_netns(const std::string& netns, const std::vector<std::string>& argv) {
    std::vector<std::string> full = {find_program("ip"), "netns", "exec", netns};
    full.insert(full.end(), argv.begin(), argv.end());
    return run_ok(full);
  }

  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // Kills whatever still runs in the namespaces (by pid), then removes the relay, the
  // namespaces, the wires and the bridge. Bounded; safe to call twice.
  void teardown() {
    for (const auto& n : nodes_) {
      const CommandResult pids = run_command({find_program("ip"), "netns", "pids", n.netns}, milliseconds(5000));
      std::istringstream in(pids.output);
      for (long pid; in >> pid;)
        if (pid > 1 && pid != ::getpid()) ::kill(pid_t(pid), SIGKILL);
    }
    relay_.reset();
    for (const auto& n : nodes_) {
      (void)ip({"link", "del", n.wire_bridge_side});  // and its peer, the bridge port
      (void)ip({"link", "del", n.wire_node_side});    // and its peer, the node's eth0
      (void)ip({"netns", "del", n.netns});
    }
    nodes_.clear();
    if (made_bridge_) (void)ip({"link", "del", bridge_});
    made_bridge_ = false;
  }

 private:
  static ::testing::AssertionResult run_ok(const std::vector<std::string>& argv) {
    const CommandResult r = run_command(argv);
    if (r.rc == 0) return ::testing::AssertionSuccess();
    std::string line;
    for (const auto& a : argv) line += a + " ";
    return ::testing::AssertionFailure() << line << "failed (" << r.rc << "): " << r.output;
  }
  static ::testing::AssertionResult tc(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {find_program("tc")};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_ok(argv);
  }

  std::pair<::testing::AssertionResult, std::string> relay_command(const std::string& cmd) {
    if (!relay_ || !relay_->write_line(cmd))
      return {::testing::AssertionFailure() << "the relay is gone: " << read(dir_ / "relay.log"), ""};
    const std::string reply = relay_->read_line_matching("", seconds(5));
    if (reply.rfind("ok ", 0) != 0)
      return {::testing::AssertionFailure() << "relay: " << cmd << ": " << (reply.empty() ? "no answer" : reply), reply};
    return {::testing::AssertionSuccess(), reply};
  }

  // A /24 of 10/8 from this pid that no interface or route of the root namespace uses yet.
  ::testing::AssertionResult pick_subnet() {
    const CommandResult used = run_command({find_program("ip"), "-4", "-o", "route", "show", "table", "all"});
    const CommandResult addrs = run_command({find_program("ip"), "-4", "-o", "addr"});
    const unsigned pid = unsigned(::getpid());
    for (unsigned k = 0; k < 256; ++k) {
      const unsigned v = (pid + k * 7919) % (120 * 256);
      const std::string s = "10." + std::to_string(100 + v / 256) + "." + std::to_string(v % 256);
      if (used.output.find(s + ".") == std::string::npos && addrs.output.find(s + ".") == std::string::npos) {
        subnet_ = s;
        host_address_ = s + ".254";
        return ::testing::AssertionSuccess();
      }
    }
    return ::testing::AssertionFailure() << "no free 10.x.y.0/24 subnet";
  }

  // Namespaces and links of test processes that are gone (killed before their teardown).
  static void sweep_stale() {
    auto dead = [](const std::string& pid) {
      return !pid.empty() && pid.find_first_not_of("0123456789") == std::string::npos && std::stol(pid) != ::getpid() &&
             ::access(("/proc/" + pid).c_str(), F_OK) != 0;
    };
    const CommandResult ns = run_command({find_program("ip"), "netns", "list"});
    std::istringstream nin(ns.output);
    for (std::string line; std::getline(nin, line);) {
      const std::string name = line.substr(0, line.find(' '));
      if (name.rfind("conveyor-", 0) != 0) continue;
      const std::string rest = name.substr(9);
      if (dead(rest.substr(0, rest.find_first_not_of("0123456789")))) (void)ip({"netns", "del", name});
    }
    const CommandResult links = run_command({find_program("ip"), "-o", "link", "show"});
    std::istringstream lin(links.output);
    for (std::string line; std::getline(lin, line);) {
      // "12: cv1234b0@cv1234p0: <...>"
      const size_t colon = line.find(": ");
      if (colon == std::string::npos) continue;
      std::string name = line.substr(colon + 2);
      name = name.substr(0, name.find_first_of("@:"));
      if (name.rfind("cv", 0) != 0) continue;
      const size_t digits_end = name.find_first_not_of("0123456789", 2);
      if (digits_end == std::string::npos || digits_end == 2) continue;
      if (dead(name.substr(2, digits_end - 2))) (void)ip({"link", "del", name});
    }
  }

  fs::path dir_;
  std::string subnet_, host_address_, bridge_;
  bool made_bridge_ = false;
  std::vector<Node> nodes_;
  std::unique_ptr<Process> relay_;
};

}  // namespace conveyor::netns_test

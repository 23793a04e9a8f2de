// A Slurm cluster a test starts in a temporary folder (munged, slurmctld and one slurmd per
// node, as its children, on free ports), and what scontrol says of a job. Used by
// test_slurm.cc; every process of the cluster carries its SLURM_CONF, by which teardown
// finds whatever is left.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/netns/netns_harness.h"
#include "tests/scripts/slurm_test_util.h"

namespace conveyor::slurm_test {

class Daemon {
 public:
  static std::unique_ptr<Daemon> start(const std::vector<std::string>& argv, const std::string& log, std::string& error) {
    const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      error = "open " + log + ": " + errno_text();
      return nullptr;
    }
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0) {
      error = "open /dev/null: " + errno_text();
      ::close(log_fd);
      return nullptr;
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {  // only async-signal-safe calls from here to exec
      if (::setsid() < 0 || ::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent ||
          ::dup2(null_fd, 0) < 0 || ::dup2(log_fd, 1) < 0 || ::dup2(log_fd, 2) < 0)
        ::_exit(126);
      ::execv(args[0], args.data());
      static const char msg[] = "test_slurm: execv failed\n";
      [[maybe_unused]] ssize_t n = ::write(2, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    const int fork_errno = errno;
    ::close(log_fd);
    ::close(null_fd);
    if (pid < 0) {
      error = "fork for " + argv[0] + ": " + std::strerror(fork_errno);
      return nullptr;
    }
    return std::unique_ptr<Daemon>(new Daemon(pid, argv[0], log));
  }
  ~Daemon() { stop(); }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  bool alive() { return testing::child_running(pid_); }
  // SIGTERM to the group, SIGKILL after `grace`; reaps the daemon.
  void stop(milliseconds grace = milliseconds(5000)) {
    if (pid_ <= 0) return;
    const pid_t group = pid_;
    if (::kill(-group, SIGTERM) != 0 && errno != ESRCH)
      std::fprintf(stderr, "test_slurm: kill(-%d, SIGTERM): %s\n", int(group), errno_text().c_str());
    const auto deadline = Clock::now() + grace;
    while (alive() && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(20));
    ::kill(-group, SIGKILL);  // the rest of the group, whether or not the leader went
    const auto hard = Clock::now() + seconds(5);
    while (alive() && Clock::now() < hard) std::this_thread::sleep_for(milliseconds(20));
    if (pid_ > 0) std::fprintf(stderr, "test_slurm: %s (pid %d) survived SIGKILL\n", name_.c_str(), int(pid_));
  }
  const std::string& log() const { return log_; }

 private:
  Daemon(pid_t pid, std::string name, std::string log) : pid_(pid), name_(std::move(name)), log_(std::move(log)) {}
  pid_t pid_;
  std::string name_, log_;
};

inline constexpr const char* kPartition = "conveyor";

// A one-node Slurm cluster in a temporary folder: munged on its own key and socket,
// slurmctld and slurmd on free ports, all state and logs in the folder. The destructor
// cancels its jobs, stops the daemons and kills every process that is left of it (found by
// SLURM_CONF in its environment); the folder stays when the test failed.
struct SlurmCluster {
  fs::path dir;
  fs::path conf;
  std::string node;  // this host's short name: SlurmctldHost and the one NodeName
  std::unique_ptr<Daemon> munged, slurmctld, slurmd;
  // Set before start() for several nodes: one slurmd in each node's network namespace
  // (tests/netns/netns_harness.h), named as the node, at its address; slurmctld in the root
  // namespace at `controller_address` (the bridge's).
  std::vector<netns_test::Node> ns_nodes;
  std::string controller_address;
  std::vector<std::unique_ptr<Daemon>> ns_slurmds;
  std::vector<pid_t> own_children;  // children of the test that are not the cluster's (the relay)

  std::string marker() const { return "SLURM_CONF=" + conf.string(); }

  ::testing::AssertionResult start() {
    std::string tmpl = (fs::temp_directory_path() / "conveyor-slurm-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) return ::testing::AssertionFailure() << "mkdtemp " << tmpl << ": " << errno_text();
    dir = tmpl;
    conf = dir / "slurm.conf";
    // Every process started from here on (the daemons, the Slurm commands, the job) uses
    // this cluster and carries the marker.
    if (::setenv("SLURM_CONF", conf.c_str(), 1) != 0) return ::testing::AssertionFailure() << "setenv: " << errno_text();
    // slurmd starts each slurmstepd through a fork that exits at once: the orphans come to
    // this process (not to init, which may never reap them) and teardown reaps them.
    if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
      return ::testing::AssertionFailure() << "prctl(PR_SET_CHILD_SUBREAPER): " << errno_text();

    // munged: a fresh 1024-byte key, readable by its owner only. munged refuses a socket
    // in a folder not searchable by everyone (the cluster's folder is private, 0700)
    // unless --force makes that a warning.
    const fs::path m = dir / "munge";
    std::error_code ec;
    fs::create_directories(m, ec);
    if (ec) return ::testing::AssertionFailure() << "mkdir " << m << ": " << ec.message();
    if (auto r = write_key(m / "munge.key"); !r) return r;
    std::string error;
    munged = Daemon::start({find_program("munged"), "--force", "--foreground", "--key-file=" + (m / "munge.key").string(),
                            "--socket=" + (m / "munge.socket").string(), "--pid-file=" + (m / "munged.pid").string(),
                            "--log-file=" + (m / "munged.log").string(), "--seed-file=" + (m / "munged.seed").string()},
                           (dir / "munged.out").string(), error);
    if (!munged) return ::testing::AssertionFailure() << "cannot start munged: " << error;
    const auto munge_deadline = Clock::now() + seconds(15);
    while (!fs::exists(m / "munge.socket") && munged->alive() && Clock::now() < munge_deadline)
      std::this_thread::sleep_for(milliseconds(50));
    if (!fs::exists(m / "munge.socket"))
      return ::testing::AssertionFailure() << "munged made no socket in 15 s: " << read_text(dir / "munged.out");

    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) return ::testing::AssertionFailure() << "gethostname: " << errno_text();
    node = host;
    node = node.substr(0, node.find('.'));  // slurmd knows itself by the short name
    std::vector<int> ports;
    if (auto r = free_ports(2, ports); !r) return r;
    const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus < 1) return ::testing::AssertionFailure() << "sysconf(_SC_NPROCESSORS_ONLN): " << errno_text();
    for (const char* sub : {"state", "spool", "tmp"}) {
      fs::create_directories(dir / sub, ec);
      if (ec) return ::testing::AssertionFailure() << "mkdir " << (dir / sub) << ": " << ec.message();
    }
    {
      std::ofstream c(conf);
      c << "ClusterName=conveyortest\n"
        << "SlurmctldHost=" << node << (controller_address.empty() ? "" : "(" + controller_address + ")") << "\n"
        << "SlurmctldPort=" << ports[0] << "\n"
        << "SlurmdPort=" << ports[1] << "\n"
        << "SlurmUser=root\nSlurmdUser=root\n"
        << "AuthType=auth/munge\nCredType=cred/munge\n"
        << "AuthInfo=socket=" << (m / "munge.socket").string() << "\n"
        << "StateSaveLocation=" << (dir / "state").string() << "\n"
        << "SlurmdSpoolDir=" << (dir / "spool").string() << (ns_nodes.empty() ? "" : "-%n") << "\n"
        << "TmpFS=" << (dir / "tmp").string() << "\n"
        << "SlurmctldPidFile=" << (dir / "slurmctld.pid").string() << "\n"
        << "SlurmdPidFile=" << (dir / "slurmd").string() << (ns_nodes.empty() ? "" : "-%n") << ".pid\n"
        << "SlurmctldLogFile=" << (dir / "slurmctld.log").string() << "\n"
        << "SlurmdLogFile=" << (dir / "slurmd").string() << (ns_nodes.empty() ? "" : "-%n") << ".log\n"
        // No cgroups in a container: processes are tracked by parentage, tasks not bound.
        << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        << "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
        << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
        << "MpiDefault=none\nSwitchType=switch/none\nMailProg=/bin/true\n"
        << "ReturnToService=2\nKillWait=10\n"
        ;
      std::string partition_nodes;
      if (ns_nodes.empty()) {
        c << "NodeName=" << node << " CPUs=" << cpus << " State=UNKNOWN\n";
        partition_nodes = node;
      }
      for (const auto& n : ns_nodes) {
        c << "NodeName=" << n.name << " NodeAddr=" << n.address << " CPUs=" << cpus << " State=UNKNOWN\n";
        partition_nodes += (partition_nodes.empty() ? "" : ",") + n.name;
      }
      c << "PartitionName=" << kPartition << " Nodes=" << partition_nodes << " Default=YES MaxTime=INFINITE State=UP\n";
      if (!c) return ::testing::AssertionFailure() << "cannot write " << conf;
    }
    slurmctld = Daemon::start({find_program("slurmctld"), "-D"}, (dir / "slurmctld.out").string(), error);
    if (!slurmctld) return ::testing::AssertionFailure() << "cannot start slurmctld: " << error;
    std::string all_idle = "idle";
    if (ns_nodes.empty()) {
      slurmd = Daemon::start({find_program("slurmd"), "-D"}, (dir / "slurmd.out").string(), error);
      if (!slurmd) return ::testing::AssertionFailure() << "cannot start slurmd: " << error;
    } else {
      all_idle.clear();
      for (const auto& n : ns_nodes) {
        // nsenter runs slurmd itself (no fork) in the node's network namespace and nothing
        // else of it (`ip netns exec` would also mount a /sys without the cgroup tree).
        fs::create_directories(dir / ("spool-" + n.name), ec);
        if (ec) return ::testing::AssertionFailure() << "mkdir spool-" << n.name << ": " << ec.message();
        auto d = Daemon::start({find_program("nsenter"), "--net=/run/netns/" + n.netns, find_program("slurmd"), "-D", "-N", n.name},
                               (dir / ("slurmd-" + n.name + ".out")).string(), error);
        if (!d) return ::testing::AssertionFailure() << "cannot start slurmd for " << n.name << ": " << error;
        ns_slurmds.push_back(std::move(d));
        all_idle += (all_idle.empty() ? "" : "\n") + std::string("idle");
      }
    }

    // With ReturnToService=2 a node turns idle as soon as its slurmd registers.
    const auto deadline = Clock::now() + seconds(30);
    std::string state;
    while (Clock::now() < deadline) {
      bool up = slurmctld->alive() && (!slurmd || slurmd->alive());
      for (auto& d : ns_slurmds) up = up && d->alive();
      if (!up) break;
      state = trimmed(sh("sinfo -h -N -o %t 2>&1", seconds(10)).text);
      if (state == all_idle) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(milliseconds(200));
    }
    return ::testing::AssertionFailure() << "the nodes did not turn idle in 30 s (sinfo: " << state << ")\n"
                                         << logs();
  }

  std::string logs() const {
    std::string s;
    for (const char* f : {"slurmctld.out", "slurmd.out", "munged.out"})
      s += std::string("---- ") + f + "\n" + read_text(dir / f) + "\n";
    for (const auto& n : ns_nodes)
      for (const std::string& f : {"slurmd-" + n.name + ".out", "slurmd-" + n.name + ".log"})
        s += "---- " + f + "\n" + read_text(dir / f) + "\n";
    return s;
  }

  ~SlurmCluster() {
    if (dir.empty()) return;
    if (slurmctld && slurmctld->alive()) {
      // Cancel every job and give the script its clean stop first.
      sh(std::string("scancel --partition=") + kPartition + " 2>&1", seconds(15));
      const auto deadline = Clock::now() + seconds(20);  // KillWait is 10 s
      while (Clock::now() < deadline && !trimmed(sh("squeue -h -o %i 2>/dev/null", seconds(10)).text).empty())
        std::this_thread::sleep_for(milliseconds(200));
    }
    slurmd.reset();  // stops it
    ns_slurmds.clear();
    slurmctld.reset();
    munged.reset();
    // What is left of the cluster: step daemons, job scripts, srun, workers.
    const auto deadline = Clock::now() + seconds(10);
    for (auto left = processes_with_env({marker()}); !left.empty() && Clock::now() < deadline;
         left = processes_with_env({marker()})) {
      for (const auto& p : left) {
        std::fprintf(stderr, "test_slurm: killing what is left of the cluster: pid %d %s\n", int(p.pid), p.cmdline.c_str());
        if (::kill(p.pid, SIGKILL) != 0 && errno != ESRCH)
          std::fprintf(stderr, "test_slurm: kill(%d): %s\n", int(p.pid), errno_text().c_str());
      }
      std::this_thread::sleep_for(milliseconds(100));
    }
    reap_orphans();
    if (::prctl(PR_SET_CHILD_SUBREAPER, 0) != 0)
      std::fprintf(stderr, "test_slurm: prctl(PR_SET_CHILD_SUBREAPER, 0): %s\n", errno_text().c_str());
    if (::unsetenv("SLURM_CONF") != 0) std::fprintf(stderr, "test_slurm: unsetenv: %s\n", errno_text().c_str());
    if (::testing::Test::HasFailure()) {
      std::fprintf(stderr, "test_slurm: the cluster's folder (logs, job output) is kept: %s\n", dir.c_str());
    } else {
      std::error_code ec;
      fs::remove_all(dir, ec);
      if (ec) std::fprintf(stderr, "test_slurm: cannot remove %s: %s\n", dir.c_str(), ec.message().c_str());
    }
  }

 private:
  // Waits for the children this process adopted (step daemons); bounded.
  // This process's children, but for those in `keep` (the test's own helpers).
  static std::vector<pid_t> children(const std::vector<pid_t>& keep) {
    std::vector<pid_t> out;
    std::error_code ec;
    for (fs::directory_iterator it("/proc", ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string stat = read_text(it->path() / "stat");  // "pid (comm) state ppid ..."
      const size_t close = stat.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(stat.substr(close + 1));
      std::string state;
      long ppid = 0;
      rest >> state >> ppid;
      const pid_t pid = pid_t(std::stol(name));
      if (ppid == ::getpid() && std::find(keep.begin(), keep.end(), pid) == keep.end()) out.push_back(pid);
    }
    return out;
  }

  // Waits for the children this process adopted (step daemons); bounded.
  void reap_orphans() const {
    const auto deadline = Clock::now() + seconds(5);
    while (true) {
      const std::vector<pid_t> left = children(own_children);
      for (pid_t pid : left) {
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) < 0 && errno != ECHILD)
          std::fprintf(stderr, "test_slurm: waitpid(%d): %s\n", int(pid), errno_text().c_str());
      }
      if (left.empty()) return;
      if (Clock::now() >= deadline) {
        std::fprintf(stderr, "test_slurm: %zu adopted process(es) still run after teardown\n", left.size());
        return;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
  }

  static ::testing::AssertionResult write_key(const fs::path& path) {
    std::array<char, 1024> key;
    const int in = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (in < 0) return ::testing::AssertionFailure() << "open /dev/urandom: " << errno_text();
    const ssize_t got = ::read(in, key.data(), key.size());
    ::close(in);
    if (got != ssize_t(key.size())) return ::testing::AssertionFailure() << "read /dev/urandom: " << errno_text();
    const int out = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (out < 0) return ::testing::AssertionFailure() << "create " << path << ": " << errno_text();
    const ssize_t put = ::write(out, key.data(), key.size());
    const int write_errno = errno;
    if (::close(out) != 0 || put != ssize_t(key.size()))
      return ::testing::AssertionFailure() << "write " << path << ": " << std::strerror(write_errno);
    return ::testing::AssertionSuccess();
  }
};

// Field `key` ("JobState", "ExitCode") of job `id` from scontrol ("" when it does not know it).
inline std::string job_field(const std::string& id, const std::string& key) {
  const std::string out = " " + sh("scontrol show job -o " + id + " 2>/dev/null", seconds(10)).text;
  const size_t at = out.find(" " + key + "=");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 2;
  return trimmed(out.substr(begin, out.find(' ', begin) - begin));
}

}  // namespace conveyor::slurm_test

// scripts/slurm/conveyor.sbatch on a real one-node Slurm cluster that the test starts in a
// temporary folder (munged, slurmctld and slurmd as its children, on free ports): a
// 3-stage CPU pipeline of the demo model with three workers on the node, submitted with
// sbatch; /health must turn ok and a completion come back, then scancel (or the SIGTERM
// the time limit sends the batch shell) must end the job and leave no coordinator or
// worker behind. Every process of that cluster, the job's included, carries the cluster's
// SLURM_CONF in its environment: teardown finds them by it and kills whatever is left, on
// every path. Without Slurm and munge the test is skipped.
//
// The other tests run the script without Slurm: its refusals name what is wrong, and
// --check prints the job's copy of a cluster file, which the coordinator's own parser reads.
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

#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "tests/netns/netns_harness.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

std::string errno_text() { return std::strerror(errno); }

std::string script_path() { return testing::source_dir() + "/scripts/slurm/conveyor.sbatch"; }
std::string bin_dir() { return std::string(CONVEYOR_BINARY_DIR) + "/bin"; }

// `s` as one word for sh.
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Output {
  int rc = -1;  // the exit code; -1 when it did not exit normally
  std::string text;
};

// Runs `cmd` with sh, killed after `limit` (coreutils timeout); returns its stdout (add
// 2>&1 to `cmd` for stderr as well).
Output sh(const std::string& cmd, seconds limit = seconds(30)) {
  Output out;
  const std::string line = "timeout -k 5 " + std::to_string(limit.count()) + " sh -c " + quoted(cmd);
  FILE* p = ::popen(line.c_str(), "r");
  if (!p) {
    out.text = "popen(" + line + ") failed: " + errno_text();
    return out;
  }
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.text.append(buf.data(), n);
  const int status = ::pclose(p);
  if (status == -1) out.text += "\npclose failed: " + errno_text();
  else if (WIFEXITED(status)) out.rc = WEXITSTATUS(status);
  return out;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "(cannot read " + path.string() + ")";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// The full path of program `name` on PATH or in the sbin folders (daemons live there and a
// non-login root shell may lack them on PATH), or "".
std::string find_program(const std::string& name) {
  std::string dirs = std::getenv("PATH") ? std::getenv("PATH") : "";
  dirs += ":/usr/sbin:/sbin:/usr/local/sbin";
  std::stringstream ss(dirs);
  for (std::string d; std::getline(ss, d, ':');) {
    if (d.empty()) continue;
    const fs::path p = fs::path(d) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

// `n` distinct TCP ports free now (each socket stays bound until all are chosen).
::testing::AssertionResult free_ports(int n, std::vector<int>& ports) {
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
  };
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      close_all();
      return ::testing::AssertionFailure() << "socket: " << errno_text();
    }
    fds.push_back(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const std::string why = errno_text();
      close_all();
      return ::testing::AssertionFailure() << "bind/getsockname on port 0: " << why;
    }
    ports.push_back(ntohs(addr.sin_port));
  }
  close_all();
  return ::testing::AssertionSuccess();
}

// The processes (other than this one) whose environment holds every one of `entries`
// ("NAME=value"), with their executable.
struct Proc {
  pid_t pid;
  std::string exe;
  std::string cmdline;
};
std::vector<Proc> processes_with_env(const std::vector<std::string>& entries) {
  std::vector<Proc> out;
  std::error_code ec;
  for (fs::directory_iterator it("/proc", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = pid_t(std::stol(name));
    if (pid == ::getpid()) continue;
    std::ifstream in(it->path() / "environ", std::ios::binary);
    if (!in) continue;  // gone, or not ours to read
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string env = std::string(1, '\0') + ss.str();
    bool all = true;
    for (const auto& e : entries) all = all && env.find(std::string(1, '\0') + e + std::string(1, '\0')) != std::string::npos;
    if (!all) continue;
    std::error_code ec2;
    Proc p{pid, fs::read_symlink(it->path() / "exe", ec2).string(), read_text(it->path() / "cmdline")};
    for (char& c : p.cmdline)
      if (c == '\0') c = ' ';
    out.push_back(std::move(p));
  }
  return out;
}

std::string describe(const std::vector<Proc>& procs) {
  std::string s;
  for (const auto& p : procs) s += "\n  pid " + std::to_string(p.pid) + ": " + p.cmdline;
  return s;
}

// A daemon of the test cluster: its own session, stdout and stderr to `log`, stdin from
// /dev/null, killed with its process group (SIGTERM, then SIGKILL) by stop() or when it
// goes away, and by the kernel if this test dies.
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

constexpr const char* kPartition = "conveyor";

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
std::string job_field(const std::string& id, const std::string& key) {
  const std::string out = " " + sh("scontrol show job -o " + id + " 2>/dev/null", seconds(10)).text;
  const size_t at = out.find(" " + key + "=");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 2;
  return trimmed(out.substr(begin, out.find(' ', begin) - begin));
}

// How the job is told to stop.
struct StopWay {
  const char* name;
  const char* command;      // followed by the job id
  const char* final_state;  // scontrol's JobState once the job has ended
  bool script_stops_all;    // the script alone stops workers and coordinator, and says so
};

const StopWay kStopWays[] = {
    // Slurm sends SIGTERM to every process of the job at once (the script traps it) and
    // SIGKILL after KillWait.
    {"Scancel", "scancel", "CANCELLED", false},
    // What the time limit does with the script's --signal=B:TERM@60: SIGTERM to the batch
    // shell alone; the script stops the workers, then the coordinator, and exits 0.
    {"TimeLimitSignal", "scancel --batch --signal=TERM", "COMPLETED", true},
};

// What the test names show for the parameter (gtest would print its bytes).
void PrintTo(const StopWay& way, std::ostream* os) { *os << way.name; }

class SlurmJob : public ::testing::TestWithParam<StopWay> {};

TEST_P(SlurmJob, ServesThenStopsLeavingNothing) {
  for (const char* prog : {"munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol"})
    if (find_program(prog).empty())
      GTEST_SKIP() << prog << " is not installed: scripts/setup.sh installs Slurm and munge (slurmctld slurmd slurm-client munge)";
  if (::geteuid() != 0) GTEST_SKIP() << "slurmd must run as root (it starts job steps as the submitting user)";
  const StopWay& way = GetParam();
  const auto started = Clock::now();

  SlurmCluster cluster;
  ASSERT_TRUE(cluster.start());

  // The operator's cluster file as cluster_configs/local-cpu.yaml has it: loopback hosts,
  // a model path relative to the file and a join token, all of which the job's copy
  // replaces; the ports are free now.
  const fs::path job = cluster.dir / "job";
  std::error_code ec;
  fs::create_directories(job, ec);
  ASSERT_FALSE(ec) << ec.message();
  fs::create_directory_symlink(testing::source_dir() + "/models/brown-gpt2", job / "model", ec);
  ASSERT_FALSE(ec) << "symlink " << (job / "model") << ": " << ec.message();
  std::vector<int> ports;
  ASSERT_TRUE(free_ports(2, ports));
  const int http_port = ports[0];
  {
    std::ofstream y(job / "cluster.yaml");
    y << "model:\n  path: model   # relative to this file\n  name: brown-gpt2\n"
      << "http:\n  host: 127.0.0.1\n  port: " << ports[0] << "\n"
      << "control:\n  host: 127.0.0.1\n  port: " << ports[1] << "\n  join_token: local-demo-token\n"
      << "pipeline:\n  stages: 3\n  replicas: 1\n";
    ASSERT_TRUE(y.good()) << "cannot write " << (job / "cluster.yaml");
  }

  // Three CPU workers on this node (one CPU thread each: the machine may have two cores);
  // no CONVEYOR_JOIN_TOKEN, so the script makes one.
  const fs::path job_out = job / "job.out";
  const Output submitted = sh("cd " + quoted(job.string()) + " && env -u CONVEYOR_JOIN_TOKEN CONVEYOR_BIN=" +
                              quoted(bin_dir()) + " CONVEYOR_WORKERS_PER_NODE=3 CONVEYOR_WORKER_ARGS=" +
                              quoted("--backend cpu --kv-cache-mb 64") +
                              " CONVEYOR_CPU_THREADS=1 CONVEYOR_STOP_TIMEOUT=10 sbatch --parsable --job-name=conveyor-test"
                              " --time=5 --output=" + quoted(job_out.string()) + " " + quoted(script_path()) +
                              " cluster.yaml 2>&1");
  ASSERT_EQ(submitted.rc, 0) << "sbatch: " << submitted.text;
  const std::string job_id = trimmed(submitted.text.substr(0, submitted.text.find(';')));
  ASSERT_FALSE(job_id.empty()) << submitted.text;
  ASSERT_EQ(job_id.find_first_not_of("0123456789"), std::string::npos) << "sbatch printed: " << submitted.text;

  // Bounded wait for the pipeline; the job must stay alive meanwhile.
  bool healthy = false;
  std::string state;
  for (const auto deadline = Clock::now() + seconds(90); !healthy && Clock::now() < deadline;) {
    HttpRequest h;
    h.target = "/health";
    h.timeout = milliseconds(2000);
    const auto r = http_call("127.0.0.1", http_port, h);
    healthy = r.ok() && r->status == 200;
    if (healthy) break;
    state = job_field(job_id, "JobState");
    if (state != "PENDING" && state != "CONFIGURING" && state != "RUNNING") break;
    std::this_thread::sleep_for(milliseconds(250));
  }
  ASSERT_TRUE(healthy) << "no ok /health within 90 s; job " << job_id << " is " << state << "; its output:\n"
                       << read_text(job_out) << cluster.logs();

  HttpRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json{{"model", "brown-gpt2"}, {"prompt", "The jury said"}, {"max_tokens", 4}, {"temperature", 0}}.dump();
  req.timeout = milliseconds(20000);
  const auto resp = http_call("127.0.0.1", http_port, req);
  ASSERT_TRUE(resp.ok()) << resp.error();
  ASSERT_EQ(resp->status, 200) << resp->body;
  const json body = json::parse(resp->body, nullptr, false);
  ASSERT_FALSE(body.is_discarded()) << resp->body;
  ASSERT_TRUE(body.contains("choices") && body["choices"].is_array() && !body["choices"].empty()) << resp->body;
  ASSERT_TRUE(body["choices"][0]["text"].is_string()) << resp->body;
  EXPECT_FALSE(body["choices"][0]["text"].get<std::string>().empty()) << resp->body;

  // The job says where the REST endpoint is: the first node, as Slurm addresses it.
  EXPECT_NE(read_text(job_out).find("REST endpoint: http://" + cluster.node + ":" + std::to_string(http_port)),
            std::string::npos)
      << read_text(job_out);

  // Stop: the job ends and nothing of it is left.
  const Output stop = sh(std::string(way.command) + " " + job_id + " 2>&1");
  ASSERT_EQ(stop.rc, 0) << way.command << ": " << stop.text;
  const std::vector<std::string> of_the_job = {cluster.marker(), "SLURM_JOB_ID=" + job_id};
  std::vector<Proc> left;
  for (const auto deadline = Clock::now() + seconds(30); Clock::now() < deadline;) {
    state = job_field(job_id, "JobState");
    left = processes_with_env(of_the_job);
    if (state == way.final_state && left.empty()) break;
    std::this_thread::sleep_for(milliseconds(200));
  }
  const std::string out = read_text(job_out);
  EXPECT_EQ(state, way.final_state) << out;
  bool conveyor_left = false;
  for (const auto& p : left) {
    const std::string exe = fs::path(p.exe).filename().string();
    conveyor_left = conveyor_left || exe == "conveyor-coordinator" || exe == "conveyor-worker";
  }
  EXPECT_FALSE(conveyor_left) << "a coordinator or worker outlived the job:" << describe(left);
  EXPECT_TRUE(left.empty()) << "left of the job:" << describe(left);
  EXPECT_NE(out.find("conveyor.sbatch: SIGTERM: stopping"), std::string::npos) << out;
  if (way.script_stops_all) {
    for (const char* line : {"conveyor.sbatch: stopping the workers", "conveyor.sbatch: stopping the coordinator",
                             "conveyor.sbatch: stopped"})
      EXPECT_NE(out.find(line), std::string::npos) << "no '" << line << "' in the job's output:\n" << out;
    EXPECT_EQ(out.find("did not stop"), std::string::npos) << out;
    EXPECT_EQ(job_field(job_id, "ExitCode"), "0:0") << out;
  }
  std::printf("test_slurm: cluster up, job served and stopped (%s) in %.1f s\n", way.name,
              std::chrono::duration<double>(Clock::now() - started).count());
}

INSTANTIATE_TEST_SUITE_P(StopWays, SlurmJob, ::testing::ValuesIn(kStopWays),
                         [](const ::testing::TestParamInfo<StopWay>& info) { return std::string(info.param.name); });

// ---- several nodes --------------------------------------------------------------------

// `sbatch -N 3` on three Slurm nodes, each a network namespace of its own with its own
// address (one slurmd per namespace, slurmctld in the root namespace): the coordinator on
// the first node, two workers on every node (one step per node), each worker bound to its
// node's address. The job serves; `scancel` of one node's step takes that node's workers
// away and spares on the other nodes take their stages; the job goes on serving the same
// answers; scancel of the job leaves nothing.
TEST(SlurmNodes, ThreeNodesServeAndSurviveScancelOfOneNodesStep) {
  for (const char* prog : {"munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol"})
    if (find_program(prog).empty())
      GTEST_SKIP() << prog << " is not installed: scripts/setup.sh installs Slurm and munge (slurmctld slurmd slurm-client munge)";
  if (const std::string why = netns_test::netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (find_program("nsenter").empty()) GTEST_SKIP() << "nsenter (util-linux) is not installed";
  const auto started = Clock::now();

  const fs::path topo_dir = fs::temp_directory_path() / ("conveyor-slurm-nodes-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(topo_dir, ec);
  fs::create_directories(topo_dir, ec);
  ASSERT_FALSE(ec) << ec.message();
  netns_test::Topology topo;  // declared first: torn down after the Slurm cluster
  ASSERT_TRUE(topo.create(topo_dir, {"node1", "node2", "node3"}));
  SlurmCluster cluster;
  cluster.ns_nodes = topo.nodes();
  cluster.controller_address = topo.host_address();
  cluster.own_children = {topo.relay_pid()};
  ASSERT_TRUE(cluster.start());

  const fs::path job = cluster.dir / "job";
  fs::create_directories(job, ec);
  ASSERT_FALSE(ec) << ec.message();
  fs::create_directory_symlink(testing::source_dir() + "/models/brown-gpt2", job / "model", ec);
  ASSERT_FALSE(ec) << ec.message();
  {
    // The operator's file: loopback hosts, which the job's flags replace; each node has its
    // own ports, so fixed ones do.
    std::ofstream y(job / "cluster.yaml");
    y << "model:\n  path: model\n  name: brown-gpt2\n"
      << "http:\n  host: 127.0.0.1\n  port: 8000\n"
      << "control:\n  host: 127.0.0.1\n  port: 5555\n  join_token: local-demo-token\n"
      << "pipeline:\n  stages: 3\n"
      << "heartbeat:\n  interval_ms: 200\n  liveness_ms: 2000\n";
    ASSERT_TRUE(y.good());
  }
  const std::string first = topo.node("node1").address;
  const fs::path job_out = job / "job.out";
  const Output submitted = sh("cd " + quoted(job.string()) + " && env -u CONVEYOR_JOIN_TOKEN CONVEYOR_BIN=" +
                              quoted(bin_dir()) + " CONVEYOR_WORKERS_PER_NODE=2 CONVEYOR_WORKER_ARGS=" +
                              quoted("--backend cpu --kv-cache-mb 64") +
                              " CONVEYOR_CPU_THREADS=1 CONVEYOR_STOP_TIMEOUT=10 sbatch -N 3 --parsable"
                              " --job-name=conveyor-test --time=5 --output=" + quoted(job_out.string()) + " " +
                              quoted(script_path()) + " cluster.yaml 2>&1");
  ASSERT_EQ(submitted.rc, 0) << "sbatch: " << submitted.text;
  const std::string job_id = trimmed(submitted.text.substr(0, submitted.text.find(';')));
  ASSERT_EQ(job_id.find_first_not_of("0123456789"), std::string::npos) << "sbatch printed: " << submitted.text;

  auto call = [&](const std::string& method, const std::string& target, const std::string& body) {
    HttpRequest r;
    r.method = method;
    r.target = target;
    r.body = body;
    if (!body.empty()) r.headers = {{"Content-Type", "application/json"}};
    r.timeout = milliseconds(30000);
    return http_call(first, 8000, r);
  };
  auto cluster_info = [&] {
    auto r = call("GET", "/v1/cluster", "");
    return r && r->status == 200 ? json::parse(r->body, nullptr, false) : json();
  };
  auto count = [](const json& info, const std::function<bool(const json&)>& pred) {
    int n = 0;
    if (info.is_object())
      for (const auto& w : info["workers"]) n += pred(w);
    return n;
  };
  auto state_is = [](const json& w, std::initializer_list<const char*> states) {
    const std::string s = w.value("state", "");
    return std::any_of(states.begin(), states.end(), [&](const char* x) { return s == x; });
  };

  // Serving: three stages ready, six workers on three nodes, each at its node's address.
  json info;
  std::string state;
  for (const auto deadline = Clock::now() + seconds(120); Clock::now() < deadline;) {
    auto h = call("GET", "/health", "");
    info = cluster_info();
    if (h && h->status == 200 && count(info, [](const json&) { return true; }) == 6) break;
    state = job_field(job_id, "JobState");
    if (state != "PENDING" && state != "CONFIGURING" && state != "RUNNING") break;
    std::this_thread::sleep_for(milliseconds(250));
  }
  ASSERT_EQ(count(info, [](const json&) { return true; }), 6)
      << "job " << job_id << " is " << state << "; /v1/cluster: " << info.dump() << "\n" << read_text(job_out) << cluster.logs();
  for (const auto& n : topo.nodes())
    EXPECT_EQ(count(info, [&](const json& w) { return w.value("host", "") == n.address; }), 2)
        << n.name << " " << n.address << ": " << info.dump();
  EXPECT_NE(read_text(job_out).find("REST endpoint: http://" + first + ":8000"), std::string::npos) << read_text(job_out);

  const std::string request =
      json{{"model", "brown-gpt2"}, {"prompt", "The jury said"}, {"max_tokens", 6}, {"temperature", 0}}.dump();
  auto resp = call("POST", "/v1/completions", request);
  ASSERT_TRUE(resp.ok()) << resp.error();
  ASSERT_EQ(resp->status, 200) << resp->body;
  const std::string answer = json::parse(resp->body)["choices"][0]["text"];

  // scancel of node2's step: its two workers go; the job and the pipeline go on.
  std::string step;
  const Output steps = sh("squeue -h -s -j " + job_id + " -o '%i %N' 2>&1", seconds(10));
  std::istringstream lines(steps.text);
  for (std::string id, nodes; lines >> id >> nodes;)
    if (nodes == "node2" && id.find(".batch") == std::string::npos) step = id;
  ASSERT_FALSE(step.empty()) << "no step of job " << job_id << " on node2: " << steps.text;
  const auto cancelled = Clock::now();
  const Output scancel_step = sh("scancel " + step + " 2>&1");
  ASSERT_EQ(scancel_step.rc, 0) << scancel_step.text;
  const std::string node2 = topo.node("node2").address;
  bool repaired = false;
  for (const auto deadline = Clock::now() + seconds(60); !repaired && Clock::now() < deadline;) {
    auto h = call("GET", "/health", "");
    info = cluster_info();
    repaired = h && h->status == 200 &&
               count(info, [&](const json& w) { return w.value("host", "") == node2 && state_is(w, {"ready", "loading", "spare"}); }) == 0 &&
               count(info, [&](const json& w) { return state_is(w, {"ready"}); }) == 3;
    if (!repaired) std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(repaired) << "/v1/cluster: " << info.dump() << "\n" << read_text(job_out);
  const double repair_s = std::chrono::duration<double>(Clock::now() - cancelled).count();
  resp = call("POST", "/v1/completions", request);
  ASSERT_TRUE(resp.ok()) << resp.error();
  ASSERT_EQ(resp->status, 200) << resp->body;
  EXPECT_EQ(json::parse(resp->body)["choices"][0]["text"], answer);
  EXPECT_EQ(job_field(job_id, "JobState"), "RUNNING") << read_text(job_out);
  for (const auto until = Clock::now() + seconds(10);
       read_text(job_out).find("the workers' step on node2 ended") == std::string::npos && Clock::now() < until;)
    std::this_thread::sleep_for(milliseconds(100));
  EXPECT_NE(read_text(job_out).find("the workers' step on node2 ended"), std::string::npos) << read_text(job_out);

  // scancel of the job: it ends and nothing of it is left.
  const Output stop = sh("scancel " + job_id + " 2>&1");
  ASSERT_EQ(stop.rc, 0) << stop.text;
  const std::vector<std::string> of_the_job = {cluster.marker(), "SLURM_JOB_ID=" + job_id};
  std::vector<Proc> left;
  for (const auto deadline = Clock::now() + seconds(30); Clock::now() < deadline;) {
    state = job_field(job_id, "JobState");
    left = processes_with_env(of_the_job);
    if (state == "CANCELLED" && left.empty()) break;
    std::this_thread::sleep_for(milliseconds(200));
  }
  EXPECT_EQ(state, "CANCELLED") << read_text(job_out);
  EXPECT_TRUE(left.empty()) << "left of the job:" << describe(left);
  std::printf("test_slurm: 3 nodes served; scancel of node2's step repaired in %.1f s; whole test %.1f s\n", repair_s,
              std::chrono::duration<double>(Clock::now() - started).count());
  if (!::testing::Test::HasFailure()) fs::remove_all(topo_dir, ec);
}

// ---- without Slurm ------------------------------------------------------------------------

struct ScriptRun {
  fs::path dir;
  ScriptRun() {
    dir = fs::temp_directory_path() / ("conveyor-slurm-script-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::create_directory_symlink(testing::source_dir() + "/models/brown-gpt2", dir / "model");
  }
  ~ScriptRun() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  // The script run outside any Slurm job from `dir` with `env` (sh assignments) and `args`.
  Output run(const std::string& env, const std::string& args, bool with_stderr = true) const {
    return sh("cd " + quoted(dir.string()) + " && env -u SLURM_JOB_ID -u SLURM_JOB_NODELIST -u CONVEYOR_CONFIG " + env +
              " bash " + quoted(script_path()) + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null"));
  }
};

TEST(SlurmScript, RefusesABadSetupNamingWhatIsWrong) {
  ScriptRun s;
  std::ofstream(s.dir / "cluster.yaml") << "model: {path: model}\npipeline: {stages: 3}\n";
  const std::string bin = "CONVEYOR_BIN=" + quoted(bin_dir());

  Output r = s.run(bin, "");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("no cluster file"), std::string::npos) << r.text;

  r = s.run(bin, "/nonexistent/cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("'/nonexistent/cluster.yaml' does not exist"), std::string::npos) << r.text;

  r = s.run("CONVEYOR_BIN=/nonexistent/bin", "cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("/nonexistent/bin/conveyor-coordinator is missing"), std::string::npos) << r.text;

  r = s.run(bin + " CONVEYOR_WORKERS_PER_NODE=0", "cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("CONVEYOR_WORKERS_PER_NODE"), std::string::npos) << r.text;

  r = s.run(bin, "cluster.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("not inside a Slurm job"), std::string::npos) << r.text;

  r = s.run(bin + " CONVEYOR_CONFIG=cluster.yaml", "--check");
  EXPECT_EQ(r.rc, 0) << r.text;
}

// --check: the coordinator itself reads the cluster file as it is (block or flow style) with
// the flags the job gives it, and prints what it would run with: both hosts the bind
// address, the model path relative to the file, the join token from the environment, every
// other value as the file has it.
TEST(SlurmScript, CheckShowsWhatTheCoordinatorWouldRunWith) {
  ScriptRun s;
  const std::string env = "CONVEYOR_BIN=" + quoted(bin_dir()) + " CONVEYOR_BIND_HOST=0.0.0.0";
  const std::vector<std::pair<std::string, std::string>> files = {
      {"block.yaml",
       "# the demo\nmodel:\n  path: model   # relative\n  name: demo\nhttp:\n  port: 8123\n  api_key: 'k,1'\n"
       "control:\n    host: 127.0.0.1\n    port: 5566\n    join_token: file-token\npipeline:\n  stages: 3\n"},
      {"flow.yaml",
       "model: {path: \"model\", name: demo}\nhttp: {port: 8123, api_key: \"k,1\"}  # a comment\n"
       "control: {host: 127.0.0.1, port: 5566, join_token: file-token}\npipeline: {stages: 3}\n"},
      {"multi.yaml",  // a flow mapping over several lines: the awk rewriting of old refused it
       "model: {path: model, name: demo}\nhttp: {port: 8123,\n  api_key: \"k,1\"}\n"
       "control: {host: 127.0.0.1, port: 5566,\n  join_token: file-token}\npipeline: {stages: 3}\n"},
  };
  for (const auto& [name, text] : files) {
    std::ofstream(s.dir / name) << text;
    const Output r = s.run("CONVEYOR_JOIN_TOKEN=env-token " + env, "--check " + name, /*with_stderr=*/false);
    ASSERT_EQ(r.rc, 0) << name << ":\n" << s.run(env, "--check " + name).text;
    const json cfg = json::parse(r.text, nullptr, false);
    ASSERT_FALSE(cfg.is_discarded()) << r.text;
    EXPECT_EQ(cfg["http"]["host"], "0.0.0.0") << r.text;
    EXPECT_EQ(cfg["control"]["host"], "0.0.0.0") << r.text;
    EXPECT_EQ(cfg["http"]["port"], 8123) << r.text;
    EXPECT_EQ(cfg["control"]["port"], 5566) << r.text;
    EXPECT_EQ(cfg["http"]["api_key_set"], true) << r.text;
    EXPECT_EQ(cfg["control"]["join_token_from"], "environment") << r.text;
    // A wildcard bind address: UCX's choice of interface (the workers pass their own --host).
    EXPECT_EQ(cfg["control"]["data_interface"], "any") << r.text;
    EXPECT_EQ(cfg["control"]["data_interface_from"], "wildcard address 0.0.0.0") << r.text;
    EXPECT_EQ(cfg["model"]["name"], "demo") << r.text;
    EXPECT_EQ(fs::path(cfg["model"]["path"].get<std::string>()).lexically_normal(), (s.dir / "model").lexically_normal())
        << r.text;
    EXPECT_EQ(cfg["pipeline"]["stages"], 3) << r.text;
  }

  // A loopback bind address keeps the data plane on lo, the interface holding it.
  {
    const Output r = s.run("CONVEYOR_JOIN_TOKEN=env-token CONVEYOR_BIN=" + quoted(bin_dir()) + " CONVEYOR_BIND_HOST=127.0.0.1",
                           "--check block.yaml", /*with_stderr=*/false);
    ASSERT_EQ(r.rc, 0) << r.text;
    const json cfg = json::parse(r.text, nullptr, false);
    ASSERT_FALSE(cfg.is_discarded()) << r.text;
    EXPECT_EQ(cfg["control"]["host"], "127.0.0.1") << r.text;
    EXPECT_EQ(cfg["control"]["data_interface"], "lo") << r.text;
    EXPECT_EQ(cfg["control"]["data_interface_from"], "address 127.0.0.1") << r.text;
  }
  // An address this host does not hold is refused, naming it and the host's interfaces.
  Output r = s.run("CONVEYOR_BIN=" + quoted(bin_dir()) + " CONVEYOR_BIND_HOST=192.0.2.254", "--check block.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("'192.0.2.254' (192.0.2.254) is not an address of this host"), std::string::npos) << r.text;
  // A broken file is refused with the coordinator's own message (file, line, reason).
  std::ofstream(s.dir / "bad.yaml") << "model: {path: model}\npipeline: {stages: 0}\n";
  r = s.run(env, "--check bad.yaml");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.text.find("bad.yaml"), std::string::npos) << r.text;
  EXPECT_NE(r.text.find("the coordinator refuses"), std::string::npos) << r.text;
}

}  // namespace
}  // namespace conveyor

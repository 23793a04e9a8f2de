// Every environment variable Conveyor's programs read, declared once (options.cc: name,
// variable, meaning, the values it takes; the default is the Options member's initialiser),
// read once at start-up into an immutable snapshot, and printed by the daemons' --check.
//
// A daemon's main calls read_options() first thing: a bad value stops it there, with an
// error naming the variable and the value. It then installs the snapshot for the few
// libraries that read the process's options (install_options; the trace folder), passes the
// kernels' options down as arguments (kernels never read the environment), and under --check
// prints describe_options() or options_json().
//
// UCX's own variables (UCX_TLS, UCX_NET_DEVICES, UCX_KEEPALIVE_INTERVAL) are declared here too,
// marked as UCX's: UCX reads them itself when a channel starts, and Conveyor only consults them
// (ucx_variable) so that its own choice agrees with what UCX will use.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <spdlog/common.h>

#include "common/kernel_options.h"
#include "common/status.h"

namespace conveyor {

// The snapshot. Each member's initialiser is its option's default.
struct Options {
  KernelOptions kernels;
  spdlog::level::level_enum log_level = spdlog::level::info;
  std::string trace_dir;   // "": no step traces
  std::string join_token;  // "": none from the environment (secret: --check says set or unset)
  std::string api_key;     // "": none from the environment (secret)
  // A worker's micro-batches smaller than this go staged through host memory even where the
  // direct GPU path is open (stage_worker/worker_impl.h says why 64 KiB).
  int64_t direct_min_bytes = int64_t(64) << 10;
  // The data plane's progress thread keeps polling this many microseconds after its last
  // progress, and a send or a receive as long for its result, instead of sleeping
  // (UcxChannelOptions::spin_when_idle and spin_in_calls; 0: they sleep).
  int64_t data_idle_spin_us = 0;
  // The data plane talks over shared memory with the daemons of its own host that do too,
  // each watching the other's process (UcxChannelOptions::host_shared_memory).
  bool data_shared_memory = true;
  // UCX's own variables as the environment had them at start-up ("": unset, UCX's default).
  std::string ucx_tls, ucx_net_devices, ucx_keepalive_interval, ucx_tcp_conn_nb, ucx_tcp_max_poll;

  // The names (OptionSpec::name) of the options the environment set.
  std::vector<std::string> from_environment;
  bool set_by_environment(std::string_view name) const;
};

// The daemons that read an option (OptionSpec::scope bits); --check prints those of its own.
enum OptionScope : unsigned { kCoordinatorScope = 1u, kWorkerScope = 2u };

// One option's declaration.
struct OptionSpec {
  std::string_view name = {};      // as --check prints it: "gemm.tune"
  std::string_view variable = {};  // "CONVEYOR_GEMM_TUNE"
  std::string_view meaning = {};   // one line
  std::string_view values = {};    // what it takes, as errors and docs say it: "0 or 1"
  unsigned scope = 0;         // OptionScope bits
  bool ucx = false;           // UCX's own variable: UCX reads it, Conveyor only looks
  bool secret = false;        // --check says only whether it is set
  // Stores `text` (never empty: an empty variable counts as unset) into `out`, or says why it
  // cannot, leaving `out` as it was.
  std::function<Status(std::string_view text, Options& out)> parse = nullptr;
  std::function<std::string(const Options&)> show = nullptr;  // the value as --check prints it
};

// Every option, in the order --check prints them.
std::span<const OptionSpec> option_specs();
// The declaration of `name` (or of the variable `name`); null when there is none.
const OptionSpec* find_option(std::string_view name);

// Where read_options looks: a variable's value, or nullopt when it is unset.
using Environment = std::function<std::optional<std::string>(std::string_view variable)>;
Environment process_environment();  // this process's environment, as it is now

// The snapshot from `env`: each option the environment sets, parsed; the rest at their
// defaults. An empty variable counts as unset. The error names every bad variable and its
// value: "CONVEYOR_GEMM_TUNE='yes please': expected 0 or 1 (or true/false, on/off)".
Expected<Options> read_options(const Environment& env = process_environment());

// The effective values of the options in `scope`, one line each:
//   gemm.tune = 1 (default, CONVEYOR_GEMM_TUNE)
//   gemm.order = fixed (env CONVEYOR_GEMM_ORDER)
// Secrets print as "set" or "unset", never their value.
std::string describe_options(const Options& options, unsigned scope);
// The same as JSON, for a --check that prints JSON: {"gemm.tune": {"value": "1", "from":
// "default", "variable": "CONVEYOR_GEMM_TUNE"}, ...}.
nlohmann::json options_json(const Options& options, unsigned scope);

// The process's snapshot: the one install_options() set, else the environment read at the first
// call (programs without a registry-aware main: tests, benchmarks); there a bad value is
// logged and its default kept.
const Options& process_options();
// Makes `options` the process's snapshot. A daemon's main calls it once, before anything reads
// process_options(); later it is an error (the snapshot never changes once read).
Status install_options(Options options);

// UCX's own variables as the environment has them now (nullopt: unset). Read live, not from
// the snapshot: UCX reads the environment itself when a channel starts, and a choice made
// beside it (leave the operator's UCX_TLS alone, say what chose the interface) must agree.
enum class UcxVariable { Tls, NetDevices, KeepaliveInterval, TcpConnNb, TcpMaxPoll };
std::optional<std::string> ucx_variable(UcxVariable variable);

}  // namespace conveyor

#include "common/options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <memory>
#include <mutex>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

namespace conveyor {
namespace {

constexpr unsigned kBoth = kCoordinatorScope | kWorkerScope;

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return out;
}

// ---- parsing: each returns the value or says what it expected (the caller names the variable)

Expected<bool> parse_bool(std::string_view text) {
  const std::string v = lower(text);
  if (v == "1" || v == "true" || v == "on") return true;
  if (v == "0" || v == "false" || v == "off") return false;
  return Status::error("expected 0 or 1 (or true/false, on/off)");
}

Expected<int64_t> parse_int(std::string_view text, int64_t lo, int64_t hi) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi)
    return Status::error("expected a whole number from " + std::to_string(lo) + " to " + std::to_string(hi));
  return v;
}

std::string list_text(std::span<const int> values) {
  std::string out;
  for (int v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
  return out;
}

Expected<int> parse_int_of(std::string_view text, std::span<const int> allowed) {
  auto v = parse_int(text, INT32_MIN, INT32_MAX);
  if (!v || !is_one_of(int(*v), allowed)) return Status::error("expected one of " + list_text(allowed));
  return int(*v);
}

Expected<spdlog::level::level_enum> parse_log_level(std::string_view text) {
  using namespace spdlog::level;
  // spdlog's from_str turns an unknown name into "off": a typo would silence the daemon.
  static const std::pair<const char*, level_enum> kLevels[] = {
      {"trace", trace}, {"debug", debug}, {"info", info},         {"warn", warn}, {"warning", warn},
      {"err", err},     {"error", err},   {"critical", critical}, {"off", off}};
  const std::string v = lower(text);
  for (const auto& [name, level] : kLevels)
    if (v == name) return level;
  return Status::error("expected trace, debug, info, warn, error, critical or off");
}

// ---- the kinds of option: each binds a parser and a printer to one member of Options

// `field(o)` is the option's member, for a const or a mutable Options.
template <class Field>
OptionSpec flag(OptionSpec spec, Field field) {
  spec.values = "0 or 1 (or true/false, on/off)";
  spec.parse = [field](std::string_view text, Options& o) -> Status {
    auto v = parse_bool(text);
    if (!v) return v.status();
    field(o) = *v;
    return {};
  };
  spec.show = [field](const Options& o) -> std::string { return field(o) ? "1" : "0"; };
  return spec;
}

// A bool shown and given as one of two words: `on` (true) or `off` (false).
template <class Field>
OptionSpec choice(OptionSpec spec, Field field, const char* on, const char* off) {
  spec.values = std::string(on) + " or " + off;
  spec.parse = [field, on = std::string(on), off = std::string(off)](std::string_view t, Options& o) -> Status {
    const std::string v = lower(t);
    if (v != on && v != off) return Status::error("expected " + on + " or " + off);
    field(o) = v == on;
    return {};
  };
  spec.show = [field, on, off](const Options& o) -> std::string { return field(o) ? on : off; };
  return spec;
}

template <class Field>
OptionSpec number(OptionSpec spec, Field field, int64_t lo, int64_t hi) {
  spec.parse = [field, lo, hi](std::string_view text, Options& o) -> Status {
    auto v = parse_int(text, lo, hi);
    if (!v) return v.status();
    field(o) = static_cast<std::remove_reference_t<decltype(field(o))>>(*v);
    return {};
  };
  spec.show = [field](const Options& o) { return std::to_string(field(o)); };
  return spec;
}

template <class Field>
OptionSpec number_of(OptionSpec spec, Field field, std::span<const int> allowed) {
  spec.parse = [field, allowed](std::string_view text, Options& o) -> Status {
    auto v = parse_int_of(text, allowed);
    if (!v) return v.status();
    field(o) = *v;
    return {};
  };
  spec.show = [field](const Options& o) { return std::to_string(field(o)); };
  return spec;
}

template <class Field>
OptionSpec text(OptionSpec spec, Field field) {
  spec.values = spec.values.empty() ? "any text" : spec.values;
  spec.parse = [field](std::string_view t, Options& o) -> Status {
    field(o) = std::string(t);
    return {};
  };
  spec.show = [field, secret = spec.secret](const Options& o) -> std::string {
    if (secret) return field(o).empty() ? "unset" : "set";
    return field(o).empty() ? "unset" : field(o);
  };
  return spec;
}

// ---- the registry

// The daemons' own: logging, tracing, secrets, the data plane.
void add_daemon_options(std::vector<OptionSpec>& s) {
  {
    OptionSpec level{.name = "log.level",
                     .variable = "CONVEYOR_LOG_LEVEL",
                     .meaning = "the least severe log lines written to stderr",
                     .values = "trace, debug, info, warn, error, critical or off",
                     .scope = kBoth};
    level.parse = [](std::string_view t, Options& o) -> Status {
      auto v = parse_log_level(t);
      if (!v) return v.status();
      o.log_level = *v;
      return {};
    };
    level.show = [](const Options& o) {
      const auto name = spdlog::level::to_string_view(o.log_level);
      return std::string(name.data(), name.size());
    };
    s.push_back(std::move(level));
  }
  s.push_back(text({.name = "trace.dir",
                    .variable = "CONVEYOR_TRACE_DIR",
                    .meaning = "a folder: each daemon appends a JSON line per step to a file of its own there "
                               "(unset: no trace)",
                    .values = "a folder path",
                    .scope = kBoth},
                   [](auto& o) -> auto& { return o.trace_dir; }));
  s.push_back(text({.name = "control.join_token",
                    .variable = "CONVEYOR_JOIN_TOKEN",
                    .meaning = "the cluster's join token (coordinator: when the cluster file has none, or with "
                               "--join-token-from-env; worker: without --join-token)",
                    .scope = kBoth,
                    .secret = true},
                   [](auto& o) -> auto& { return o.join_token; }));
  s.push_back(text({.name = "http.api_key",
                    .variable = "CONVEYOR_API_KEY",
                    .meaning = "the REST API key, when the cluster file has no http.api_key (the conveyor command "
                               "sends it too)",
                    .scope = kCoordinatorScope,
                    .secret = true},
                   [](auto& o) -> auto& { return o.api_key; }));
  s.push_back(number({.name = "data_plane.direct_min_bytes",
                      .variable = "CONVEYOR_DIRECT_MIN_BYTES",
                      .meaning = "micro-batches smaller than this go staged through host memory even where the "
                                 "GPU-to-GPU path is open (0: all direct)",
                      .values = "a whole number of bytes, 0 or more",
                      .scope = kWorkerScope},
                     [](auto& o) -> auto& { return o.direct_min_bytes; }, 0, INT64_MAX));
  s.push_back(number({.name = "data_plane.idle_spin_us",
                      .variable = "CONVEYOR_DATA_IDLE_SPIN_US",
                      .meaning = "microseconds the data plane's progress thread keeps polling after its last "
                                 "progress, and a send or a receive for its result, instead of sleeping: an "
                                 "answer within them costs no wake-up, at a core's cost (0: they sleep)",
                      .values = "0 to 1000000",
                      .scope = kBoth},
                     [](auto& o) -> auto& { return o.data_idle_spin_us; }, 0, 1000000));
  s.push_back(flag({.name = "data_plane.shared_memory",
                    .variable = "CONVEYOR_DATA_SHM",
                    .meaning = "the data plane talks over shared memory with the daemons of its host that do too, "
                               "each watching the other's process for its exit (0: TCP loopback, as between hosts)",
                    .scope = kBoth},
                   [](auto& o) -> auto& { return o.data_shared_memory; }));
}

// The kernels' (KernelOptions): a worker passes them down; kernels never read the environment.
void add_kernel_options(std::vector<OptionSpec>& s) {
  s.push_back(number({.name = "cpu.threads",
                      .variable = "CONVEYOR_CPU_THREADS",
                      .meaning = "threads of the CPU ops, the caller included (0: one per hardware thread; "
                                 "`conveyor local` sets cores / workers)",
                      .values = "0 to 4096",
                      .scope = kWorkerScope},
                     [](auto& o) -> auto& { return o.kernels.cpu_threads; }, 0, 4096));
  s.push_back(flag({.name = "deterministic",
                    .variable = "CONVEYOR_DETERMINISTIC",
                    .meaning = "fixed summation orders: a sequence's logits and K/V are the same bits in any batch "
                               "(0: the fastest kernels, whose order follows the batch)",
                    .scope = kWorkerScope},
                   [](auto& o) -> auto& { return o.kernels.gemm.deterministic; }));
  s.push_back(flag({.name = "gemm.tune",
                    .variable = "CONVEYOR_GEMM_TUNE",
                    .meaning = "time each product shape's candidate kernels once and keep the fastest (0: the "
                               "heuristic's first choice, untimed)",
                    .scope = kWorkerScope},
                   [](auto& o) -> auto& { return o.kernels.gemm.tuning; }));
  s.push_back(choice({.name = "gemm.order",
                      .variable = "CONVEYOR_GEMM_ORDER",
                      .meaning = "deterministic products: sequential (cuBLASLt's unsplit kernels and the sequential "
                                 "GEMV where they apply) or fixed (the fixed-order tiles for every shape)",
                      .scope = kWorkerScope},
                     [](auto& o) -> auto& { return o.kernels.gemm.sequential_order; }, "sequential", "fixed"));
  s.push_back(choice({.name = "gemm.int8_order",
                      .variable = "CONVEYOR_GEMM_INT8_ORDER",
                      .meaning = "deterministic int8 weight-only products: fixed (the fixed-order tiles: the fastest "
                                 "decode) or sequential (the sequential order over the dequantised weights: prefill "
                                 "at cuBLASLt's speed, decode slower; with gemm.order sequential)",
                      .scope = kWorkerScope},
                     [](auto& o) -> auto& { return o.kernels.gemm.int8_sequential_order; }, "sequential", "fixed"));
  s.push_back(flag({.name = "gemm.fp8_fast_accum",
                    .variable = "CONVEYOR_FP8_FAST_ACCUM",
                    .meaning = "cuBLASLt's fast FP8 accumulation for --fp8 stages (no periodic promotion to fp32: "
                               "faster, less exact)",
                    .scope = kWorkerScope},
                   [](auto& o) -> auto& { return o.kernels.gemm.fp8_fast_accum; }));
  s.push_back(number_of({.name = "gemv.k_split",
                         .variable = "CONVEYOR_GEMV_KSPLIT",
                         .meaning = "forced K slices of the fp16/bf16 GEMV, for measurements (0: chosen by N)",
                         .values = "0, 1, 2 or 4",
                         .scope = kWorkerScope},
                        [](auto& o) -> auto& { return o.kernels.gemm.gemv_k_split; }, kGemvKSplits));
  s.push_back(number({.name = "gemv.l2_prefetch_bytes",
                      .variable = "CONVEYOR_GEMV_L2_PREFETCH",
                      .meaning = "bytes of each weight row the GEMV prefetches into L2 while the kernel before it "
                                 "runs (0: none)",
                      .values = "0 to 1048576",
                      .scope = kWorkerScope},
                     [](auto& o) -> auto& { return o.kernels.gemm.gemv_l2_prefetch_bytes; }, 0,
                     kMaxGemvL2PrefetchBytes));
  s.push_back(number_of({.name = "int8_gemv.k_split",
                         .variable = "CONVEYOR_INT8_GEMV_KSPLIT",
                         .meaning = "forced K slices of the int8 GEMV, for measurements (0: chosen by shape and SMs)",
                         .values = "0, 1, 2, 4 or 8",
                         .scope = kWorkerScope},
                        [](auto& o) -> auto& { return o.kernels.gemm.int8_gemv_k_split; }, kInt8GemvKSplits));
  s.push_back(flag({.name = "cuda.pdl",
                    .variable = "CONVEYOR_PDL",
                    .meaning = "Programmatic Dependent Launch: a kernel may start while the one before it ends "
                               "(0: plain launches)",
                    .scope = kWorkerScope},
                   [](auto& o) -> auto& { return o.kernels.pdl; }));
}

// UCX's own variables: UCX reads them; Conveyor only looks (ucx_variable).
void add_ucx_options(std::vector<OptionSpec>& s) {
  s.push_back(text({.name = "ucx.tls",
                    .variable = "UCX_TLS",
                    .meaning = "UCX's transports; when set, Conveyor leaves its own choice (tcp, shared memory, "
                               "CUDA) to it",
                    .values = "UCX's syntax",
                    .scope = kBoth,
                    .ucx = true},
                   [](auto& o) -> auto& { return o.ucx_tls; }));
  s.push_back(text({.name = "ucx.net_devices",
                    .variable = "UCX_NET_DEVICES",
                    .meaning = "UCX's network devices; when set, it wins over --data-interface and the address's "
                               "interface",
                    .values = "UCX's syntax",
                    .scope = kBoth,
                    .ucx = true},
                   [](auto& o) -> auto& { return o.ucx_net_devices; }));
  s.push_back(text({.name = "ucx.keepalive_interval",
                    .variable = "UCX_KEEPALIVE_INTERVAL",
                    .meaning = "UCX's endpoint keepalive; when unset, Conveyor sets inf (off: with it UCX 1.13 can crash "
                               "when a peer resumes, transport/README.md)",
                    .values = "UCX's syntax",
                    .scope = kBoth,
                    .ucx = true},
                   [](auto& o) -> auto& { return o.ucx_keepalive_interval; }));
  s.push_back(text({.name = "ucx.tcp_conn_nb",
                    .variable = "UCX_TCP_CONN_NB",
                    .meaning = "UCX's TCP connect mode; when unset, Conveyor sets y (non-blocking: a peer whose SYNs "
                               "are dropped does not hold the data plane for minutes, transport/README.md)",
                    .values = "y or n",
                    .scope = kBoth,
                    .ucx = true},
                   [](auto& o) -> auto& { return o.ucx_tcp_conn_nb; }));
  s.push_back(text({.name = "ucx.tcp_max_poll",
                    .variable = "UCX_TCP_MAX_POLL",
                    .meaning = "UCX's TCP events handled per wait; when unset, Conveyor sets 1 (with more, UCX 1.13 can "
                               "handle an event of an endpoint an earlier event closed and abort, transport/README.md)",
                    .values = "UCX's syntax",
                    .scope = kBoth,
                    .ucx = true},
                   [](auto& o) -> auto& { return o.ucx_tcp_max_poll; }));
}

// In the order --check prints them: the daemons', the kernels', UCX's.
std::vector<OptionSpec> make_specs() {
  std::vector<OptionSpec> s;
  add_daemon_options(s);
  add_kernel_options(s);
  add_ucx_options(s);
  return s;
}

const std::vector<OptionSpec>& specs() {
  static const std::vector<OptionSpec> s = make_specs();
  return s;
}

// The value as an error quotes it: whole, unless it is long.
std::string quote(std::string_view value) {
  constexpr size_t kMax = 80;
  return "'" + std::string(value.substr(0, kMax)) + (value.size() > kMax ? "...'" : "'");
}

// Reads every option `env` sets into `out`; one line per bad value into `errors` (that option
// keeps its default).
void read_into(const Environment& env, Options& out, std::vector<std::string>& errors) {
  for (const OptionSpec& spec : specs()) {
    const std::optional<std::string> value = env(spec.variable);
    if (!value || value->empty()) continue;
    if (Status s = spec.parse(*value, out); !s) {
      errors.push_back(std::string(spec.variable) + "=" + (spec.secret ? "'...'" : quote(*value)) + ": " +
                       s.message());
      continue;
    }
    out.from_environment.emplace_back(spec.name);
  }
}

std::string source_of(const OptionSpec& spec, const Options& options) {
  return options.set_by_environment(spec.name) ? "env" : "default";
}

struct ProcessOptions {
  std::mutex mu;
  std::unique_ptr<const Options> snapshot;
};

ProcessOptions& process() {
  static ProcessOptions p;
  return p;
}

}  // namespace

bool Options::set_by_environment(std::string_view name) const {
  return std::find(from_environment.begin(), from_environment.end(), name) != from_environment.end();
}

std::span<const OptionSpec> option_specs() { return specs(); }

const OptionSpec* find_option(std::string_view name) {
  for (const OptionSpec& spec : specs())
    if (spec.name == name || spec.variable == name) return &spec;
  return nullptr;
}

Environment process_environment() {
  return [](std::string_view variable) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(variable).c_str());
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
}

Expected<Options> read_options(const Environment& env) {
  Options out;
  std::vector<std::string> errors;
  read_into(env, out, errors);
  if (errors.empty()) return out;
  std::string message = "bad environment: ";
  for (size_t i = 0; i < errors.size(); ++i) message += (i ? "; " : "") + errors[i];
  return Status::error(message);
}

std::string describe_options(const Options& options, unsigned scope) {
  std::string out;
  for (const OptionSpec& spec : specs()) {
    if (!(spec.scope & scope)) continue;
    const bool from_env = options.set_by_environment(spec.name);
    out += std::string(spec.name) + " = " + spec.show(options) + " (" + (from_env ? "env " : "default, ") +
           std::string(spec.variable) + ")\n";
  }
  return out;
}

nlohmann::json options_json(const Options& options, unsigned scope) {
  nlohmann::json out = nlohmann::json::object();
  for (const OptionSpec& spec : specs())
    if (spec.scope & scope)
      out[std::string(spec.name)] = {
          {"value", spec.show(options)}, {"from", source_of(spec, options)}, {"variable", spec.variable}};
  return out;
}

const Options& process_options() {
  ProcessOptions& p = process();
  std::lock_guard lock(p.mu);
  if (!p.snapshot) {
    auto options = std::make_unique<Options>();
    std::vector<std::string> errors;
    read_into(process_environment(), *options, errors);
    for (const std::string& e : errors) spdlog::error("options: {}; its default stays", e);
    p.snapshot = std::move(options);
  }
  return *p.snapshot;
}

Status install_options(Options options) {
  ProcessOptions& p = process();
  std::lock_guard lock(p.mu);
  if (p.snapshot)
    return Status::error("options: the process's options were already read; install_options must come first, once");
  p.snapshot = std::make_unique<const Options>(std::move(options));
  return {};
}

std::optional<std::string> ucx_variable(UcxVariable variable) {
  // In UcxVariable's order; each is declared above as UCX's own (tests/common/test_options.cc).
  static constexpr std::string_view kNames[] = {"UCX_TLS", "UCX_NET_DEVICES", "UCX_KEEPALIVE_INTERVAL",
                                                "UCX_TCP_CONN_NB", "UCX_TCP_MAX_POLL"};
  return process_environment()(kNames[int(variable)]);
}

}  // namespace conveyor

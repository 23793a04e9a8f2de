// The options registry (common/options.h): every option's declaration is whole, defaults are
// today's behaviour, each kind of value parses, a bad value's error names the variable and the
// value, --check prints each option as "name = value (default|env)", docs/OPERATIONS.md lists
// every variable, and both daemons print their options under --check.
#include "common/options.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

// An environment of exactly these variables.
Environment env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
}

Options read_ok(std::map<std::string, std::string> vars) {
  auto o = read_options(env_of(std::move(vars)));
  EXPECT_TRUE(o.ok()) << o.error();
  return o.ok() ? *o : Options{};
}

std::string read_error(std::map<std::string, std::string> vars) {
  auto o = read_options(env_of(std::move(vars)));
  EXPECT_FALSE(o.ok());
  return o.ok() ? "" : o.error();
}

TEST(Options, EveryDeclarationIsWholeAndUnique) {
  std::set<std::string_view> names, variables;
  for (const OptionSpec& s : option_specs()) {
    EXPECT_FALSE(s.name.empty());
    EXPECT_TRUE(names.insert(s.name).second) << "two options named " << s.name;
    EXPECT_TRUE(variables.insert(s.variable).second) << "two options read " << s.variable;
    EXPECT_TRUE(s.variable.starts_with(s.ucx ? "UCX_" : "CONVEYOR_")) << s.variable;
    EXPECT_FALSE(s.meaning.empty()) << s.name;
    EXPECT_FALSE(s.values.empty()) << s.name;
    EXPECT_NE(s.scope & (kCoordinatorScope | kWorkerScope), 0u) << s.name;
    ASSERT_TRUE(s.parse && s.show) << s.name;
    EXPECT_EQ(find_option(s.name), &s);
    EXPECT_EQ(find_option(s.variable), &s);
  }
  EXPECT_EQ(find_option("no.such.option"), nullptr);
  // The variables issue 27 found read across the tree, each declared once.
  for (const char* v : {"CONVEYOR_GEMV_L2_PREFETCH", "CONVEYOR_GEMV_KSPLIT", "CONVEYOR_GEMM_TUNE", "CONVEYOR_GEMM_ORDER",
                        "CONVEYOR_GEMM_INT8_ORDER",
                        "CONVEYOR_DETERMINISTIC", "CONVEYOR_FP8_FAST_ACCUM", "CONVEYOR_PDL", "CONVEYOR_INT8_GEMV_KSPLIT",
                        "CONVEYOR_CPU_THREADS", "CONVEYOR_TRACE_DIR", "UCX_TLS", "UCX_NET_DEVICES",
                        "UCX_KEEPALIVE_INTERVAL", "CONVEYOR_LOG_LEVEL", "CONVEYOR_JOIN_TOKEN", "CONVEYOR_API_KEY",
                        "CONVEYOR_DIRECT_MIN_BYTES", "CONVEYOR_DATA_IDLE_SPIN_US", "CONVEYOR_DATA_SHM", "UCX_TCP_CONN_NB",
                        "UCX_TCP_MAX_POLL"})
    EXPECT_NE(find_option(v), nullptr) << v << " is not declared";
  for (const char* v : {"UCX_TLS", "UCX_NET_DEVICES", "UCX_KEEPALIVE_INTERVAL", "UCX_TCP_CONN_NB", "UCX_TCP_MAX_POLL"})
    EXPECT_TRUE(find_option(v)->ucx) << v;
}

// The defaults are what the programs did before the registry, with nothing set.
TEST(Options, DefaultsAreTodaysBehaviour) {
  const Options o = read_ok({});
  EXPECT_TRUE(o.from_environment.empty());
  const GemmOptions& g = o.kernels.gemm;
  EXPECT_TRUE(g.tuning);
  EXPECT_TRUE(g.deterministic);
  EXPECT_TRUE(g.sequential_order);
  EXPECT_FALSE(g.fp8_fast_accum);
  EXPECT_EQ(g.gemv_k_split, 0);
  EXPECT_EQ(g.gemv_l2_prefetch_bytes, 0);
  EXPECT_EQ(g.int8_gemv_k_split, 0);
  EXPECT_TRUE(o.kernels.pdl);
  EXPECT_EQ(o.kernels.cpu_threads, 0);
  EXPECT_EQ(o.log_level, spdlog::level::info);
  EXPECT_EQ(o.trace_dir, "");
  EXPECT_EQ(o.join_token, "");
  EXPECT_EQ(o.api_key, "");
  EXPECT_EQ(o.direct_min_bytes, int64_t(64) << 10);
  EXPECT_TRUE(o.data_shared_memory);
  EXPECT_EQ(o.data_idle_spin_us, 0);
  EXPECT_EQ(o.ucx_tls, "");
  // An empty variable counts as unset, as it did.
  const Options empty = read_ok({{"CONVEYOR_GEMM_TUNE", ""}, {"CONVEYOR_TRACE_DIR", ""}, {"UCX_TLS", ""}});
  EXPECT_TRUE(empty.kernels.gemm.tuning);
  EXPECT_TRUE(empty.from_environment.empty());
}

TEST(Options, EachKindParses) {
  const Options o = read_ok({{"CONVEYOR_GEMM_TUNE", "0"},
                             {"CONVEYOR_DETERMINISTIC", "off"},
                             {"CONVEYOR_GEMM_ORDER", "fixed"},
                             {"CONVEYOR_GEMM_INT8_ORDER", "sequential"},
                             {"CONVEYOR_FP8_FAST_ACCUM", "TRUE"},
                             {"CONVEYOR_GEMV_KSPLIT", "4"},
                             {"CONVEYOR_GEMV_L2_PREFETCH", "4096"},
                             {"CONVEYOR_INT8_GEMV_KSPLIT", "8"},
                             {"CONVEYOR_PDL", "0"},
                             {"CONVEYOR_CPU_THREADS", "3"},
                             {"CONVEYOR_LOG_LEVEL", "debug"},
                             {"CONVEYOR_TRACE_DIR", "/tmp/traces"},
                             {"CONVEYOR_JOIN_TOKEN", "s3cret"},
                             {"CONVEYOR_API_KEY", "k"},
                             {"CONVEYOR_DIRECT_MIN_BYTES", "0"},
                             {"CONVEYOR_DATA_IDLE_SPIN_US", "300"},
                             {"CONVEYOR_DATA_SHM", "0"},
                             {"UCX_TLS", "tcp,self"},
                             {"UCX_NET_DEVICES", "lo"},
                             {"UCX_KEEPALIVE_INTERVAL", "2s"},
                             {"UCX_TCP_CONN_NB", "n"},
                             {"UCX_TCP_MAX_POLL", "4"}});
  const GemmOptions& g = o.kernels.gemm;
  EXPECT_FALSE(g.tuning);
  EXPECT_FALSE(g.deterministic);
  EXPECT_FALSE(g.sequential_order);
  EXPECT_TRUE(g.int8_sequential_order);
  EXPECT_TRUE(g.fp8_fast_accum);
  EXPECT_EQ(g.gemv_k_split, 4);
  EXPECT_EQ(g.gemv_l2_prefetch_bytes, 4096);
  EXPECT_EQ(g.int8_gemv_k_split, 8);
  EXPECT_FALSE(o.kernels.pdl);
  EXPECT_EQ(o.kernels.cpu_threads, 3);
  EXPECT_EQ(o.log_level, spdlog::level::debug);
  EXPECT_EQ(o.trace_dir, "/tmp/traces");
  EXPECT_EQ(o.join_token, "s3cret");
  EXPECT_EQ(o.api_key, "k");
  EXPECT_EQ(o.direct_min_bytes, 0);
  EXPECT_EQ(o.data_idle_spin_us, 300);
  EXPECT_FALSE(o.data_shared_memory);
  EXPECT_EQ(o.ucx_tls, "tcp,self");
  EXPECT_EQ(o.ucx_net_devices, "lo");
  EXPECT_EQ(o.ucx_keepalive_interval, "2s");
  EXPECT_EQ(o.ucx_tcp_conn_nb, "n");
  EXPECT_EQ(o.ucx_tcp_max_poll, "4");
  EXPECT_EQ(o.from_environment.size(), option_specs().size());
  EXPECT_TRUE(o.set_by_environment("gemm.tune"));
  EXPECT_EQ(read_ok({{"CONVEYOR_GEMM_ORDER", "sequential"}}).kernels.gemm.sequential_order, true);
  EXPECT_EQ(read_ok({{"CONVEYOR_GEMM_INT8_ORDER", "Sequential"}}).kernels.gemm.int8_sequential_order, true);
  EXPECT_EQ(read_error({{"CONVEYOR_GEMM_INT8_ORDER", "tiles"}}),
            "bad environment: CONVEYOR_GEMM_INT8_ORDER='tiles': expected sequential or fixed");
  EXPECT_EQ(read_ok({{"CONVEYOR_LOG_LEVEL", "warning"}}).log_level, spdlog::level::warn);
}

// What each option prints, read back, is the same option: --check's output can be pasted into
// an environment file.
TEST(Options, ShownValuesReadBack) {
  const Options defaults;
  for (const OptionSpec& s : option_specs()) {
    if (s.secret || s.ucx || s.show(defaults) == "unset") continue;  // text that is unset by default
    Options o;
    ASSERT_TRUE(s.parse(s.show(defaults), o).ok()) << s.name << " = " << s.show(defaults);
    EXPECT_EQ(s.show(o), s.show(defaults)) << s.name;
  }
}

TEST(Options, ABadValueNamesTheVariableAndTheValue) {
  EXPECT_EQ(read_error({{"CONVEYOR_GEMM_TUNE", "yes please"}}),
            "bad environment: CONVEYOR_GEMM_TUNE='yes please': expected 0 or 1 (or true/false, on/off)");
  EXPECT_EQ(read_error({{"CONVEYOR_GEMV_KSPLIT", "3"}}),
            "bad environment: CONVEYOR_GEMV_KSPLIT='3': expected one of 0, 1, 2, 4");
  EXPECT_EQ(read_error({{"CONVEYOR_INT8_GEMV_KSPLIT", "16"}}),
            "bad environment: CONVEYOR_INT8_GEMV_KSPLIT='16': expected one of 0, 1, 2, 4, 8");
  EXPECT_EQ(read_error({{"CONVEYOR_CPU_THREADS", "-1"}}),
            "bad environment: CONVEYOR_CPU_THREADS='-1': expected a whole number from 0 to 4096");
  EXPECT_EQ(read_error({{"CONVEYOR_CPU_THREADS", "4x"}}),
            "bad environment: CONVEYOR_CPU_THREADS='4x': expected a whole number from 0 to 4096");
  EXPECT_EQ(read_error({{"CONVEYOR_GEMV_L2_PREFETCH", "2097152"}}),
            "bad environment: CONVEYOR_GEMV_L2_PREFETCH='2097152': expected a whole number from 0 to 1048576");
  EXPECT_EQ(read_error({{"CONVEYOR_GEMM_ORDER", "random"}}),
            "bad environment: CONVEYOR_GEMM_ORDER='random': expected sequential or fixed");
  // spdlog would have turned an unknown level into "off": the daemon went silent.
  EXPECT_EQ(read_error({{"CONVEYOR_LOG_LEVEL", "verbose"}}),
            "bad environment: CONVEYOR_LOG_LEVEL='verbose': expected trace, debug, info, warn, error, critical or off");
  EXPECT_NE(read_error({{"CONVEYOR_DIRECT_MIN_BYTES", "1MiB"}}).find("CONVEYOR_DIRECT_MIN_BYTES='1MiB'"),
            std::string::npos);
  EXPECT_EQ(read_error({{"CONVEYOR_DATA_IDLE_SPIN_US", "2000000"}}),
            "bad environment: CONVEYOR_DATA_IDLE_SPIN_US='2000000': expected a whole number from 0 to 1000000");
  // Every bad variable at once, so one restart fixes them all.
  const std::string both = read_error({{"CONVEYOR_PDL", "2"}, {"CONVEYOR_DETERMINISTIC", "maybe"}});
  EXPECT_NE(both.find("CONVEYOR_PDL='2'"), std::string::npos) << both;
  EXPECT_NE(both.find("CONVEYOR_DETERMINISTIC='maybe'"), std::string::npos) << both;
  // A long value is cut.
  const std::string long_value(200, 'x');
  EXPECT_NE(read_error({{"CONVEYOR_GEMM_ORDER", long_value}}).find(std::string(80, 'x') + "...'"), std::string::npos);
}

TEST(Options, CheckPrintsNameValueAndSource) {
  const Options o = read_ok({{"CONVEYOR_GEMM_ORDER", "fixed"}, {"CONVEYOR_JOIN_TOKEN", "s3cret"}});
  const std::string worker = describe_options(o, kWorkerScope);
  EXPECT_NE(worker.find("gemm.tune = 1 (default, CONVEYOR_GEMM_TUNE)\n"), std::string::npos) << worker;
  EXPECT_NE(worker.find("gemm.order = fixed (env CONVEYOR_GEMM_ORDER)\n"), std::string::npos) << worker;
  EXPECT_NE(worker.find("control.join_token = set (env CONVEYOR_JOIN_TOKEN)\n"), std::string::npos) << worker;
  EXPECT_NE(worker.find("trace.dir = unset (default, CONVEYOR_TRACE_DIR)\n"), std::string::npos) << worker;
  EXPECT_NE(worker.find("data_plane.direct_min_bytes = 65536 (default, CONVEYOR_DIRECT_MIN_BYTES)\n"),
            std::string::npos)
      << worker;
  EXPECT_EQ(worker.find("s3cret"), std::string::npos) << "a secret printed: " << worker;
  EXPECT_EQ(worker.find("http.api_key"), std::string::npos) << "the worker has no REST API: " << worker;
  // One line per option of the scope.
  size_t worker_options = 0;
  for (const OptionSpec& s : option_specs()) worker_options += (s.scope & kWorkerScope) ? 1 : 0;
  EXPECT_EQ(size_t(std::count(worker.begin(), worker.end(), '\n')), worker_options);

  const std::string coordinator = describe_options(o, kCoordinatorScope);
  EXPECT_EQ(coordinator.find("gemm."), std::string::npos) << "the coordinator runs no kernels: " << coordinator;
  EXPECT_NE(coordinator.find("http.api_key = unset (default, CONVEYOR_API_KEY)\n"), std::string::npos) << coordinator;

  const nlohmann::json j = options_json(o, kCoordinatorScope);
  EXPECT_EQ(j["log.level"]["value"], "info") << j;
  EXPECT_EQ(j["log.level"]["from"], "default") << j;
  EXPECT_EQ(j["control.join_token"]["value"], "set") << j;
  EXPECT_EQ(j["control.join_token"]["from"], "env") << j;
  EXPECT_EQ(j["control.join_token"]["variable"], "CONVEYOR_JOIN_TOKEN") << j;
  EXPECT_FALSE(j.contains("gemm.tune")) << j;
}

// The operator's guide lists every option (its variable and its name, on one line).
TEST(Options, OperationsGuideListsEveryOption) {
  std::ifstream f(testing::source_dir() + "/docs/OPERATIONS.md");
  ASSERT_TRUE(f) << "docs/OPERATIONS.md";
  std::vector<std::string> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(line);
  for (const OptionSpec& s : option_specs()) {
    const std::string variable = "`" + std::string(s.variable) + "`", name = "`" + std::string(s.name) + "`";
    const bool listed = std::any_of(lines.begin(), lines.end(), [&](const std::string& l) {
      return l.starts_with("| ") && l.find(variable) != std::string::npos && l.find(name) != std::string::npos;
    });
    EXPECT_TRUE(listed) << "docs/OPERATIONS.md has no table row for " << s.variable << " (" << s.name << ")";
  }
}

// UCX reads its variables itself when a channel starts, so Conveyor's look at them is live.
TEST(Options, UcxVariablesAreReadLive) {
  {
    testing::ScopedEnv unset("UCX_KEEPALIVE_INTERVAL", nullptr);
    EXPECT_FALSE(ucx_variable(UcxVariable::KeepaliveInterval));
  }
  testing::ScopedEnv set("UCX_KEEPALIVE_INTERVAL", "3s");
  EXPECT_EQ(ucx_variable(UcxVariable::KeepaliveInterval), "3s");
  testing::ScopedEnv tls("UCX_TLS", "tcp");
  EXPECT_EQ(ucx_variable(UcxVariable::Tls), "tcp");
  testing::ScopedEnv devices("UCX_NET_DEVICES", "lo");
  EXPECT_EQ(ucx_variable(UcxVariable::NetDevices), "lo");
  testing::ScopedEnv connect_mode("UCX_TCP_CONN_NB", "n");
  EXPECT_EQ(ucx_variable(UcxVariable::TcpConnNb), "n");
  testing::ScopedEnv max_poll("UCX_TCP_MAX_POLL", "4");
  EXPECT_EQ(ucx_variable(UcxVariable::TcpMaxPoll), "4");
}

// A daemon installs its snapshot once, before anything reads it; it never changes after.
TEST(Options, TheProcessSnapshotIsInstalledOnce) {
  Options mine;
  mine.trace_dir = "/tmp/installed";
  ASSERT_TRUE(install_options(mine).ok());
  EXPECT_EQ(process_options().trace_dir, "/tmp/installed");
  const Status again = install_options(Options{});
  EXPECT_FALSE(again.ok());
  EXPECT_NE(again.message().find("install_options must come first, once"), std::string::npos) << again.message();
  EXPECT_EQ(process_options().trace_dir, "/tmp/installed");
}

// Runs `command` through the shell; its stdout, and its exit status in `rc`.
std::string run(const std::string& command, int& rc) { return testing::run_shell(command, rc); }

TEST(Options, DaemonsCheckPrintsTheirOptions) {
  const std::string worker = testing::bin_dir() + "/conveyor-worker";
  const std::string coordinator = testing::bin_dir() + "/conveyor-coordinator";
  if (!std::filesystem::exists(worker) || !std::filesystem::exists(coordinator))
    GTEST_SKIP() << "the daemons are not built in " << testing::bin_dir();
  int rc = -1;
  std::string out = run("env -i CONVEYOR_GEMM_ORDER=fixed CONVEYOR_JOIN_TOKEN=t " + worker + " --check", rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("gemm.order = fixed (env CONVEYOR_GEMM_ORDER)\n"), std::string::npos) << out;
  EXPECT_NE(out.find("cpu.threads = 0 (default, CONVEYOR_CPU_THREADS)\n"), std::string::npos) << out;
  EXPECT_NE(out.find("control.join_token = set (env CONVEYOR_JOIN_TOKEN)\n"), std::string::npos) << out;

  // A bad value stops the daemon at start-up, naming the variable and the value.
  out = run("env -i CONVEYOR_CPU_THREADS=many " + worker + " --check 2>&1", rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("conveyor-worker: bad environment: CONVEYOR_CPU_THREADS='many'"), std::string::npos) << out;
  out = run("env -i CONVEYOR_LOG_LEVEL=loud " + coordinator + " --config /nonexistent.yaml --check 2>&1", rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("conveyor-coordinator: bad environment: CONVEYOR_LOG_LEVEL='loud'"), std::string::npos) << out;

  // The coordinator's --check is JSON; its options are under "options".
  const std::string model = testing::source_dir() + "/models/brown-gpt2";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("options-check-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "cluster.yaml") << "model: {path: \"" << model << "\"}\n"
                                      << "control: {host: 127.0.0.1, port: 0, join_token: \"t\"}\n";
  out = run("env -i CONVEYOR_TRACE_DIR=/tmp/t " + coordinator + " --config " + (dir / "cluster.yaml").string() +
                " --check",
            rc);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(rc, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["options"]["trace.dir"]["value"], "/tmp/t") << j;
  EXPECT_EQ(j["options"]["trace.dir"]["from"], "env") << j;
  EXPECT_EQ(j["options"]["log.level"]["from"], "default") << j;
}

}  // namespace
}  // namespace conveyor

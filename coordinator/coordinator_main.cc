// conveyor-coordinator: the coordinator daemon (REST API + control plane + scheduler).
//   conveyor-coordinator --config cluster.yaml [--http-host H] [--http-port P]
//                        [--control-host H] [--control-port P] [--data-interface IF]
//                        [--join-token-from-env] [--check]
// The flags override the cluster file's http.host/port and control.host/port/data_interface (a
// launcher such as scripts/slurm/conveyor.sbatch knows the node's address, the file does not);
// --check validates the whole cluster file (every mistake, one a line with its line number; the
// model's config and tokenizer load) and prints the settings the daemon would run with as JSON;
// its "options" are the environment's (common/options.h), read once, first: a bad value stops
// the daemon naming it.
// Prints "conveyor-coordinator: listening on http://HOST:PORT (control tcp://HOST:PORT)"
// once both sockets are bound, so a launcher can find ports chosen with 0.
#include <sys/stat.h>

#include <csignal>
#include <cstdio>
#include <optional>
#include <iostream>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "common/options.h"
#include "common/service.h"
#include "coordinator/cluster_config.h"
#include "coordinator/coordinator.h"
#include "coordinator/rest/http_server.h"
#include "coordinator/metrics.h"
#include "coordinator/request_log.h"
#include "transport/net_interface.h"

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

constexpr int kBadInput = 2;  // a bad flag, file or environment (1: a failure to start)

// The flags that override the cluster file.
struct Flags {
  std::string config_path;
  std::optional<std::string> http_host, control_host, data_interface, chat_template;
  std::optional<int> http_port, control_port;
  bool token_from_env = false, check = false;
};

void add_flags(CLI::App& app, Flags& f) {
  app.add_option("--config", f.config_path, "the cluster file (YAML)")->required();
  app.add_option("--http-host", f.http_host, "address the REST API binds (overrides http.host; 0.0.0.0: every interface)");
  app.add_option("--http-port", f.http_port, "REST port (overrides http.port; 0: a free one)")->check(CLI::Range(0, 65535));
  app.add_option("--control-host", f.control_host,
                 "address the control plane binds, and whose interface the data plane uses (overrides control.host)");
  app.add_option("--control-port", f.control_port, "control port (overrides control.port; 0: a free one)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--data-interface", f.data_interface,
                 "the data plane's network interface(s), UCX_NET_DEVICES syntax, or 'any' (overrides "
                 "control.data_interface; default: the interface holding the control host's address, lo for "
                 "127.0.0.1, every one for 0.0.0.0; UCX_NET_DEVICES in the environment wins)");
  app.add_option("--chat-template", f.chat_template,
                 "the chat template for /v1/chat/completions: a built-in name (chatml, llama2, llama3, mistral, "
                 "zephyr, gemma) or a Jinja file (overrides model.chat_template and the model's tokenizer_config.json)");
  app.add_flag("--join-token-from-env", f.token_from_env,
               "take the join token from $CONVEYOR_JOIN_TOKEN even when the file names one (a launcher's token)");
  app.add_flag("--check", f.check, "validate the cluster file (every mistake, with its line) and print the settings the daemon "
               "would run with (JSON, no secrets); exit status 2 when the file has mistakes");
}

// The flags over the file's values; an error names the flag.
conveyor::Status apply_flags(const Flags& f, const conveyor::Options& options, conveyor::ClusterConfig& cfg) {
  for (const auto& [flag, value] : {std::pair{"--http-host", &f.http_host}, std::pair{"--control-host", &f.control_host}})
    if (value->has_value() && (*value)->empty())
      return conveyor::Status::error(std::string(flag) + " needs an address (0.0.0.0 binds every interface)");
  if (f.data_interface && f.data_interface->empty())
    return conveyor::Status::error("--data-interface needs an interface name, or 'any'");
  if (f.http_host) cfg.http_host = *f.http_host;
  if (f.http_port) cfg.http_port = *f.http_port;
  if (f.control_host) cfg.control_host = *f.control_host;
  if (f.control_port) cfg.control_port = *f.control_port;
  if (f.data_interface) cfg.data_interface = *f.data_interface;
  if (f.chat_template) cfg.chat_template = *f.chat_template;
  if (f.token_from_env) {
    if (options.join_token.empty())
      return conveyor::Status::error("--join-token-from-env but CONVEYOR_JOIN_TOKEN is unset or empty");
    cfg.join_token = options.join_token;
  }
  return conveyor::ok_status();
}

// The scheduler's settings as the file gave them (0: auto, from the pipeline's workers).
nlohmann::json scheduler_json(const conveyor::ClusterConfig& cfg) {
  return {{"in_flight", cfg.in_flight_auto ? 0 : cfg.in_flight},
          {"max_batch_tokens", cfg.max_batch_tokens},
          {"prefill_chunk", cfg.prefill_chunk},
          {"prefill_tokens_per_batch", cfg.prefill_tokens_per_batch},
          {"max_sequences_per_batch", cfg.max_sequences_per_batch},
          {"max_running", cfg.max_running},
          {"max_queue", cfg.max_queue},
          {"shutdown_timeout_ms", cfg.shutdown_timeout_ms},
          {"pipeline_wait_ms", cfg.pipeline_wait_ms},
          {"batch_timeout_ms", cfg.batch_timeout_ms},
          {"request_timeout_ms", cfg.request_timeout_ms},
          {"prefix_cache", cfg.prefix_cache},
          {"step_ahead", cfg.step_ahead}};
}

// --check: the settings the daemon would run with, as JSON (no secrets).
conveyor::Expected<nlohmann::json> check_json(const Flags& f, const conveyor::Options& options,
                                              const conveyor::ClusterConfig& cfg, const conveyor::ChatSettings& chat) {
  // The data plane's interface, as Coordinator::start chooses it, and what chose it.
  auto iface = conveyor::transport::choose_data_interface(cfg.control_host, cfg.data_interface);
  if (!iface) return conveyor::Status::error("control host " + cfg.control_host + ": " + iface.error());
  return nlohmann::json{
      {"source", cfg.source},
      {"model",
       {{"path", cfg.model_path},
        {"name", cfg.model_name},
        {"chat_template", chat.chat_template ? nlohmann::json(chat.chat_template->name()) : nlohmann::json(nullptr)}}},
      {"http",
       {{"host", cfg.http_host},
        {"port", cfg.http_port},
        {"api_key_set", !cfg.api_key.empty()},
        {"cors_origins", cfg.cors_origins}}},
      {"control",
       {{"host", cfg.control_host},
        {"port", cfg.control_port},
        {"join_token_from", f.token_from_env ? "environment" : "file or environment"},
        {"data_interface", iface->shown},
        {"data_interface_from", iface->source}}},
      {"pipeline", {{"stages", cfg.stages}, {"replicas", cfg.replicas}, {"layers", cfg.layers}}},
      {"scheduler", scheduler_json(cfg)},
      {"heartbeat", {{"interval_ms", cfg.heartbeat_interval_ms}, {"liveness_ms", cfg.liveness_ms}}},
      {"log", {{"format", cfg.log_json ? "json" : "text"}}},
      {"objective", conveyor::objective_name(cfg.objective)},
      {"options", conveyor::options_json(options, conveyor::kCoordinatorScope)}};
}

// What the REST layer serves from: the model, the coordinator's calls, the metrics.
conveyor::RestContext rest_context(const conveyor::ClusterConfig& cfg, std::shared_ptr<const conveyor::Tokenizer> tokenizer,
                                   std::shared_ptr<const conveyor::ChatSettings> chat, conveyor::Coordinator* c,
                                   conveyor::Metrics* metrics) {
  conveyor::RestContext ctx;
  ctx.chat = std::move(chat);
  ctx.cors_origins = cfg.cors_origins;
  ctx.model_name = cfg.model_name;
  ctx.config = cfg.model;
  ctx.tokenizer = std::move(tokenizer);
  ctx.backend = c;
  ctx.metrics = metrics;
  ctx.api_key = cfg.api_key;
  ctx.health = [c] { return c->health(); };
  ctx.cluster = [c] { return c->cluster(); };
  ctx.drain = [c](const std::string& worker) { return c->drain(worker); };
  ctx.plan = [c](const conveyor::PlanRequest& request) { return c->plan(request); };
  return ctx;
}

// Until SIGINT or SIGTERM, then gracefully: no new requests, the accepted ones finish
// (streams included) within the shutdown timeout, then stop.
void serve_until_stopped(conveyor::Coordinator& c, conveyor::HttpServer& http, const conveyor::ClusterConfig& cfg) {
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    conveyor::service::watchdog_tick();
  }
  conveyor::service::stopping();
  spdlog::info("coordinator: shutting down: taking no new requests, finishing the accepted ones (up to {} s)",
               cfg.shutdown_timeout_ms / 1000.0);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(cfg.shutdown_timeout_ms);
  size_t left = 0;
  while ((left = c.quiesce(std::chrono::seconds(1))) > 0 && std::chrono::steady_clock::now() < give_up)
    conveyor::service::watchdog_tick();
  if (left) spdlog::warn("coordinator: {} request(s) still running after {} ms are failed", left, cfg.shutdown_timeout_ms);
  c.stop();  // fails what is left; the REST server below still writes those answers
  if (const int cut = http.shutdown(std::chrono::seconds(5)))
    spdlog::warn("coordinator: {} answer(s) were still being written when the REST server stopped", cut);
}

// A cluster file that holds a secret should be its owner's alone (chmod 600): says so on
// stderr when group or others may read it. The daemon still starts.
void warn_if_secrets_readable(const conveyor::ClusterConfig& cfg) {
  struct stat st {};
  if (cfg.secrets_in_file.empty() || ::stat(cfg.source.c_str(), &st) != 0 || (st.st_mode & 077) == 0) return;
  std::string keys;
  for (const std::string& k : cfg.secrets_in_file) keys += (keys.empty() ? "" : ", ") + k;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", unsigned(st.st_mode & 07777));
  std::cerr << "conveyor-coordinator: warning: " << cfg.source << " holds secrets (" << keys << ") and others may read it "
            << "(mode " << mode << "): chmod 600 it, or pass them in the environment (CONVEYOR_JOIN_TOKEN, "
            << "CONVEYOR_API_KEY)\n";
}

// Each line of `why` (a cluster file's mistakes are one a line) under the program's name.
int fail(const std::string& why, int code) {
  std::istringstream lines(why);
  for (std::string line; std::getline(lines, line);) std::cerr << "conveyor-coordinator: " << line << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"conveyor-coordinator: the Conveyor coordinator daemon"};
  app.option_defaults()->always_capture_default();  // --help shows each default
  add_flags(app, flags);
  CLI11_PARSE(app, argc, argv);
  auto options = conveyor::read_options();
  if (!options) return fail(options.error(), kBadInput);
  // The snapshot the libraries read (the cluster file's secrets, the trace folder).
  if (conveyor::Status s = conveyor::install_options(*options); !s) return fail(s.message(), 1);
  spdlog::set_default_logger(spdlog::stderr_color_mt("coordinator"));  // stdout is for the ready line
  spdlog::set_level(options->log_level);

  auto cfg = conveyor::load_cluster_config(flags.config_path);
  if (!cfg) return fail(cfg.error(), kBadInput);
  if (conveyor::Status s = apply_flags(flags, *options, *cfg); !s) return fail(s.message(), kBadInput);
  warn_if_secrets_readable(*cfg);
  auto tok = conveyor::Tokenizer::load(cfg->model_path);
  if (!tok) return fail(cfg->source + ": model.path: " + tok.error(), kBadInput);
  auto chat = conveyor::load_chat_settings(cfg->model_path, cfg->chat_template);
  if (!chat) return fail(chat.error(), kBadInput);
  if (flags.check) {
    auto out = check_json(flags, *options, *cfg, **chat);
    if (!out) return fail(out.error(), kBadInput);
    std::cout << out->dump(2) << std::endl;
    return 0;
  }
  if (cfg->log_json) conveyor::set_log_format(conveyor::LogFormat::Json);
  auto tokenizer = std::make_shared<const conveyor::Tokenizer>(std::move(tok).value());
  conveyor::Metrics metrics;
  auto coord = conveyor::Coordinator::start(*cfg, tokenizer, &metrics);
  if (!coord) return fail(coord.error(), 1);
  conveyor::Coordinator* c = coord->get();
  auto http = conveyor::HttpServer::start(cfg->http_host, cfg->http_port,
                                          rest_context(*cfg, tokenizer, std::move(chat).value(), c, &metrics),
                                          cfg->http_threads);
  if (!http) return fail(http.error(), 1);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::cout << "conveyor-coordinator: listening on http://" << cfg->http_host << ":" << (*http)->port()
            << " (control tcp://" << cfg->control_host << ":" << c->control_port() << ")" << std::endl;
  conveyor::service::ready("serving " + cfg->model_name + " on http://" + cfg->http_host + ":" +
                           std::to_string((*http)->port()));
  serve_until_stopped(*c, **http, *cfg);
  return 0;
}

// conveyor-coordinator: the coordinator daemon (REST API + control plane + scheduler).
//   conveyor-coordinator --config cluster.yaml
// Prints "conveyor-coordinator: listening on http://HOST:PORT (control tcp://HOST:PORT)"
// once both sockets are bound, so a launcher can find ports chosen with 0.
#include <csignal>
#include <iostream>
#include <thread>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "common/service.h"
#include "coordinator/cluster_config.h"
#include "coordinator/coordinator.h"
#include "coordinator/rest/http_server.h"
#include "coordinator/metrics.h"

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }
}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  CLI::App app{"conveyor-coordinator: the Conveyor coordinator daemon"};
  app.add_option("--config", config_path, "the cluster file (YAML)")->required();
  CLI11_PARSE(app, argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_mt("coordinator"));
  if (const char* lvl = std::getenv("CONVEYOR_LOG_LEVEL")) spdlog::set_level(spdlog::level::from_str(lvl));  // stdout is for the ready line

  auto cfg = conveyor::load_cluster_config(config_path);
  if (!cfg) {
    std::cerr << "conveyor-coordinator: " << cfg.error() << "\n";
    return 2;
  }
  auto tok = conveyor::Tokenizer::load(cfg->model_path);
  if (!tok) {
    std::cerr << "conveyor-coordinator: " << tok.error() << "\n";
    return 2;
  }
  auto tokenizer = std::make_shared<const conveyor::Tokenizer>(std::move(tok).value());
  conveyor::Metrics metrics;
  auto coord = conveyor::Coordinator::start(*cfg, tokenizer, &metrics);
  if (!coord) {
    std::cerr << "conveyor-coordinator: " << coord.error() << "\n";
    return 1;
  }
  conveyor::Coordinator* c = coord->get();
  conveyor::RestContext ctx;
  ctx.model_name = cfg->model_name;
  ctx.config = cfg->model;
  ctx.tokenizer = tokenizer;
  ctx.backend = c;
  ctx.metrics = &metrics;
  ctx.api_key = cfg->api_key;
  ctx.health = [c] { return c->health(); };
  ctx.cluster = [c] { return c->cluster(); };
  ctx.drain = [c](const std::string& worker) { return c->drain(worker); };
  ctx.plan = [c](const conveyor::PlanRequest& request) { return c->plan(request); };
  auto http = conveyor::HttpServer::start(cfg->http_host, cfg->http_port, ctx, cfg->http_threads);
  if (!http) {
    std::cerr << "conveyor-coordinator: " << http.error() << "\n";
    return 1;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::cout << "conveyor-coordinator: listening on http://" << cfg->http_host << ":" << (*http)->port()
            << " (control tcp://" << cfg->control_host << ":" << c->control_port() << ")" << std::endl;
  conveyor::service::ready("serving " + cfg->model_name + " on http://" + cfg->http_host + ":" +
                           std::to_string((*http)->port()));
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    conveyor::service::watchdog_tick();
  }
  // Graceful: no new requests, the accepted ones finish (streams included), then stop.
  conveyor::service::stopping();
  spdlog::info("coordinator: shutting down: taking no new requests, finishing the accepted ones (up to {} s)",
               cfg->shutdown_timeout_ms / 1000.0);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(cfg->shutdown_timeout_ms);
  size_t left = 0;
  while ((left = c->quiesce(std::chrono::seconds(1))) > 0 && std::chrono::steady_clock::now() < give_up)
    conveyor::service::watchdog_tick();
  if (left) spdlog::warn("coordinator: {} request(s) still running after {} ms are failed", left, cfg->shutdown_timeout_ms);
  c->stop();  // fails what is left; the REST server below still writes those answers
  if (const int cut = (*http)->shutdown(std::chrono::seconds(5)))
    spdlog::warn("coordinator: {} answer(s) were still being written when the REST server stopped", cut);
  return 0;
}

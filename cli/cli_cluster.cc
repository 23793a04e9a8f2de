// `conveyor generate`, `status`, `drain`, `plan`: clients of any cluster's REST API.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "cli/http_client.h"
#include "common/options.h"

namespace conveyor::cli {

using json = nlohmann::json;

namespace {

// The request's Authorization: --api-key, else CONVEYOR_API_KEY (the options registry).
void authorize(HttpRequest& req, std::string key) {
  if (key.empty()) key = process_options().api_key;
  if (!key.empty()) req.headers.push_back({"Authorization", "Bearer " + key});
}

}  // namespace

void add_generate_command(CLI::App& app, GenerateOptions& o) {
  CLI::App* cmd = app.add_subcommand("generate", "stream a completion from a cluster's REST API");
  cmd->add_option("prompt", o.prompt, "the text to continue")->required();
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--max-tokens", o.max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", o.temperature, "0 = greedy")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", o.top_k, "0 = off")->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--top-p", o.top_p, "1 = off")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", o.seed, "sampling seed (default: none, each run differs)");
  cmd->add_option("--stop", o.stop, "stop strings")->default_str("none");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
  cmd->add_option("--idle-timeout", o.idle_timeout_s, "seconds without a byte from the server before giving up")
      ->check(CLI::Range(0.1, 86400.0));
  cmd->add_option("--timeout", o.timeout_s, "seconds the whole completion may take")->check(CLI::Range(0.1, 86400.0));
}

int generate_command(const GenerateOptions& o) {
  auto hp = parse_http_url(o.url);
  if (!hp) {
    std::cerr << "conveyor generate: " << hp.error() << "\n";
    return 2;
  }
  json body = {{"prompt", o.prompt}, {"max_tokens", o.max_tokens}, {"temperature", o.temperature},
               {"top_p", o.top_p}, {"top_k", o.top_k}, {"stream", true}};
  if (o.seed) body["seed"] = *o.seed;
  if (!o.stop.empty()) body["stop"] = o.stop;
  HttpRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.body = body.dump();
  req.timeout = std::chrono::milliseconds(int64_t(o.timeout_s * 1000));
  req.idle_timeout = std::chrono::milliseconds(int64_t(o.idle_timeout_s * 1000));
  authorize(req, o.api_key);
  std::string error;
  std::cout << o.prompt << std::flush;
  SseParser sse([&](std::string_view data) {
    if (data == "[DONE]") return;
    try {
      const json chunk = json::parse(data);
      if (chunk.contains("error")) {
        error = chunk["error"].value("message", chunk["error"].dump());
        return;
      }
      for (const auto& c : chunk.at("choices")) std::cout << c.value("text", std::string()) << std::flush;
    } catch (const std::exception& e) {
      error = std::string("bad event from the server: ") + e.what();
    }
  });
  std::string raw;
  req.on_body = [&](std::string_view bytes) {
    raw.append(bytes);
    sse.feed(bytes);
  };
  auto r = http_call(hp->first, hp->second, req);
  std::cout << "\n";
  if (!r) {
    std::cerr << "conveyor generate: " << r.error() << "\n";
    if (r.error().find("(the idle limit)") != std::string::npos || r.error().find("(the call's limit)") != std::string::npos)
      std::cerr << "conveyor generate: the cluster may be stuck: see its /health and `conveyor status` "
                   "(--idle-timeout and --timeout set these limits)\n";
    return 1;
  }
  if (r->status != 200) {
    std::string msg = raw;
    try {
      msg = json::parse(raw).at("error").value("message", raw);
    } catch (const std::exception&) {
    }
    std::cerr << "conveyor generate: HTTP " << r->status << ": " << msg << "\n";
    return 1;
  }
  if (!error.empty()) {
    std::cerr << "conveyor generate: " << error << "\n";
    return 1;
  }
  return 0;
}

namespace {

// POSTs `body` to one of the coordinator's admin endpoints; on anything but 200 prints the
// server's message as "conveyor CMD: ..." and returns nothing (`rc` says the exit code).
std::optional<json> admin_post(const std::string& cmd, const std::string& url, std::string key, const std::string& target,
                               const json& body, int& rc) {
  auto hp = parse_http_url(url);
  if (!hp) {
    std::cerr << "conveyor " << cmd << ": " << hp.error() << "\n";
    rc = 2;
    return std::nullopt;
  }
  HttpRequest req;
  req.method = "POST";
  req.target = target;
  req.body = body.dump();
  authorize(req, key);
  auto r = http_call(hp->first, hp->second, req);
  rc = 1;
  if (!r) {
    std::cerr << "conveyor " << cmd << ": " << r.error() << "\n";
    return std::nullopt;
  }
  json answer = json::parse(r->body, nullptr, false);
  if (r->status != 200) {
    std::string msg = r->body;
    if (!answer.is_discarded() && answer.contains("error")) msg = answer["error"].value("message", msg);
    std::cerr << "conveyor " << cmd << ": HTTP " << r->status << ": " << msg << "\n";
    return std::nullopt;
  }
  rc = 0;
  return answer.is_discarded() ? json::object() : answer;
}

std::string shape_text(const json& plan) {
  std::string s = std::to_string(plan.value("stages", 0)) + " stage(s) x " + std::to_string(plan.value("replicas", 0)) +
                  " replica(s), layers";
  for (const auto& r : plan.value("layers", json::array()))
    s += " " + std::to_string(r[0].get<int>()) + "-" + std::to_string(r[1].get<int>());
  return s;
}

}  // namespace

void add_drain_command(CLI::App& app, DrainOptions& o) {
  CLI::App* cmd = app.add_subcommand("drain", "take a worker out of service; a spare (or a smaller plan) takes its stage");
  cmd->add_option("worker", o.worker, "the worker's name (see conveyor status)")->required();
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int drain_command(const DrainOptions& o) {
  int rc = 0;
  auto body = admin_post("drain", o.url, o.api_key, "/v1/cluster/workers/" + o.worker + "/drain", json::object(), rc);
  if (!body) return rc;
  std::cout << "conveyor drain: " << o.worker << " drained";
  if (body->contains("replaced_by")) std::cout << "; its stage went to " << (*body)["replaced_by"].get<std::string>();
  if (body->contains("replanned")) std::cout << "; the plan is now " << shape_text((*body)["replanned"]);
  std::cout << "\n";
  return 0;
}

void add_plan_command(CLI::App& app, PlanOptions& o) {
  CLI::App* cmd = app.add_subcommand("plan", "change the number of stages, replicas or the layer split while serving");
  cmd->add_option("--stages", o.stages, "pipeline stages (default: as now)")->check(CLI::Range(1, 1024));
  cmd->add_option("--replicas", o.replicas, "pipeline replicas (default: as now)")->check(CLI::Range(1, 1024));
  cmd->add_option("--layers", o.layers, "explicit layer ranges, e.g. 0:3,3:5,5:6");
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int plan_command(const PlanOptions& o) {
  json plan = json::object();
  if (o.stages) plan["stages"] = *o.stages;
  if (o.replicas) plan["replicas"] = *o.replicas;
  if (!o.layers.empty()) {
    json ranges = json::array();
    std::stringstream ss(o.layers);
    for (std::string item; std::getline(ss, item, ',');) {
      long long b = 0, e = 0;
      char extra = 0;
      if (std::sscanf(item.c_str(), "%lld:%lld%c", &b, &e, &extra) != 2) {
        std::cerr << "conveyor plan: --layers: '" << item << "' is not BEGIN:END (e.g. 0:3,3:6)\n";
        return 2;
      }
      ranges.push_back({b, e});
    }
    plan["layers"] = ranges;
  }
  if (plan.empty()) {
    std::cerr << "conveyor plan: give --stages, --replicas and/or --layers\n";
    return 2;
  }
  int rc = 0;
  auto body = admin_post("plan", o.url, o.api_key, "/v1/cluster/plan", plan, rc);
  if (!body) return rc;
  std::cout << "conveyor plan: " << (body->value("changed", true) ? "now " : "unchanged: ")
            << shape_text(body->value("plan", json::object())) << "\n";
  return 0;
}

void add_status_command(CLI::App& app, StatusOptions& o) {
  CLI::App* cmd = app.add_subcommand("status", "print a cluster's workers and pipelines");
  cmd->add_option("--url", o.url, "the coordinator's URL");
  cmd->add_option("--api-key", o.api_key, "API key (default: $CONVEYOR_API_KEY)");
}

int status_command(const StatusOptions& o) {
  auto hp = parse_http_url(o.url);
  if (!hp) {
    std::cerr << "conveyor status: " << hp.error() << "\n";
    return 2;
  }
  HttpRequest req;
  req.target = "/v1/cluster";
  authorize(req, o.api_key);
  auto r = http_call(hp->first, hp->second, req);
  if (!r || r->status != 200) {
    std::cerr << "conveyor status: " << (r ? "HTTP " + std::to_string(r->status) + ": " + r->body : r.error()) << "\n";
    return 1;
  }
  const json c = json::parse(r->body, nullptr, false);
  if (c.is_discarded()) {
    std::cerr << "conveyor status: the server's answer is not JSON\n";
    return 1;
  }
  std::printf("model %s, queue %d\n", c.value("model", std::string("?")).c_str(), c.value("queue", 0));
  if (c.contains("plan")) {
    std::printf("plan: %s", shape_text(c["plan"]).c_str());
    if (c.contains("target") && c["target"] != c["plan"]) std::printf(" (target: %s)", shape_text(c["target"]).c_str());
    std::printf("\n");
  }
  std::printf("\n");
  std::printf("%-14s %-10s %-8s %-9s %-5s %-10s %-6s %-6s %s\n", "WORKER", "HOST", "PID", "STATE", "STAGE", "LAYERS",
              "LOAD", "BUSY", "KV USED/CAP");
  for (const auto& w : c.value("workers", json::array())) {
    const std::string stage = w.contains("stage") ? std::to_string(w["pipeline"].get<int>()) + "." +
                                                        std::to_string(w["stage"].get<int>())
                                                  : "-";
    const std::string layers = w.contains("layers") ? std::to_string(w["layers"][0].get<int>()) + "-" +
                                                          std::to_string(w["layers"][1].get<int>())
                                                    : "-";
    std::printf("%-14s %-10s %-8lld %-9s %-5s %-10s %5.0f%% %5.0f%% %lld/%lld\n", w.value("name", "").c_str(),
                w.value("host", "").c_str(), (long long)w.value("pid", 0LL), w.value("state", "").c_str(),
                stage.c_str(), layers.c_str(), 100 * w.value("load_progress", 0.0), 100 * w.value("busy_fraction", 0.0),
                (long long)w.value("kv_used_tokens", 0LL), (long long)w.value("kv_capacity_tokens", 0LL));
  }
  std::printf("\n");
  for (const auto& p : c.value("pipelines", json::array()))
    std::printf("pipeline %d: %s, epoch %d, %d batches in flight\n", p.value("pipeline", 0),
                p.value("ready", false) ? "ready" : "NOT READY", p.value("epoch", 0), p.value("in_flight", 0));
  return 0;
}

}  // namespace conveyor::cli

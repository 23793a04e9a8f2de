#include "coordinator/cluster_config.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "common/options.h"
#include "model/chat_template.h"

namespace conveyor {
namespace {

struct Ctx {
  const std::string& source;
  Status at(const YAML::Node& n, const std::string& what) const {
    const YAML::Mark m = n.Mark();
    return Status::error(source + ":" + std::to_string(m.line + 1) + ": " + what);
  }
};

Status check_keys(const Ctx& c, const YAML::Node& map, const std::string& section,
                  const std::set<std::string>& known) {
  if (!map.IsMap()) return c.at(map, "'" + section + "' must be a mapping");
  for (const auto& kv : map) {
    // A complex key ("? [a, b]" or "? {a: 1}") has no string form: as<string> would throw.
    if (!kv.first.IsScalar())
      return c.at(kv.first, "a key in " + (section.empty() ? std::string("the top level") : "'" + section + "'") +
                                " is a " + (kv.first.IsSequence() ? "list" : kv.first.IsMap() ? "mapping" : "null") +
                                ", not a name");
    const std::string key = kv.first.as<std::string>();
    if (!known.count(key)) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      return c.at(kv.first, "unknown key '" + key + "' in " + (section.empty() ? "the top level" : "'" + section + "'") +
                                " (known: " + list + ")");
    }
  }
  return ok_status();
}

template <class T>
Status get(const Ctx& c, const YAML::Node& map, const std::string& section, const char* key, T& out) {
  const YAML::Node n = map[key];
  if (!n) return ok_status();
  try {
    if (!n.IsScalar()) throw YAML::BadConversion(n.Mark());
    out = n.as<T>();
  } catch (const YAML::BadConversion&) {
    const char* type = std::is_same_v<T, std::string> ? "a string" : std::is_same_v<T, bool> ? "true or false" : "a number";
    return c.at(n, "'" + section + "." + key + "' must be " + type);
  }
  return ok_status();
}

template <class T>
Status get_positive(const Ctx& c, const YAML::Node& map, const std::string& section, const char* key, T& out,
                    T min = 1) {
  if (Status s = get(c, map, section, key, out); !s) return s;
  if (map[key] && out < min)
    return c.at(map[key], "'" + section + "." + key + "' must be at least " + std::to_string(min));
  return ok_status();
}

}  // namespace

double layer_cost(const ModelConfig& c) {
  const double C = double(c.n_embd), I = double(c.n_inner > 0 ? c.n_inner : 4 * c.n_embd);
  return 4 * C * C + 2 * C * I;  // QKV, projection, FC, FC2: multiply-adds per token
}

double head_cost(const ModelConfig& c) { return double(c.vocab_size) * double(c.n_embd); }

std::vector<std::pair<int64_t, int64_t>> balanced_layer_split(const ModelConfig& c, int stages) {
  const int64_t L = c.n_layer;
  const int S = std::max(1, std::min<int>(stages, int(L)));
  const double lc = layer_cost(c), hc = head_cost(c);
  // cost of a stage running layers [b, e)
  auto cost = [&](int64_t b, int64_t e) { return double(e - b) * lc + (e == L ? hc : 0.0); };
  // best[s][e]: for s stages running layers [0, e), the smallest largest stage cost, then
  // (among plans with that largest cost) the smallest sum of squared costs, so the stages
  // that are not the slowest are as even as they can be. cut[s][e]: where the last of those
  // stages begins. Exact ties go to the later cut: earlier stages take the extra layers.
  struct Score {
    double max = std::numeric_limits<double>::infinity(), squares = 0;
    bool better_or_equal(const Score& o) const {
      if (o.max == std::numeric_limits<double>::infinity()) return true;
      const double tol = 1e-9 * std::max(1.0, o.max);
      if (max < o.max - tol) return true;
      if (max > o.max + tol) return false;
      return squares <= o.squares * (1 + 1e-12);
    }
  };
  std::vector<std::vector<Score>> best(size_t(S) + 1, std::vector<Score>(size_t(L) + 1));
  std::vector<std::vector<int64_t>> cut(size_t(S) + 1, std::vector<int64_t>(size_t(L) + 1, 0));
  best[0][0] = {0, 0};
  for (int s = 1; s <= S; ++s)
    for (int64_t e = s; e <= L; ++e)
      for (int64_t b = s - 1; b < e; ++b) {
        const Score& prev = best[size_t(s - 1)][size_t(b)];
        if (prev.max == std::numeric_limits<double>::infinity()) continue;  // unreachable
        const double c = cost(b, e);
        const Score v{std::max(prev.max, c), prev.squares + c * c};
        if (v.better_or_equal(best[size_t(s)][size_t(e)])) best[size_t(s)][size_t(e)] = v, cut[size_t(s)][size_t(e)] = b;
      }
  std::vector<std::pair<int64_t, int64_t>> out(static_cast<size_t>(S));
  for (int s = S, e = int(L); s >= 1; --s) {
    const int64_t b = cut[size_t(s)][size_t(e)];
    out[size_t(s - 1)] = {b, e};
    e = int(b);
  }
  return out;
}

Status check_layer_split(const std::vector<std::pair<int64_t, int64_t>>& layers, int stages, int64_t n_layer) {
  if (int(layers.size()) != stages)
    return Status::error("layers lists " + std::to_string(layers.size()) + " ranges for " + std::to_string(stages) +
                         " stages");
  int64_t expect = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto [b, e] = layers[i];
    if (b != expect || e <= b)
      return Status::error("stage " + std::to_string(i) + " has layers [" + std::to_string(b) + ", " +
                           std::to_string(e) + "): ranges must be non-empty and contiguous from 0");
    expect = e;
  }
  if (expect != n_layer)
    return Status::error("the layer ranges end at " + std::to_string(expect) + " but the model has " +
                         std::to_string(n_layer) + " layers");
  return ok_status();
}

namespace {

// The 'model' section (required): where the checkpoint is and the name it is served under.
Status parse_model_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node model = root["model"];
  if (!model) return Status::error(c.source + ": missing required section 'model' (model: {path: DIR})");
  Status s;
  if (!(s = check_keys(c, model, "model", {"path", "name", "chat_template"}))) return s;
  if (!(s = get(c, model, "model", "chat_template", cfg.chat_template))) return s;
  if (!(s = get(c, model, "model", "path", cfg.model_path))) return s;
  if (cfg.model_path.empty()) return c.at(model, "'model.path' is required");
  if (!(s = get(c, model, "model", "name", cfg.model_name))) return s;
  if (cfg.model_name.empty()) cfg.model_name = std::filesystem::path(cfg.model_path).lexically_normal().filename().string();
  if (cfg.model_name.empty()) cfg.model_name = "model";
  return ok_status();
}

// "*" alone, or each scheme://host[:port] (http or https, no path, no trailing slash).
Status check_cors_origins(const std::vector<std::string>& origins) {
  for (const std::string& o : origins) {
    if (o == "*") {
      if (origins.size() > 1) return Status::error("'*' allows every origin: list it alone");
      continue;
    }
    const size_t scheme_end = o.find("://");
    const std::string scheme = scheme_end == std::string::npos ? "" : o.substr(0, scheme_end);
    const std::string rest = scheme_end == std::string::npos ? "" : o.substr(scheme_end + 3);
    const bool host_ok = !rest.empty() && rest.find_first_of("/?#*@ ") == std::string::npos && rest.front() != ':';
    if ((scheme != "http" && scheme != "https") || !host_ok)
      return Status::error("'" + o + "' is not an origin: write scheme://host[:port] (http or https, no path), or '*'");
  }
  return ok_status();
}

// http.cors_origins: "*", or a list of origins (scheme://host[:port]) or of "*" alone.
Status parse_cors_origins(const Ctx& c, const YAML::Node& http, std::vector<std::string>& out) {
  const YAML::Node n = http["cors_origins"];
  if (!n) return ok_status();
  if (n.IsScalar()) {
    out = {n.as<std::string>()};
  } else if (n.IsSequence()) {
    for (const YAML::Node& o : n) {
      if (!o.IsScalar()) return c.at(o, "'http.cors_origins' must list origins as strings");
      out.push_back(o.as<std::string>());
    }
  } else {
    return c.at(n, "'http.cors_origins' must be \"*\" or a list of origins (scheme://host[:port])");
  }
  if (Status s = check_cors_origins(out); !s) return c.at(n, "'http.cors_origins': " + s.message());
  return ok_status();
}

// The 'http' and 'control' sections: where the daemon listens, and its secrets.
Status parse_listen_sections(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  Status s;
  if (const YAML::Node h = root["http"]) {
    if (!(s = check_keys(c, h, "http", {"host", "port", "api_key", "threads", "cors_origins"})) ||
        !(s = parse_cors_origins(c, h, cfg.cors_origins)))
      return s;
    if (!(s = get(c, h, "http", "host", cfg.http_host)) || !(s = get_positive(c, h, "http", "port", cfg.http_port, 0)) ||
        !(s = get(c, h, "http", "api_key", cfg.api_key)) || !(s = get_positive(c, h, "http", "threads", cfg.http_threads)))
      return s;
    if (cfg.http_port > 65535) return c.at(h["port"], "'http.port' must be at most 65535");
  }
  if (const YAML::Node ctl = root["control"]) {
    if (!(s = check_keys(c, ctl, "control", {"host", "port", "join_token", "curve_secret_key", "data_interface"})))
      return s;
    if (!(s = get(c, ctl, "control", "host", cfg.control_host)) ||
        !(s = get(c, ctl, "control", "data_interface", cfg.data_interface)) ||
        !(s = get_positive(c, ctl, "control", "port", cfg.control_port, 0)) ||
        !(s = get(c, ctl, "control", "join_token", cfg.join_token)) ||
        !(s = get(c, ctl, "control", "curve_secret_key", cfg.curve_secret_key)))
      return s;
    if (cfg.control_port > 65535) return c.at(ctl["port"], "'control.port' must be at most 65535");
  }
  // The environment's (the options registry's snapshot) where the file sets none.
  if (cfg.api_key.empty()) cfg.api_key = process_options().api_key;
  if (cfg.join_token.empty()) cfg.join_token = process_options().join_token;
  if (cfg.join_token.empty())
    return Status::error(c.source + ": no join token: set control.join_token or CONVEYOR_JOIN_TOKEN");
  return ok_status();
}

// Reads the model's config into cfg.model. A relative model path is relative to the cluster
// file's folder, not to the daemon's working directory (which is / under systemd).
Status load_model(const Ctx& c, const YAML::Node& root, const std::string& base_dir, ClusterConfig& cfg) {
  if (std::filesystem::path(cfg.model_path).is_relative() && !base_dir.empty())
    cfg.model_path = (std::filesystem::path(base_dir) / cfg.model_path).lexically_normal().string();
  if (!cfg.chat_template.empty() && !builtin_chat_template(cfg.chat_template) &&
      std::filesystem::path(cfg.chat_template).is_relative() && !base_dir.empty())  // a file beside the cluster file
    cfg.chat_template = (std::filesystem::path(base_dir) / cfg.chat_template).lexically_normal().string();
  auto mc = load_model_config(cfg.model_path);
  if (!mc) return Status::error(c.source + ":" + std::to_string(root["model"]["path"].Mark().line + 1) + ": " + mc.error());
  cfg.model = *mc;
  return ok_status();
}

// The 'pipeline.layers' list of [begin, end] pairs, checked against the plan.
Status parse_layer_ranges(const Ctx& c, const YAML::Node& l, ClusterConfig& cfg) {
  if (!l.IsSequence()) return c.at(l, "'pipeline.layers' must be a list of [begin, end] pairs");
  for (const auto& r : l) {
    if (!r.IsSequence() || r.size() != 2) return c.at(r, "each entry of 'pipeline.layers' must be [begin, end]");
    try {
      cfg.layers.emplace_back(r[0].as<int64_t>(), r[1].as<int64_t>());
    } catch (const YAML::BadConversion&) {
      return c.at(r, "layer range bounds must be integers");
    }
  }
  if (Status s = check_layer_split(cfg.layers, cfg.stages, cfg.model.n_layer); !s)
    return c.at(l, "impossible plan: " + s.message());
  return ok_status();
}

// The 'pipeline' section: stages, replicas and each stage's layers (balanced when not given).
Status parse_pipeline_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node pipe = root["pipeline"];
  Status s;
  if (pipe) {
    if (!(s = check_keys(c, pipe, "pipeline", {"stages", "replicas", "layers"}))) return s;
    if (!(s = get_positive(c, pipe, "pipeline", "stages", cfg.stages)) ||
        !(s = get_positive(c, pipe, "pipeline", "replicas", cfg.replicas)))
      return s;
  }
  if (cfg.stages > cfg.model.n_layer)
    return c.at(pipe["stages"], "impossible plan: " + std::to_string(cfg.stages) + " stages for a model of " +
                                    std::to_string(cfg.model.n_layer) + " layers");
  if (pipe && pipe["layers"]) return parse_layer_ranges(c, pipe["layers"], cfg);
  cfg.layers = balanced_layer_split(cfg.model, cfg.stages);
  return ok_status();
}

// The 'scheduler' section; in_flight defaults to one micro-batch per stage.
Status parse_scheduler_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  Status s;
  if (const YAML::Node sch = root["scheduler"]) {
    if (!(s = check_keys(c, sch, "scheduler", {"in_flight", "max_batch_tokens", "prefill_chunk",
                                               "prefill_tokens_per_batch", "max_queue", "max_running",
                                               "max_sequences_per_batch", "shutdown_timeout_ms",
                                               "pipeline_wait_ms", "batch_timeout_ms", "request_timeout_ms",
                                               "prefix_cache"})))
      return s;
    // 0 = auto for the limits (Scheduler's batch_limits).
    if (!(s = get_positive(c, sch, "scheduler", "in_flight", cfg.in_flight, 0)) ||
        !(s = get_positive<int64_t>(c, sch, "scheduler", "max_batch_tokens", cfg.max_batch_tokens, 0)) ||
        !(s = get_positive<int64_t>(c, sch, "scheduler", "prefill_chunk", cfg.prefill_chunk, 0)) ||
        !(s = get_positive<int64_t>(c, sch, "scheduler", "prefill_tokens_per_batch", cfg.prefill_tokens_per_batch, 0)) ||
        !(s = get_positive<int64_t>(c, sch, "scheduler", "max_queue", cfg.max_queue, 0)) ||
        !(s = get_positive<int64_t>(c, sch, "scheduler", "max_running", cfg.max_running, 0)) ||
        !(s = get_positive<int64_t>(c, sch, "scheduler", "max_sequences_per_batch", cfg.max_sequences_per_batch, 0)) ||
        !(s = get_positive(c, sch, "scheduler", "shutdown_timeout_ms", cfg.shutdown_timeout_ms, 0)) ||
        !(s = get_positive(c, sch, "scheduler", "pipeline_wait_ms", cfg.pipeline_wait_ms, 0)) ||
        !(s = get_positive(c, sch, "scheduler", "batch_timeout_ms", cfg.batch_timeout_ms, 0)) ||
        !(s = get_positive(c, sch, "scheduler", "request_timeout_ms", cfg.request_timeout_ms, 0)) ||
        !(s = get(c, sch, "scheduler", "prefix_cache", cfg.prefix_cache)))
      return s;
  }
  if (cfg.in_flight == 0) {
    cfg.in_flight = cfg.stages;
    cfg.in_flight_auto = true;
  }
  return ok_status();
}

// The 'heartbeat' section: the liveness window must outlast the heartbeat interval.
Status parse_heartbeat_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  Status s;
  if (const YAML::Node hb = root["heartbeat"]) {
    if (!(s = check_keys(c, hb, "heartbeat", {"interval_ms", "liveness_ms"}))) return s;
    if (!(s = get_positive(c, hb, "heartbeat", "interval_ms", cfg.heartbeat_interval_ms, 10)) ||
        !(s = get_positive(c, hb, "heartbeat", "liveness_ms", cfg.liveness_ms, 50)))
      return s;
    if (cfg.liveness_ms <= cfg.heartbeat_interval_ms)
      return c.at(hb, "'heartbeat.liveness_ms' must exceed 'heartbeat.interval_ms'");
  }
  return ok_status();
}

// The 'log' section: the shape of the coordinator's log lines (coordinator/request_log.h).
Status parse_log_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node log = root["log"];
  if (!log) return ok_status();
  if (Status s = check_keys(c, log, "log", {"format"}); !s) return s;
  std::string format = "text";
  if (Status s = get(c, log, "log", "format", format); !s) return s;
  if (format != "text" && format != "json")
    return c.at(log["format"], "'log.format' must be text or json, got '" + format + "'");
  cfg.log_json = format == "json";
  return ok_status();
}

}  // namespace

Expected<ClusterConfig> parse_cluster_config(const std::string& text, const std::string& source,
                                             const std::string& base_dir) {
  ClusterConfig cfg;
  cfg.source = source;
  const Ctx c{source};
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    return Status::error(source + ":" + std::to_string(e.mark.line + 1) + ": not valid YAML: " + e.msg);
  }
  if (!root || root.IsNull()) return Status::error(source + ": the cluster file is empty");
  Status s;
  if (!(s = check_keys(c, root, "", {"model", "http", "control", "pipeline", "scheduler", "heartbeat", "log"})) ||
      !(s = parse_model_section(c, root, cfg)) || !(s = parse_listen_sections(c, root, cfg)) ||
      !(s = load_model(c, root, base_dir, cfg)) || !(s = parse_pipeline_section(c, root, cfg)) ||
      !(s = parse_scheduler_section(c, root, cfg)) || !(s = parse_heartbeat_section(c, root, cfg)) ||
      !(s = parse_log_section(c, root, cfg)))
    return s;
  return cfg;
}

Expected<ClusterConfig> load_cluster_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::error(path + ": cannot open the cluster file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_cluster_config(ss.str(), path, std::filesystem::path(path).parent_path().string());
}

}  // namespace conveyor

#include "coordinator/cluster_config.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "common/options.h"
#include "model/chat_template.h"

namespace conveyor {
namespace {

// Collects every mistake in the file (each with its line), so one run of --check lists them
// all; a section whose values others depend on (the model) stops only those others.
struct Ctx {
  const std::string& source;
  std::vector<std::string>& errors;
  void at(const YAML::Node& n, const std::string& what) const {
    const YAML::Mark m = n.Mark();
    errors.push_back(source + ":" + std::to_string(m.line + 1) + ": " + what);
  }
  void file(const std::string& what) const { errors.push_back(source + ": " + what); }
};

std::string section_name(const std::string& section) {
  return section.empty() ? std::string("the top level") : "'" + section + "'";
}

// False when `map` is not a mapping (nothing in it can be read); each unknown key is an error.
bool check_keys(const Ctx& c, const YAML::Node& map, const std::string& section, const std::set<std::string>& known) {
  if (!map.IsMap()) {
    c.at(map, section_name(section) + " must be a mapping");
    return false;
  }
  for (const auto& kv : map) {
    // A complex key ("? [a, b]" or "? {a: 1}") has no string form: as<string> would throw.
    if (!kv.first.IsScalar()) {
      c.at(kv.first, "a key in " + section_name(section) + " is a " +
                         (kv.first.IsSequence() ? "list" : kv.first.IsMap() ? "mapping" : "null") + ", not a name");
      continue;
    }
    const std::string key = kv.first.as<std::string>();
    if (!known.count(key)) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      c.at(kv.first, "unknown key '" + key + "' in " + section_name(section) + " (known: " + list + ")");
    }
  }
  return true;
}

// A string or a boolean; false (and an error) when it is there but not one.
template <class T>
bool get(const Ctx& c, const YAML::Node& map, const std::string& section, const char* key, T& out) {
  const YAML::Node n = map[key];
  if (!n) return true;
  try {
    if (!n.IsScalar()) throw YAML::BadConversion(n.Mark());
    out = n.as<T>();
  } catch (const YAML::BadConversion&) {
    c.at(n, "'" + section + "." + key + "' must be " + (std::is_same_v<T, bool> ? "true or false" : "a string"));
    return false;
  }
  return true;
}

// The values a number may take: [min, max], and 0 as well where 0 means auto (or "off").
struct Range {
  int64_t min, max;
  const char* zero = nullptr;  // what 0 means, where min > 0 and 0 is allowed
  std::string text() const {
    const std::string span = "at least " + std::to_string(min) + " and at most " + std::to_string(max);
    return zero ? "0 (" + std::string(zero) + ") or " + span : span;
  }
  bool holds(int64_t v) const { return (zero && v == 0) || (v >= min && v <= max); }
};

// A whole number within `range`; out keeps its default when the key is absent or wrong.
template <class T>
bool get_number(const Ctx& c, const YAML::Node& map, const std::string& section, const char* key, T& out,
                const Range& range) {
  const YAML::Node n = map[key];
  if (!n) return true;
  const std::string name = "'" + section + "." + key + "'";
  int64_t v = 0;
  try {
    if (!n.IsScalar()) throw YAML::BadConversion(n.Mark());
    v = n.as<int64_t>();
  } catch (const YAML::BadConversion&) {
    c.at(n, name + " must be a whole number, " + range.text());
    return false;
  }
  if (!range.holds(v)) {
    c.at(n, name + " must be " + range.text() + " (it is " + std::to_string(v) + ")");
    return false;
  }
  out = T(v);
  return true;
}

constexpr int64_t kMaxTokens = int64_t(1) << 20;  // rows of a micro-batch, prompt tokens of a chunk
constexpr int64_t kHourMs = 3600 * 1000;

// The line an error names ("FILE:LINE: ..."); 0 for one about the whole file.
int64_t line_of(const std::string& error, const std::string& source) {
  const size_t at = source.size() + 1;
  if (error.size() <= at || error[at - 1] != ':' || !std::isdigit(static_cast<unsigned char>(error[at]))) return 0;
  return std::strtoll(error.c_str() + at, nullptr, 10);
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
// False when there is no path to load.
bool parse_model_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node model = root["model"];
  if (!model) {
    c.file("missing required section 'model' (model: {path: DIR})");
    return false;
  }
  if (!check_keys(c, model, "model", {"path", "name", "chat_template"})) return false;
  get(c, model, "model", "chat_template", cfg.chat_template);
  if (!get(c, model, "model", "path", cfg.model_path)) return false;
  if (cfg.model_path.empty()) {
    c.at(model, "'model.path' is required");
    return false;
  }
  get(c, model, "model", "name", cfg.model_name);
  if (cfg.model_name.empty()) cfg.model_name = std::filesystem::path(cfg.model_path).lexically_normal().filename().string();
  if (cfg.model_name.empty()) cfg.model_name = "model";
  return true;
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
void parse_cors_origins(const Ctx& c, const YAML::Node& http, std::vector<std::string>& out) {
  const YAML::Node n = http["cors_origins"];
  if (!n) return;
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
  if (Status s = check_cors_origins(out); !s) c.at(n, "'http.cors_origins': " + s.message());
}

// The 'http' and 'control' sections: where the daemon listens, and its secrets.
void parse_listen_sections(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const Range port{0, 65535};
  if (const YAML::Node h = root["http"];
      h && check_keys(c, h, "http", {"host", "port", "api_key", "threads", "cors_origins"})) {
    parse_cors_origins(c, h, cfg.cors_origins);
    get(c, h, "http", "host", cfg.http_host);
    get_number(c, h, "http", "port", cfg.http_port, port);
    get(c, h, "http", "api_key", cfg.api_key);
    get_number(c, h, "http", "threads", cfg.http_threads, {1, 256});
  }
  if (const YAML::Node ctl = root["control"];
      ctl && check_keys(c, ctl, "control", {"host", "port", "join_token", "curve_secret_key", "data_interface"})) {
    get(c, ctl, "control", "host", cfg.control_host);
    get(c, ctl, "control", "data_interface", cfg.data_interface);
    get_number(c, ctl, "control", "port", cfg.control_port, port);
    get(c, ctl, "control", "join_token", cfg.join_token);
    get(c, ctl, "control", "curve_secret_key", cfg.curve_secret_key);
  }
  for (const auto& [key, value] : {std::pair{"http.api_key", &cfg.api_key}, std::pair{"control.join_token", &cfg.join_token},
                                   std::pair{"control.curve_secret_key", &cfg.curve_secret_key}})
    if (!value->empty()) cfg.secrets_in_file.push_back(key);
  // The environment's (the options registry's snapshot) where the file sets none.
  if (cfg.api_key.empty()) cfg.api_key = process_options().api_key;
  if (cfg.join_token.empty()) cfg.join_token = process_options().join_token;
  if (cfg.join_token.empty()) c.file("no join token: set control.join_token or CONVEYOR_JOIN_TOKEN");
}

// Reads the model's config into cfg.model. A relative model path is relative to the cluster
// file's folder, not to the daemon's working directory (which is / under systemd).
bool load_model(const Ctx& c, const YAML::Node& root, const std::string& base_dir, ClusterConfig& cfg) {
  if (std::filesystem::path(cfg.model_path).is_relative() && !base_dir.empty())
    cfg.model_path = (std::filesystem::path(base_dir) / cfg.model_path).lexically_normal().string();
  if (!cfg.chat_template.empty() && !builtin_chat_template(cfg.chat_template) &&
      std::filesystem::path(cfg.chat_template).is_relative() && !base_dir.empty())  // a file beside the cluster file
    cfg.chat_template = (std::filesystem::path(base_dir) / cfg.chat_template).lexically_normal().string();
  auto mc = load_model_config(cfg.model_path);
  if (!mc) {
    c.at(root["model"]["path"], mc.error());
    return false;
  }
  cfg.model = *mc;
  return true;
}

// The 'pipeline.layers' list of [begin, end] pairs, checked against the plan.
void parse_layer_ranges(const Ctx& c, const YAML::Node& l, ClusterConfig& cfg) {
  if (!l.IsSequence()) return c.at(l, "'pipeline.layers' must be a list of [begin, end] pairs");
  bool read = true;
  for (const auto& r : l) {
    if (!r.IsSequence() || r.size() != 2) {
      c.at(r, "each entry of 'pipeline.layers' must be [begin, end]");
      read = false;
      continue;
    }
    try {
      cfg.layers.emplace_back(r[0].as<int64_t>(), r[1].as<int64_t>());
    } catch (const YAML::BadConversion&) {
      c.at(r, "layer range bounds must be integers");
      read = false;
    }
  }
  if (!read) return;
  if (Status s = check_layer_split(cfg.layers, cfg.stages, cfg.model.n_layer); !s)
    c.at(l, "impossible plan: " + s.message());
}

// The 'pipeline' section: stages, replicas and each stage's layers (balanced when not given).
// `model_loaded`: cfg.model is the checkpoint's, so the plan can be checked against it.
void parse_pipeline_section(const Ctx& c, const YAML::Node& root, bool model_loaded, ClusterConfig& cfg) {
  const YAML::Node pipe = root["pipeline"];
  if (pipe && !check_keys(c, pipe, "pipeline", {"stages", "replicas", "layers"})) return;
  if (pipe) {
    get_number(c, pipe, "pipeline", "stages", cfg.stages, {1, 1024});
    get_number(c, pipe, "pipeline", "replicas", cfg.replicas, {1, 1024});
  }
  if (!model_loaded) return;
  if (cfg.stages > cfg.model.n_layer)
    return c.at(pipe["stages"], "impossible plan: " + std::to_string(cfg.stages) + " stages for a model of " +
                                    std::to_string(cfg.model.n_layer) + " layers");
  if (pipe && pipe["layers"]) return parse_layer_ranges(c, pipe["layers"], cfg);
  cfg.layers = balanced_layer_split(cfg.model, cfg.stages);
}

// The 'scheduler' section; 0 = auto for the micro-batch limits (Scheduler's batch_limits),
// and in_flight then follows the number of stages.
void parse_scheduler_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node sch = root["scheduler"];
  if (sch && check_keys(c, sch, "scheduler", {"in_flight", "max_batch_tokens", "prefill_chunk",
                                              "prefill_tokens_per_batch", "max_queue", "max_running",
                                              "max_sequences_per_batch", "shutdown_timeout_ms", "pipeline_wait_ms",
                                              "batch_timeout_ms", "request_timeout_ms", "prefix_cache", "step_ahead"})) {
    const std::string s = "scheduler";
    // A micro-batch of fewer rows than one K/V granule (16 tokens) only slows every step.
    get_number(c, sch, s, "in_flight", cfg.in_flight, {1, 64, "auto"});
    get_number(c, sch, s, "max_batch_tokens", cfg.max_batch_tokens, {16, kMaxTokens, "auto"});
    get_number(c, sch, s, "prefill_chunk", cfg.prefill_chunk, {1, kMaxTokens, "auto"});
    get_number(c, sch, s, "prefill_tokens_per_batch", cfg.prefill_tokens_per_batch, {1, kMaxTokens, "auto"});
    get_number(c, sch, s, "max_sequences_per_batch", cfg.max_sequences_per_batch, {1, 65536, "auto"});
    get_number(c, sch, s, "max_running", cfg.max_running, {1, 1000000, "auto"});
    get_number(c, sch, s, "max_queue", cfg.max_queue, {1, 1000000});
    get_number(c, sch, s, "shutdown_timeout_ms", cfg.shutdown_timeout_ms, {0, kHourMs});
    get_number(c, sch, s, "pipeline_wait_ms", cfg.pipeline_wait_ms, {0, kHourMs});
    get_number(c, sch, s, "batch_timeout_ms", cfg.batch_timeout_ms, {100, kHourMs, "never"});
    get_number(c, sch, s, "request_timeout_ms", cfg.request_timeout_ms, {100, 24 * kHourMs, "no deadline"});
    get(c, sch, s, "prefix_cache", cfg.prefix_cache);
    get(c, sch, s, "step_ahead", cfg.step_ahead);
  }
  if (cfg.in_flight == 0) {
    cfg.in_flight = cfg.stages;
    cfg.in_flight_auto = true;
  }
}

// The 'heartbeat' section: the liveness window must outlast the heartbeat interval.
void parse_heartbeat_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node hb = root["heartbeat"];
  if (!hb || !check_keys(c, hb, "heartbeat", {"interval_ms", "liveness_ms"})) return;
  const bool interval = get_number(c, hb, "heartbeat", "interval_ms", cfg.heartbeat_interval_ms, {10, 60000});
  const bool liveness = get_number(c, hb, "heartbeat", "liveness_ms", cfg.liveness_ms, {50, 600000});
  if (interval && liveness && cfg.liveness_ms <= cfg.heartbeat_interval_ms)
    c.at(hb, "'heartbeat.liveness_ms' (" + std::to_string(cfg.liveness_ms) + ") must exceed 'heartbeat.interval_ms' (" +
                 std::to_string(cfg.heartbeat_interval_ms) + ")");
}

// The 'log' section: the shape of the coordinator's log lines (coordinator/request_log.h).
void parse_log_section(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node log = root["log"];
  if (!log || !check_keys(c, log, "log", {"format"})) return;
  std::string format = "text";
  if (!get(c, log, "log", "format", format)) return;
  if (format != "text" && format != "json")
    return c.at(log["format"], "'log.format' must be text or json, got '" + format + "'");
  cfg.log_json = format == "json";
}

// 'objective': what the cluster optimises (layout_choice.h); throughput when absent.
void parse_objective_key(const Ctx& c, const YAML::Node& root, ClusterConfig& cfg) {
  const YAML::Node n = root["objective"];
  if (!n) return;
  const auto o = n.IsScalar() ? parse_objective(n.Scalar()) : Expected<Objective>(Status::error(""));
  if (!o)
    return c.at(n, "'objective' must be latency or throughput" + (n.IsScalar() ? ", got '" + n.Scalar() + "'" : std::string()));
  cfg.objective = *o;
}

}  // namespace

Expected<ClusterConfig> parse_cluster_config(const std::string& text, const std::string& source,
                                             const std::string& base_dir) {
  ClusterConfig cfg;
  cfg.source = source;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    return Status::error(source + ":" + std::to_string(e.mark.line + 1) + ": not valid YAML: " + e.msg);
  }
  if (!root || root.IsNull()) return Status::error(source + ": the cluster file is empty");
  std::vector<std::string> errors;
  const Ctx c{source, errors};
  if (!check_keys(c, root, "", {"model", "http", "control", "pipeline", "scheduler", "heartbeat", "log", "objective"}))
    return Status::error(errors.front());
  const bool model_loaded = parse_model_section(c, root, cfg) && load_model(c, root, base_dir, cfg);
  parse_listen_sections(c, root, cfg);
  parse_pipeline_section(c, root, model_loaded, cfg);
  parse_scheduler_section(c, root, cfg);
  parse_heartbeat_section(c, root, cfg);
  parse_log_section(c, root, cfg);
  parse_objective_key(c, root, cfg);
  if (errors.empty()) return cfg;
  // Every mistake, one a line, in the file's order.
  std::stable_sort(errors.begin(), errors.end(), [&](const std::string& a, const std::string& b) {
    return line_of(a, source) < line_of(b, source);
  });
  std::string all;
  for (const std::string& e : errors) all += (all.empty() ? "" : "\n") + e;
  return Status::error(all);
}

Expected<ClusterConfig> load_cluster_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::error(path + ": cannot open the cluster file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_cluster_config(ss.str(), path, std::filesystem::path(path).parent_path().string());
}

}  // namespace conveyor

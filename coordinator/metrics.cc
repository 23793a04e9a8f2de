#include "coordinator/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace conveyor {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), per_bucket_(bounds_.size() + 1, 0) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end())
    throw std::invalid_argument("histogram bounds must be strictly ascending");
}

void Histogram::observe(double value, uint64_t times) {
  if (times == 0 || std::isnan(value)) return;
  // First bucket whose upper bound is >= value (Prometheus buckets are "le").
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  per_bucket_[i] += times;
  count_ += times;
  sum_ += value * double(times);
}

std::vector<uint64_t> Histogram::cumulative_counts() const {
  std::vector<uint64_t> out(bounds_.size());
  uint64_t running = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) out[i] = running += per_bucket_[i];
  return out;
}

const std::vector<double>& Metrics::time_to_first_token_buckets() {
  static const std::vector<double> b = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                        1,     2.5,  5,     10,   20,  30,   60};
  return b;
}

const std::vector<double>& Metrics::inter_token_latency_buckets() {
  static const std::vector<double> b = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06,
                                        0.08,  0.1,    0.15,  0.25, 0.5,  1,    2.5};
  return b;
}

const std::vector<double>& Metrics::turnaround_buckets() {
  static const std::vector<double> b = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                        0.01,    0.025,  0.05,    0.1,    0.25,  1};
  return b;
}

Metrics::Metrics()
    : ttft_(time_to_first_token_buckets()), itl_(inter_token_latency_buckets()), gap_(turnaround_buckets()) {}

void Metrics::observe_coordinator_gap(double seconds) {
  std::lock_guard lock(mu_);
  gap_.observe(seconds);
}

uint64_t Metrics::coordinator_gap_count() const {
  std::lock_guard lock(mu_);
  return gap_.count();
}

void Metrics::count_batch_timeout_replay() {
  std::lock_guard lock(mu_);
  ++batch_timeout_replays_;
}

void Metrics::count_cancelled() {
  std::lock_guard lock(mu_);
  ++cancelled_;
}

void Metrics::add_discarded_tokens(uint64_t tokens) {
  std::lock_guard lock(mu_);
  discarded_tokens_ += tokens;
}

uint64_t Metrics::cancelled() const {
  std::lock_guard lock(mu_);
  return cancelled_;
}

uint64_t Metrics::batch_timeout_replays() const {
  std::lock_guard lock(mu_);
  return batch_timeout_replays_;
}

void Metrics::set_prefix_cache(const PrefixCacheFigures& f) {
  std::lock_guard lk(mu_);
  prefix_ = f;
}

void Metrics::set_queue_wait(std::string_view reason, int64_t requests) {
  std::lock_guard lock(mu_);
  queue_wait_reason_ = std::string(reason);
  queue_waiting_ = requests;
}

void Metrics::set_pipeline_admission(int pipeline, int64_t limit_sequences, int64_t running_sequences,
                                     int64_t kv_reserved_tokens, int64_t kv_budget_tokens) {
  std::lock_guard lock(mu_);
  admission_[pipeline] = {limit_sequences, running_sequences, kv_reserved_tokens, kv_budget_tokens};
}

void Metrics::set_stage_idle_ready_fraction(int pipeline, int stage, const std::string& worker, double fraction) {
  std::lock_guard lock(mu_);
  std::erase_if(stage_idle_ready_, [&](const auto& kv) {
    return std::get<0>(kv.first) == pipeline && std::get<1>(kv.first) == stage && std::get<2>(kv.first) != worker;
  });
  stage_idle_ready_[{pipeline, stage, worker}] = fraction;
}

void Metrics::count_request(int http_status) {
  std::lock_guard lock(mu_);
  ++requests_by_code_[http_status];
}

bool Metrics::counts_as_request(std::string_view target) {
  const std::string_view path = target.substr(0, target.find('?'));
  return path != "/health" && path != "/metrics" && path != "/";  // probes, scrapes, the status page
}

void Metrics::count_request(std::string_view target, int http_status) {
  if (counts_as_request(target)) count_request(http_status);
}

void Metrics::observe_time_to_first_token(double seconds) {
  std::lock_guard lock(mu_);
  ttft_.observe(seconds);
}

void Metrics::observe_inter_token_latency(double seconds, uint64_t tokens) {
  std::lock_guard lock(mu_);
  itl_.observe(seconds, tokens);
}

void Metrics::add_prompt_tokens(uint64_t tokens) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += tokens;
}

void Metrics::add_generated_tokens(uint64_t tokens) {
  std::lock_guard lock(mu_);
  generated_tokens_ += tokens;
}

void Metrics::set_queue_depth(int64_t requests) {
  std::lock_guard lock(mu_);
  queue_depth_ = requests;
}

void Metrics::set_running_sequences(int64_t sequences) {
  std::lock_guard lock(mu_);
  running_sequences_ = sequences;
}

void Metrics::set_stage_busy_fraction(int pipeline, int stage, const std::string& worker, double fraction) {
  std::lock_guard lock(mu_);
  // One series per (pipeline, stage): a stage that moved to another worker drops the old one.
  std::erase_if(stage_busy_, [&](const auto& kv) {
    return std::get<0>(kv.first) == pipeline && std::get<1>(kv.first) == stage &&
           std::get<2>(kv.first) != worker;
  });
  stage_busy_[{pipeline, stage, worker}] = fraction;
}

void Metrics::set_kv_cache_tokens(int pipeline, int stage, int64_t used_tokens, int64_t capacity_tokens) {
  std::lock_guard lock(mu_);
  kv_tokens_[{pipeline, stage}] = {used_tokens, capacity_tokens};
}

void Metrics::clear_stage_gauges() {
  std::lock_guard lock(mu_);
  stage_busy_.clear();
  stage_idle_ready_.clear();
  kv_tokens_.clear();
  admission_.clear();
}

uint64_t Metrics::requests_with_code(int http_status) const {
  std::lock_guard lock(mu_);
  auto it = requests_by_code_.find(http_status);
  return it == requests_by_code_.end() ? 0 : it->second;
}

uint64_t Metrics::time_to_first_token_count() const {
  std::lock_guard lock(mu_);
  return ttft_.count();
}

uint64_t Metrics::inter_token_latency_count() const {
  std::lock_guard lock(mu_);
  return itl_.count();
}

std::string prometheus_number(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, value);
  return std::string(buf, r.ptr);
}

std::string prometheus_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

namespace {

void family(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out.append("# TYPE ").append(name).append(" ").append(type).append("\n");
}

void sample(std::string& out, std::string_view name, std::string_view labels, double value) {
  out.append(name);
  if (!labels.empty()) out.append("{").append(labels).append("}");
  out.append(" ").append(prometheus_number(value)).append("\n");
}

void histogram(std::string& out, std::string_view name, std::string_view help, const Histogram& h) {
  family(out, name, "histogram", help);
  const std::string bucket = std::string(name) + "_bucket";
  const std::vector<uint64_t> cum = h.cumulative_counts();
  for (size_t i = 0; i < cum.size(); ++i)
    sample(out, bucket, "le=\"" + prometheus_number(h.upper_bounds()[i]) + "\"", double(cum[i]));
  sample(out, bucket, "le=\"+Inf\"", double(h.count()));
  sample(out, std::string(name) + "_sum", "", h.sum());
  sample(out, std::string(name) + "_count", "", double(h.count()));
}

std::string stage_labels(int pipeline, int stage) {
  return "pipeline=\"" + std::to_string(pipeline) + "\",stage=\"" + std::to_string(stage) + "\"";
}

}  // namespace

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  render_requests(out);
  render_queue(out);
  render_prefix_cache(out);
  render_pipeline_flow(out);
  render_stages(out);
  return out;
}

// Requests, tokens and their latencies.
void Metrics::render_requests(std::string& out) const {
  family(out, "conveyor_requests_total", "counter", "Answers to clients' calls (not /health, /metrics or /), by HTTP status code.");
  for (const auto& [code, n] : requests_by_code_)
    sample(out, "conveyor_requests_total", "code=\"" + std::to_string(code) + "\"", double(n));

  family(out, "conveyor_prompt_tokens_total", "counter", "Prompt tokens of admitted completion requests.");
  sample(out, "conveyor_prompt_tokens_total", "", double(prompt_tokens_));
  family(out, "conveyor_generated_tokens_total", "counter", "Tokens generated for completion requests.");
  sample(out, "conveyor_generated_tokens_total", "", double(generated_tokens_));
  family(out, "conveyor_requests_cancelled_total", "counter",
         "Requests whose client closed its connection before the answer was complete; their sequences were freed.");
  sample(out, "conveyor_requests_cancelled_total", "", double(cancelled_));
  family(out, "conveyor_discarded_tokens_total", "counter",
         "Tokens the last stage generated for sequences that had already ended (a stop string's step in flight, "
         "a cancelled or failed request's).");
  sample(out, "conveyor_discarded_tokens_total", "", double(discarded_tokens_));

  histogram(out, "conveyor_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.", ttft_);
  histogram(out, "conveyor_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one sequence.", itl_);

}

// The queue and each pipeline's admission.
void Metrics::render_queue(std::string& out) const {
  family(out, "conveyor_queue_depth", "gauge", "Requests accepted and waiting in the queue for a pipeline.");
  sample(out, "conveyor_queue_depth", "", double(queue_depth_));
  family(out, "conveyor_running_sequences", "gauge", "Sequences admitted onto a pipeline and not finished.");
  sample(out, "conveyor_running_sequences", "", double(running_sequences_));
  family(out, "conveyor_queue_waiting_requests", "gauge",
         "Requests in the queue, labelled with why its head waits: kv_cache (no pipeline has K/V room), "
         "running_limit (pipelines with room run their admission limit), no_pipeline, or none.");
  for (const char* reason : {"none", "kv_cache", "running_limit", "no_pipeline"})
    sample(out, "conveyor_queue_waiting_requests", std::string("reason=\"") + reason + "\"",
           queue_wait_reason_ == reason ? double(queue_waiting_) : 0.0);
  family(out, "conveyor_pipeline_admission_limit_sequences", "gauge",
         "Sequences a pipeline may run at once (scheduler.max_running; auto: in-flight depth x sequences per micro-batch).");
  for (const auto& [p, a] : admission_)
    sample(out, "conveyor_pipeline_admission_limit_sequences", "pipeline=\"" + std::to_string(p) + "\"", double(a.limit));
  family(out, "conveyor_pipeline_running_sequences", "gauge", "Sequences running on a pipeline.");
  for (const auto& [p, a] : admission_)
    sample(out, "conveyor_pipeline_running_sequences", "pipeline=\"" + std::to_string(p) + "\"", double(a.running));
  family(out, "conveyor_pipeline_kv_reserved_tokens", "gauge",
         "K/V tokens the requests admitted onto a pipeline may grow to (prompt + max_tokens).");
  for (const auto& [p, a] : admission_)
    sample(out, "conveyor_pipeline_kv_reserved_tokens", "pipeline=\"" + std::to_string(p) + "\"", double(a.kv_reserved));
  family(out, "conveyor_pipeline_kv_budget_tokens", "gauge",
         "K/V tokens admission may reserve on a pipeline: the smallest capacity its stages report.");
  for (const auto& [p, a] : admission_)
    sample(out, "conveyor_pipeline_kv_budget_tokens", "pipeline=\"" + std::to_string(p) + "\"", double(a.kv_budget));
}

void Metrics::render_prefix_cache(std::string& out) const {
  const std::pair<const char*, const char*> prefix_counters[] = {
      {"lookups", "Prompts that looked for a cached prefix of theirs (a sequence's first prefill)."},
      {"hits", "Prompts that found a cached prefix and forked it instead of computing it."},
      {"reused_tokens", "Prompt tokens forked from the prefix cache rather than computed."},
      {"computed_tokens", "Prompt tokens computed by prompts that looked in the prefix cache."}};
  const int64_t prefix_values[] = {prefix_.lookups, prefix_.hits, prefix_.reused_tokens, prefix_.computed_tokens};
  for (size_t i = 0; i < 4; ++i) {
    const std::string name = std::string("conveyor_prefix_cache_") + prefix_counters[i].first + "_total";
    family(out, name, "counter", prefix_counters[i].second);
    sample(out, name, "", double(prefix_values[i]));
  }
  family(out, "conveyor_prefix_cache_entries", "gauge", "Cached prompt prefixes the pipelines' stages hold.");
  sample(out, "conveyor_prefix_cache_entries", "", double(prefix_.entries));
  family(out, "conveyor_prefix_cache_tokens", "gauge", "K/V tokens the cached prefixes count against the pipelines' budgets.");
  sample(out, "conveyor_prefix_cache_tokens", "", double(prefix_.cached_tokens));
}

// The coordinator's turnaround between micro-batches and its timeout replays.
void Metrics::render_pipeline_flow(std::string& out) const {
  histogram(out, "conveyor_coordinator_turnaround_seconds",
            "Seconds from a micro-batch's result arriving at the coordinator to its pipeline's next micro-batch being sent.",
            gap_);
  family(out, "conveyor_batch_timeout_replays_total", "counter",
         "Pipelines replayed because a micro-batch had not come back scheduler.batch_timeout_ms after it was sent.");
  sample(out, "conveyor_batch_timeout_replays_total", "", double(batch_timeout_replays_));

}

// Each stage's busy and idle fractions and its K/V cache, from its heartbeats.
void Metrics::render_stages(std::string& out) const {
  family(out, "conveyor_stage_busy_fraction", "gauge",
         "Fraction of recent wall time a pipeline stage spent computing.");
  for (const auto& [key, value] : stage_busy_) {
    const auto& [pipeline, stage, worker] = key;
    sample(out, "conveyor_stage_busy_fraction",
           stage_labels(pipeline, stage) + ",worker=\"" + prometheus_label_value(worker) + "\"", value);
  }
  family(out, "conveyor_stage_idle_ready_fraction", "gauge",
         "Fraction of recent wall time a pipeline stage sat between steps with its next input already waiting.");
  for (const auto& [key, value] : stage_idle_ready_) {
    const auto& [pipeline, stage, worker] = key;
    sample(out, "conveyor_stage_idle_ready_fraction",
           stage_labels(pipeline, stage) + ",worker=\"" + prometheus_label_value(worker) + "\"", value);
  }
  family(out, "conveyor_kv_cache_used_tokens", "gauge", "KV-cache slots in use on a stage, in tokens, as of its last heartbeat.");
  for (const auto& [key, v] : kv_tokens_)
    sample(out, "conveyor_kv_cache_used_tokens", stage_labels(key.first, key.second), double(v.first));
  family(out, "conveyor_kv_cache_capacity_tokens", "gauge", "KV-cache capacity of a stage, in tokens.");
  for (const auto& [key, v] : kv_tokens_)
    sample(out, "conveyor_kv_cache_capacity_tokens", stage_labels(key.first, key.second), double(v.second));
}

}  // namespace conveyor

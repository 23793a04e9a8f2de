// Metrics: the coordinator's Prometheus registry, rendered for GET /metrics in the text
// exposition format 0.0.4. No dependency; one mutex guards everything, so every method may
// be called from any thread (the REST layer's io threads and the scheduler's thread).
//
// What each family means, and who records it:
//   REST layer (http_server.cc):
//     conveyor_requests_total{code}: answers to clients' calls (the API, /v1/..., and any
//       other path), by HTTP status; a stream counts as 200 when its header goes out.
//       /health probes, /metrics scrapes and the status page (/) are not counted: a load
//       balancer polling /health while a cluster starts would otherwise show as 503s that
//       no client received.
//     conveyor_prompt_tokens_total (at admission), conveyor_generated_tokens_total (as
//       updates arrive), time to first token, inter-token latency.
//   Engine (engine.cc):
//     conveyor_requests_cancelled_total: requests whose client went away before the answer was
//       complete (the REST layer saw the connection close); their sequences were freed;
//     conveyor_discarded_tokens_total: tokens the last stage generated for sequences that had
//       already ended (a stop string's step in flight, a cancelled or failed request's).
//   Core (coordinator.cc, from the scheduler and the workers' heartbeats):
//     conveyor_queue_depth: requests accepted and waiting for a pipeline slot;
//     conveyor_running_sequences: sequences admitted onto a pipeline and not finished;
//     conveyor_stage_busy_fraction, conveyor_kv_cache_{used,capacity}_tokens: each stage as
//       its worker last reported it (every heartbeat interval). A finished sequence's K/V
//       is released on every stage by the next micro-batch of its pipeline, which the
//       coordinator sends at once even when it carries nothing else, so used tokens fall to
//       0 within about one heartbeat of running_sequences reaching 0.
//     conveyor_stage_idle_ready_fraction: of the same window, the share a stage sat between
//       steps with its next input already there (its own overhead: the previous result's
//       send, decoding the next header), from the worker's heartbeat;
//     conveyor_queue_waiting_requests{reason}: the queue, by why its head waits (kv_cache: no
//       pipeline has K/V room for it; running_limit: every pipeline with room runs its
//       admission limit of sequences; no_pipeline: none serves); one reason at a time;
//     conveyor_pipeline_admission_limit_sequences, conveyor_pipeline_running_sequences,
//       conveyor_pipeline_kv_reserved_tokens, conveyor_pipeline_kv_budget_tokens: per
//       pipeline, what admission allows and what it has given;
//     conveyor_coordinator_turnaround_seconds: from a micro-batch's result arriving to the
//       pipeline's next micro-batch being sent (the coordinator's gap between steps).
//     conveyor_batch_timeout_replays_total: pipelines replayed because a micro-batch had not
//       come back scheduler.batch_timeout_ms after it was sent (no result, no error); should
//       stay 0 without faults (issue 28).
//     conveyor_prefix_cache_lookups_total, _hits_total: prompts that looked for a cached
//       prefix (their first prefill) and those that found one; conveyor_prefix_cache_
//       reused_tokens_total / _computed_tokens_total: their prompt tokens forked from the cache
//       and computed (the token hit rate is reused / (reused + computed));
//       conveyor_prefix_cache_entries, conveyor_prefix_cache_tokens: what the caches hold now.
//     clear_stage_gauges() after a re-plan so gauges of stages that no longer exist
//     disappear instead of freezing at their last value.
//
// Units: seconds for latencies, tokens for KV-cache figures, a fraction in [0, 1] for busy.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace conveyor {

// Cumulative-bucket histogram (not thread-safe by itself; Metrics guards it).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);  // ascending, finite; +Inf is implicit
  void observe(double value, uint64_t times = 1);
  const std::vector<double>& upper_bounds() const { return bounds_; }
  // counts()[i]: observations <= upper_bounds()[i] (cumulative); count(): all of them.
  std::vector<uint64_t> cumulative_counts() const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> per_bucket_;  // non-cumulative; last entry is (last bound, +Inf)
  uint64_t count_ = 0;
  double sum_ = 0;
};

class Metrics {
 public:
  static constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";
  static const std::vector<double>& time_to_first_token_buckets();   // seconds
  static const std::vector<double>& inter_token_latency_buckets();   // seconds
  static const std::vector<double>& turnaround_buckets();            // seconds

  Metrics();

  // REST layer.
  void count_request(int http_status);
  // As above for an answer to `target` (path and query), unless it is a probe, a scrape or
  // the status page (/health, /metrics, /), which conveyor_requests_total leaves out.
  void count_request(std::string_view target, int http_status);
  static bool counts_as_request(std::string_view target);
  void observe_time_to_first_token(double seconds);
  void observe_inter_token_latency(double seconds, uint64_t tokens = 1);
  void add_prompt_tokens(uint64_t tokens);
  void add_generated_tokens(uint64_t tokens);

  // Core.
  void set_queue_depth(int64_t requests);
  void set_running_sequences(int64_t sequences);
  void set_stage_busy_fraction(int pipeline, int stage, const std::string& worker, double fraction);
  void set_stage_idle_ready_fraction(int pipeline, int stage, const std::string& worker, double fraction);
  void set_kv_cache_tokens(int pipeline, int stage, int64_t used_tokens, int64_t capacity_tokens);
  // The queue's requests and why its head waits ("none", "kv_cache", "running_limit", "no_pipeline").
  void set_queue_wait(std::string_view reason, int64_t requests);
  void set_pipeline_admission(int pipeline, int64_t limit_sequences, int64_t running_sequences, int64_t kv_reserved_tokens,
                              int64_t kv_budget_tokens);
  void observe_coordinator_gap(double seconds);
  // A pipeline replayed because a micro-batch of it was taken for lost (batch_timeout_ms).
  void count_batch_timeout_replay();
  void count_cancelled();
  void add_discarded_tokens(uint64_t tokens);
  struct PrefixCacheFigures {
    int64_t lookups = 0, hits = 0, reused_tokens = 0, computed_tokens = 0, entries = 0, cached_tokens = 0;
  };
  void set_prefix_cache(const PrefixCacheFigures& f);
  void clear_stage_gauges();

  // The whole registry in the Prometheus text format (HELP and TYPE for every family).
  std::string render() const;

  // For tests.
  uint64_t requests_with_code(int http_status) const;
  uint64_t time_to_first_token_count() const;
  uint64_t inter_token_latency_count() const;
  uint64_t coordinator_gap_count() const;
  uint64_t batch_timeout_replays() const;
  uint64_t cancelled() const;

 private:
  // render()'s parts, each with mu_ held.
  void render_requests(std::string& out) const;
  void render_queue(std::string& out) const;
  void render_prefix_cache(std::string& out) const;
  void render_pipeline_flow(std::string& out) const;
  void render_stages(std::string& out) const;
  mutable std::mutex mu_;
  std::map<int, uint64_t> requests_by_code_;
  Histogram ttft_, itl_, gap_;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0;
  uint64_t batch_timeout_replays_ = 0;
  uint64_t cancelled_ = 0, discarded_tokens_ = 0;
  int64_t queue_depth_ = 0, running_sequences_ = 0;
  std::map<std::tuple<int, int, std::string>, double> stage_busy_;  // (pipeline, stage, worker)
  std::map<std::tuple<int, int, std::string>, double> stage_idle_ready_;  // (pipeline, stage, worker)
  std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> kv_tokens_;  // -> (used, capacity)
  std::string queue_wait_reason_ = "none";
  int64_t queue_waiting_ = 0;
  struct Admission {
    int64_t limit = 0, running = 0, kv_reserved = 0, kv_budget = 0;
  };
  std::map<int, Admission> admission_;  // by pipeline
  PrefixCacheFigures prefix_;
};

// Prometheus sample value: shortest round-trip decimal, "+Inf", "-Inf", "NaN".
std::string prometheus_number(double value);
// A label value with \, " and newline escaped.
std::string prometheus_label_value(std::string_view value);

}  // namespace conveyor

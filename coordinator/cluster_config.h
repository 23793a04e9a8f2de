// The coordinator's cluster file (YAML). Every key is known: an unknown key, a wrong type, a
// number out of its range or an impossible plan is refused at start with the file, the line
// and the reason; every mistake in the file is listed (one a line), not only the first.
//
//   model:     {path: DIR, name: NAME, chat_template: NAME|FILE}   (a relative DIR or FILE is
//               relative to the cluster file; chat_template: a built-in name, else a file)
//   http:      {host: 127.0.0.1, port: 8000, api_key: KEY, threads: 2,
//               cors_origins: [https://app.example.com, ...] or "*"}
//   control:   {host: 127.0.0.1, port: 5555, join_token: TOKEN, curve_secret_key: Z85,
//               data_interface: IF}   (IF: absent = host's interface, see data_interface below)
//   pipeline:  {stages: N, replicas: R, layers: [[b, e], ...]}
//   scheduler: {in_flight: D, max_batch_tokens: T, prefill_chunk: C, prefill_tokens_per_batch: P,
//               max_queue: Q, max_running: S, max_sequences_per_batch: B,
//               shutdown_timeout_ms: 30000, pipeline_wait_ms: 30000, batch_timeout_ms: 30000,
//               request_timeout_ms: 600000, prefix_cache: true, step_ahead: true}
//              (D, T, C, P, S, B: 0 or absent = auto, from what the pipeline's workers say of
//               their steps: see scheduler.h, batch_limits)
//   heartbeat: {interval_ms: 500, liveness_ms: 3000}
//   log:       {format: text}   (or json: one JSON object a line, coordinator/request_log.h)
//
// Ranges (0 = auto where the scheduler line above says so): ports 0-65535 (0: a free one),
// http.threads 1-256, pipeline.stages 1-min(1024, the model's layers), replicas 1-1024;
// in_flight 1-64, max_batch_tokens 16-1048576, prefill_chunk and prefill_tokens_per_batch
// 1-1048576, max_sequences_per_batch 1-65536, max_running 1-1000000, max_queue 1-1000000;
// shutdown_timeout_ms and pipeline_wait_ms 0-3600000; batch_timeout_ms 0 (never) or
// 100-3600000; request_timeout_ms 0 (no deadline) or 100-86400000; heartbeat.interval_ms
// 10-60000, liveness_ms 50-600000 and above interval_ms.
//
// api_key and join_token may come from CONVEYOR_API_KEY / CONVEYOR_JOIN_TOKEN instead.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/model_config.h"
#include "common/status.h"
#include "coordinator/layout_choice.h"

namespace conveyor {

struct ClusterConfig {
  std::string source;  // the file it came from, for messages

  std::string model_path;
  std::string model_name;
  ModelConfig model;  // read from model_path at load time
  // /v1/chat/completions' template (model/chat_template.h): a built-in's name or a file;
  // empty: the model's own (tokenizer_config.json), if any.
  std::string chat_template;

  std::string http_host = "127.0.0.1";
  int http_port = 8000;
  int http_threads = 2;
  std::string api_key;
  // Origins allowed to call the API from a browser (rest/http_headers.h); ["*"]: any; empty: no CORS.
  std::vector<std::string> cors_origins;

  std::string control_host = "127.0.0.1";
  int control_port = 5555;
  // The data plane's interface (transport/net_interface.h, choose_data_interface): empty
  // follows control_host (its interface; `lo` for 127.0.0.1; every one for 0.0.0.0); "any",
  // or names in UCX_NET_DEVICES's syntax, override that. UCX_NET_DEVICES overrides both.
  std::string data_interface;
  std::string join_token;
  std::string curve_secret_key;
  // The secrets the file itself sets (http.api_key, control.join_token, curve_secret_key), by
  // key: such a file should be readable by its owner only (the coordinator warns otherwise).
  std::vector<std::string> secrets_in_file;

  int stages = 1;
  int replicas = 1;
  std::vector<std::pair<int64_t, int64_t>> layers;  // per stage [begin, end); filled by the plan

  int in_flight = 0;  // micro-batches in flight per pipeline; 0 = number of stages
  bool in_flight_auto = false;  // in_flight was 0: it follows the number of stages on a re-plan
  // A micro-batch's limits and the admission limit; 0 = auto, from the figures the pipeline's
  // workers give in their register (Scheduler's batch_limits).
  int64_t max_batch_tokens = 0;          // decode rows + prompt rows
  int64_t prefill_chunk = 0;             // prompt tokens of one sequence
  int64_t prefill_tokens_per_batch = 0;  // prompt tokens of all sequences together
  int64_t max_sequences_per_batch = 0;
  int64_t max_running = 0;               // sequences running on a pipeline (auto: in_flight x max_sequences_per_batch)
  int64_t max_queue = 1024;              // requests waiting for admission; more are refused (429)
  // A micro-batch that has not come back this long after it was sent is taken for lost: its
  // pipeline replays in a new epoch, as after a stage's error. 0: never.
  int batch_timeout_ms = 30000;
  // Prefix K/V reuse across requests (scheduler.h): a prompt that starts like one computed
  // before forks the stages' K/V of that prefix instead of computing it again.
  bool prefix_cache = true;
  // A pipeline of one stage sends each decode step before the step before it has come back,
  // on the token the stage sampled there (Scheduler::next_step): the coordinator's round trip
  // leaves the step's critical path.
  bool step_ahead = true;
  int shutdown_timeout_ms = 30000;  // SIGTERM: how long accepted requests may take to finish
  // While no pipeline can serve (its only worker drained or died, no spare): how long an
  // accepted request waits in the queue for one before it is refused (503, Retry-After).
  // 0: refuse such requests at submission, as nothing could serve them.
  int pipeline_wait_ms = 30000;
  // An accepted request's whole life, from its arrival: past it the request ends with a 504
  // (a stream with an error event) and its sequences are freed, whatever holds it up (a
  // stage that stopped making progress, a queue that never drains). 0: no deadline.
  int request_timeout_ms = 600000;

  int heartbeat_interval_ms = 500;
  int liveness_ms = 3000;

  bool log_json = false;  // log.format: json (every log line a JSON object; default text)
  // What the cluster optimises (layout_choice.h): the layout `conveyor local` takes for
  // several GPUs when it is given no shape, and what /v1/cluster reports.
  Objective objective = Objective::Throughput;
};

Expected<ClusterConfig> load_cluster_config(const std::string& path);
// `base_dir` anchors a relative model.path (load_cluster_config passes the file's folder;
// empty: the working directory).
Expected<ClusterConfig> parse_cluster_config(const std::string& yaml_text, const std::string& source,
                                             const std::string& base_dir = "");

// The plan's default: contiguous layer ranges for `stages` stages whose largest compute
// cost (multiply-adds per token: 4C^2 + 2CI per layer, plus V*C for the LM head on the last
// stage) is as small as possible, since the slowest stage sets the pipeline's pace. Among
// equal plans the earlier stages take the extra layers.
std::vector<std::pair<int64_t, int64_t>> balanced_layer_split(const ModelConfig& config, int stages);

// Checks explicit layer ranges: `stages` contiguous, non-empty ranges covering [0, n_layer).
Status check_layer_split(const std::vector<std::pair<int64_t, int64_t>>& layers, int stages, int64_t n_layer);

}  // namespace conveyor

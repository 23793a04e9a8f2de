// The `conveyor` command's subcommands, each a function the thin main calls (and tests
// can call directly). Each returns the process exit code.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace conveyor::cli {

// `conveyor run`: single-process generation on the CPU engine (no cluster).
struct RunOptions {
  std::string model_dir;
  std::string prompt;
  int max_tokens = 64;
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float repetition_penalty = 1.0f;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};
void add_run_command(CLI::App& app, RunOptions& options);
int run_command(const RunOptions& options);

// `conveyor perplexity`: perplexity of a text file (or the model's heldout.json).
struct PerplexityOptions {
  std::string model_dir;
  std::string file;  // empty: the text of MODEL/heldout.json
};
void add_perplexity_command(CLI::App& app, PerplexityOptions& options);
int perplexity_command(const PerplexityOptions& options);

// `conveyor local`: a coordinator and stages * replicas + spares workers on this machine,
// as child processes; prints the URL when /health says ready, stops them all on Ctrl-C.
struct LocalOptions {
  std::string model_dir;
  int stages = 1;
  int replicas = 1;
  int spares = 0;
  int port = 8000;
  // Per worker: "auto" (CPU: 256 MiB; CUDA: the worker sizes it from GPU memory) or MiB.
  std::string kv_cache_mb = "auto";
  int in_flight = 0;
  bool no_prefix_cache = false;  // scheduler.prefix_cache: false
  bool no_step_ahead = false;    // scheduler.step_ahead: false
  std::string log_dir;
  bool verbose = false;
  std::string backend = "auto";  // the workers' --backend; auto: cuda when conveyor-worker finds a GPU
  int gpus = 1;                  // cuda: GPUs to use; worker i's ranks on GPUs (i * tp + k) % gpus
  bool gpus_given = false;       // --gpus was on the command line (auto then keeps it)
  std::string dtype = "f16";
  bool int8_weights = false;     // cuda: int8 weight-only layer matrices
  bool fp8 = false;              // cuda, Hopper: FP8 E4M3 layer matrices and activations
  std::string kv_dtype = "auto";  // cuda: the K/V cache's type, auto (the dtype) or fp8
  int tp = 1;                    // tensor-parallel ranks per worker: threads (cpu) or GPUs (cuda)
  bool shape_given = false;      // --stages, --replicas or --tp on the command line
  // With several GPUs and no shape given: the cluster's objective (coordinator/layout_choice.h)
  // and the measured figures the layout is chosen from (empty: the project's, when found).
  std::string objective = "throughput";
  std::string layout_figures;
  std::string chat_template;     // model.chat_template: a built-in name or a file; empty: the model's own
};
void add_local_command(CLI::App& app, LocalOptions& options);
int local_command(const LocalOptions& options);

// `conveyor generate`: streams a completion from a cluster.
struct GenerateOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string prompt;
  int max_tokens = 64;
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::string api_key;
  double idle_timeout_s = 60;  // the stream fails when nothing arrives for this long
  double timeout_s = 600;      // and when it has not ended after this long
};
void add_generate_command(CLI::App& app, GenerateOptions& options);
int generate_command(const GenerateOptions& options);

// `conveyor status`: the cluster table.
struct StatusOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string api_key;
};
void add_status_command(CLI::App& app, StatusOptions& options);
int status_command(const StatusOptions& options);

// `conveyor drain NAME`: takes a worker out of service (its stage goes to a spare, or the
// plan shrinks over the other workers).
struct DrainOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string api_key;
  std::string worker;
};
void add_drain_command(CLI::App& app, DrainOptions& options);
int drain_command(const DrainOptions& options);

// `conveyor plan --stages N --replicas R --layers 0:3,3:6`: re-plans a running cluster.
struct PlanOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string api_key;
  std::optional<int> stages, replicas;
  std::string layers;
};
void add_plan_command(CLI::App& app, PlanOptions& options);
int plan_command(const PlanOptions& options);

}  // namespace conveyor::cli

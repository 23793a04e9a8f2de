// The `conveyor` command's subcommands, each a function the thin main calls (and tests
// can call directly). Each returns the process exit code.
#pragma once

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

}  // namespace conveyor::cli

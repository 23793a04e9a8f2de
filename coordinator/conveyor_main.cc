// `conveyor`: the command line for people. Each subcommand lives in coordinator/cli_*.cc.
#include <iostream>

#include <CLI/CLI.hpp>

#include "coordinator/cli.h"

int main(int argc, char** argv) {
  CLI::App app{"conveyor: serve GPT models across GPUs and nodes"};
  app.require_subcommand(1);
  conveyor::cli::RunOptions run;
  conveyor::cli::PerplexityOptions ppl;
  conveyor::cli::add_run_command(app, run);
  conveyor::cli::add_perplexity_command(app, ppl);
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("run")) return conveyor::cli::run_command(run);
    if (app.got_subcommand("perplexity")) return conveyor::cli::perplexity_command(ppl);
  } catch (const std::exception& e) {
    std::cerr << "conveyor: " << e.what() << "\n";
    return 1;
  }
  return 2;
}

// `conveyor`: the command line for people. Each subcommand lives in coordinator/cli_*.cc.
#include <iostream>

#include <CLI/CLI.hpp>

#include "cli/cli.h"

int main(int argc, char** argv) {
  CLI::App app{"conveyor: serve GPT models across GPUs and nodes"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows each default (subcommands inherit it)
  conveyor::cli::RunOptions run;
  conveyor::cli::PerplexityOptions ppl;
  conveyor::cli::add_run_command(app, run);
  conveyor::cli::add_perplexity_command(app, ppl);
  conveyor::cli::LocalOptions local;
  conveyor::cli::GenerateOptions gen;
  conveyor::cli::StatusOptions status;
  conveyor::cli::add_local_command(app, local);
  conveyor::cli::add_generate_command(app, gen);
  conveyor::cli::add_status_command(app, status);
  conveyor::cli::DrainOptions drain;
  conveyor::cli::add_drain_command(app, drain);
  conveyor::cli::PlanOptions plan;
  conveyor::cli::add_plan_command(app, plan);
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("run")) return conveyor::cli::run_command(run);
    if (app.got_subcommand("perplexity")) return conveyor::cli::perplexity_command(ppl);
    if (app.got_subcommand("local")) return conveyor::cli::local_command(local);
    if (app.got_subcommand("generate")) return conveyor::cli::generate_command(gen);
    if (app.got_subcommand("status")) return conveyor::cli::status_command(status);
    if (app.got_subcommand("drain")) return conveyor::cli::drain_command(drain);
    if (app.got_subcommand("plan")) return conveyor::cli::plan_command(plan);
  } catch (const std::exception& e) {
    std::cerr << "conveyor: " << e.what() << "\n";
    return 1;
  }
  return 2;
}

// How a model goes on N GPUs of one machine when the operator names no shape: one stage
// tensor-parallel over all of them, N pipeline stages, or N one-stage replicas (when the
// model fits one GPU), chosen from measured figures for the cluster's stated objective.
// Pure functions (tests/coordinator/test_layout_choice.cc); `conveyor local` asks.
//
// The figures are what bench/two_gpu_table.sh measures through REST: for each layout and
// client count, tokens/s and the inter-token latency. They depend on the machine, so the
// operator can measure their own and pass them (`conveyor local --layout-figures FILE`);
// bench/layout_figures.jsonl holds the project's measurement (its rows name the device).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor {

// What the cluster optimises (the cluster file's `objective`): a client's inter-token
// latency, or the tokens/s of the whole machine under load.
enum class Objective { Latency, Throughput };
Expected<Objective> parse_objective(const std::string& text);  // "latency" or "throughput"
const char* objective_name(Objective o);

// One measured row: `layout` "tp", "stages" or "replicas" over `gpus` GPUs (or "one": the
// same model on one GPU), at `clients` concurrent clients.
struct LayoutFigure {
  std::string layout;
  int gpus = 0;
  int clients = 0;
  double tokens_per_s = 0;
  double itl_ms_p50 = 0;
  std::string device;  // where it was measured ("2 x NVIDIA H200, 2026-11-26")
};

// One JSON object a line (bench/two_gpu_table.sh's figures.jsonl): layout, gpus, clients,
// tokens_per_s, itl_ms_p50 and optionally device. An error names the line and what is wrong.
Expected<std::vector<LayoutFigure>> parse_layout_figures(const std::string& text, const std::string& source);

struct LayoutChoice {
  std::string layout;  // "tp", "stages" or "replicas"
  int stages = 1, tp = 1, replicas = 1;
  std::string why;  // one sentence: the figures compared, or the rule taken without them
};

// The layout for `gpus` GPUs (>= 2) and `objective`: among the layouts the model allows
// (replicas only when `fits_one_gpu`), the best measured one for `gpus` GPUs. Latency: the
// lowest inter-token latency at the fewest clients measured; throughput: the most tokens/s at
// the most clients measured. Without figures for every allowed layout at that GPU count, a
// rule instead, said as such: latency takes tp (a token's work split over the GPUs),
// throughput replicas when the model fits one GPU, else stages.
LayoutChoice choose_layout(Objective objective, int gpus, bool fits_one_gpu, const std::vector<LayoutFigure>& figures);

}  // namespace conveyor

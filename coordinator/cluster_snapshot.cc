#include "coordinator/cluster_snapshot.h"

#include <algorithm>
#include <numeric>
#include <set>

namespace conveyor {

StageFigures stage_figures_of(std::span<const WorkerInfo* const> stages) {
  StageFigures f;
  std::set<std::string> backends;
  bool any = false;
  for (const WorkerInfo* w : stages) {
    if (!w) continue;
    const StageCapabilities& c = w->caps;
    if (c.max_rows_per_step > 0) f.max_rows = f.max_rows > 0 ? std::min(f.max_rows, c.max_rows_per_step) : c.max_rows_per_step;
    f.sequences = std::max(f.sequences, c.max_sequences_per_step);
    f.prompt_rows = std::max(f.prompt_rows, c.max_prompt_rows_per_step);
    f.extra_in_flight = any ? std::min(f.extra_in_flight, c.extra_in_flight) : c.extra_in_flight;
    f.kv_page_tokens = std::lcm(f.kv_page_tokens, std::max<int64_t>(1, c.kv_page_tokens));
    backends.insert(w->backend);
    any = true;
  }
  for (const std::string& b : backends) f.backends += (f.backends.empty() ? "" : "+") + b;
  return f;
}

}  // namespace conveyor

#include "coordinator/layout_choice.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace conveyor {

Expected<Objective> parse_objective(const std::string& text) {
  if (text == "latency") return Objective::Latency;
  if (text == "throughput") return Objective::Throughput;
  return Status::error("the objective is latency or throughput, not '" + text + "'");
}

const char* objective_name(Objective o) { return o == Objective::Latency ? "latency" : "throughput"; }

namespace {

const char* const kLayouts[] = {"one", "tp", "stages", "replicas"};

bool known_layout(const std::string& l) { return std::find(std::begin(kLayouts), std::end(kLayouts), l) != std::end(kLayouts); }

std::string layout_text(const std::string& layout, int gpus) {
  if (layout == "tp") return "1 stage at tp " + std::to_string(gpus);
  if (layout == "stages") return std::to_string(gpus) + " stages";
  if (layout == "replicas") return std::to_string(gpus) + " replicas";
  return "1 GPU";
}

LayoutChoice shape_of(const std::string& layout, int gpus) {
  LayoutChoice c;
  c.layout = layout;
  if (layout == "tp") c.tp = gpus;
  else if (layout == "stages") c.stages = gpus;
  else c.replicas = gpus;
  return c;
}

// 18773.4 -> "18,773"
std::string grouped(double v) {
  std::string s = std::to_string(std::llround(v));
  for (int i = int(s.size()) - 3; i > 0; i -= 3) s.insert(size_t(i), ",");
  return s;
}

std::string two_decimals(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", v);
  return b;
}

}  // namespace

Expected<std::vector<LayoutFigure>> parse_layout_figures(const std::string& text, const std::string& source) {
  std::vector<LayoutFigure> out;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = source + ":" + std::to_string(n) + ": ";
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return Status::error(where + "not a JSON object");
    LayoutFigure f;
    try {
      f.layout = j.at("layout").get<std::string>();
      f.gpus = j.at("gpus").get<int>();
      f.clients = j.at("clients").get<int>();
      f.tokens_per_s = j.at("tokens_per_s").get<double>();
      f.itl_ms_p50 = j.at("itl_ms_p50").get<double>();
      f.device = j.value("device", std::string());
    } catch (const nlohmann::json::exception& e) {
      return Status::error(where + "needs layout, gpus, clients, tokens_per_s and itl_ms_p50 (" + e.what() + ")");
    }
    if (!known_layout(f.layout))
      return Status::error(where + "layout '" + f.layout + "' is none of one, tp, stages, replicas");
    if (f.gpus < 1 || f.clients < 1 || !(f.tokens_per_s > 0) || !(f.itl_ms_p50 > 0))
      return Status::error(where + "gpus and clients must be at least 1, tokens_per_s and itl_ms_p50 above 0");
    out.push_back(std::move(f));
  }
  return out;
}

LayoutChoice choose_layout(Objective objective, int gpus, bool fits_one_gpu, const std::vector<LayoutFigure>& figures) {
  std::vector<std::string> allowed = {"tp", "stages"};
  if (fits_one_gpu) allowed.push_back("replicas");
  const bool latency = objective == Objective::Latency;
  // Per allowed layout, its row at the load the objective looks at: the fewest clients
  // (latency) or the most (throughput).
  std::map<std::string, const LayoutFigure*> pick;
  for (const LayoutFigure& f : figures) {
    if (f.gpus != gpus || std::find(allowed.begin(), allowed.end(), f.layout) == allowed.end()) continue;
    const LayoutFigure*& p = pick[f.layout];
    if (!p || (latency ? f.clients < p->clients : f.clients > p->clients)) p = &f;
  }
  const bool same_load = std::all_of(pick.begin(), pick.end(), [&](const auto& kv) {
    return kv.second->clients == pick.begin()->second->clients;
  });
  if (pick.size() != allowed.size() || !same_load) {
    LayoutChoice c = shape_of(latency ? "tp" : fits_one_gpu ? "replicas" : "stages", gpus);
    c.why = std::string("no figures measured for every layout on ") + std::to_string(gpus) +
            " GPUs at one load, so the rule: " +
            (latency ? "a token's work split over the GPUs (tp) for the lowest inter-token latency"
                     : fits_one_gpu ? "the model fits one GPU, so one replica a GPU for the most tokens/s"
                                    : "the model does not fit one GPU, so one stage a GPU for the most tokens/s");
    return c;
  }
  auto better = [&](const LayoutFigure* a, const LayoutFigure* b) {
    return latency ? a->itl_ms_p50 < b->itl_ms_p50 : a->tokens_per_s > b->tokens_per_s;
  };
  const LayoutFigure* best = nullptr;
  for (const std::string& l : allowed)
    if (!best || better(pick[l], best)) best = pick[l];
  auto figure = [&](const LayoutFigure* f) {
    return latency ? two_decimals(f->itl_ms_p50) + " ms between tokens" : grouped(f->tokens_per_s) + " tokens/s";
  };
  LayoutChoice c = shape_of(best->layout, gpus);
  c.why = layout_text(best->layout, gpus) + " measured " + figure(best) + " at " + std::to_string(best->clients) +
          (best->clients == 1 ? " client" : " clients");
  std::string others;
  for (const std::string& l : allowed)
    if (pick[l] != best) {
      const std::string name = layout_text(l, gpus);
      others += std::string(others.empty() ? "" : " and ") + name + (name.back() == 's' ? "' " : "'s ") + figure(pick[l]);
    }
  c.why += ", against " + others;
  if (!best->device.empty()) c.why += " (" + best->device + ")";
  if (!fits_one_gpu) c.why += "; replicas are out: the model does not fit one GPU";
  return c;
}

}  // namespace conveyor

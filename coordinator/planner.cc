#include "coordinator/planner.h"

#include <algorithm>

#include "coordinator/cluster_config.h"  // balanced_layer_split, check_layer_split

namespace conveyor {

nlohmann::json shape_json(const Shape& shape) {
  nlohmann::json layers = nlohmann::json::array();
  for (auto [b, e] : shape.layers) layers.push_back({b, e});
  return {{"stages", shape.stages}, {"replicas", shape.replicas}, {"layers", layers}};
}

int64_t stage_weight_bytes(const StageFootprint& f, LayerRange layers, int64_t n_layer) {
  const bool first = layers.first == 0, last = layers.second == n_layer;
  const int64_t ends = first && last ? f.embedding_and_head_bytes
                                     : (first ? f.embedding_bytes : 0) + (last ? f.head_bytes : 0);
  return (layers.second - layers.first) * f.layer_bytes + ends;
}

namespace {

// A plannable worker's bytes for `layers` (plannable: it has a footprint).
int64_t weight_bytes(const WorkerInfo& w, const ModelConfig& model, LayerRange layers) {
  return stage_weight_bytes(*w.footprint, layers, model.n_layer);
}

std::string range_text(LayerRange r) {
  return "[" + std::to_string(r.first) + ", " + std::to_string(r.second) + ")";
}

}  // namespace

Expected<std::vector<std::string>> place(const Workers& workers, const PlanModel& model, const Shape& shape,
                                         const std::string& without) {
  std::vector<const WorkerInfo*> pool;
  for (const auto& [name, w] : workers)
    if (w.plannable() && name != without) pool.push_back(&w);
  const size_t S = size_t(shape.stages), n = S * size_t(shape.replicas);
  if (pool.size() < n)
    return Status::error(std::to_string(shape.stages) + " stage(s) x " + std::to_string(shape.replicas) +
                         " replica(s) need " + std::to_string(n) + " workers and " + std::to_string(pool.size()) +
                         " can serve");
  std::vector<std::string> out(n);
  std::vector<bool> used(pool.size(), false);
  auto fits = [&](const WorkerInfo& w, size_t slot) {
    return weight_bytes(w, model.config, shape.layers[slot % S]) <= w.weight_room();
  };
  // First every worker that already holds a slot's layers keeps them.
  for (size_t slot = 0; slot < n; ++slot)
    for (size_t i = 0; i < pool.size(); ++i)
      if (!used[i] && pool[i]->holds(shape.layers[slot % S], model.path) && fits(*pool[i], slot)) {
        out[slot] = pool[i]->name;
        used[i] = true;
        break;
      }
  // Then the largest remaining stages go to the roomiest remaining workers.
  std::vector<size_t> slots, free;
  for (size_t slot = 0; slot < n; ++slot)
    if (out[slot].empty()) slots.push_back(slot);
  for (size_t i = 0; i < pool.size(); ++i)
    if (!used[i]) free.push_back(i);
  std::stable_sort(free.begin(), free.end(),
                   [&](size_t a, size_t b) { return pool[a]->weight_room() > pool[b]->weight_room(); });
  // A slot's size: its bytes in the format of the roomiest free worker, which takes the largest.
  auto size_of = [&](size_t slot) { return weight_bytes(*pool[free.front()], model.config, shape.layers[slot % S]); };
  if (!free.empty())
    std::stable_sort(slots.begin(), slots.end(), [&](size_t a, size_t b) { return size_of(a) > size_of(b); });
  for (size_t k = 0; k < slots.size(); ++k) {
    const WorkerInfo& w = *pool[free[k]];
    const LayerRange layers = shape.layers[slots[k] % S];
    if (!fits(w, slots[k]))
      return Status::error("layers " + range_text(layers) + " need " +
                           std::to_string(weight_bytes(w, model.config, layers) >> 20) + " MiB and worker '" + w.name +
                           "' has " + std::to_string(w.weight_room() >> 20) + " MiB");
    out[slots[k]] = w.name;
  }
  return out;
}

Shape shape_with(const Shape& target, const ModelConfig& model, int stages, int replicas) {
  return {stages, replicas, stages == target.stages ? target.layers : balanced_layer_split(model, stages)};
}

Expected<Placement> largest_feasible(const Workers& workers, const PlanModel& model, const Shape& target,
                                     const std::string& without) {
  std::string first_why;
  for (int r = target.replicas; r >= 1; --r)
    for (int s = target.stages; s >= 1; --s) {
      Shape shape = shape_with(target, model.config, s, r);
      auto placed = place(workers, model, shape, without);
      if (placed) return Placement{std::move(shape), std::move(placed).value()};
      if (first_why.empty()) first_why = placed.error();
    }
  return Status::error(first_why);
}

CoreStatus shape_from_request(const PlanRequest& request, const ModelConfig& model, const Shape& target, Shape& out) {
  auto invalid = [](std::string message, std::string param) {
    return CoreStatus::refuse(CoreError::Invalid, std::move(message), std::move(param));
  };
  if (!request.stages && !request.replicas && !request.layers)
    return invalid("the plan is empty: give stages, replicas and/or layers", "");
  const int64_t L = model.n_layer;
  Shape shape = target;
  if (request.stages) {
    if (*request.stages < 1 || *request.stages > L)
      return invalid("stages must be an integer from 1 to " + std::to_string(L) + " (the model's layers)", "stages");
    shape.stages = int(*request.stages);
  }
  if (request.replicas) {
    if (*request.replicas < 1 || *request.replicas > 64) return invalid("replicas must be an integer from 1 to 64", "replicas");
    shape.replicas = int(*request.replicas);
  }
  if (request.layers) {
    if (!request.stages) shape.stages = int(request.layers->size());
    if (Status s = check_layer_split(*request.layers, shape.stages, L); !s) return invalid(s.message(), "layers");
    shape.layers = *request.layers;
  } else if (request.stages && shape.stages != target.stages) {
    shape.layers = balanced_layer_split(model, shape.stages);
  }
  out = std::move(shape);
  return {};
}

}  // namespace conveyor

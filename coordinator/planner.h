// The planner: where a plan's stages go. Pure functions of (workers, model, shape): no
// threads, no sockets, no state of their own (tests/coordinator/test_planner.cc).
//
// A shape is S stages x R pipeline replicas over given layer ranges; a placement names the
// worker of each of its S x R slots, replica-major (slot = replica * S + stage).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "common/status.h"
#include "coordinator/core_status.h"
#include "coordinator/membership.h"

namespace conveyor {

struct Shape {
  int stages = 1, replicas = 1;
  std::vector<LayerRange> layers;  // one per stage, covering [0, n_layer)
  bool operator==(const Shape&) const = default;
};

// {"stages": S, "replicas": R, "layers": [[b, e], ...]}
nlohmann::json shape_json(const Shape& shape);

struct Placement {
  Shape shape;
  std::vector<std::string> workers;  // per slot, replica-major
};

// What the planner knows of the model: its shape and the checkpoint workers load.
struct PlanModel {
  const ModelConfig& config;
  const std::string& path;
};

// What layers `layers` of a model of `n_layer` layers take on a worker whose footprint for
// it is `f` (StageFootprint: its own format's bytes; the coordinator knows none).
int64_t stage_weight_bytes(const StageFootprint& f, LayerRange layers, int64_t n_layer);

// Places the slots of `shape` on plannable workers other than `without`: a worker that holds
// a slot's layers keeps them (no reload); the other slots go largest stage first to the
// roomiest worker left (a stage's size: its bytes on the roomiest). Only workers that
// described the model (WorkerInfo::footprint) are placed. An error when the workers are too few or a stage does not fit in a
// worker's memory, saying which.
Expected<std::vector<std::string>> place(const Workers& workers, const PlanModel& model, const Shape& shape,
                                         const std::string& without = "");

// A shape of `stages` x `replicas`: `target`'s layer ranges when it has that many stages
// (they may be the operator's), else the balanced split.
Shape shape_with(const Shape& target, const ModelConfig& model, int stages, int replicas);

// The largest shape the plannable workers (other than `without`) can run: `target`, else as
// many of its replicas as possible, each with as many of its stages as the workers and their
// memory allow. The error is why the target itself cannot be placed.
Expected<Placement> largest_feasible(const Workers& workers, const PlanModel& model, const Shape& target,
                                     const std::string& without = "");

// POST /v1/cluster/plan as the core takes it: absent fields keep their value.
struct PlanRequest {
  std::optional<int64_t> stages, replicas;
  std::optional<std::vector<LayerRange>> layers;
};

// `request` applied to `target`, into `out`: stages, replicas and layer ranges checked against
// the model (an Invalid status names the field). Changing only the stages splits the layers
// anew.
CoreStatus shape_from_request(const PlanRequest& request, const ModelConfig& model, const Shape& target, Shape& out);

}  // namespace conveyor

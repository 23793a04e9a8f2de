#include "coordinator/membership.h"

#include <limits>

namespace conveyor {

const char* member_state_name(MemberState s) {
  switch (s) {
    case MemberState::Spare: return "spare";
    case MemberState::Loading: return "loading";
    case MemberState::Ready: return "ready";
    case MemberState::Dead: return "dead";
    case MemberState::Failed: return "failed";
    case MemberState::Drained: return "drained";
  }
  return "?";
}

bool WorkerInfo::holds(LayerRange range, const std::string& model_path) const {
  if (state == MemberState::Ready || state == MemberState::Loading) return stage >= 0 && layers == range;
  return state == MemberState::Spare && holding && holding->model == model_path &&
         LayerRange{holding->layer_begin, holding->layer_end} == range;
}

int64_t WorkerInfo::weight_room() const {
  return caps.weight_memory_bytes > 0 ? caps.weight_memory_bytes : std::numeric_limits<int64_t>::max();
}

nlohmann::json worker_json(const WorkerInfo& w) {
  nlohmann::json e = {{"name", w.name}, {"host", w.host}, {"pid", w.pid}, {"backend", w.backend},
                      {"gpus", w.gpus}, {"state", member_state_name(w.state)},
                      {"busy_fraction", w.busy_fraction}, {"busy_seconds_total", w.busy_seconds_total},
                      {"clock_seconds", w.clock_seconds}, {"wait_input_seconds_total", w.wait_input_seconds_total},
                      {"idle_ready_seconds_total", w.idle_ready_seconds_total},
                      {"idle_ready_fraction", w.idle_ready_fraction}, {"kv_used_tokens", w.kv_used_tokens},
                      {"kv_capacity_tokens", w.kv_capacity_tokens}, {"load_progress", w.load_fraction},
                      {"load_bytes_done", w.load_bytes_done}, {"load_bytes_total", w.load_bytes_total},
                      {"load_seconds", w.load_seconds}, {"memory_bytes", w.memory_bytes},
                      {"dtype", std::string(activation_dtype_wire_name(w.caps.dtype))}, {"weight_format", w.caps.weight_format},
                      {"weight_memory_bytes", w.caps.weight_memory_bytes}};
  if (w.footprint)
    e["footprint"] = {{"layer_bytes", w.footprint->layer_bytes}, {"embedding_bytes", w.footprint->embedding_bytes},
                      {"head_bytes", w.footprint->head_bytes},
                      {"kv_bytes_per_token_per_layer", w.footprint->kv_bytes_per_token_per_layer}};
  if (w.leaving) e["leaving"] = true;
  if (!w.data_plane.is_null()) e["data_plane"] = w.data_plane;
  if (w.stage >= 0) {
    e["pipeline"] = w.pipeline;
    e["stage"] = w.stage;
    e["layers"] = {w.layers.first, w.layers.second};
  }
  if (!w.last_error.empty()) e["last_error"] = w.last_error;
  if (!w.resolved_error.empty()) e["resolved_error"] = w.resolved_error;
  return e;
}

}  // namespace conveyor

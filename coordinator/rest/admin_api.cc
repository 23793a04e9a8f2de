#include "coordinator/rest/admin_api.h"

#include "common/json_limits.h"

namespace conveyor {

using json = nlohmann::json;

Expected<PlanRequest> parse_plan_body(const json& body, ApiError* error) {
  auto bad = [&](const std::string& msg, const std::string& param) {
    *error = api_error(400, msg, param);
    return Status::error(msg);
  };
  if (!body.is_object()) return bad("the plan must be a JSON object with stages, replicas and/or layers", "");
  if (json_deeper_than(body, kMaxJsonDepth))  // before range.dump() below recurses through it
    return bad("the plan nests deeper than " + std::to_string(kMaxJsonDepth) + " levels", "");
  for (const auto& [key, _] : body.items())
    if (key != "stages" && key != "replicas" && key != "layers")
      return bad("unknown field '" + key + "' (a plan has stages, replicas and layers)", key);
  PlanRequest r;
  for (auto [key, out] : {std::pair{"stages", &r.stages}, std::pair{"replicas", &r.replicas}}) {
    if (!body.contains(key)) continue;
    const json& v = body.at(key);
    if (!v.is_number_integer()) return bad(std::string(key) + " must be an integer", key);
    *out = v.get<int64_t>();
  }
  if (body.contains("layers")) {
    const json& v = body.at("layers");
    if (!v.is_array()) return bad("layers must be a list of [begin, end] ranges", "layers");
    std::vector<LayerRange> layers;
    for (const json& range : v) {
      if (!range.is_array() || range.size() != 2 || !range[0].is_number_integer() || !range[1].is_number_integer())
        return bad("layers must be a list of [begin, end] ranges of integers; got " + range.dump(), "layers");
      layers.emplace_back(range[0].get<int64_t>(), range[1].get<int64_t>());
    }
    r.layers = std::move(layers);
  }
  return r;
}

ApiError api_error_of(const CoreStatus& s) {
  switch (s.error) {
    case CoreError::Invalid: return api_error(400, s.message, s.param);
    case CoreError::NotFound: return api_error(404, s.message, s.param, "not_found_error");
    case CoreError::Conflict: return api_error(409, s.message, s.param, "conflict_error");
    case CoreError::QueueFull: return api_error(429, s.message, "", "rate_limit_error", "queue_full");
    case CoreError::Timeout: return api_error(504, s.message, "", "timeout_error", "request_timeout");
    case CoreError::None:
    case CoreError::Unavailable: break;
  }
  return api_error(503, s.message, "", "service_unavailable");
}

}  // namespace conveyor

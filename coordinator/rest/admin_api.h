// The operator's REST calls (POST /v1/cluster/plan, .../drain) and the one place where the
// core's refusals (core_status.h) become HTTP statuses and OpenAI-shaped error bodies.
#pragma once

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "coordinator/core_status.h"
#include "coordinator/planner.h"
#include "coordinator/rest/openai_api.h"

namespace conveyor {

// The body of POST /v1/cluster/plan: {"stages": S, "replicas": R, "layers": [[b, e], ...]},
// any of them. Refusals (400) name the field: an unknown key, a non-integer, a malformed
// range. Whether the numbers suit the model is the core's to say.
Expected<PlanRequest> parse_plan_body(const nlohmann::json& body, ApiError* error);

// The HTTP form of a refusal: Invalid 400, NotFound 404, Conflict 409, QueueFull 429,
// Unavailable 503.
ApiError api_error_of(const CoreStatus& status);

}  // namespace conveyor

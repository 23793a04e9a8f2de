#include "common/sampling_params.h"

#include <cmath>
#include <string>

namespace conveyor {

Status validate_sampling_params(const SamplingParams& p, int64_t vocab_size) {
  auto bad = [](const std::string& field, const std::string& rule) {
    return Status::error("sampling parameter \"" + field + "\" " + rule);
  };
  if (!std::isfinite(p.temperature) || p.temperature < 0) return bad("temperature", "must be >= 0");
  if (p.top_k < 0) return bad("top_k", "must be >= 0 (0 disables it)");
  if (!(p.top_p > 0 && p.top_p <= 1)) return bad("top_p", "must be in (0, 1]");
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0)
    return bad("repetition_penalty", "must be > 0 (1 disables it)");
  if (!std::isfinite(p.presence_penalty)) return bad("presence_penalty", "must be a finite number");
  if (!std::isfinite(p.frequency_penalty)) return bad("frequency_penalty", "must be a finite number");
  if (p.min_tokens < 0) return bad("min_tokens", "must be >= 0");
  for (int32_t id : p.stop_token_ids)
    if (id < 0 || id >= vocab_size)
      return bad("stop_token_ids", "holds " + std::to_string(id) + ", outside the vocabulary [0, " +
                                       std::to_string(vocab_size) + ")");
  return ok_status();
}

}  // namespace conveyor

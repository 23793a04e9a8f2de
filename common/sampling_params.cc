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
  if (p.logit_bias.size() > kMaxLogitBiasEntries)
    return bad("logit_bias", "holds " + std::to_string(p.logit_bias.size()) + " entries; at most " +
                                 std::to_string(kMaxLogitBiasEntries) + " are allowed");
  for (size_t i = 0; i < p.logit_bias.size(); ++i) {
    const auto [id, bias] = p.logit_bias[i];
    if (id < 0 || id >= vocab_size)
      return bad("logit_bias", "holds token id " + std::to_string(id) + ", outside the vocabulary [0, " +
                                   std::to_string(vocab_size) + ")");
    if (i > 0 && id <= p.logit_bias[i - 1].first)
      return bad("logit_bias", "ids must be ascending and distinct (" + std::to_string(id) + " follows " +
                                   std::to_string(p.logit_bias[i - 1].first) + ")");
    if (!std::isfinite(bias) || bias < -kLogitBiasMax || bias > kLogitBiasMax)
      return bad("logit_bias", "bias of token " + std::to_string(id) + " must be between -100 and 100");
  }
  return ok_status();
}

}  // namespace conveyor

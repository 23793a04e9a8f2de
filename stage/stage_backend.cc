#include "stage/stage_backend.h"

#include <string>

namespace conveyor {

Status check_activations(const ActivationsView& in, int64_t tokens, int64_t width, const std::string& stage) {
  if (!is_activation_dtype(in.dtype))
    return Status::error(stage + ": activations of " + std::string(dtype_name(in.dtype)) + " (F32, F16 or BF16 expected)");
  const size_t want = size_t(tokens * width) * dtype_bytes(in.dtype);
  if (in.bytes.size() != want)
    return Status::error(stage + ": received " + std::to_string(in.bytes.size()) + " bytes of " +
                         std::string(dtype_name(in.dtype)) + " activations, expected " + std::to_string(tokens) +
                         " tokens x " + std::to_string(width) + " (" + std::to_string(want) + " bytes)");
  return ok_status();
}

Status check_step_input(const StepInput& in, const StageBackend& stage, const std::string& name) {
  const int64_t T = total_tokens(in.slices);
  if (stage.has_embedding()) {
    if (int64_t(in.token_ids.size()) != T)
      return Status::error(name + ": " + std::to_string(in.token_ids.size()) + " token ids for " + std::to_string(T) +
                           " tokens of micro-batch slices");
  } else if (Status s = check_activations(in.activations, T, stage.config().n_embd, name); !s) {
    return s;
  }
  if (!stage.has_head()) {
    if (in.head != HeadOutput::None) return Status::error(name + ": only the last stage has the LM head");
    return ok_status();
  }
  if (in.head == HeadOutput::None) return Status::error(name + ": the last stage must be asked for tokens or logits");
  if (in.head == HeadOutput::Tokens) {
    if (!stage.samples_in_place()) return Status::error(name + ": this backend samples on the host (ask for logits)");
    if (in.sample_rows.size() != in.slices.size())
      return Status::error(name + ": " + std::to_string(in.sample_rows.size()) + " sampling rows for " +
                           std::to_string(in.slices.size()) + " slices");
    for (const SampleRow& r : in.sample_rows)
      if (r.params == nullptr) return Status::error(name + ": a sampling row has no parameters");
  }
  return ok_status();
}

}  // namespace conveyor

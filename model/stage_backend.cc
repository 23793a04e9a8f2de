#include "model/stage_backend.h"

#include <cstring>

#include "model/safetensors.h"  // convert_to_f32

namespace conveyor {

Status CpuStageBackend::embed(std::span<const SeqSlice> slices, const int32_t* ids) {
  hidden_.resize(size_t(total_tokens(slices) * config().n_embd));
  return stage_.embed(slices, ids, hidden_.data());
}

Status CpuStageBackend::forward(std::span<const SeqSlice> slices, const ActivationsView* in) {
  if (in) {
    const int64_t T = total_tokens(slices);
    if (Status s = check_activations(*in, T, config().n_embd, "cpu stage"); !s) return s;
    hidden_.resize(size_t(T * config().n_embd));
    if (Status s = convert_to_f32(in->dtype, in->bytes.data(), hidden_.size(), hidden_.data()); !s) return s;
  }
  return stage_.forward(slices, hidden_.data());
}

Status CpuStageBackend::read_activations(int64_t tokens, std::span<std::byte> out) {
  const size_t bytes = size_t(tokens * config().n_embd) * sizeof(float);
  if (bytes > hidden_.size() * sizeof(float) || out.size() < bytes)
    return Status::error("cpu stage: cannot hand on " + std::to_string(tokens) + " rows of activations (" +
                         std::to_string(hidden_.size() / size_t(config().n_embd)) + " computed, room for " +
                         std::to_string(out.size()) + " bytes)");
  std::memcpy(out.data(), hidden_.data(), bytes);
  return ok_status();
}

}  // namespace conveyor

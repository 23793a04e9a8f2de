#include "stage/cpu/cpu_stage_backend.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "model/safetensors.h"  // convert_to_f32

namespace conveyor {

Expected<std::unique_ptr<CpuStageBackend>> CpuStageBackend::create(StageWeights weights, int tp,
                                                                   int64_t kv_cache_bytes) {
  auto stage = CpuStage::create(std::move(weights), tp);
  if (!stage) return stage.status();
  return std::unique_ptr<CpuStageBackend>(new CpuStageBackend(std::move(stage).value(), kv_cache_bytes));
}

Status CpuStageBackend::step(const StepInput& in, StepOutput& out) {
  if (Status s = check_step_input(in, *this, "cpu stage"); !s) return s;
  const int64_t T = total_tokens(in.slices), C = config().n_embd;
  hidden_.resize(size_t(T * C));
  if (has_embedding()) {
    if (Status s = stage_->embed(in.slices, in.token_ids.data(), hidden_.data()); !s) return s;
  } else if (Status s = convert_to_f32(in.activations.dtype, in.activations.bytes.data(), hidden_.size(), hidden_.data());
             !s) {
    return s;
  }
  if (Status s = stage_->forward(in.slices, hidden_.data()); !s) return s;
  if (!has_head()) {
    const size_t bytes = hidden_.size() * sizeof(float);
    auto to = out.activations(bytes);
    if (!to) return to.status();
    std::memcpy(to->data(), hidden_.data(), bytes);
    return ok_status();
  }
  const bool all = in.head == HeadOutput::AllLogits;
  out.logits.resize(size_t((all ? T : int64_t(in.slices.size())) * config().vocab_size));
  return stage_->logits(in.slices, hidden_.data(), all, out.logits.data());
}

Status CpuStageBackend::fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) {
  // The budget the worker was given bounds the copies a fork makes (its prefix's rows).
  if (stage_->kv_bytes_used() + num_tokens * stage_->kv_bytes_per_token() > kv_cache_bytes_)
    return Status::error("cpu stage: no K/V room to fork sequence " + std::to_string(parent) + " into " +
                         std::to_string(child) + " (" + std::to_string(num_tokens) + " tokens; " +
                         std::to_string(kv_used_tokens()) + " of " + std::to_string(kv_capacity_tokens()) + " used)");
  return stage_->fork_sequence(parent, child, num_tokens);
}

std::shared_ptr<std::byte[]> CpuStageBackend::allocate_host(size_t bytes) const {
  return std::shared_ptr<std::byte[]>(new (std::nothrow) std::byte[bytes]);
}

int64_t CpuStageBackend::kv_used_tokens() const {
  return stage_->kv_bytes_used() / std::max<int64_t>(1, stage_->kv_bytes_per_token());
}

int64_t CpuStageBackend::kv_capacity_tokens() const {
  return kv_cache_bytes_ / std::max<int64_t>(1, stage_->kv_bytes_per_token());
}

std::string CpuStageBackend::describe() const {
  return stage_->tensor_parallel() > 1 ? "cpu tp=" + std::to_string(stage_->tensor_parallel()) : "cpu";
}

}  // namespace conveyor

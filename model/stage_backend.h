// What a stage runs its micro-batches on: the CPU stage (model/cpu_stage.h) or a GPU stage
// (kernels/cuda/gpu_stage_backend.h), behind one interface whose activations are fp32 in
// host memory, as they travel between stages. The calls and their checks are CpuStage's:
// embed (first stage), forward (this stage's layers, appending K/V), logits (last stage).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "common/model_config.h"
#include "common/status.h"
#include "model/cpu_stage.h"
#include "model/sampling.h"

namespace conveyor {

class StageBackend {
 public:
  virtual ~StageBackend() = default;

  virtual const ModelConfig& config() const = 0;
  virtual bool has_embedding() const = 0;
  virtual bool has_head() const = 0;

  virtual Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids, float* hidden) = 0;
  virtual Status forward(std::span<const SeqSlice> slices, float* hidden) = 0;
  virtual Status logits(std::span<const SeqSlice> slices, const float* hidden, bool all_positions, float* out) = 0;

  // Last stage, a backend that chooses tokens where its logits are (the GPU: no logits cross
  // to the host): for slice i, the token sample_next would draw from its last row given
  // rows[i], and that token's log-prob under the raw logits. The executor uses it when no
  // slice asks for more than the chosen token's log-prob.
  virtual bool samples_in_place() const { return false; }
  virtual Status sample_last(std::span<const SeqSlice> /*slices*/, const float* /*hidden*/,
                             std::span<const SampleRow> /*rows*/, int32_t* /*tokens*/, float* /*logprobs*/) {
    return Status::error(describe() + ": this backend samples on the host");
  }

  virtual void free_sequence(uint64_t seq_id) = 0;
  virtual void clear() = 0;

  virtual int64_t num_sequences() const = 0;
  virtual int64_t kv_used_tokens() const = 0;
  // Tokens the K/V cache can hold in all; -1 when only host memory bounds it (the CPU).
  virtual int64_t kv_capacity_tokens() const = 0;
  virtual int64_t kv_bytes_per_token() const = 0;
  // "cpu", "cuda:0 F16", ...: for logs and the cluster table.
  virtual std::string describe() const = 0;
};

// The CPU stage as a StageBackend.
class CpuStageBackend final : public StageBackend {
 public:
  // tp > 1: the layers run tensor parallel over that many threads (CpuStage).
  explicit CpuStageBackend(StageWeights weights, int tp = 1) : stage_(std::move(weights), tp) {}

  const ModelConfig& config() const override { return stage_.config(); }
  bool has_embedding() const override { return stage_.weights().has_embedding(); }
  bool has_head() const override { return stage_.weights().has_head(); }
  Status embed(std::span<const SeqSlice> slices, const int32_t* ids, float* hidden) override {
    return stage_.embed(slices, ids, hidden);
  }
  Status forward(std::span<const SeqSlice> slices, float* hidden) override { return stage_.forward(slices, hidden); }
  Status logits(std::span<const SeqSlice> slices, const float* hidden, bool all, float* out) override {
    return stage_.logits(slices, hidden, all, out);
  }
  void free_sequence(uint64_t seq_id) override { stage_.free_sequence(seq_id); }
  void clear() override { stage_.clear(); }
  int64_t num_sequences() const override { return stage_.num_sequences(); }
  int64_t kv_used_tokens() const override { return stage_.kv_bytes_used() / std::max<int64_t>(1, stage_.kv_bytes_per_token()); }
  int64_t kv_capacity_tokens() const override { return -1; }
  int64_t kv_bytes_per_token() const override { return stage_.kv_bytes_per_token(); }
  std::string describe() const override {
    return stage_.tensor_parallel() > 1 ? "cpu tp=" + std::to_string(stage_.tensor_parallel()) : "cpu";
  }

  CpuStage& stage() { return stage_; }

 private:
  CpuStage stage_;
};

}  // namespace conveyor

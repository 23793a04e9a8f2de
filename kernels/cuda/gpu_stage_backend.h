// A GPU stage (a TpStage: one GPU, or several tensor parallel) behind model/stage_backend.h,
// for the stage worker: activations arrive and
// leave as fp32 host rows (the wire format) and are converted on the GPU; between embed,
// forward and logits of one micro-batch they stay on the device. The last stage samples on
// the GPU (sample_last: GpuSampler, the CPU's algorithm and Philox counters) unless a slice
// asks for top log-probs or prompt log-probs; then its logits go to the host and the
// executor samples there.
//
// Every CUDA failure comes back as a Status naming the stage; nothing throws.
#pragma once

#include <memory>

#include "kernels/cuda/tp_stage.h"
#include "model/stage_backend.h"

namespace conveyor::cuda {

class GpuStageBackend final : public StageBackend {
 public:
  // Builds the stage over `devices` (one GPU, or the tensor-parallel group in rank order).
  static Expected<std::unique_ptr<GpuStageBackend>> create(const StageWeights& weights, const std::vector<int>& devices,
                                                           const GpuStageOptions& options);

  const ModelConfig& config() const override { return stage_->config(); }
  bool has_embedding() const override { return stage_->has_embedding(); }
  bool has_head() const override { return stage_->has_head(); }
  Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids, float* hidden) override;
  Status forward(std::span<const SeqSlice> slices, float* hidden) override;
  Status logits(std::span<const SeqSlice> slices, const float* hidden, bool all_positions, float* out) override;
  bool samples_in_place() const override { return true; }
  Status sample_last(std::span<const SeqSlice> slices, const float* hidden, std::span<const SampleRow> rows,
                     int32_t* tokens, float* logprobs) override;
  void free_sequence(uint64_t seq_id) override { stage_->free_sequence(seq_id); }
  void clear() override;
  int64_t num_sequences() const override { return stage_->num_sequences(); }
  int64_t kv_used_tokens() const override { return stage_->kv_capacity_tokens() - stage_->kv_free_tokens(); }
  int64_t kv_capacity_tokens() const override { return stage_->kv_capacity_tokens(); }
  int64_t kv_bytes_per_token() const override { return stage_->kv_bytes_per_token(); }
  std::string describe() const override;

  TpStage& stage() { return *stage_; }

 private:
  explicit GpuStageBackend(std::unique_ptr<TpStage> stage) : stage_(std::move(stage)) {}
  // Puts `hidden` on the device unless the device copy is the current one.
  Status ensure_on_device(std::span<const SeqSlice> slices, const float* hidden);

  std::unique_ptr<TpStage> stage_;
  bool device_current_ = false;  // the device holds this micro-batch's activations
};

}  // namespace conveyor::cuda

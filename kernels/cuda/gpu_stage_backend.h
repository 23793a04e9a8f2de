// A GPU stage (a TpStage: one GPU, or several tensor parallel) behind model/stage_backend.h,
// for the stage worker. Activations arrive as host rows of F32, F16 or BF16 (converted on
// the GPU; the stage's own dtype is a plain copy) and leave in the stage's dtype, half the
// bytes of fp32; between embed, forward and logits/read_activations of one micro-batch they
// stay on the device. A micro-batch of decode steps only (one token per sequence) runs as
// GpuStage::decode, the whole step replayed from a CUDA graph: embed() keeps the token ids
// for it, and on the last stage forward() leaves the step to sample_last, which replays it
// with the sampling rows (logits() runs the ordinary calls instead). allocate_host gives page-locked memory, so the worker's outgoing
// slots and the data plane's receive buffers are copied as DMA. The last stage samples on
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
  DType activation_dtype() const override { return stage_->lead().dtype(); }
  Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids) override;
  Status forward(std::span<const SeqSlice> slices, const ActivationsView* in) override;
  Status read_activations(int64_t tokens, std::span<std::byte> out) override;
  Status logits(std::span<const SeqSlice> slices, bool all_positions, float* out) override;
  bool samples_in_place() const override { return true; }
  Status sample_last(std::span<const SeqSlice> slices, std::span<const SampleRow> rows, int32_t* tokens,
                     float* logprobs) override;
  std::shared_ptr<std::byte[]> allocate_host(size_t bytes) const override;
  void free_sequence(uint64_t seq_id) override { stage_->free_sequence(seq_id); }
  void clear() override {
    embed_pending_ = step_pending_ = false;
    stage_->clear();
  }
  int64_t num_sequences() const override { return stage_->num_sequences(); }
  int64_t kv_used_tokens() const override { return stage_->kv_capacity_tokens() - stage_->kv_free_tokens(); }
  int64_t kv_capacity_tokens() const override { return stage_->kv_capacity_tokens(); }
  int64_t kv_bytes_per_token() const override { return stage_->kv_bytes_per_token(); }
  std::string describe() const override;

  TpStage& stage() { return *stage_; }

 private:
  explicit GpuStageBackend(std::unique_ptr<TpStage> stage) : stage_(std::move(stage)) {}
  // Runs what embed/forward left for later the ordinary way (embed, forward), for logits().
  Status run_pending(std::span<const SeqSlice> slices);
  // embed()'s token ids while their embedding is still to run (then no longer), else null.
  const int32_t* take_ids();

  std::unique_ptr<TpStage> stage_;
  std::vector<int32_t> ids_;     // embed()'s token ids, until forward runs them
  bool embed_pending_ = false;   // the first stage's embedding is still to run
  bool step_pending_ = false;    // the last stage's decode step waits for sample_last
};

}  // namespace conveyor::cuda

// The CPU stage (cpu_stage.h) behind stage/stage_backend.h: activations in fp32 on the host,
// logits handed to the caller to choose from (it does not sample in place).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "stage/cpu/cpu_stage.h"
#include "stage/stage_backend.h"

namespace conveyor {

class CpuStageBackend final : public StageBackend {
 public:
  // tp > 1: the layers run tensor parallel over that many threads. kv_cache_bytes: the K/V
  // budget the worker was given (host memory bounds nothing else), reported as a capacity in
  // tokens. Errors name what is wrong with the weights or tp.
  static Expected<std::unique_ptr<CpuStageBackend>> create(StageWeights weights, int tp, int64_t kv_cache_bytes);

  // What a CPU stage is before it holds a model (stage_backend.h): fp32, its weights in the
  // host's `memory_bytes` less the K/V budget, and its batching figures.
  static StageCapabilities capabilities(int64_t memory_bytes, int64_t kv_cache_bytes);
  // What `config`'s weights and K/V take on a CPU stage of `tp` ranks: fp32 tensors as the
  // weight table lists them, plus (tp > 1) each rank's copy of its slices of the split ones.
  static Expected<StageFootprint> footprint(const ModelConfig& config, int tp);

  const ModelConfig& config() const override { return stage_->config(); }
  bool has_embedding() const override { return stage_->weights().has_embedding(); }
  bool has_head() const override { return stage_->weights().has_head(); }
  DType activation_dtype() const override { return DType::F32; }
  bool samples_in_place() const override { return false; }
  Status step(const StepInput& in, StepOutput& out) override;
  std::shared_ptr<std::byte[]> allocate_host(size_t bytes) const override;
  Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) override;
  void free_sequence(uint64_t seq_id) override { stage_->free_sequence(seq_id); }
  void clear() override { stage_->clear(); }
  int64_t num_sequences() const override { return stage_->num_sequences(); }
  int64_t kv_used_tokens() const override;
  int64_t kv_capacity_tokens() const override;
  int64_t kv_bytes_per_token() const override { return stage_->kv_bytes_per_token(); }
  std::string describe() const override;

  CpuStage& stage() { return *stage_; }

 private:
  CpuStageBackend(std::unique_ptr<CpuStage> stage, int64_t kv_cache_bytes)
      : stage_(std::move(stage)), kv_cache_bytes_(kv_cache_bytes) {}

  std::unique_ptr<CpuStage> stage_;
  int64_t kv_cache_bytes_;
  std::vector<float> hidden_;  // this micro-batch's activations [tokens, n_embd]
};

}  // namespace conveyor

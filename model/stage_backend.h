// What a stage runs its micro-batches on: the CPU stage (model/cpu_stage.h) or a GPU stage
// (kernels/cuda/gpu_stage_backend.h), behind one interface. A backend keeps the micro-batch's
// activations where it computes (host or device) from embed/forward to logits or
// read_activations; activations cross between stages as host rows of F32 (the CPU) or the
// GPU stage's F16/BF16, and a backend takes any of the three. The calls and their checks are
// CpuStage's: embed (first stage), forward (this stage's layers, appending K/V), logits
// (last stage).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/status.h"
#include "model/cpu_stage.h"
#include "model/sampling.h"

namespace conveyor {

// Activations as they travel between stages: [tokens, n_embd] elements of `dtype`
// (is_activation_dtype) in host memory, or device memory where the backend says it takes it.
struct ActivationsView {
  DType dtype = DType::F32;
  std::span<const std::byte> bytes;
};

class StageBackend {
 public:
  virtual ~StageBackend() = default;

  virtual const ModelConfig& config() const = 0;
  virtual bool has_embedding() const = 0;
  virtual bool has_head() const = 0;

  // The element type of the activations this stage hands on (read_activations).
  virtual DType activation_dtype() const = 0;

  // First stage: the micro-batch's activations become the embedding of `token_ids`.
  virtual Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids) = 0;
  // This stage's layers, on `in` (the previous stage's activations; checked to be
  // [tokens, n_embd] of an activation dtype), or on what embed left when `in` is null.
  virtual Status forward(std::span<const SeqSlice> slices, const ActivationsView* in) = 0;
  // Non-last stages, after forward: the outgoing activations, tokens x n_embd elements of
  // activation_dtype(), into `out` (host memory; page-locked for a GPU backend is fastest).
  virtual Status read_activations(int64_t tokens, std::span<std::byte> out) = 0;
  // Last stage, after forward: ln_f + LM head into host `out` (as CpuStage::logits).
  virtual Status logits(std::span<const SeqSlice> slices, bool all_positions, float* out) = 0;

  // Last stage, a backend that chooses tokens where its logits are (the GPU: no logits cross
  // to the host): for slice i, the token sample_next would draw from its last row given
  // rows[i], and that token's log-prob under the raw logits. The executor uses it when no
  // slice asks for more than the chosen token's log-prob.
  virtual bool samples_in_place() const { return false; }
  virtual Status sample_last(std::span<const SeqSlice> /*slices*/, std::span<const SampleRow> /*rows*/,
                             int32_t* /*tokens*/, float* /*logprobs*/) {
    return Status::error(describe() + ": this backend samples on the host");
  }

  // Host memory for activations this backend reads and writes: page-locked for a GPU backend
  // (copies to and from the device run as DMA), the heap otherwise. Throws std::bad_alloc.
  virtual std::shared_ptr<std::byte[]> allocate_host(size_t bytes) const {
    return std::shared_ptr<std::byte[]>(new std::byte[bytes]);
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

// The CPU stage as a StageBackend: activations in fp32 on the host.
class CpuStageBackend final : public StageBackend {
 public:
  // tp > 1: the layers run tensor parallel over that many threads (CpuStage).
  explicit CpuStageBackend(StageWeights weights, int tp = 1) : stage_(std::move(weights), tp) {}

  const ModelConfig& config() const override { return stage_.config(); }
  bool has_embedding() const override { return stage_.weights().has_embedding(); }
  bool has_head() const override { return stage_.weights().has_head(); }
  DType activation_dtype() const override { return DType::F32; }
  Status embed(std::span<const SeqSlice> slices, const int32_t* ids) override;
  Status forward(std::span<const SeqSlice> slices, const ActivationsView* in) override;
  Status read_activations(int64_t tokens, std::span<std::byte> out) override;
  Status logits(std::span<const SeqSlice> slices, bool all, float* out) override {
    return stage_.logits(slices, hidden_.data(), all, out);
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
  std::vector<float> hidden_;  // this micro-batch's activations [tokens, n_embd]
};

// Checks `in` against a micro-batch of `tokens` tokens of width `width`: an activation
// dtype and exactly tokens x width elements. `stage` names the stage in the error.
inline Status check_activations(const ActivationsView& in, int64_t tokens, int64_t width, const std::string& stage) {
  if (!is_activation_dtype(in.dtype))
    return Status::error(stage + ": activations of " + std::string(dtype_name(in.dtype)) + " (F32, F16 or BF16 expected)");
  const size_t want = size_t(tokens * width) * dtype_bytes(in.dtype);
  if (in.bytes.size() != want)
    return Status::error(stage + ": received " + std::to_string(in.bytes.size()) + " bytes of " +
                         std::string(dtype_name(in.dtype)) + " activations, expected " + std::to_string(tokens) +
                         " tokens x " + std::to_string(width) + " (" + std::to_string(want) + " bytes)");
  return ok_status();
}

}  // namespace conveyor

// A GPU stage (a TpStage: one GPU, or several tensor parallel) behind stage/stage_backend.h,
// for the stage worker. Activations arrive as host rows of F32, F16 or BF16 (converted on the
// GPU; the stage's own dtype is a plain copy) and leave in the stage's dtype, half the bytes
// of fp32; within a step they stay on the device. A micro-batch of decode steps only (one
// token per sequence) runs as GpuStage::decode, the whole step replayed from a CUDA graph
// (on the last stage with its sampling rows); other micro-batches run embed / forward, then
// on the last stage the logits and the GPU sampler (the CPU's algorithm and Philox
// counters), or the logits go to the host when the caller asks for them. allocate_host
// gives page-locked memory, so the worker's outgoing slots and the data plane's receive
// buffers are copied as DMA.
//
// Every CUDA failure comes back as a Status naming the stage.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/host_allocator.h"
#include "stage/cuda/tp_stage.h"
#include "stage/stage_backend.h"

namespace conveyor::cuda {

class GpuStageBackend final : public StageBackend {
 public:
  // Builds the stage over `devices` (one GPU, or the tensor-parallel group in rank order) and
  // warms it up: the products of every plan bucket a step can reach are planned and the decode
  // graphs captured before the first request (TpStage::warm_up).
  static Expected<std::unique_ptr<GpuStageBackend>> create(const StageWeights& weights, const std::vector<int>& devices,
                                                           const GpuStageOptions& options);
  // The same, each rank loading its part straight from the checkpoint's bytes (TpStage's
  // direct load: no fp32 host copy). `progress`: checkpoint bytes done over all ranks.
  static Expected<std::unique_ptr<GpuStageBackend>> create(const StageCheckpoint& checkpoint,
                                                           const std::vector<int>& devices,
                                                           const GpuStageOptions& options,
                                                           const LoadProgress& progress = {});

  // What a GPU stage built with `options` is before it holds a model (stage_backend.h): its
  // dtype and weight format, the share of its GPUs' `memory_bytes` its weights may take, its
  // K/V page, its activation rows and its batching figures.
  static StageCapabilities capabilities(const GpuStageOptions& options, int64_t memory_bytes);
  // What `config`'s weights and K/V take on a stage of `ranks` GPUs built with `options`: the
  // weight layout each rank allocates (plan_weight_layout, gpu_weights.h; the LM head on rank
  // 0) and its heads' K/V (KvCache::page_bytes), summed over the ranks. Host arithmetic only.
  static Expected<StageFootprint> footprint(const ModelConfig& config, int ranks, const GpuStageOptions& options);

  const ModelConfig& config() const override { return stage_->config(); }
  bool has_embedding() const override { return stage_->has_embedding(); }
  bool has_head() const override { return stage_->has_head(); }
  DType activation_dtype() const override { return stage_->lead().dtype(); }
  bool samples_in_place() const override { return true; }
  Status step(const StepInput& in, StepOutput& out) override;
  std::shared_ptr<std::byte[]> allocate_host(size_t bytes) const override;
  Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) override {
    return stage_->fork_sequence(parent, child, num_tokens);
  }
  void free_sequence(uint64_t seq_id) override { stage_->free_sequence(seq_id); }
  void clear() override { stage_->clear(); }
  int64_t num_sequences() const override { return stage_->num_sequences(); }
  int64_t kv_used_tokens() const override { return stage_->kv_capacity_tokens() - stage_->kv_free_tokens(); }
  int64_t kv_capacity_tokens() const override { return stage_->kv_capacity_tokens(); }
  int64_t kv_bytes_per_token() const override { return stage_->kv_bytes_per_token(); }
  std::string describe() const override;
  Status health() const override { return stage_->health(); }

  TpStage& stage() { return *stage_; }

 private:
  explicit GpuStageBackend(std::unique_ptr<TpStage> stage) : stage_(std::move(stage)) {}
  // The backend over a stage create() built, warmed up (TpStage::warm_up) for the sequences and
  // rows its steps take, which it logs.
  static Expected<std::unique_ptr<GpuStageBackend>> made(Expected<std::unique_ptr<TpStage>> stage);
  Status run_step(const StepInput& in, StepOutput& out);
  // The stage's outgoing rows into the memory `out.activations` gives.
  Status hand_on(int64_t tokens, StepOutput& out);

  std::unique_ptr<TpStage> stage_;
};

// The data plane's direct path (a UCX built with CUDA moves activations GPU to GPU): device
// memory on `device` (cudaMalloc; null when none is left) for the worker's outgoing slots and
// its receive buffers, and a call that makes `device` current on the calling thread (UCX's
// progress thread works in that thread's CUDA context). GpuStage::upload_hidden and
// download_hidden copy with cudaMemcpyDefault, so device rows go in and out as device-to-device
// copies on the stage's stream, which they synchronise.
HostAllocator device_memory_allocator(int device);
void make_device_current(int device);

}  // namespace conveyor::cuda

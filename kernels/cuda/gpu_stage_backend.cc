#include "kernels/cuda/gpu_stage_backend.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace conveyor::cuda {

namespace {

// Runs f, turning a thrown conveyor::Error (a failed CUDA call) into a Status.
template <class F>
Status guarded(const std::string& stage, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return Status::error(stage + ": " + e.what());
  }
}

}  // namespace

Expected<std::unique_ptr<GpuStageBackend>> GpuStageBackend::create(const StageWeights& weights,
                                                                   const std::vector<int>& devices,
                                                                   const GpuStageOptions& options) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return Status::error(options.name + ": no CUDA device usable: " + cudaGetErrorString(e));
  if (devices.empty()) return Status::error(options.name + ": no CUDA device given");
  for (int device : devices)
    if (device < 0 || device >= count)
      return Status::error(options.name + ": CUDA device " + std::to_string(device) + " asked, this node has " +
                           std::to_string(count));
  try {
    CUDA_CHECK(cudaSetDevice(devices[0]));
    return std::unique_ptr<GpuStageBackend>(new GpuStageBackend(TpStage::create(weights, devices, options)));
  } catch (const std::exception& e) {
    return Status::error(e.what());
  }
}

std::string GpuStageBackend::describe() const {
  std::string d = "cuda:";
  for (size_t i = 0; i < stage_->devices().size(); ++i) d += (i ? "," : "") + std::to_string(stage_->devices()[i]);
  d += " " + std::string(dtype_name(stage_->lead().dtype()));
  if (stage_->lead().int8_weights()) d += " int8-weights";
  if (stage_->ranks() > 1) d += " tp=" + std::to_string(stage_->ranks());
  return d;
}

namespace {
// Every slice is one new token: the micro-batch is a decode step.
bool decode_step(std::span<const SeqSlice> slices) {
  return std::all_of(slices.begin(), slices.end(), [](const SeqSlice& s) { return s.num_tokens == 1; });
}
}  // namespace

Status GpuStageBackend::embed(std::span<const SeqSlice> slices, const int32_t* token_ids) {
  ids_.assign(token_ids, token_ids + total_tokens(slices));
  embed_pending_ = true;
  step_pending_ = false;
  return ok_status();
}

Status GpuStageBackend::forward(std::span<const SeqSlice> slices, const ActivationsView* in) {
  return guarded(stage_->name(), [&]() -> Status {
    step_pending_ = false;
    const int64_t T = total_tokens(slices);
    if (T > stage_->max_tokens())
      return Status::error(stage_->name() + ": micro-batch of " + std::to_string(T) +
                           " tokens exceeds the stage's " + std::to_string(stage_->max_tokens()) + " activation rows");
    if (in) {
      if (Status s = check_activations(*in, T, config().n_embd, stage_->name()); !s) return s;
      stage_->upload_hidden(in->bytes.data(), in->dtype, T);
      embed_pending_ = false;
    }
    if (!decode_step(slices)) return run_pending(slices);
    if (has_head()) {  // sample_last replays the step with its sampling rows; checked now
      if (Status s = stage_->lead().check_slices(slices, true); !s) return s;
      step_pending_ = true;
      return ok_status();
    }
    return stage_->decode(slices, take_ids(), {}, nullptr);
  });
}

const int32_t* GpuStageBackend::take_ids() {
  if (!embed_pending_) return nullptr;
  embed_pending_ = false;
  return ids_.data();
}

Status GpuStageBackend::run_pending(std::span<const SeqSlice> slices) {
  step_pending_ = false;
  if (const int32_t* ids = take_ids())
    if (Status s = stage_->embed(slices, ids); !s) return s;
  return stage_->forward(slices);
}

Status GpuStageBackend::read_activations(int64_t tokens, std::span<std::byte> out) {
  return guarded(stage_->name(), [&]() -> Status {
    const size_t bytes = size_t(tokens * config().n_embd) * dtype_bytes(activation_dtype());
    if (out.size() < bytes)
      return Status::error(stage_->name() + ": " + std::to_string(out.size()) + " bytes cannot hold " +
                           std::to_string(tokens) + " rows of activations (" + std::to_string(bytes) + " bytes)");
    stage_->download_hidden(out.data(), activation_dtype(), tokens);
    return ok_status();
  });
}

Status GpuStageBackend::logits(std::span<const SeqSlice> slices, bool all_positions, float* out) {
  return guarded(stage_->name(), [&]() -> Status {
    if (step_pending_)
      if (Status s = run_pending(slices); !s) return s;
    return stage_->logits(slices, all_positions, out);
  });
}

Status GpuStageBackend::sample_last(std::span<const SeqSlice> slices, std::span<const SampleRow> rows, int32_t* tokens,
                                    float* logprobs) {
  return guarded(stage_->name(), [&]() -> Status {
    if (rows.size() != slices.size())
      return Status::error(stage_->name() + ": " + std::to_string(rows.size()) + " sampling rows for " +
                           std::to_string(slices.size()) + " slices");
    if (step_pending_) {
      step_pending_ = false;
      return stage_->decode(slices, take_ids(), rows, tokens, logprobs);
    }
    if (Status s = stage_->logits(slices, false, nullptr); !s) return s;
    return stage_->sample(rows, tokens, logprobs);
  });
}

std::shared_ptr<std::byte[]> GpuStageBackend::allocate_host(size_t bytes) const {
  auto* p = static_cast<std::byte*>(pinned_alloc(bytes));
  if (!p) throw std::bad_alloc();
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { pinned_free(q); });
}

}  // namespace conveyor::cuda

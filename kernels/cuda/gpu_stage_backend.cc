#include "kernels/cuda/gpu_stage_backend.h"

#include <cuda_runtime.h>

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

Status GpuStageBackend::ensure_on_device(std::span<const SeqSlice> slices, const float* hidden) {
  if (device_current_) return ok_status();
  const int64_t T = total_tokens(slices);
  if (T > stage_->max_tokens())
    return Status::error(stage_->name() + ": micro-batch of " + std::to_string(T) +
                         " tokens exceeds the stage's " + std::to_string(stage_->max_tokens()) + " activation rows");
  stage_->upload_hidden(hidden, T);
  device_current_ = true;
  return ok_status();
}

Status GpuStageBackend::embed(std::span<const SeqSlice> slices, const int32_t* token_ids, float*) {
  return guarded(stage_->name(), [&]() -> Status {
    device_current_ = false;
    if (Status s = stage_->embed(slices, token_ids); !s) return s;
    device_current_ = true;
    return ok_status();
  });
}

Status GpuStageBackend::forward(std::span<const SeqSlice> slices, float* hidden) {
  return guarded(stage_->name(), [&]() -> Status {
    if (Status s = ensure_on_device(slices, hidden); !s) return s;
    device_current_ = false;  // whatever happens next, the device copy is not this batch's input any more
    if (Status s = stage_->forward(slices); !s) return s;
    if (has_head()) {
      device_current_ = true;  // logits() reads it next
    } else {
      stage_->download_hidden(hidden, total_tokens(slices));
    }
    return ok_status();
  });
}

Status GpuStageBackend::logits(std::span<const SeqSlice> slices, const float* hidden, bool all_positions, float* out) {
  return guarded(stage_->name(), [&]() -> Status {
    if (Status s = ensure_on_device(slices, hidden); !s) return s;
    device_current_ = false;
    return stage_->logits(slices, all_positions, out);
  });
}

Status GpuStageBackend::sample_last(std::span<const SeqSlice> slices, const float* hidden, std::span<const SampleRow> rows,
                                    int32_t* tokens, float* logprobs) {
  return guarded(stage_->name(), [&]() -> Status {
    if (rows.size() != slices.size())
      return Status::error(stage_->name() + ": " + std::to_string(rows.size()) + " sampling rows for " +
                           std::to_string(slices.size()) + " slices");
    if (Status s = ensure_on_device(slices, hidden); !s) return s;
    device_current_ = false;
    if (Status s = stage_->logits(slices, false, nullptr); !s) return s;
    return stage_->sample(rows, tokens, logprobs);
  });
}

void GpuStageBackend::clear() {
  device_current_ = false;
  stage_->clear();
}

}  // namespace conveyor::cuda

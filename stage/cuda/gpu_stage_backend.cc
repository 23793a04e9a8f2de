#include "stage/cuda/gpu_stage_backend.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace conveyor::cuda {

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
  if (cudaError_t e = cudaSetDevice(devices[0]); e != cudaSuccess)
    return Status::error(std::string("cudaSetDevice(devices[0]) failed: ") + cudaGetErrorName(e) + ": " +
                         cudaGetErrorString(e));
  auto stage = TpStage::create(weights, devices, options);
  if (!stage) return stage.status();
  return std::unique_ptr<GpuStageBackend>(new GpuStageBackend(std::move(stage).value()));
}

std::string GpuStageBackend::describe() const {
  std::string d = "cuda:";
  for (size_t i = 0; i < stage_->devices().size(); ++i) d += (i ? "," : "") + std::to_string(stage_->devices()[i]);
  d += " " + std::string(dtype_name(stage_->lead().dtype()));
  if (stage_->lead().int8_weights()) d += " int8-weights";
  if (stage_->lead().fp8()) d += " fp8";
  if (stage_->ranks() > 1) d += " tp=" + std::to_string(stage_->ranks());
  return d;
}

Status GpuStageBackend::step(const StepInput& in, StepOutput& out) {
  if (Status s = check_step_input(in, *this, stage_->name()); !s) return s;
  // The compute thread's current GPU is the stage's lead GPU (device guards restore to it).
  if (cudaError_t e = cudaSetDevice(stage_->devices()[0]); e != cudaSuccess)
    return Status::error(stage_->name() + ": cannot make GPU " + std::to_string(stage_->devices()[0]) +
                         " current: " + cudaGetErrorString(e));
  return run_step(in, out);
}

Status GpuStageBackend::run_step(const StepInput& in, StepOutput& out) {
  const int64_t T = total_tokens(in.slices);
  if (T > stage_->max_tokens())
    return Status::error(stage_->name() + ": micro-batch of " + std::to_string(T) + " tokens exceeds the stage's " +
                         std::to_string(stage_->max_tokens()) + " activation rows");
  const int32_t* ids = has_embedding() ? in.token_ids.data() : nullptr;
  if (!has_embedding())
    if (Status s = stage_->upload_hidden(in.activations.bytes.data(), in.activations.dtype, T); !s) return s;
  const bool decode = std::all_of(in.slices.begin(), in.slices.end(), [](const SeqSlice& s) { return s.num_tokens == 1; });
  const size_t n = in.slices.size();
  // Decode steps replay the CUDA graphs: the last stage only when it chooses the tokens here.
  if (decode && in.head == HeadOutput::Tokens) {
    out.tokens.resize(n), out.logprobs.resize(n);
    return stage_->decode(in.slices, ids, in.sample_rows, out.tokens.data(), out.logprobs.data());
  }
  if (decode && in.head == HeadOutput::None) {
    if (Status s = stage_->decode(in.slices, ids, {}, nullptr); !s) return s;
    return hand_on(T, out);
  }
  if (ids)
    if (Status s = stage_->embed(in.slices, ids); !s) return s;
  if (Status s = stage_->forward(in.slices); !s) return s;
  switch (in.head) {
    case HeadOutput::None: return hand_on(T, out);
    case HeadOutput::Tokens:
      out.tokens.resize(n), out.logprobs.resize(n);
      if (Status s = stage_->logits(in.slices, false, nullptr); !s) return s;
      return stage_->sample(in.sample_rows, out.tokens.data(), out.logprobs.data());
    case HeadOutput::LastLogits:
    case HeadOutput::AllLogits: {
      const bool all = in.head == HeadOutput::AllLogits;
      out.logits.resize(size_t((all ? T : int64_t(n)) * config().vocab_size));
      return stage_->logits(in.slices, all, out.logits.data());
    }
  }
  return ok_status();
}

Status GpuStageBackend::hand_on(int64_t tokens, StepOutput& out) {
  const size_t bytes = size_t(tokens * config().n_embd) * dtype_bytes(activation_dtype());
  auto to = out.activations(bytes);
  if (!to) return to.status();
  if (to->size() < bytes)
    return Status::error(stage_->name() + ": " + std::to_string(to->size()) + " bytes cannot hold " +
                         std::to_string(tokens) + " rows of activations (" + std::to_string(bytes) + " bytes)");
  return stage_->download_hidden(to->data(), activation_dtype(), tokens);
}

std::shared_ptr<std::byte[]> GpuStageBackend::allocate_host(size_t bytes) const {
  auto* p = static_cast<std::byte*>(pinned_alloc(bytes));
  if (!p) return nullptr;
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { pinned_free(q); });
}

HostAllocator device_memory_allocator(int device) {
  return {[device](size_t n) -> void* {
            void* p = nullptr;
            if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, n) != cudaSuccess) {
              cudaGetLastError();  // out of memory: the caller reports it
              return nullptr;
            }
            return p;
          },
          [device](void* p) {
            if (cudaSetDevice(device) == cudaSuccess) cudaFree(p);
          }};
}

void make_device_current(int device) {
  // cudaFree(nullptr) creates the device's primary context on this thread now, not inside
  // UCX's first transfer.
  if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) cudaGetLastError();
}

}  // namespace conveyor::cuda

#include "stage/cuda/gpu_stage_backend.h"

#include <cuda_runtime.h>

#include <spdlog/spdlog.h>

#include <algorithm>

#include "kernels/cuda/paged_kv.h"
#include "model/tp_shard.h"
#include "stage/cuda/gpu_weights.h"
#include "stage/cuda/kv_cache.h"

namespace conveyor::cuda {

namespace {

// The devices exist, and the first is current (the stage's lead GPU).
Status check_devices(const std::vector<int>& devices, const GpuStageOptions& options) {
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
  return ok_status();
}

// The sequences a step takes (capabilities(): why).
int64_t step_sequences(bool kv_fp8, int64_t max_seqs) { return std::min<int64_t>(kv_fp8 ? 512 : 256, max_seqs); }

}  // namespace

Expected<std::unique_ptr<GpuStageBackend>> GpuStageBackend::made(Expected<std::unique_ptr<TpStage>> stage) {
  if (!stage) return stage.status();
  std::unique_ptr<GpuStageBackend> backend(new GpuStageBackend(std::move(stage).value()));
  TpStage& s = *backend->stage_;
  auto warm = s.warm_up(step_sequences(s.lead().kv_fp8(), s.max_seqs()), s.max_tokens());
  if (!warm) return warm.status();
  spdlog::info("{}: {}", s.name(), *warm);
  return backend;
}

Expected<std::unique_ptr<GpuStageBackend>> GpuStageBackend::create(const StageWeights& weights,
                                                                   const std::vector<int>& devices,
                                                                   const GpuStageOptions& options) {
  if (Status s = check_devices(devices, options); !s) return s;
  return made(TpStage::create(weights, devices, options));
}

Expected<std::unique_ptr<GpuStageBackend>> GpuStageBackend::create(const StageCheckpoint& checkpoint,
                                                                   const std::vector<int>& devices,
                                                                   const GpuStageOptions& options,
                                                                   const LoadProgress& progress) {
  if (Status s = check_devices(devices, options); !s) return s;
  return made(TpStage::create(checkpoint, devices, options, DirectLoadOptions{}, progress));
}

StageCapabilities GpuStageBackend::capabilities(const GpuStageOptions& o, int64_t memory_bytes) {
  StageCapabilities c;
  c.dtype = o.dtype;
  c.weight_format = o.int8_weights ? "int8" : o.fp8 ? "fp8" : o.dtype == DType::BF16 ? "bf16" : "f16";
  // A tenth of the GPUs' memory stays for the activations, workspaces and the K/V cache.
  c.weight_memory_bytes = memory_bytes / 10 * 9;
  c.kv_page_tokens = kPageTokens;
  c.max_rows_per_step = GpuStage::activation_rows(o);
  // A GPU's decode step costs little more at 256 rows than at 64 (its weights are read once a
  // step). A prompt row costs less than a decode step's fixed weight reads, and 256 clients
  // asking for as many tokens as their prompts hold need a step's worth of prompt rows every
  // step, so a step takes twice the sequences' rows of prompts (docs/OPERATIONS.md). An FP8
  // K/V cache holds twice the positions: 512 sequences a step (1.09x the decode tokens/s of
  // 256 for gpt3-6.7b on an H100, docs/PERFORMANCE.md).
  c.max_sequences_per_step = step_sequences(o.kv_fp8, o.max_seqs);
  c.max_prompt_rows_per_step = std::min<int64_t>(512, c.max_rows_per_step);
  // A GPU step costs nearly as much at half the rows: one micro-batch per stage.
  c.extra_in_flight = 0;
  return c;
}

Expected<StageFootprint> GpuStageBackend::footprint(const ModelConfig& c, int ranks, const GpuStageOptions& o) {
  if (c.n_embd <= 0 || c.n_head <= 0 || c.n_embd % c.n_head != 0 || c.n_inner <= 0 || c.vocab_size <= 0 ||
      c.n_positions <= 0)
    return Status::error(o.name + ": the model's shapes are not a GPT's (n_embd " + std::to_string(c.n_embd) +
                         ", n_head " + std::to_string(c.n_head) + ", n_inner " + std::to_string(c.n_inner) + ")");
  if (ranks < 1 || ranks > c.n_head || ranks > c.n_inner)
    return Status::error(o.name + ": " + std::to_string(ranks) + " tensor-parallel GPUs for " +
                         std::to_string(c.n_head) + " heads (at most one GPU a head)");
  const bool byte_matrices = o.int8_weights || o.fp8;
  StageFootprint f;
  for (int r = 0; r < ranks; ++r) {
    const TpShard shard = TpShard::of(c, r, ranks);
    auto bytes = [&](int64_t layers, bool embedding, bool head) {
      return plan_weight_layout(c, shard, layers, embedding, head && r == 0, o.dtype, byte_matrices).bytes;
    };
    f.layer_bytes += bytes(1, false, false);  // every tensor starts aligned: layers add up exactly
    f.embedding_bytes += bytes(0, true, false);
    f.head_bytes += bytes(0, false, true);
    f.embedding_and_head_bytes += bytes(0, true, true);
    f.kv_bytes_per_token_per_layer += KvCache::page_bytes(1, shard.heads(), c.head_dim(), o.dtype, o.kv_fp8) / kPageTokens;
  }
  return f;
}

std::string GpuStageBackend::describe() const {
  std::string d = "cuda:";
  for (size_t i = 0; i < stage_->devices().size(); ++i) d += (i ? "," : "") + std::to_string(stage_->devices()[i]);
  d += " " + std::string(dtype_name(stage_->lead().dtype()));
  if (stage_->lead().int8_weights()) d += " int8-weights";
  if (stage_->lead().fp8()) d += " fp8";
  if (stage_->lead().kv_fp8()) d += " kv=fp8";
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

#include "stage/backend_factory.h"

#include <unistd.h>

#include "kernels/cpu/ops.h"
#include "model/stage_checkpoint.h"
#include "stage/cpu/cpu_stage_backend.h"
#ifdef CONVEYOR_HAVE_CUDA
#include "stage/cuda/gpu_node.h"
#include "stage/cuda/gpu_stage_backend.h"
#endif

namespace conveyor {

std::string_view backend_name(Backend backend) { return backend == Backend::Cuda ? "cuda" : "cpu"; }

Status apply_kernel_options(const KernelOptions& options) {
  if (Status s = cpu::set_threads(options.cpu_threads); !s) return s;
#ifdef CONVEYOR_HAVE_CUDA
  cuda::use_pdl(options.pdl);
#endif
  return ok_status();
}

Expected<Backend> parse_backend(std::string_view name) {
  if (name == "cpu") return Backend::Cpu;
  if (name == "cuda") return Backend::Cuda;
  return Status::error("unknown stage backend '" + std::string(name) + "' (cpu or cuda)");
}

#ifdef CONVEYOR_HAVE_CUDA
namespace {

// The GPU stage a worker's options make: the one place they turn into GpuStageOptions, for
// the stage itself and for what the worker says of it before it holds one.
cuda::GpuStageOptions gpu_options(const StageOptions& o) {
  cuda::GpuStageOptions g;
  g.dtype = o.dtype;
  g.int8_weights = o.int8_weights;
  g.fp8 = o.fp8;
  g.kv_fp8 = o.kv_fp8;
  g.name = o.name;
  g.kv_cache_fraction = o.gpu_memory_fraction;
  g.kv_cache_max_bytes = o.gpu_kv_cache_max_bytes;
  g.gemm = o.gemm;
  // A micro-batch of up to 512 sequences (the largest decode graph): the scheduler fills the
  // K/V capacity, and a GPU's decode step costs little more at 256 rows than at 64.
  g.max_seqs = 512;
  return g;
}

}  // namespace
#endif

Expected<std::unique_ptr<StageBackend>> make_stage_backend(StageWeights weights, const StageOptions& o) {
  if (o.backend == Backend::Cpu) {
    if (o.fp8) return Status::error(o.name + ": fp8 needs the CUDA backend (FP8 tensor cores); the CPU stage is fp32");
    if (o.kv_fp8) return Status::error(o.name + ": an FP8 K/V cache needs the CUDA backend; the CPU stage keeps fp32 K/V");
    auto b = CpuStageBackend::create(std::move(weights), o.tensor_parallel, o.kv_cache_bytes);
    if (!b) return b.status();
    return std::unique_ptr<StageBackend>(std::move(b).value());
  }
#ifdef CONVEYOR_HAVE_CUDA
  auto b = cuda::GpuStageBackend::create(weights, o.gpus, gpu_options(o));
  if (!b) return b.status();
  return std::unique_ptr<StageBackend>(std::move(b).value());
#else
  return Status::error(o.name + ": this build has no CUDA backend (configure with nvcc present, -DCONVEYOR_CUDA=ON)");
#endif
}

Expected<LoadedStage> load_stage_backend(const std::string& model_dir, int64_t layer_begin, int64_t layer_end,
                                         const StageOptions& o, const LoadProgress& progress) {
#ifdef CONVEYOR_HAVE_CUDA
  if (o.backend == Backend::Cuda) {
    auto config = load_model_config(model_dir);
    if (!config) return config.status();
    auto checkpoint = open_stage_checkpoint(model_dir, *config, layer_begin, layer_end);
    if (!checkpoint) return checkpoint.status();
    auto b = cuda::GpuStageBackend::create(*checkpoint, o.gpus, gpu_options(o), progress);
    if (!b) return b.status();
    return LoadedStage{std::unique_ptr<StageBackend>(std::move(b).value()), checkpoint->bytes()};
  }
#endif
  auto weights = load_stage_weights(model_dir, layer_begin, layer_end, progress);
  if (!weights) return weights.status();
  const int64_t bytes = weights->checkpoint_bytes_read;
  auto b = make_stage_backend(std::move(weights).value(), o);
  if (!b) return b.status();
  return LoadedStage{std::move(b).value(), bytes};
}

StageCapabilities stage_capabilities(const StageOptions& o) {
#ifdef CONVEYOR_HAVE_CUDA
  if (o.backend == Backend::Cuda) return cuda::GpuStageBackend::capabilities(gpu_options(o), stage_memory_bytes(o));
#endif
  return CpuStageBackend::capabilities(stage_memory_bytes(o), o.kv_cache_bytes);
}

Expected<StageFootprint> stage_footprint(const ModelConfig& config, const StageOptions& o) {
  if (o.backend == Backend::Cpu) return CpuStageBackend::footprint(config, o.tensor_parallel);
#ifdef CONVEYOR_HAVE_CUDA
  return cuda::GpuStageBackend::footprint(config, int(o.gpus.size()), gpu_options(o));
#else
  return Status::error(o.name + ": this build has no CUDA backend (configure with nvcc present, -DCONVEYOR_CUDA=ON)");
#endif
}

int usable_gpus() {
#ifdef CONVEYOR_HAVE_CUDA
  return cuda::usable_gpus();
#else
  return 0;
#endif
}

int64_t stage_memory_bytes(const StageOptions& o) {
#ifdef CONVEYOR_HAVE_CUDA
  if (o.backend == Backend::Cuda) return cuda::total_memory_bytes(o.gpus);
#else
  (void)o;
#endif
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : 0;
}

HostAllocator receive_allocator(const StageOptions& o) {
#ifdef CONVEYOR_HAVE_CUDA
  if (o.backend == Backend::Cuda && !o.gpus.empty()) return cuda::pinned_host_allocator(o.gpus[0]);
#else
  (void)o;
#endif
  return {};
}

DeviceMemory device_memory(const StageOptions& o) {
#ifdef CONVEYOR_HAVE_CUDA
  if (o.backend == Backend::Cuda && !o.gpus.empty()) {
    const int gpu = o.gpus[0];
    return {cuda::device_memory_allocator(gpu), [gpu] { cuda::make_device_current(gpu); }};
  }
#else
  (void)o;
#endif
  return {};
}

}  // namespace conveyor

// The one place that knows which stage backends this build has: it makes the StageBackend a
// worker runs its stage on, and answers what the node offers for them (GPUs, memory, the
// kind of host memory the data plane should receive into). Nothing above the stage layer
// names CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/host_allocator.h"
#include "common/kernel_options.h"
#include "common/status.h"
#include "model/weights.h"
#include "stage/stage_backend.h"

namespace conveyor {

enum class Backend { Cpu, Cuda };
std::string_view backend_name(Backend backend);  // "cpu", "cuda"
// "cpu" or "cuda" (case as written); the error lists both.
Expected<Backend> parse_backend(std::string_view name);

struct StageOptions {
  Backend backend = Backend::Cpu;
  std::string name = "stage";          // names the stage in errors and logs
  int tensor_parallel = 1;             // cpu: threads; cuda: the number of `gpus`
  std::vector<int> gpus = {0};         // cuda: the stage's GPUs, in rank order
  DType dtype = DType::F16;            // cuda: F16 or BF16
  bool int8_weights = false;           // cuda: layer matrices int8 weight-only (per-channel scales)
  bool fp8 = false;                    // cuda, Hopper: layer matrices and their inputs FP8 E4M3 (not with int8)
  bool kv_fp8 = false;                 // cuda: the K/V cache in FP8 E4M3 with per-token scales (--kv-dtype fp8)
  double gpu_memory_fraction = 0.9;    // cuda: of the memory left after the weights, for the K/V cache
  int64_t kv_cache_bytes = 512ll << 20;  // cpu: the K/V budget
  int64_t gpu_kv_cache_max_bytes = 0;    // cuda: a cap on each rank's K/V cache (0: the memory fraction alone)
  GemmOptions gemm;                      // cuda: the products' options (the worker passes the registry's)
};

// The kernels' process-wide settings (the CPU ops' threads, PDL): once, at start-up, before
// any stage is made. An error names what was refused.
Status apply_kernel_options(const KernelOptions& options);

// The stage `weights` describe, on the backend `options` name. Errors say what was wrong (a
// backend this build lacks, a GPU the node has not, weights that do not fit).
Expected<std::unique_ptr<StageBackend>> make_stage_backend(StageWeights weights, const StageOptions& options);

// A stage loaded from a checkpoint directory, and what its load read.
struct LoadedStage {
  std::unique_ptr<StageBackend> backend;
  int64_t checkpoint_bytes = 0;  // the stage's tensor data, as stored (fp16 checkpoints: 2 bytes a weight)
};

// Layers [layer_begin, layer_end) of the checkpoint in `model_dir`, on the backend `options`
// name: a GPU stage straight from the checkpoint's bytes (each rank its part, through
// page-locked buffers; GpuStageBackend), a CPU stage through fp32 host weights
// (load_stage_weights). `progress`: checkpoint bytes done, of all. Errors name the file and
// the tensor (missing, wrong shape or dtype) or what make_stage_backend refused.
Expected<LoadedStage> load_stage_backend(const std::string& model_dir, int64_t layer_begin, int64_t layer_end,
                                         const StageOptions& options, const LoadProgress& progress = {});

// What the stage `options` name is before it holds a model, as its backend says (a worker's
// register carries it). A build without CUDA describes the CPU stage.
StageCapabilities stage_capabilities(const StageOptions& options);

// What `config`'s weights and K/V take on the stage `options` name, in its backend's own
// format (a worker's answer to the coordinator's welcome). An error when the backend cannot
// hold that model (shapes it cannot split, a backend this build lacks).
Expected<StageFootprint> stage_footprint(const ModelConfig& config, const StageOptions& options);

// CUDA devices a stage could run on: 0 when this build has no CUDA backend or the driver
// finds none.
int usable_gpus();

// The memory a stage's weights live in: the total of its GPUs' memory on CUDA, else the
// host's. 0 when it cannot be read (the error is logged).
int64_t stage_memory_bytes(const StageOptions& options);

// Where the data plane should put received activations: page-locked memory for a CUDA stage
// (its copies to the GPU then run as DMA), the heap (an empty allocator) otherwise.
HostAllocator receive_allocator(const StageOptions& options);

// The data plane's direct path: device memory on a CUDA stage's lead GPU (the worker's
// outgoing slots and its receive buffers, when its UCX moves CUDA memory), and a call that
// makes that GPU current on a thread (UCX's progress thread). Empty for a CPU stage or a
// build without CUDA.
struct DeviceMemory {
  HostAllocator allocator;
  std::function<void()> bind_thread;
};
DeviceMemory device_memory(const StageOptions& options);

}  // namespace conveyor

// TpAllReduce: the all-reduce a tensor-parallel GPU stage calls twice per layer. Messages
// up to CustomAllReduce::kNcclCrossoverBytes go through the custom peer-memory kernel
// (faster there, docs/PERFORMANCE.md); larger ones through NCCL, so it is never slower
// than NCCL. One object per process; rank r's calls come from the thread that drives GPU r
// (NCCL requires that, or group calls, when one thread drives several GPUs).
#pragma once

#include <memory>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/custom_all_reduce.h"

namespace conveyor::cuda {

class TpAllReduce {
 public:
  // The GPUs of the group, in rank order; NCCL communicators for all of them and the custom
  // kernel's buffers (sized for the crossover).
  static Expected<std::unique_ptr<TpAllReduce>> create(const std::vector<int>& devices);
  ~TpAllReduce();
  TpAllReduce(const TpAllReduce&) = delete;
  TpAllReduce& operator=(const TpAllReduce&) = delete;

  int ranks() const { return custom_->ranks(); }
  // In place, fp16 sum of `count` halves at `data` (on GPU `rank`), on `stream`. Capturable
  // in a CUDA graph whichever path it takes.
  Status all_reduce(int rank, __half* data, size_t count, cudaStream_t stream);

  struct Nccl;

 private:
  TpAllReduce() = default;
  std::unique_ptr<CustomAllReduce> custom_;
  std::unique_ptr<Nccl> nccl_;
};

}  // namespace conveyor::cuda

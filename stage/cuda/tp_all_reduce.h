// TpAllReduce: the all-reduce a tensor-parallel GPU stage calls twice per layer, exact: the
// ranks' values are summed in rank order in fp32 and rounded once, whatever the message's
// size, so a row's sum does not depend on the batch or chunk it travels in. On two GPUs,
// messages up to CustomAllReduce::kNcclCrossoverBytes go through the custom peer-memory
// kernel (faster there, docs/PERFORMANCE.md) and larger ones through NCCL, whose sum of
// two values is the same bits. With three GPUs or more the custom kernel takes every size
// (NCCL's order is not rank order), its buffers sized for the largest message. One object per stage; rank r's calls come from the thread that drives GPU r
// (NCCL requires that, or group calls, when one thread drives several GPUs).
//
// Ranks may share a GPU (tests of a tensor-parallel stage on a one-GPU machine). NCCL
// refuses that, so such a group sizes the custom kernel's buffers for its largest message
// and uses it at every size. Its ranks still wait for each other inside the kernel, so
// nothing may make one wait for the GPU to go idle: such tests raise CUDA_DEVICE_MAX_CONNECTIONS and load kernels eagerly
// (tests/test_util.h, scripts/gpu_check.sh).
#pragma once

#include <memory>
#include <set>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/custom_all_reduce.h"

namespace conveyor::cuda {

// No GPU appears twice (ranks sharing a GPU make NCCL unusable).
inline bool distinct_gpus(const std::vector<int>& devices) {
  return std::set<int>(devices.begin(), devices.end()).size() == devices.size();
}

class TpAllReduce {
 public:
  // The GPUs of the group, in rank order; `max_bytes` bounds one message. NCCL communicators
  // for all of them (distinct GPUs) and the custom kernel's buffers.
  // push_max_bytes: the custom kernel's push call up to this size (CustomAllReduce::create).
  static Expected<std::unique_ptr<TpAllReduce>> create(const std::vector<int>& devices,
                                                       size_t max_bytes = size_t(1) << 30,
                                                       size_t push_max_bytes = CustomAllReduce::kPushMaxMeasured);
  ~TpAllReduce();
  TpAllReduce(const TpAllReduce&) = delete;
  TpAllReduce& operator=(const TpAllReduce&) = delete;

  int ranks() const { return custom_->ranks(); }
  bool uses_nccl() const { return nccl_ != nullptr; }
  // In place, sum of `count` elements at `data` (on GPU `rank`), on `stream`. T: __half or
  // __nv_bfloat16. Capturable in a CUDA graph whichever path it takes.
  template <class T>
  Status all_reduce(int rank, T* data, size_t count, cudaStream_t stream);

  struct Nccl;

 private:
  TpAllReduce() = default;
  size_t max_bytes_ = 0;
  std::unique_ptr<CustomAllReduce> custom_;
  std::unique_ptr<Nccl> nccl_;  // null when ranks share a GPU
};

}  // namespace conveyor::cuda

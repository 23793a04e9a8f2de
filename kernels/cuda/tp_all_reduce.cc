#include "kernels/cuda/tp_all_reduce.h"

#include <string>

#include <nccl.h>

namespace conveyor::cuda {

struct TpAllReduce::Nccl {
  std::vector<ncclComm_t> comms;
  ~Nccl() {
    for (ncclComm_t c : comms)
      if (c) ncclCommDestroy(c);
  }
};

Expected<std::unique_ptr<TpAllReduce>> TpAllReduce::create(const std::vector<int>& devices) {
  std::unique_ptr<TpAllReduce> t(new TpAllReduce());
  auto custom = CustomAllReduce::create(devices, CustomAllReduce::kNcclCrossoverBytes);
  if (!custom) return custom.status();
  t->custom_ = std::move(custom).value();
  t->nccl_ = std::make_unique<Nccl>();
  t->nccl_->comms.assign(devices.size(), nullptr);
  const ncclResult_t r = ncclCommInitAll(t->nccl_->comms.data(), int(devices.size()), devices.data());
  if (r != ncclSuccess) {
    t->nccl_->comms.assign(devices.size(), nullptr);  // nothing to destroy
    return Status::error(std::string("tensor-parallel all-reduce: ncclCommInitAll: ") + ncclGetErrorString(r));
  }
  return t;
}

TpAllReduce::~TpAllReduce() = default;

Status TpAllReduce::all_reduce(int rank, __half* data, size_t count, cudaStream_t stream) {
  if (count * sizeof(__half) <= CustomAllReduce::kNcclCrossoverBytes) return custom_->all_reduce(rank, data, count, stream);
  if (rank < 0 || rank >= ranks()) return Status::error("tensor-parallel all-reduce: no rank " + std::to_string(rank));
  const ncclResult_t r = ncclAllReduce(data, data, count, ncclFloat16, ncclSum, nccl_->comms[size_t(rank)], stream);
  if (r != ncclSuccess) return Status::error(std::string("tensor-parallel all-reduce: ncclAllReduce: ") + ncclGetErrorString(r));
  return ok_status();
}

}  // namespace conveyor::cuda

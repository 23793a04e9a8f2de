#include "stage/cuda/tp_all_reduce.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include <nccl.h>

namespace conveyor::cuda {

struct TpAllReduce::Nccl {
  std::vector<ncclComm_t> comms;
  ~Nccl() {
    for (ncclComm_t c : comms)
      if (c) ncclCommDestroy(c);
  }
};

Expected<std::unique_ptr<TpAllReduce>> TpAllReduce::create(const std::vector<int>& devices, size_t max_bytes,
                                                           size_t push_max_bytes) {
  std::unique_ptr<TpAllReduce> t(new TpAllReduce());
  t->max_bytes_ = max_bytes;
  const bool distinct = distinct_gpus(devices);
  // NCCL above the crossover only where its sums are ours bit for bit: two ranks (one
  // addition, rounded once either way). With more, its order is not rank order, and a row's
  // sum would change with the size of the message it travels in (the batch, the chunk).
  const bool nccl_above = distinct && devices.size() == 2;
  const size_t custom_bytes = nccl_above ? std::min(max_bytes, CustomAllReduce::kNcclCrossoverBytes) : max_bytes;
  auto custom = CustomAllReduce::create(devices, custom_bytes, push_max_bytes);
  if (!custom) return custom.status();
  t->custom_ = std::move(custom).value();
  if (!nccl_above || max_bytes <= custom_bytes) return t;
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

template <class T>
Status TpAllReduce::all_reduce(int rank, T* data, size_t count, cudaStream_t stream) {
  const size_t bytes = count * sizeof(T);
  if (bytes <= custom_->max_bytes()) return custom_->all_reduce(rank, data, count, stream);
  if (rank < 0 || rank >= ranks()) return Status::error("tensor-parallel all-reduce: no rank " + std::to_string(rank));
  if (!nccl_ || bytes > max_bytes_)
    return Status::error("tensor-parallel all-reduce: " + std::to_string(bytes) + " bytes exceed the group's " +
                         std::to_string(max_bytes_) + "-byte messages");
  const ncclDataType_t type = std::is_same_v<T, __half> ? ncclFloat16 : ncclBfloat16;
  const ncclResult_t r = ncclAllReduce(data, data, count, type, ncclSum, nccl_->comms[size_t(rank)], stream);
  if (r != ncclSuccess) return Status::error(std::string("tensor-parallel all-reduce: ncclAllReduce: ") + ncclGetErrorString(r));
  return ok_status();
}

template Status TpAllReduce::all_reduce<__half>(int, __half*, size_t, cudaStream_t);
template Status TpAllReduce::all_reduce<__nv_bfloat16>(int, __nv_bfloat16*, size_t, cudaStream_t);

}  // namespace conveyor::cuda

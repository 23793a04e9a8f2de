// CustomAllReduce: an in-place fp16 or bf16 sum all-reduce over the GPUs of one process, for the
// decode regime where NCCL is latency-bound (two all-reduces per layer of a few KiB to a
// few MiB each).
//
// Every rank owns a peer-visible staging buffer and an array of flags in its device
// memory; peer access is enabled between all pairs, so a kernel on one GPU reads the other
// GPUs' buffers directly and signals them by storing into their flags. One kernel per call
// and rank, no host round trip:
//   push (small messages, by default up to measured_push_max): each rank stores its input into
//     every peer's receive area as 16-byte lines of 8 data bytes and two copies of the call's
//     flag (NCCL's LL protocol), then sums, in rank order, its own input and the lines the
//     peers pushed to it as they arrive: no barrier, no fence, no read across NVLink, one
//     write latency. The lines double the bytes on the wire, so larger messages pull:
//   one-shot: each block copies its slice of the input into the rank's
//     buffer, meets the same block of every other rank at a flag barrier, then sums that
//     slice over all ranks' buffers in rank order (so every rank gets the same bits) into
//     the output;
//   two-shot (larger): the slice is split in one part per rank; rank r reduces part r from
//     every buffer into its own buffer (reduce-scatter), a second barrier, then every rank
//     gathers the reduced parts (all-gather): each GPU reads 2(R-1)/R of the message
//     instead of.
// Consecutive calls stage their data in alternate halves of the buffers, so no barrier is
// needed at the end of a call (a rank writes a half again only after every peer has begun
// the call in between, which ends their reads of it): one flag round trip per one-shot
// call. Barrier values come from a call counter in device memory that the kernel itself
// advances, so a call captured in a CUDA graph is correct on every replay. Sums are taken
// in fp32 and rounded to fp16 once.
//
// (A call fused with the bias, residual and LayerNorm after it was tried and removed: on two
// H200s it made the tensor-parallel decode step 4-13% slower than this call followed by the
// LayerNorm kernel, docs/PERFORMANCE.md.)
//
// Ranks may share a GPU (a tensor-parallel stage tested on a one-GPU machine): their
// buffers are then plain device memory of that GPU, and their kernels run side by side on
// it (at most kMaxBlocks blocks each, so all of them fit at once).
//
// Every rank must make the same sequence of calls with the same counts (as with NCCL), and
// a rank's calls must be ordered on the GPU (one stream, or streams that wait on each other).
// Ranks are driven from one thread or one thread each; a call only launches a kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/check.h"

namespace conveyor::cuda {

class CustomAllReduce {
 public:
  enum class Algo { Auto, Push, OneShot, TwoShot };

  // Enables peer access between `devices` (2 to 8 ranks' GPUs, each able to reach every other)
  // and allocates on each a staging buffer of `max_bytes` and the flags. Errors name the
  // pair without peer access or the failed call.
  // push_max_bytes sizes the push call's receive areas (2 halves x ranks x push_max_bytes x 2
  // on each GPU); Auto pushes up to it (0: never; kPushMaxMeasured, the default: the measured
  // crossover for this many ranks, measured_push_max).
  static Expected<std::unique_ptr<CustomAllReduce>> create(const std::vector<int>& devices, size_t max_bytes,
                                                           size_t push_max_bytes = kPushMaxMeasured);
  ~CustomAllReduce();
  CustomAllReduce(const CustomAllReduce&) = delete;
  CustomAllReduce& operator=(const CustomAllReduce&) = delete;

  int ranks() const { return int(devices_.size()); }
  size_t max_bytes() const { return max_bytes_; }
  size_t push_max_bytes() const { return push_max_bytes_; }
  // Auto: push up to create's push_max_bytes (ranks on distinct GPUs); above, one-shot on 2 GPUs (two-shot reads as much there
  // and adds a barrier), else one-shot up to kOneShotMaxBytes and two-shot above (auto_algo).
  // Push on 2 GPUs up to 512 KiB: past it the doubled bytes cost more than the saved round trip
  // (2 H200s: 6.98 vs 8.76 us one-shot at 512 KiB, a tie at 1 MiB, 18.8 vs 14.3 us at 2 MiB).
  // With more ranks each one's lines go to every peer: up to 256 KiB (4 H200s: 9.71 vs 10.83 us
  // one-shot at 256 KiB, 15.54 vs 13.89 at 512 KiB), and one-shot up to 512 KiB (13.89 vs
  // 16.72 us two-shot there; 19.06 vs 18.61 at 1 MiB). docs/PERFORMANCE.md, "Four GPUs".
  static constexpr size_t kPushMaxBytes = 512 << 10;
  static constexpr size_t kPushMaxBytesWide = 256 << 10;
  static constexpr size_t kOneShotMaxBytes = 512 << 10;
  static constexpr size_t kPushMaxMeasured = ~size_t(0);  // create's default: measured_push_max
  static size_t measured_push_max(int ranks) { return ranks > 2 ? kPushMaxBytesWide : kPushMaxBytes; }
  // What Auto runs for a message of `bytes` over `ranks` ranks that may push up to `push_max`.
  static Algo auto_algo(int ranks, size_t bytes, size_t push_max) {
    if (bytes <= push_max) return Algo::Push;
    return ranks > 2 && bytes > kOneShotMaxBytes ? Algo::TwoShot : Algo::OneShot;
  }
  // Above this, NCCL is faster (2 H200s over NVLink, conveyor-bench-all-reduce,
  // docs/PERFORMANCE.md): a caller hands larger messages to NCCL.
  static constexpr size_t kNcclCrossoverBytes = size_t(16) << 20;

  // Rank `rank`'s part of a call: sums `count` elements at `data` (on the rank's device) over
  // all ranks, in place, on `stream` (of that device). count * sizeof(T) <= max_bytes.
  // T: __half or __nv_bfloat16 (sums in fp32, rounded once). Capturable.
  template <class T>
  Status all_reduce(int rank, T* data, size_t count, cudaStream_t stream, Algo algo = Algo::Auto);


 private:
  CustomAllReduce() = default;
  // The push call (Algo::Push): count * sizeof(T) <= push_max_bytes_. Its ranks
  // wait for each other's stores with no barrier, so Auto pushes only
  // when no two ranks share a GPU.
  template <class T>
  Status push(int rank, T* data, size_t count, bool aligned, cudaStream_t stream);
  // A call's kernel: with programmatic dependent launch where no two ranks share a GPU.
  template <class... KArgs, class... Args>
  Status launch(void (*kernel)(KArgs...), int blocks, cudaStream_t stream, Args&&... args);

  std::vector<int> devices_;
  size_t max_bytes_ = 0;
  std::vector<DeviceBuffer> memory_;  // per rank, on its device: staging buffer, flags, counters
  std::vector<uint4*> buffers_;       // per rank: staging buffer, two halves of max_bytes (rounded up to 16)
  std::vector<uint32_t*> flags_;      // per rank: [kMaxBlocks][kMaxRanks] barrier flags
  std::vector<uint32_t*> counters_;   // per rank: calls finished, blocks of the running call finished
  std::vector<uint4*> push_;          // per rank: the push calls' receive area, [2 halves][ranks][push_lines_]
  int64_t push_lines_ = 0;
  size_t push_max_bytes_ = 0;  // Auto pushes up to this (create's push_max_bytes, within max_bytes)
  bool distinct_ = true;  // no two ranks on one GPU: Auto may push (see push())
  // Blocks a call may take. Its blocks spin until the same blocks of every peer arrive, so
  // ranks that share a GPU must leave room for the work their peers still have to run before
  // they reach the call: k ranks on a GPU take at most a 2k-th of its SMs each (four ranks on
  // one H100 at 64 blocks each covered every SM and hung).
  int max_blocks_ = 0;
};

}  // namespace conveyor::cuda

// TpGroup: the threads of a tensor-parallel stage, one per rank (the caller is rank 0):
// a CPU stage's ranks, or the threads that drive a GPU stage's GPUs, one each; and the CPU
// all-reduce that joins the CPU ranks' partial outputs.
//
// run(fn) runs fn(rank) on every rank at once and returns when all are done. all_reduce
// sums the ranks' partial outputs into a destination the two-shot way: every rank sums, in
// rank order, its own contiguous share of the elements over all the partials, so each
// element's bits are the same whatever the number of threads and however the work is
// split (0 + p0 + p1 + ... in that order, then the bias, then the residual).
//
// Not reentrant: one run() at a time (the stage runs one micro-batch at a time).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace conveyor {

class TpGroup {
 public:
  explicit TpGroup(int ranks);
  ~TpGroup();
  TpGroup(const TpGroup&) = delete;
  TpGroup& operator=(const TpGroup&) = delete;

  int ranks() const { return ranks_; }
  void run(const std::function<void(int rank)>& fn);

  // Inside run(), on rank `rank`: for its share of i in [0, n): out[i] += (sum over r of
  // parts[r][i]) + bias[i % width]. `parts` may hold null entries (ranks with an empty
  // shard), which count as zeros. The caller runs it on every rank, then no rank may read
  // `out` before run() returns.
  static void all_reduce_add(float* out, std::span<const float* const> parts, const float* bias, int64_t n,
                             int64_t width, int rank, int ranks);

 private:
  void worker(int rank);

  int ranks_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace conveyor

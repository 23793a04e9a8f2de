#include "common/tp_group.h"

namespace conveyor {

TpGroup::TpGroup(int ranks) : ranks_(ranks < 1 ? 1 : ranks) {
  for (int r = 1; r < ranks_; ++r) threads_.emplace_back([this, r] { worker(r); });
}

TpGroup::~TpGroup() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void TpGroup::run(const std::function<void(int)>& fn) {
  if (ranks_ == 1) return fn(0);
  {
    std::lock_guard lk(mu_);
    fn_ = &fn;
    pending_ = ranks_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  fn(0);
  std::unique_lock lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

void TpGroup::worker(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* fn = nullptr;
    {
      std::unique_lock lk(mu_);
      start_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
    }
    (*fn)(rank);
    std::lock_guard lk(mu_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

void TpGroup::all_reduce_add(float* out, std::span<const float* const> parts, const float* bias, int64_t n,
                             int64_t width, int rank, int ranks) {
  const int64_t begin = n * rank / ranks, end = n * (rank + 1) / ranks;
  for (int64_t i = begin; i < end; ++i) {
    float acc = 0;
    bool first = true;
    for (const float* p : parts)
      if (p) acc = first ? p[i] : acc + p[i], first = false;
    out[i] += acc + bias[i % width];
  }
}

}  // namespace conveyor

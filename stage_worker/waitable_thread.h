// A thread whose end can be waited for within a time limit, which std::thread's join cannot:
// the worker's control thread waits for its loader and compute threads in slices and sends
// its heartbeats between them, so a wait as long as a send's timeout does not make the
// coordinator take a live worker for dead. Private to stage_worker/.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace conveyor {

class WaitableThread {
 public:
  WaitableThread() = default;
  ~WaitableThread() { join(); }
  WaitableThread(const WaitableThread&) = delete;
  WaitableThread& operator=(const WaitableThread&) = delete;

  // Runs `work` on a new thread; the previous one must have been joined.
  void start(std::function<void()> work) {
    {
      std::lock_guard lock(mu_);
      done_ = false;
    }
    thread_ = std::thread([this, work = std::move(work)] {
      work();
      std::lock_guard lock(mu_);
      done_ = true;
      ended_.notify_all();
    });
  }

  // Started and not yet joined.
  bool joinable() const { return thread_.joinable(); }

  // Joins the thread if it ends within `timeout` (at once if there is none): true when none
  // is left running.
  bool join_for(std::chrono::milliseconds timeout) {
    if (!thread_.joinable()) return true;
    {
      std::unique_lock lock(mu_);
      if (!ended_.wait_for(lock, timeout, [&] { return done_; })) return false;
    }
    thread_.join();
    return true;
  }

  void join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable ended_;
  bool done_ = false;  // guarded by mu_
};

}  // namespace conveyor

#include "stage_worker/handoff.h"

#include <spdlog/spdlog.h>

#include <stdexcept>

namespace conveyor {

Handoff::Handoff(transport::Channel& channel, int slots, std::chrono::milliseconds send_timeout)
    : channel_(channel), timeout_(send_timeout), slots_(size_t(slots < 1 ? 1 : slots)) {
  sender_ = std::thread([this] { run(); });
}

Handoff::~Handoff() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  sender_.join();
}

Expected<int> Handoff::acquire(size_t bytes, const Allocate& allocate, bool device) {
  std::unique_lock lock(mu_);
  int index = -1;
  changed_.wait(lock, [&] {
    for (size_t i = 0; i < slots_.size(); ++i)
      if (!slots_[i].busy) return index = int(i), true;
    return interrupted_;
  });
  if (index < 0) return Status::error("no free slot for outgoing activations: the stage is stopping");
  Slot& s = slots_[size_t(index)];
  s.busy = true;
  lock.unlock();
  if (s.capacity < bytes || (s.device != device && bytes > 0)) {
    s.data.reset();  // before the new allocation: the old one may be large
    s.capacity = 0;
    s.device = device;
    s.data = allocate(bytes);
    if (!s.data) {
      cancel(index);
      return Status::error(std::string("no ") + (device ? "device" : "host") + " memory for " + std::to_string(bytes) +
                           " bytes of outgoing activations");
    }
    s.capacity = bytes;
  }
  return index;
}

std::span<std::byte> Handoff::slot(int index) {
  Slot& s = slots_.at(size_t(index));
  return {s.data.get(), s.capacity};
}

void Handoff::submit(int index, transport::PeerId peer, std::vector<std::byte> header, size_t bytes,
                     OnFailure on_failure) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(Send{index, peer, std::move(header), bytes, std::move(on_failure)});
  }
  changed_.notify_all();
}

void Handoff::cancel(int index) {
  {
    std::lock_guard lock(mu_);
    slots_.at(size_t(index)).busy = false;
  }
  changed_.notify_all();
}

bool Handoff::drain() {
  std::unique_lock lock(mu_);
  changed_.wait(lock, [&] { return (queue_.empty() && !sending_) || interrupted_; });
  return queue_.empty() && !sending_;
}

bool Handoff::drain_for(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return changed_.wait_for(lock, timeout, [&] { return queue_.empty() && !sending_; });
}

void Handoff::interrupt_waits() {
  {
    std::lock_guard lock(mu_);
    interrupted_ = true;
  }
  changed_.notify_all();
}

void Handoff::resume_waits() {
  std::lock_guard lock(mu_);
  interrupted_ = false;
}

bool Handoff::idle() {
  std::lock_guard lock(mu_);
  return queue_.empty() && !sending_;
}

void Handoff::retire(Slot& s) {
  retired_bytes_ += s.capacity;
  spdlog::warn("handoff: a send failed, so its {} slot of {} bytes is kept unwritten while the peer may still read "
               "it ({} bytes kept so far); the next micro-batch takes fresh memory",
               s.device ? "device" : "host", s.capacity, retired_bytes_);
  retired_.push_back(std::move(s.data));
  s.capacity = 0;
}

void Handoff::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left to send
    Send send = std::move(queue_.front());
    queue_.pop_front();
    sending_ = true;
    lock.unlock();
    const Slot& s = slots_[size_t(send.slot)];
    const auto t0 = std::chrono::steady_clock::now();
    const bool device = s.device && send.bytes > 0;
    const bool lent = send.bytes > 0 && channel_.peer_reads_failed_payloads(send.peer, device);
    const Status sent = channel_.send(send.peer, send.header, {s.data.get(), send.bytes, device}, timeout_);
    if (device && sent) device_sends_.fetch_add(1, std::memory_order_relaxed);
    send_ns_total_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
        std::memory_order_relaxed);
    if (!sent && send.on_failure) send.on_failure(sent);
    lock.lock();
    if (!sent && lent) retire(slots_[size_t(send.slot)]);
    slots_[size_t(send.slot)].busy = false;
    sending_ = false;
    changed_.notify_all();
  }
}

}  // namespace conveyor

// One place that turns UCX results into Status, and RAII owners for the UCX objects a
// channel creates (config, context, worker, worker address, request). Each owner frees its
// object in its destructor; a channel declares them in creation order, so C++ destroys them
// in reverse order of creation (request before worker before context).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include "common/status.h"

namespace conveyor::transport {

// "ucp_init(...) failed at ucx_channel.cc:42: Input/output error" for a failed call.
Status ucx_status(ucs_status_t status, const char* call, const char* file, int line);

}  // namespace conveyor::transport

// Evaluates a call returning ucs_status_t; on anything but UCS_OK returns (from the
// enclosing function, which returns Status or Expected<T>) a Status naming the call.
#define CONVEYOR_UCX_CHECK(call)                                                                 \
  do {                                                                                           \
    const ucs_status_t conveyor_ucx_status_ = (call);                                            \
    if (conveyor_ucx_status_ != UCS_OK)                                                          \
      return ::conveyor::transport::ucx_status(conveyor_ucx_status_, #call, __FILE__, __LINE__); \
  } while (0)

namespace conveyor::transport::ucx {

// Movable owner of one raw handle with a release function; the base of the owners below.
template <class Handle, void (*Release)(Handle)>
class Owned {
 public:
  Owned() = default;
  explicit Owned(Handle h) : h_(h) {}
  Owned(Owned&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Owned& operator=(Owned&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { reset(); }
  Handle get() const { return h_; }
  explicit operator bool() const { return h_ != nullptr; }
  void reset() {
    if (h_) Release(std::exchange(h_, nullptr));
  }
  // Gives the handle up without freeing it (left to the process's exit).
  Handle release() { return std::exchange(h_, nullptr); }

 private:
  Handle h_ = nullptr;
};

using Config = Owned<ucp_config_t*, ucp_config_release>;
using Context = Owned<ucp_context_h, ucp_cleanup>;
using Worker = Owned<ucp_worker_h, ucp_worker_destroy>;

// The worker's address (what peers need to create an endpoint to it).
class WorkerAddress {
 public:
  WorkerAddress() = default;
  WorkerAddress(ucp_worker_h worker, ucp_address_t* address, std::size_t bytes)
      : worker_(worker), address_(address), bytes_(bytes) {}
  WorkerAddress(WorkerAddress&& o) noexcept
      : worker_(o.worker_), address_(std::exchange(o.address_, nullptr)), bytes_(o.bytes_) {}
  WorkerAddress& operator=(WorkerAddress&& o) noexcept {
    if (this != &o) {
      reset();
      worker_ = o.worker_;
      address_ = std::exchange(o.address_, nullptr);
      bytes_ = o.bytes_;
    }
    return *this;
  }
  ~WorkerAddress() { reset(); }
  std::span<const std::byte> bytes() const {
    return {reinterpret_cast<const std::byte*>(address_), bytes_};
  }
  void reset() {
    if (address_) ucp_worker_release_address(worker_, std::exchange(address_, nullptr));
  }

 private:
  ucp_worker_h worker_ = nullptr;
  ucp_address_t* address_ = nullptr;
  std::size_t bytes_ = 0;
};

// A request handle returned by a non-blocking ucp call. Completion callbacks only record
// the result; the handle is released here. Releasing a request still in flight cancels it
// first; UCX then invokes no further callback for it (but may still touch its buffers
// until the worker is progressed or destroyed: the channel keeps those alive).
class Request {
 public:
  Request() = default;
  Request(ucp_worker_h worker, void* request) : worker_(worker), request_(request) {}
  Request(Request&& o) noexcept
      : worker_(o.worker_), request_(std::exchange(o.request_, nullptr)) {}
  Request& operator=(Request&& o) noexcept {
    if (this != &o) {
      reset();
      worker_ = o.worker_;
      request_ = std::exchange(o.request_, nullptr);
    }
    return *this;
  }
  ~Request() { reset(); }
  explicit operator bool() const { return request_ != nullptr; }
  void* get() const { return request_; }
  bool done() const { return !request_ || ucp_request_check_status(request_) != UCS_INPROGRESS; }
  void cancel() const {
    if (request_) ucp_request_cancel(worker_, request_);
  }
  void reset() {
    if (!request_) return;
    if (ucp_request_check_status(request_) == UCS_INPROGRESS) ucp_request_cancel(worker_, request_);
    ucp_request_free(std::exchange(request_, nullptr));
  }

 private:
  ucp_worker_h worker_ = nullptr;
  void* request_ = nullptr;
};

}  // namespace conveyor::transport::ucx

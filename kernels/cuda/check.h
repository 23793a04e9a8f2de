// One macro checks every CUDA runtime, cuBLAS and cuBLASLt call and every kernel launch:
//
//   CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
//   my_kernel<<<grid, block, smem, stream>>>(...);
//   CUDA_CHECK(cudaGetLastError());   // the launch
//
// A failure throws conveyor::Error whose message names the call's text, the error, and
// file:line. CUDA errors are not recoverable in operation (a sticky error poisons the
// context), so an exception that unwinds to a start-up boundary or to main is the contract.
//
// DeviceBuffer and PinnedBuffer are the RAII owners of device and page-locked host memory;
// device_alloc's out-of-memory message names who asked, the bytes asked and the bytes free.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/status.h"

namespace conveyor::cuda {

[[noreturn]] void throw_check_failure(const char* call, const std::string& error, const char* file,
                                      int line);

inline void check_result(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess)
    throw_check_failure(call, std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e), file,
                        line);
}
inline void check_result(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw_check_failure(call, std::string(cublasGetStatusName(s)) + ": " + cublasGetStatusString(s),
                        file, line);
}

// Device memory owned by one object; moves, never copies. Freed with cudaFree on the device
// that was current when it was allocated (the caller keeps the device current).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* p, size_t bytes) : ptr_(p), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }
  void reset() noexcept;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// cudaMalloc of `bytes` (0 gives an empty buffer). On failure throws conveyor::Error:
// "<owner>: cannot allocate <what>: <bytes> bytes asked, <free> bytes free of <total> on device N".
DeviceBuffer device_alloc(size_t bytes, const std::string& owner, const std::string& what);

// Page-locked host memory that every GPU of the process copies to and from as DMA
// (cudaHostAlloc, portable): null when it cannot be had. For the allocators of other layers
// (the data plane's receive buffers); PinnedBuffer owns one.
void* pinned_alloc(size_t bytes) noexcept;
void pinned_free(void* p) noexcept;

// Page-locked host memory (pinned_alloc), for copies that must be asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(size_t bytes, const std::string& what);
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }
  void reset() noexcept;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Makes `device` current for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Programmatic Dependent Launch for the kernels that support it (launch.cuh): on unless
// set_pdl(false) (KernelOptions::pdl; a daemon sets it at start-up from CONVEYOR_PDL). Set it
// before the first launch: CUDA graphs keep what their capture saw.
void set_pdl(bool on);
bool pdl_enabled();

// Bytes free and total on the current device.
std::pair<size_t, size_t> device_memory_info();

// The current device's SM count and shared memory an SM holds (bytes), asked once per
// device (the launch rules that size a grid to a wave of resident blocks read them at every
// call).
int sm_count();
int smem_per_sm();

// Blocks of `block_bytes` shared memory (static and dynamic) one SM holds at once, by shared
// memory alone (each block also costs the GPU's reserve).
int64_t smem_blocks_per_sm(size_t block_bytes);

// Shared memory to ask beside a block's own `block_bytes` (static and dynamic), unused, so
// that a grid of `blocks` spreads evenly over the current device's SMs: with programmatic
// dependent launch a grid's blocks are placed while the kernel before it still runs, and fill
// the room it leaves on a few SMs up to their occupancy while the other SMs stay idle for
// this grid (kernels/cuda/gemv_seq.cu has the figures). Asking ceil(blocks / SMs) blocks'
// share of an SM each leaves room for no more than that; 0 where the grid fills every SM to
// its occupancy anyway. spread_pad(1, b) is the most any grid asks (one block an SM).
size_t spread_pad(int64_t blocks, size_t block_bytes);

}  // namespace conveyor::cuda

// CUDA_CHECK(call): call returns cudaError_t or cublasStatus_t. Variadic so that template
// arguments with commas need no extra parentheses.
#define CUDA_CHECK(...) \
  ::conveyor::cuda::check_result((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)

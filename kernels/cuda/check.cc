#include "kernels/cuda/check.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace conveyor::cuda {

void throw_check_failure(const char* call, const std::string& error, const char* file, int line) {
  throw Error(std::string(call) + " failed: " + error + " at " + file + ":" + std::to_string(line));
}

void DeviceBuffer::reset() noexcept {
  if (ptr_) {
    const cudaError_t e = cudaFree(ptr_);
    // Destructors must not throw: say it and carry on (silently at process exit).
    if (e != cudaSuccess && e != cudaErrorCudartUnloading)
      std::fprintf(stderr, "cudaFree(%p) of %zu bytes failed: %s\n", ptr_, bytes_, cudaGetErrorString(e));
  }
  ptr_ = nullptr;
  bytes_ = 0;
}

DeviceGuard::DeviceGuard(int device) {
  CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_ && previous_ >= 0) cudaSetDevice(previous_);
}

namespace {
std::atomic<bool> g_pdl{true};  // read at every launch: relaxed, a start-up setting
}  // namespace

void set_pdl(bool on) { g_pdl.store(on, std::memory_order_relaxed); }

bool pdl_enabled() { return g_pdl.load(std::memory_order_relaxed); }

namespace {
// A device attribute of the current device, asked once per device (`cache` per attribute).
constexpr int kCachedDevices = 64;
int device_attribute(cudaDeviceAttr attr, std::atomic<int> (&cache)[kCachedDevices]) {
  int dev = 0, n = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const bool cached = dev >= 0 && dev < kCachedDevices;
  if (cached && (n = cache[dev].load(std::memory_order_relaxed)) > 0) return n;
  CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, dev));
  if (cached) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}
}  // namespace

int sm_count() {
  static std::atomic<int> cache[kCachedDevices] = {};
  return device_attribute(cudaDevAttrMultiProcessorCount, cache);
}

int smem_per_sm() {
  static std::atomic<int> cache[kCachedDevices] = {};
  return device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, cache);
}

namespace {
constexpr size_t kReservedPerBlock = 1024;  // the shared memory the GPU keeps for each block
}  // namespace

int64_t smem_blocks_per_sm(size_t block_bytes) {
  return int64_t(size_t(smem_per_sm()) / (block_bytes + kReservedPerBlock));
}

size_t spread_pad(int64_t blocks, size_t block_bytes) {
  const size_t used = block_bytes + kReservedPerBlock;
  const int64_t sms = sm_count(), per_sm = (std::max<int64_t>(blocks, 1) + sms - 1) / sms;
  if (per_sm >= smem_blocks_per_sm(block_bytes)) return 0;
  return (size_t(smem_per_sm()) / size_t(per_sm) - used) / 128 * 128;
}

std::pair<size_t, size_t> device_memory_info() {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return {free_bytes, total_bytes};
}

DeviceBuffer device_alloc(size_t bytes, const std::string& owner, const std::string& what) {
  if (bytes == 0) return {};
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) allocation error
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    int device = -1;
    cudaGetDevice(&device);
    throw Error(owner + ": cannot allocate " + what + ": " + std::to_string(bytes) + " bytes asked, " +
                std::to_string(free_bytes) + " bytes free of " + std::to_string(total_bytes) +
                " on device " + std::to_string(device) + " (" + cudaGetErrorString(e) + ")");
  }
  return DeviceBuffer(p, bytes);
}

void* pinned_alloc(size_t bytes) noexcept {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void pinned_free(void* p) noexcept {
  if (!p) return;
  const cudaError_t e = cudaFreeHost(p);
  if (e != cudaSuccess && e != cudaErrorCudartUnloading) std::fprintf(stderr, "cudaFreeHost(%p) failed: %s\n", p, cudaGetErrorString(e));
}

PinnedBuffer::PinnedBuffer(size_t bytes, const std::string& what) : bytes_(bytes) {
  if (bytes == 0) return;
  ptr_ = pinned_alloc(bytes);
  if (!ptr_) throw Error("cannot allocate " + std::to_string(bytes) + " bytes of pinned host memory for " + what);
}

void PinnedBuffer::reset() noexcept {
  pinned_free(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace conveyor::cuda

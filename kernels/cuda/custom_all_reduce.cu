#include "kernels/cuda/custom_all_reduce.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <utility>

#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda {
namespace {

using detail::from_float;
using detail::grid_dependency_wait;
using detail::grid_dependents_launch;
using detail::from_float2;
using detail::pack8;
using detail::to_float2;
using detail::unpack8;

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;
constexpr int64_t kUnit = 8;  // elements (fp16 or bf16) per 16-byte unit

struct Peers {
  uint4* buf[kMaxRanks];       // every rank's staging buffer (this call's half)
  uint32_t* flags[kMaxRanks];  // every rank's flags
};

__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block b of this rank meets block b of every rank: tells each that it reached `value`,
// then waits until each has told it the same. The block's earlier writes are visible to
// the peers after it (release), and the peers' to this block (acquire, then the CTA barrier).
__device__ void barrier(const Peers& peers, int rank, int ranks, uint32_t value) {
  __syncthreads();
  if (int(threadIdx.x) < ranks) {
    const int p = int(threadIdx.x);
    store_release(peers.flags[p] + blockIdx.x * kMaxRanks + rank, value);
    const uint32_t* mine = peers.flags[rank] + blockIdx.x * kMaxRanks + p;
    while (int32_t(load_acquire(mine) - value) < 0) {
    }
  }
  __syncthreads();
}

// Unit u of a message of n elements: a 16-byte load when it is whole and aligned, else per
// element with zeros past the end.
template <class T>
__device__ __forceinline__ uint4 load_unit(const T* data, int64_t u, int64_t n, bool aligned) {
  if (aligned && (u + 1) * kUnit <= n) return reinterpret_cast<const uint4*>(data)[u];
  __align__(16) T h[kUnit];
  for (int i = 0; i < kUnit; ++i) h[i] = u * kUnit + i < n ? data[u * kUnit + i] : from_float<T>(0.0f);
  return *reinterpret_cast<const uint4*>(h);
}
template <class T>
__device__ __forceinline__ void store_unit(T* data, int64_t u, int64_t n, bool aligned, uint4 v) {
  if (aligned && (u + 1) * kUnit <= n) {
    reinterpret_cast<uint4*>(data)[u] = v;
    return;
  }
  const T* h = reinterpret_cast<const T*>(&v);
  for (int i = 0; i < kUnit; ++i)
    if (u * kUnit + i < n) data[u * kUnit + i] = h[i];
}

// The sum over ranks 0..R-1, in that order, of unit u of every staging buffer, in fp32,
// rounded to T once.
template <class T>
__device__ __forceinline__ uint4 sum_unit(const Peers& peers, int ranks, int64_t u) {
  float acc[kUnit] = {};
  for (int p = 0; p < ranks; ++p) {
    float f[kUnit];
    unpack8<T>(peers.buf[p][u], f);
#pragma unroll
    for (int i = 0; i < kUnit; ++i) acc[i] += f[i];
  }
  return pack8<T>(acc);
}

// state[0]: calls this rank has finished; state[1]: blocks of the running call finished.
// Call c stages its data in half c % 2 of every buffer, so no barrier is needed at the end:
// before a rank writes half c % 2 again (call c + 2), every peer has started call c + 1
// (its block met ours at that call's barrier), so its call c, and every read of ours in it,
// is over.
template <class T, bool kTwoShot>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(Peers peers, T* data, int64_t n, int rank, int ranks,
                                                              bool aligned, uint32_t* state, int64_t half_units,
                                                              bool early) {
  const int64_t units = (n + kUnit - 1) / kUnit;
  const int64_t begin = units * blockIdx.x / gridDim.x, end = units * (blockIdx.x + 1) / gridDim.x;
  __shared__ uint32_t call;
  // Launched beside the kernel before (programmatic dependent launch): nothing of the call's,
  // not even its counter, is read before that kernel, and so every earlier call, is done.
  // `early` (no two ranks share a GPU, launch()): the kernel after may start beside this one.
  if (early) grid_dependents_launch();
  grid_dependency_wait();
  if (threadIdx.x == 0) call = *reinterpret_cast<volatile uint32_t*>(state);  // the last block advances it
  __syncthreads();
  const uint32_t base = call * 2;  // this call's barrier values: base + 1 (and base + 2 for two-shot)
  const int64_t offset = (call & 1) * half_units;
  Peers half = peers;
  for (int p = 0; p < ranks; ++p) half.buf[p] = peers.buf[p] + offset;
  uint4* mine = half.buf[rank];
  for (int64_t u = begin + threadIdx.x; u < end; u += blockDim.x) mine[u] = load_unit(data, u, n, aligned);
  barrier(half, rank, ranks, base + 1);
  if constexpr (!kTwoShot) {
    for (int64_t u = begin + threadIdx.x; u < end; u += blockDim.x) store_unit(data, u, n, aligned, sum_unit<T>(half, ranks, u));
  } else {
    const int64_t len = end - begin;
    const int64_t pb = begin + len * rank / ranks, pe = begin + len * (rank + 1) / ranks;
    for (int64_t u = pb + threadIdx.x; u < pe; u += blockDim.x) mine[u] = sum_unit<T>(half, ranks, u);  // reduce-scatter
    barrier(half, rank, ranks, base + 2);
    for (int q = 0; q < ranks; ++q) {  // all-gather: part q as rank q reduced it
      const int64_t qb = begin + len * q / ranks, qe = begin + len * (q + 1) / ranks;
      const uint4* theirs = half.buf[q];
      for (int64_t u = qb + threadIdx.x; u < qe; u += blockDim.x) store_unit(data, u, n, aligned, theirs[u]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(state + 1, 1u) == gridDim.x - 1) {  // the last block of this call
    state[1] = 0;
    state[0] = call + 1;
  }
}

// ---- push: the flag in the data, no barrier ----

struct PushPeers {
  uint4* recv[kMaxRanks];  // every rank's push area: [2 halves][ranks slots][slot_lines]
};

// 16-byte lines {4 data bytes, flag, 4 data bytes, flag}: one store, one load, and a line
// whose two flags are this call's carries this call's 8 data bytes (4 elements).
__device__ __forceinline__ void store_pushed(uint4* p, uint2 data, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(data.x), "r"(flag), "r"(data.y),
               "r"(flag)
               : "memory");
}
__device__ __forceinline__ uint2 wait_pushed(const uint4* p, uint32_t flag) {
  uint32_t a, fa, b, fb;
  do {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(fa), "=r"(b), "=r"(fb) : "l"(p) : "memory");
  } while (fa != flag || fb != flag);
  return make_uint2(a, b);
}

// Line i (elements 4i..4i+3) of a message of n elements: one 8-byte access when whole and
// aligned, else per element with zeros past the end.
template <class T>
__device__ __forceinline__ uint2 load_four(const T* data, int64_t i, int64_t n, bool aligned) {
  if (aligned && (i + 1) * 4 <= n) return reinterpret_cast<const uint2*>(data)[i];
  __align__(8) T h[4];
  for (int k = 0; k < 4; ++k) h[k] = i * 4 + k < n ? data[i * 4 + k] : from_float<T>(0.0f);
  return *reinterpret_cast<const uint2*>(h);
}
template <class T>
__device__ __forceinline__ void store_four(T* data, int64_t i, int64_t n, bool aligned, uint2 v) {
  if (aligned && (i + 1) * 4 <= n) {
    reinterpret_cast<uint2*>(data)[i] = v;
    return;
  }
  const T* h = reinterpret_cast<const T*>(&v);
  for (int k = 0; k < 4; ++k)
    if (i * 4 + k < n) data[i * 4 + k] = h[k];
}

// Adds the 4 elements of `line` to acc in fp32.
template <class T>
__device__ __forceinline__ void add_line(float (&acc)[4], uint2 line) {
  using T2 = typename detail::Pair<T>::type;
  const float2 lo = to_float2(*reinterpret_cast<const T2*>(&line.x)), hi = to_float2(*reinterpret_cast<const T2*>(&line.y));
  acc[0] += lo.x, acc[1] += lo.y, acc[2] += hi.x, acc[3] += hi.y;
}

// Every thread pushes its lines of the input to every peer (slot `rank` of their areas),
// then sums its lines over ranks 0..R-1 in order, its own from the input, the others as they
// arrive, in fp32 rounded to T once. Call c uses half c % 2 with flag c + 1: a rank pushes
// into a half again two calls later, after it received every line of the peer's call in
// between, which the peer pushes only once its earlier call, and its reads of that half,
// are over. The call counter (state[0], state[1]) is all_reduce_kernel's: one sequence.
template <class T>
__global__ void __launch_bounds__(kThreads) push_all_reduce_kernel(PushPeers peers, T* data, int64_t n, int rank,
                                                                   int ranks, bool aligned, uint32_t* state,
                                                                   int64_t slot_lines, bool early) {
  using T2 = typename detail::Pair<T>::type;
  __shared__ uint32_t call_s;
  if (early) grid_dependents_launch();  // as all_reduce_kernel
  grid_dependency_wait();
  if (threadIdx.x == 0) call_s = *reinterpret_cast<volatile uint32_t*>(state);
  __syncthreads();
  const uint32_t call = call_s, flag = call + 1;
  const int64_t lines = (n + 3) / 4, half = int64_t(call & 1) * ranks * slot_lines;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < lines; i += stride) {
    const uint2 v = load_four(data, i, n, aligned);
    for (int p = 0; p < ranks; ++p)
      if (p != rank) store_pushed(peers.recv[p] + half + rank * slot_lines + i, v, flag);
  }
  const uint4* mine = peers.recv[rank] + half;
  for (int64_t i = first; i < lines; i += stride) {
    float acc[4] = {};
    for (int p = 0; p < ranks; ++p)
      add_line<T>(acc, p == rank ? load_four(data, i, n, aligned) : wait_pushed(mine + p * slot_lines + i, flag));
    const T2 lo = from_float2<T>(make_float2(acc[0], acc[1])), hi = from_float2<T>(make_float2(acc[2], acc[3]));
    store_four(data, i, n, aligned, make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi)));
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(state + 1, 1u) == gridDim.x - 1) {  // the last block of this call
    state[1] = 0;
    state[0] = call + 1;
  }
}

}  // namespace

Expected<std::unique_ptr<CustomAllReduce>> CustomAllReduce::create(const std::vector<int>& devices, size_t max_bytes,
                                                                  size_t push_max_bytes) {
  const int R = int(devices.size());
  if (R < 2 || R > kMaxRanks)
    return Status::error("custom all-reduce: " + std::to_string(R) + " GPUs given; it needs 2 to " + std::to_string(kMaxRanks));
  std::unique_ptr<CustomAllReduce> ar(new CustomAllReduce());
  ar->devices_ = devices;
  ar->max_bytes_ = max_bytes;
  ar->push_max_bytes_ = std::min(max_bytes, push_max_bytes == kPushMaxMeasured ? measured_push_max(R) : push_max_bytes);
  ar->push_lines_ = int64_t((ar->push_max_bytes_ + 7) / 8);
  ar->distinct_ = std::set<int>(devices.begin(), devices.end()).size() == devices.size();
  ar->max_blocks_ = kMaxBlocks;
  if (!ar->distinct_) {
    int sharing = 0, sms = 0;
    for (int d : devices) sharing = std::max(sharing, int(std::count(devices.begin(), devices.end(), d)));
    if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, devices[0]); e != cudaSuccess)
      return Status::error(std::string("custom all-reduce: cannot read GPU ") + std::to_string(devices[0]) +
                           "'s SM count: " + cudaGetErrorString(e));
    ar->max_blocks_ = std::clamp(sms / (2 * sharing), 1, kMaxBlocks);
  }
  const size_t buf_bytes = 2 * ((max_bytes + 15) / 16 * 16);  // two halves, alternate calls
  const size_t flag_bytes = size_t(kMaxBlocks) * kMaxRanks * sizeof(uint32_t);
  const size_t counter_bytes = 16;  // two counters, padded: the push area after them stays 16-byte aligned
  const size_t push_bytes = size_t(2 * R * ar->push_lines_) * sizeof(uint4);  // zeros: no flag matches
  try {
    for (int a = 0; a < R; ++a)
      for (int b = 0; b < R; ++b) {
        if (devices[size_t(a)] == devices[size_t(b)]) continue;  // ranks sharing a GPU
        int can = 0;
        CUDA_CHECK(cudaDeviceCanAccessPeer(&can, devices[size_t(a)], devices[size_t(b)]));
        if (!can)
          return Status::error("custom all-reduce: GPU " + std::to_string(devices[size_t(a)]) + " cannot access GPU " +
                               std::to_string(devices[size_t(b)]) + "'s memory (no peer access: use NCCL)");
      }
    std::set<std::pair<int, int>> enabled;
    for (int r = 0; r < R; ++r) {
      DeviceGuard on(devices[size_t(r)]);
      for (int p = 0; p < R; ++p) {
        const int from = devices[size_t(r)], to = devices[size_t(p)];
        if (from == to || !enabled.insert({from, to}).second) continue;
        const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
        else CUDA_CHECK(e);
      }
      DeviceBuffer mem =
          device_alloc(buf_bytes + flag_bytes + counter_bytes + push_bytes, "custom all-reduce",
                       "staging buffer and flags on GPU " + std::to_string(devices[size_t(r)]));
      CUDA_CHECK(cudaMemset(mem.as<char>() + buf_bytes, 0, flag_bytes + counter_bytes + push_bytes));
      ar->push_.push_back(reinterpret_cast<uint4*>(mem.as<char>() + buf_bytes + flag_bytes + counter_bytes));
      ar->buffers_.push_back(mem.as<uint4>());
      ar->flags_.push_back(reinterpret_cast<uint32_t*>(mem.as<char>() + buf_bytes));
      ar->counters_.push_back(reinterpret_cast<uint32_t*>(mem.as<char>() + buf_bytes + flag_bytes));
      ar->memory_.push_back(std::move(mem));
    }
    for (int r = 0; r < R; ++r) {
      DeviceGuard on(devices[size_t(r)]);
      CUDA_CHECK(cudaDeviceSynchronize());
    }
  } catch (const Error& e) {
    return Status::error(std::string("custom all-reduce: ") + e.what());
  }
  return std::move(ar);
}

CustomAllReduce::~CustomAllReduce() {
  for (size_t r = 0; r < memory_.size(); ++r) {
    DeviceGuard on(devices_[r]);
    memory_[r].reset();
  }
}

// One call's kernel on `stream`. Where no two ranks share a GPU it may start beside the kernel
// before it (programmatic dependent launch): its blocks wait for that kernel before reading
// anything, and once they all run, the kernel after them may start too (the kernel's last
// argument). Ranks sharing a GPU do neither: kernels of one rank started early would hold the
// SMs its peers' kernels need to reach the call.
template <class... KArgs, class... Args>
Status CustomAllReduce::launch(void (*kernel)(KArgs...), int blocks, cudaStream_t stream, Args&&... args) {
  if (!distinct_) {
    kernel<<<blocks, kThreads, 0, stream>>>(std::forward<Args>(args)...);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return Status::error(std::string("custom all-reduce: launch: ") + cudaGetErrorString(e));
    return ok_status();
  }
  try {
    LAUNCH_PDL("custom all-reduce", kernel, dim3(blocks), dim3(kThreads), 0, stream, std::forward<Args>(args)...);
  } catch (const Error& e) {
    return Status::error(std::string("custom all-reduce: launch: ") + e.what());
  }
  return ok_status();
}

template <class T>
Status CustomAllReduce::all_reduce(int rank, T* data, size_t count, cudaStream_t stream, Algo algo) {
  const int R = ranks();
  if (rank < 0 || rank >= R) return Status::error("custom all-reduce: rank " + std::to_string(rank) + " of " + std::to_string(R));
  if (count * sizeof(T) > max_bytes_)
    return Status::error("custom all-reduce: " + std::to_string(count * sizeof(T)) + " bytes exceed the buffers' " +
                         std::to_string(max_bytes_));
  if (count == 0) return ok_status();
  if (algo == Algo::Push && count * sizeof(T) > push_max_bytes_)
    return Status::error("custom all-reduce: a push call takes at most " + std::to_string(push_max_bytes_) +
                         " bytes, not " + std::to_string(count * sizeof(T)));
  if (algo == Algo::Auto) algo = auto_algo(R, count * sizeof(T), distinct_ ? push_max_bytes_ : 0);
  if (algo == Algo::Push) return push(rank, data, count, reinterpret_cast<uintptr_t>(data) % 8 == 0, stream);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  Peers peers{};
  for (int p = 0; p < R; ++p) peers.buf[p] = buffers_[size_t(p)], peers.flags[p] = flags_[size_t(p)];
  const bool two_shot = algo == Algo::TwoShot;
  const int64_t units = int64_t((count + kUnit - 1) / kUnit);
  // Enough blocks to keep the GPU's memory system busy, few enough to be co-resident (a
  // block waits for the same block on the peers; ranks sharing a GPU need room for all of
  // theirs and for what their peers run before the call: max_blocks_). The same on every
  // rank for a count.
  const int blocks = int(std::min<int64_t>(max_blocks_, std::max<int64_t>(1, units / (two_shot ? 1024 : 256))));
  const int64_t half_units = int64_t((max_bytes_ + 15) / 16);
  DeviceGuard on(devices_[size_t(rank)]);
  auto kernel = two_shot ? all_reduce_kernel<T, true> : all_reduce_kernel<T, false>;
  return launch(kernel, blocks, stream, peers, data, int64_t(count), rank, R, aligned, counters_[size_t(rank)],
                half_units, distinct_);
}

template <class T>
Status CustomAllReduce::push(int rank, T* data, size_t count, bool aligned, cudaStream_t stream) {
  PushPeers peers{};
  for (int p = 0; p < ranks(); ++p) peers.recv[p] = push_[size_t(p)];
  // A line a thread, as many blocks as that takes (co-resident: see all_reduce's blocks).
  const int64_t lines = int64_t((count + 3) / 4);
  const int blocks = int(std::clamp<int64_t>((lines + kThreads - 1) / kThreads, 1, max_blocks_));
  DeviceGuard on(devices_[size_t(rank)]);
  return launch(push_all_reduce_kernel<T>, blocks, stream, peers, data, int64_t(count), rank, ranks(), aligned,
                counters_[size_t(rank)], push_lines_, distinct_);
}

template Status CustomAllReduce::all_reduce<__half>(int, __half*, size_t, cudaStream_t, Algo);
template Status CustomAllReduce::all_reduce<__nv_bfloat16>(int, __nv_bfloat16*, size_t, cudaStream_t, Algo);

}  // namespace conveyor::cuda

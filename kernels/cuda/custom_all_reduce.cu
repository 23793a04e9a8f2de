#include "kernels/cuda/custom_all_reduce.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <utility>

#include "kernels/cuda/dtype.cuh"

namespace conveyor::cuda {
namespace {

using detail::block_sum;
using detail::from_float;
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
                                                              bool aligned, uint32_t* state, int64_t half_units) {
  const int64_t units = (n + kUnit - 1) / kUnit;
  const int64_t begin = units * blockIdx.x / gridDim.x, end = units * (blockIdx.x + 1) / gridDim.x;
  __shared__ uint32_t call;
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
                                                                   int64_t slot_lines) {
  using T2 = typename detail::Pair<T>::type;
  __shared__ uint32_t call_s;
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

// ---- the fused decode step: push with the flag in the data, then residual and LayerNorm ----

constexpr int kFusedThreads = 512;

struct FusedPeers {
  uint2* recv[kMaxRanks];  // every rank's receive area: [2 halves][kMaxRanks slots][slot_lines]
};

// 8-byte lines {2 elements, flag}: one store, one load, never torn, so a line whose flag is
// this call's carries this call's data: no barrier, one NVLink write latency per call.
__device__ __forceinline__ void store_line(uint2* p, uint32_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(data), "r"(flag) : "memory");
}
__device__ __forceinline__ uint32_t wait_line(const uint2* p, uint32_t flag) {
  uint32_t data, f;
  do {
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(data), "=r"(f) : "l"(p) : "memory");
  } while (f != flag);
  return data;
}

// Block b: row b. Pushes the rank's partial row into slot `rank` of every rank's receive
// area, then sums the ranks' slots in rank order as lines arrive, and does what the
// all-reduce and add_bias_residual_layernorm would have done in two kernels, with the same
// roundings: the sum rounded to T, residual + sum + bias in fp32 rounded to T (stored), then
// LayerNorm of the stored row. Call c uses half c % 2 with flag c + 1: a rank writes a half
// again two calls later, when every peer has finished reading it (the call between needed
// the peer's data, which the peer pushes only after finishing its own earlier call).
// state[2]: calls finished; state[3]: blocks of the running call finished.
template <class T>
__global__ void __launch_bounds__(kFusedThreads)
    fused_residual_layernorm_kernel(FusedPeers peers, const T* partial, T* hidden, const T* bias, const T* gamma,
                                    const T* beta, T* ln_out, int width, float eps, int rank, int ranks,
                                    uint32_t* state, int64_t slot_lines) {
  using T2 = typename detail::Pair<T>::type;
  __shared__ uint32_t call_s;
  __shared__ float scratch[32];
  if (threadIdx.x == 0) call_s = *reinterpret_cast<volatile uint32_t*>(state + 2);
  __syncthreads();
  const uint32_t call = call_s, flag = call + 1;
  const int lines = width / 2;
  const int64_t row_off = int64_t(blockIdx.x) * lines, half = int64_t(call & 1) * kMaxRanks * slot_lines;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(partial) + row_off;
  for (int i = threadIdx.x; i < lines; i += blockDim.x) {
    const uint32_t d = in[i];
    for (int p = 0; p < ranks; ++p) store_line(peers.recv[p] + half + rank * slot_lines + row_off + i, d, flag);
  }
  T2* h = reinterpret_cast<T2*>(hidden) + row_off;
  const T2* b = reinterpret_cast<const T2*>(bias);
  const uint2* mine = peers.recv[rank] + half + row_off;
  float sum = 0.f;
  for (int i = threadIdx.x; i < lines; i += blockDim.x) {
    float2 acc = make_float2(0.f, 0.f);
    for (int p = 0; p < ranks; ++p) {
      const uint32_t d = wait_line(mine + p * slot_lines + i, flag);
      const float2 f = to_float2(*reinterpret_cast<const T2*>(&d));
      acc.x += f.x, acc.y += f.y;
    }
    const float2 s = to_float2(from_float2<T>(acc)), r = to_float2(h[i]);
    const float2 bb = b ? to_float2(b[i]) : make_float2(0.f, 0.f);
    const T2 o = from_float2<T>(make_float2(r.x + s.x + bb.x, r.y + s.y + bb.y));
    h[i] = o;
    const float2 of = to_float2(o);
    sum += of.x + of.y;
  }
  if (gamma != nullptr) {  // uniform across the block
    const float mean = block_sum(sum, scratch) / float(width);
    float sq = 0.f;
    for (int i = threadIdx.x; i < lines; i += blockDim.x) {
      const float2 v = to_float2(h[i]);
      sq += (v.x - mean) * (v.x - mean) + (v.y - mean) * (v.y - mean);
    }
    const float rstd = 1.f / sqrtf(block_sum(sq, scratch) / float(width) + eps);
    const T2* g = reinterpret_cast<const T2*>(gamma);
    const T2* be = reinterpret_cast<const T2*>(beta);
    T2* out = reinterpret_cast<T2*>(ln_out) + row_off;
    for (int i = threadIdx.x; i < lines; i += blockDim.x) {
      const float2 v = to_float2(h[i]), gg = to_float2(g[i]), bv = to_float2(be[i]);
      out[i] = from_float2<T>(make_float2((v.x - mean) * rstd * gg.x + bv.x, (v.y - mean) * rstd * gg.y + bv.y));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(state + 3, 1u) == gridDim.x - 1) {  // the last block of this call
    state[3] = 0;
    state[2] = call + 1;
  }
}

}  // namespace

Expected<std::unique_ptr<CustomAllReduce>> CustomAllReduce::create(const std::vector<int>& devices, size_t max_bytes,
                                                                  int64_t fused_max_elems, size_t push_max_bytes) {
  const int R = int(devices.size());
  if (R < 2 || R > kMaxRanks)
    return Status::error("custom all-reduce: " + std::to_string(R) + " GPUs given; it needs 2 to " + std::to_string(kMaxRanks));
  std::unique_ptr<CustomAllReduce> ar(new CustomAllReduce());
  ar->devices_ = devices;
  ar->max_bytes_ = max_bytes;
  ar->fused_max_elems_ = std::max<int64_t>(0, fused_max_elems) / 2 * 2;
  ar->slot_lines_ = ar->fused_max_elems_ / 2;
  ar->push_max_bytes_ = std::min(max_bytes, push_max_bytes);
  ar->push_lines_ = int64_t((ar->push_max_bytes_ + 7) / 8);
  ar->distinct_ = std::set<int>(devices.begin(), devices.end()).size() == devices.size();
  const size_t buf_bytes = 2 * ((max_bytes + 15) / 16 * 16);  // two halves, alternate calls
  const size_t flag_bytes = size_t(kMaxBlocks) * kMaxRanks * sizeof(uint32_t), counter_bytes = 4 * sizeof(uint32_t);
  const size_t recv_bytes = size_t(2 * kMaxRanks * ar->slot_lines_) * sizeof(uint2);  // zeros: no flag matches
  const size_t push_bytes = size_t(2 * R * ar->push_lines_) * sizeof(uint4);            // zeros too
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
          device_alloc(buf_bytes + flag_bytes + counter_bytes + recv_bytes + push_bytes, "custom all-reduce",
                       "staging buffer and flags on GPU " + std::to_string(devices[size_t(r)]));
      CUDA_CHECK(cudaMemset(mem.as<char>() + buf_bytes, 0, flag_bytes + counter_bytes + recv_bytes + push_bytes));
      char* const recv = mem.as<char>() + buf_bytes + flag_bytes + counter_bytes;
      ar->recv_.push_back(reinterpret_cast<uint2*>(recv));
      ar->push_.push_back(reinterpret_cast<uint4*>(recv + recv_bytes));
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
  if (algo == Algo::Push || (algo == Algo::Auto && distinct_ && count * sizeof(T) <= push_max_bytes_))
    return push(rank, data, count, reinterpret_cast<uintptr_t>(data) % 8 == 0, stream);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  Peers peers{};
  for (int p = 0; p < R; ++p) peers.buf[p] = buffers_[size_t(p)], peers.flags[p] = flags_[size_t(p)];
  const bool two_shot =
      algo == Algo::TwoShot || (algo == Algo::Auto && R > 2 && count * sizeof(T) > kOneShotMaxBytes);
  const int64_t units = int64_t((count + kUnit - 1) / kUnit);
  // Enough blocks to keep the GPU's memory system busy, few enough to be co-resident (a
  // block waits for the same block on the peers; ranks sharing a GPU need room for all of
  // theirs). The same on every rank for a count.
  const int blocks = int(std::min<int64_t>(kMaxBlocks, std::max<int64_t>(1, units / (two_shot ? 1024 : 256))));
  const int64_t half_units = int64_t((max_bytes_ + 15) / 16);
  DeviceGuard on(devices_[size_t(rank)]);
  if (two_shot)
    all_reduce_kernel<T, true><<<blocks, kThreads, 0, stream>>>(peers, data, int64_t(count), rank, R, aligned,
                                                                counters_[size_t(rank)], half_units);
  else
    all_reduce_kernel<T, false><<<blocks, kThreads, 0, stream>>>(peers, data, int64_t(count), rank, R, aligned,
                                                                 counters_[size_t(rank)], half_units);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::error(std::string("custom all-reduce: launch: ") + cudaGetErrorString(e));
  return ok_status();
}

template <class T>
Status CustomAllReduce::push(int rank, T* data, size_t count, bool aligned, cudaStream_t stream) {
  PushPeers peers{};
  for (int p = 0; p < ranks(); ++p) peers.recv[p] = push_[size_t(p)];
  // A line a thread, as many blocks as that takes (co-resident: see all_reduce's blocks).
  const int64_t lines = int64_t((count + 3) / 4);
  const int blocks = int(std::clamp<int64_t>((lines + kThreads - 1) / kThreads, 1, kMaxBlocks));
  DeviceGuard on(devices_[size_t(rank)]);
  push_all_reduce_kernel<T><<<blocks, kThreads, 0, stream>>>(peers, data, int64_t(count), rank, ranks(), aligned,
                                                              counters_[size_t(rank)], push_lines_);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::error(std::string("custom all-reduce: launch: ") + cudaGetErrorString(e));
  return ok_status();
}

template <class T>
Status CustomAllReduce::all_reduce_residual_layernorm(int rank, const T* partial, T* hidden, const T* bias,
                                                      const T* gamma, const T* beta, T* ln_out, int64_t rows,
                                                      int64_t width, float eps, cudaStream_t stream) {
  const int R = ranks();
  if (rank < 0 || rank >= R) return Status::error("custom all-reduce: rank " + std::to_string(rank) + " of " + std::to_string(R));
  if (rows <= 0 || width <= 0 || width % 2 != 0 || rows * width > fused_max_elems_ || rows > 65535)
    return Status::error("custom all-reduce: a fused step of " + std::to_string(rows) + " x " + std::to_string(width) +
                         " does not fit its " + std::to_string(fused_max_elems_) + "-element buffers");
  if ((gamma == nullptr) != (ln_out == nullptr) || (gamma != nullptr && beta == nullptr))
    return Status::error("custom all-reduce: a LayerNorm needs gamma, beta and ln_out");
  FusedPeers peers{};
  for (int p = 0; p < R; ++p) peers.recv[p] = recv_[size_t(p)];
  const int threads = int(std::min<int64_t>(kFusedThreads, (width / 2 + 31) / 32 * 32));
  DeviceGuard on(devices_[size_t(rank)]);
  fused_residual_layernorm_kernel<T><<<unsigned(rows), threads, 0, stream>>>(
      peers, partial, hidden, bias, gamma, beta, ln_out, int(width), eps, rank, R, counters_[size_t(rank)], slot_lines_);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::error(std::string("custom all-reduce: launch: ") + cudaGetErrorString(e));
  return ok_status();
}

template Status CustomAllReduce::all_reduce<__half>(int, __half*, size_t, cudaStream_t, Algo);
template Status CustomAllReduce::all_reduce_residual_layernorm<__half>(int, const __half*, __half*, const __half*,
                                                                      const __half*, const __half*, __half*, int64_t,
                                                                      int64_t, float, cudaStream_t);
template Status CustomAllReduce::all_reduce_residual_layernorm<__nv_bfloat16>(
    int, const __nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
    __nv_bfloat16*, int64_t, int64_t, float, cudaStream_t);
template Status CustomAllReduce::all_reduce<__nv_bfloat16>(int, __nv_bfloat16*, size_t, cudaStream_t, Algo);

}  // namespace conveyor::cuda

#include "kernels/cuda/sampling.h"

#include <cub/cub.cuh>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/launch.cuh"
#include "common/philox.h"

namespace conveyor::cuda {
namespace {

using detail::grid_dependency_wait;
using detail::grid_dependents_launch;

constexpr int kThreads = 1024;
constexpr int kDrawThreads = 512;  // the double scan needs more than 64 registers a thread
constexpr int kItems = 4;  // consecutive candidates per thread per scan tile

// What the prepare and draw kernels need of one row; list ranges index GpuSampler's one
// int list ((id, bias bits) pairs of logit_bias, repetition ids, then (id, count) pairs for
// presence/frequency, then stop ids).
struct RowParams {
  float temperature, top_p, repetition, presence, frequency;
  int32_t top_k;
  uint64_t seed, step, sample_index;
  int32_t bias_begin, bias_end, rep_begin, rep_end, freq_begin, freq_end, stop_begin, stop_end;
};

struct ArgMax {
  float v;
  int32_t i;
};
// Larger value wins; the lower id on ties (argmax_token's rule). NaN never wins.
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

// The best (value, id) of row[lo, hi) over the block; every thread gets it.
__device__ ArgMax block_argmax_range(const float* row, int64_t lo, int64_t hi) {
  __shared__ ArgMax part[32];
  ArgMax best{-INFINITY, INT32_MAX};
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) best = better(best, ArgMax{row[i], int32_t(i)});
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax other{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
    best = better(best, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if (lane == 0) part[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = lane < nwarps ? part[lane] : ArgMax{-INFINITY, INT32_MAX};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ArgMax other{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
      best = better(best, other);
    }
    if (lane == 0) part[0] = best;
  }
  __syncthreads();
  const ArgMax result = part[0];
  __syncthreads();
  return result;
}

__device__ int32_t block_argmax(const float* row, int64_t V) {
  const int32_t id = block_argmax_range(row, 0, V).i;
  return id == INT32_MAX ? 0 : id;  // every value NaN: argmax_token would say 0
}

// Argmax of a row cut into kArgmaxSplit pieces, one block each; the last block of a row to
// finish merges the pieces in order (threadfence + counter, left at zero for the next use).
constexpr int kArgmaxSplit = 16;
constexpr int kArgmaxThreads = 256;

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_split_kernel(int32_t* tokens, const float* logits, int64_t V, ArgMax* partial, int* counters) {
  __shared__ int is_last;
  grid_dependents_launch();
  grid_dependency_wait();
  const int row = blockIdx.x, piece = blockIdx.y;
  const int64_t chunk = (V + kArgmaxSplit - 1) / kArgmaxSplit;
  const int64_t lo = min(V, piece * chunk), hi = min(V, lo + chunk);
  const ArgMax best = block_argmax_range(logits + int64_t(row) * V, lo, hi);
  if (threadIdx.x == 0) {
    partial[row * kArgmaxSplit + piece] = best;
    __threadfence();
    is_last = atomicAdd(counters + row, 1) == kArgmaxSplit - 1;
  }
  __syncthreads();
  if (!is_last || threadIdx.x >= 32) return;
  __threadfence();
  const int lane = threadIdx.x;
  ArgMax b{-INFINITY, INT32_MAX};
  if (lane < kArgmaxSplit) {
    const ArgMax* p = partial + row * kArgmaxSplit + lane;
    b = ArgMax{__ldcg(&p->v), __ldcg(&p->i)};
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax other{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, other);
  }
  if (lane == 0) {
    tokens[row] = b.i == INT32_MAX ? 0 : b.i;
    counters[row] = 0;
  }
}

__global__ void __launch_bounds__(kThreads) argmax_kernel(int32_t* tokens, const float* logits, int64_t V) {
  grid_dependents_launch();
  grid_dependency_wait();
  const int32_t id = block_argmax(logits + int64_t(blockIdx.x) * V, V);
  if (threadIdx.x == 0) tokens[blockIdx.x] = id;
}

// Rows with 0 < top_k <= kSelectMax (and < V) need only their first top_k candidates, not a
// radix sort of the row: the row is cut into slices (select_slices), a block finds each
// slice's first top_k (topk_slice_kernel), and one block a row sorts the slices' candidates
// and keeps the first top_k (topk_merge_kernel). Exact: a candidate of the row is among the
// first top_k of its slice, since fewer than top_k of the row, and so of the slice, precede it
// in the order (logit desc, id asc).
constexpr int kSelectMax = 256;
constexpr int kSliceThreads = 256;
constexpr int kMergeThreads = 256;
constexpr int64_t kSliceKeys = 4096;  // a slice's keys, about: 16 KB of shared memory
constexpr int kMaxSlices = 32;        // the merge takes at most 32 x 256 candidates (64 KB)
constexpr int kLoads = 8;             // global loads a thread has in flight as a select block starts

__host__ __device__ __forceinline__ bool selects_top_k(const RowParams& p, int64_t V) {
  return p.temperature != 0.f && p.top_k > 0 && p.top_k <= kSelectMax && p.top_k < V;
}

// The candidate order (logit descending, id ascending) as one unsigned key, larger first:
// the float's order-preserving image (-0 as +0, as sample_next compares) over the
// complemented id.
__device__ __forceinline__ uint32_t order_bits(float x) {
  uint32_t b = __float_as_uint(x);
  if (b == 0x80000000u) b = 0;  // -0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ unsigned long long candidate(uint32_t bits, int64_t id) {
  return (static_cast<unsigned long long>(bits) << 32) | (0xffffffffu - uint32_t(id));
}

// Steps 0-3 of sample_next. Greedy rows are finished here; the others get a sort segment
// (empty for the rows topk_slice_kernel takes, which divide by the temperature as they read).
__global__ void __launch_bounds__(kThreads) prepare_kernel(float* logits, const RowParams* params, const int32_t* lists, int64_t V,
                               int32_t* tokens, int* seg_begin, int* seg_end) {
  const int r = blockIdx.x;
  const RowParams p = params[r];
  float* l = logits + int64_t(r) * V;
  for (int i = p.bias_begin + 2 * threadIdx.x; i < p.bias_end; i += 2 * blockDim.x) {  // distinct ids
    const int32_t id = lists[i];
    const float bias = __int_as_float(lists[i + 1]);
    if (id < 0 || id >= V) continue;
    l[id] = bias <= kLogitBiasBan ? -INFINITY : __fadd_rn(l[id], bias);
  }
  __syncthreads();
  for (int i = p.rep_begin + threadIdx.x; i < p.rep_end; i += blockDim.x) {  // distinct ids
    const int32_t id = lists[i];
    if (id < 0 || id >= V) continue;
    const float x = l[id];
    l[id] = x > 0.f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
  }
  __syncthreads();
  for (int i = p.freq_begin + 2 * threadIdx.x; i < p.freq_end; i += 2 * blockDim.x) {  // distinct ids
    const int32_t id = lists[i], count = lists[i + 1];
    if (id < 0 || id >= V) continue;
    float x = __fsub_rn(l[id], p.presence);
    x = __fsub_rn(x, __fmul_rn(p.frequency, float(count)));
    l[id] = x;
  }
  __syncthreads();
  for (int i = p.stop_begin + threadIdx.x; i < p.stop_end; i += blockDim.x) {
    const int32_t id = lists[i];
    if (id >= 0 && id < V) l[id] = -INFINITY;
  }
  __syncthreads();
  if (threadIdx.x == 0) seg_begin[r] = int(int64_t(r) * V);
  if (p.temperature == 0.f) {
    const int32_t id = block_argmax(l, V);
    if (threadIdx.x == 0) {
      tokens[r] = id;
      seg_end[r] = int(int64_t(r) * V);  // empty segment: nothing to sort
    }
    return;
  }
  const bool select = selects_top_k(p, V);
  if (p.temperature != 1.f && !select)
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) l[i] = __fdiv_rn(l[i], p.temperature);
  if (threadIdx.x == 0) seg_end[r] = int(int64_t(r) * V + (select ? 0 : V));
}

using SelectScan = cub::BlockScan<int, kSliceThreads>;

// The logit x of a row that samples, divided by its temperature t as sample_next divides it.
__device__ __forceinline__ float tempered(float x, float t) { return t != 1.f ? __fdiv_rn(x, t) : x; }
// order_bits' inverse (-0 comes back as +0, which sample_next's arithmetic cannot tell apart).
__device__ __forceinline__ float from_order_bits(uint32_t u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// Key i of a slice: from the shared copy when `cached`, else from the logits l (divided by t).
__device__ __forceinline__ uint32_t row_key(const float* l, float t, const uint32_t* row_keys, bool cached, int64_t i) {
  return cached ? row_keys[i] : order_bits(tempered(l[i], t));
}

// The k-th largest of the n keys key_at(i) (K: 32 or 64 bits), a byte at a time from the top
// (a block histogram each), into prefix; `need`: how many keys equal to it belong to the top
// k (k on entry). Every thread of the block calls it and gets the result.
template <class K, class KeyAt>
__device__ __forceinline__ void select_kth(KeyAt key_at, int64_t n, int (&hist)[256], K& s_prefix, int& s_need,
                                           K& prefix, int& need) {
  K mask = 0;
  for (int shift = int(8 * sizeof(K)) - 8; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    // Plain shared atomics, though most logits share their top bytes: lanes of a warp adding
    // once per digit after __match_any_sync were slower (H100: a slice of 3,866 keys 22.6 us
    // against 19.6).
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const K u = key_at(i);
      if ((u & mask) == prefix) atomicAdd(&hist[uint32_t(u >> shift) & 0xffu], 1);
    }
    __syncthreads();
    // The highest digit d > 0 whose keys, with those of the digits above it, reach `need`
    // (else 0): warp 0, a lane 8 digits from the top, a scan over the lanes, then the lane
    // where the count reaches need walks its 8.
    if (threadIdx.x < 32) {
      const int lane = int(threadIdx.x);
      int mine = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) mine += hist[255 - 8 * lane - j];
      int upto = mine;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, upto, o);
        if (lane >= o) upto += v;
      }
      const unsigned reached = __ballot_sync(0xffffffffu, upto >= need);
      if (lane == (reached ? __ffs(reached) - 1 : 31)) {
        int above = upto - mine, d = 255 - 8 * lane;
        for (; d > 0 && above + hist[d] < need && d > 248 - 8 * lane; --d) above += hist[d];
        s_prefix = prefix | (K(d) << shift);
        s_need = need - above;
      }
    }
    __syncthreads();
    prefix = s_prefix, need = s_need, mask |= K(0xff) << shift;
  }
}

// Candidates: every key above the k-th (`prefix`; k - need of them, any order), then the
// `need` lowest ids holding it (an ordered block compaction); the rest of cand sorts last.
// `id0` is the slice's first id in the row.
__device__ __forceinline__ void gather_candidates(const float* l, float t, const uint32_t* row_keys, bool cached,
                                                  int64_t V, int64_t id0, int k, uint32_t prefix, int need,
                                                  unsigned long long (&cand)[kSelectMax], int& s_above,
                                                  SelectScan::TempStorage& scan_storage) {
  for (int i = threadIdx.x; i < kSelectMax; i += blockDim.x) cand[i] = 0;
  if (threadIdx.x == 0) s_above = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const uint32_t u = row_key(l, t, row_keys, cached, i);
    if (u > prefix) cand[atomicAdd(&s_above, 1)] = candidate(u, id0 + i);
  }
  int taken = 0;
  for (int64_t base = 0; base < V && taken < need; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int equal = i < V && row_key(l, t, row_keys, cached, i) == prefix ? 1 : 0;
    int at = 0, total = 0;
    SelectScan(scan_storage).ExclusiveSum(equal, at, total);
    if (equal && taken + at < need) cand[k - need + taken + at] = candidate(prefix, id0 + i);
    taken += total;
    __syncthreads();  // scan_storage reuse
  }
  __syncthreads();
}

// Bitonic sort of a[0, n) in shared memory, descending; n a power of two.
__device__ __forceinline__ void bitonic_sort_descending(unsigned long long* a, int n) {
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long x = a[i], y = a[j];
          if ((x < y) == ((i & size) == 0)) a[i] = y, a[j] = x;
        }
      }
      __syncthreads();
    }
}

// Slices of a row of V logits: enough that each holds about kSliceKeys, at most kMaxSlices.
__host__ __device__ __forceinline__ int select_slices(int64_t V) {
  return int(std::min<int64_t>(kMaxSlices, (V + kSliceKeys - 1) / kSliceKeys));
}
__host__ __device__ __forceinline__ int64_t slice_keys(int64_t V) {
  const int64_t s = select_slices(V);
  return (V + s - 1) / s;
}

// Block (row, slice) of a top-k row: the first top_k candidates of the slice's ids in the
// order (logit / temperature desc, id asc), in no order, into out[row][slice][0, top_k). A
// slice holds more than top_k ids: one slice is the row (top_k < V), two or more hold 2,048
// ids or more each (top_k <= kSelectMax). A radix select over the keys' four bytes (a block
// histogram each) finds the slice's top_k-th key; the keys above it, and the lowest ids equal
// to it (an ordered block compaction), are the candidates. The keys are read from global
// memory once into dynamic shared memory when they fit (`cached`), else every pass reads
// the logits again.
__global__ void __launch_bounds__(kSliceThreads)
    topk_slice_kernel(const float* logits, const RowParams* params, int64_t V, bool cached,
                      unsigned long long* out) {
  __shared__ SelectScan::TempStorage scan_storage;
  __shared__ int hist[256];
  __shared__ unsigned long long cand[kSelectMax];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need, s_above;
  extern __shared__ uint32_t row_keys[];
  const int r = blockIdx.x, slice = blockIdx.y;
  const RowParams p = params[r];
  if (!selects_top_k(p, V)) return;
  const int k = p.top_k;
  const int64_t lo = min(V, slice * slice_keys(V)), n = min(V, lo + slice_keys(V)) - lo;
  const float* l = logits + int64_t(r) * V + lo;
  const float t = p.temperature;
  unsigned long long* dst = out + (int64_t(r) * select_slices(V) + slice) * kSelectMax;
  if (cached) {  // kLoads loads in flight a thread, not one at a time
    for (int64_t base = 0; base < n; base += int64_t(blockDim.x) * kLoads) {
      float v[kLoads];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int64_t i = base + int64_t(j) * blockDim.x + threadIdx.x;
        v[j] = i < n ? l[i] : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int64_t i = base + int64_t(j) * blockDim.x + threadIdx.x;
        if (i < n) row_keys[i] = order_bits(tempered(v[j], t));
      }
    }
    __syncthreads();
  }
  uint32_t prefix = 0;
  int need = k;
  select_kth<uint32_t>([&](int64_t i) { return row_key(l, t, row_keys, cached, i); }, n, hist, s_prefix, s_need, prefix,
                       need);
  gather_candidates(l, t, row_keys, cached, n, lo, k, prefix, need, cand, s_above, scan_storage);
  for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = cand[i];
}

// Step 4 for a top-k row: the first top_k of its slices' candidates, as the radix sort of the
// row would give them: ids, and the logits divided by the temperature (from their keys). The
// candidates are distinct (their ids are), so a radix select over their 64 bits finds the
// top_k-th, exactly top_k are at least it, and those are sorted (bitonic, in shared memory).
__global__ void __launch_bounds__(kMergeThreads)
    topk_merge_kernel(const RowParams* params, int64_t V, const unsigned long long* slices, float* sorted_keys,
                      int32_t* sorted_ids) {
  __shared__ int hist[256];
  __shared__ unsigned long long s_prefix, top[kSelectMax];
  __shared__ int s_need, s_taken;
  extern __shared__ unsigned long long merged[];
  const int r = blockIdx.x;
  const RowParams p = params[r];
  if (!selects_top_k(p, V)) return;
  const int k = p.top_k, n = select_slices(V) * k;
  const unsigned long long* mine = slices + int64_t(r) * select_slices(V) * kSelectMax;
  for (int base = 0; base < n; base += int(blockDim.x) * kLoads) {  // kLoads loads in flight a thread
    unsigned long long v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * int(blockDim.x) + int(threadIdx.x);
      v[j] = i < n ? mine[(i / k) * kSelectMax + i % k] : 0ull;
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * int(blockDim.x) + int(threadIdx.x);
      if (i < n) merged[i] = v[j];
    }
  }
  for (int i = threadIdx.x; i < kSelectMax; i += blockDim.x) top[i] = 0;
  if (threadIdx.x == 0) s_taken = 0;
  __syncthreads();
  unsigned long long prefix = 0;
  int need = k;
  select_kth<unsigned long long>([&](int64_t i) { return merged[i]; }, n, hist, s_prefix, s_need, prefix, need);
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    if (merged[i] >= prefix) top[atomicAdd(&s_taken, 1)] = merged[i];
  __syncthreads();
  int m = 1;
  while (m < k) m <<= 1;
  bitonic_sort_descending(top, m);
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const unsigned long long c = top[j];
    sorted_ids[int64_t(r) * V + j] = int32_t(0xffffffffu - uint32_t(c));
    sorted_keys[int64_t(r) * V + j] = from_order_bits(uint32_t(c >> 32));
  }
}

// First index j in [lo, hi) with pred(cum[j]) true, for a predicate monotone in j; hi if none.
template <class Pred>
__device__ int64_t first_true(const double* cum, int64_t lo, int64_t hi, Pred pred) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (pred(cum[mid])) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Steps 4-8 for rows with temperature > 0; keys/ids are the rows sorted by (logit desc, id asc).
__global__ void __launch_bounds__(kDrawThreads) draw_kernel(const RowParams* params, const float* sorted_keys, const int32_t* sorted_ids,
                            double* cum_all, int64_t V, int32_t* tokens) {
  using BlockScan = cub::BlockScan<double, kDrawThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int r = blockIdx.x;
  const RowParams p = params[r];
  if (p.temperature == 0.f) return;
  const float* keys = sorted_keys + int64_t(r) * V;
  const int32_t* ids = sorted_ids + int64_t(r) * V;
  double* cum = cum_all + int64_t(r) * V;
  const int64_t count = (p.top_k > 0 && p.top_k < V) ? p.top_k : V;
  const double m = double(keys[0]);
  if (!(m > -INFINITY)) {  // everything masked
    if (threadIdx.x == 0) tokens[r] = ids[0];
    return;
  }
  // Running sums of exp(l_i - m) over the candidates, in double.
  double carry = 0.0;
  for (int64_t base = 0; base < count; base += int64_t(kDrawThreads) * kItems) {
    double e[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + int64_t(threadIdx.x) * kItems + j;
      e[j] = i < count ? exp(double(keys[i]) - m) : 0.0;
      if (j > 0) e[j] += e[j - 1];
    }
    double before = 0.0, tile_total = 0.0;
    BlockScan(scan_storage).ExclusiveSum(e[kItems - 1], before, tile_total);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + int64_t(threadIdx.x) * kItems + j;
      if (i < count) cum[i] = carry + (before + e[j]);
    }
    carry += tile_total;
    __syncthreads();  // scan_storage reuse; cum visible to thread 0 below
  }
  if (threadIdx.x != 0) return;
  int64_t kept = count;
  if (p.top_p < 1.f) {
    const double threshold = double(p.top_p) * cum[count - 1];
    kept = std::min<int64_t>(count, first_true(cum, 0, count, [&](double c) { return c >= threshold; }) + 1);
  }
  const double total = cum[kept - 1];
  const Philox4x32 rnd = philox_draw(p.seed, p.step, p.sample_index);
  const double target = uniform_double(rnd.v[0], rnd.v[1]) * total;
  int64_t pick = first_true(cum, 0, kept, [&](double c) { return c > target; });
  if (pick >= kept) {  // rounding left none: the last candidate that raised the sum
    pick = kept - 1;
    while (pick > 0 && !(cum[pick] > cum[pick - 1])) --pick;
  }
  tokens[r] = ids[pick];
}

__global__ void iota_rows_kernel(int32_t* out, int64_t rows, int64_t V) {
  const int64_t n = rows * V;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = int32_t(i % V);
}

}  // namespace

void argmax_rows(int32_t* tokens, const float* logits, int64_t rows, int64_t V, cudaStream_t stream) {
  if (rows <= 0) return;
  LAUNCH_PDL("argmax_kernel", argmax_kernel, dim3(unsigned(rows)), dim3(kThreads), 0, stream, tokens, logits, V);
}

GpuSampler::GpuSampler(const std::string& owner, int64_t max_rows, int64_t vocab_size)
    : owner_(owner), max_rows_(max_rows), vocab_(vocab_size) {
  if (max_rows <= 0 || vocab_size <= 0 || max_rows * vocab_size >= (int64_t(1) << 31))
    throw Error(owner + ": sampler sizes out of range (" + std::to_string(max_rows) + " rows x " +
                std::to_string(vocab_size) + ")");
  const size_t n = size_t(max_rows * vocab_size);
  sorted_keys_ = device_alloc(n * sizeof(float), owner, "sampler sorted logits");
  sorted_ids_ = device_alloc(n * sizeof(int32_t), owner, "sampler sorted ids");
  iota_ = device_alloc(n * sizeof(int32_t), owner, "sampler ids");
  cum_ = device_alloc(n * sizeof(double), owner, "sampler running sums");
  offsets_ = device_alloc(size_t(2 * max_rows) * sizeof(int), owner, "sampler segments");
  params_dev_ = device_alloc(size_t(max_rows) * sizeof(RowParams), owner, "sampler parameters");
  params_host_ = PinnedBuffer(size_t(max_rows) * sizeof(RowParams), "sampler parameters");
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, temp_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(n), int(max_rows),
      static_cast<const int*>(nullptr), static_cast<const int*>(nullptr), 0, 32));
  cub_temp_ = device_alloc(std::max<size_t>(temp_bytes, 256), owner, "sampler sort workspace");
  iota_rows_kernel<<<1024, 256>>>(iota_.as<int32_t>(), max_rows, vocab_size);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  argmax_partial_ = device_alloc(size_t(max_rows * kArgmaxSplit) * sizeof(ArgMax), owner, "argmax workspace");
  argmax_counters_ = device_alloc(size_t(max_rows) * sizeof(int), owner, "argmax counters");
  CUDA_CHECK(cudaMemset(argmax_counters_.get(), 0, argmax_counters_.bytes()));
  CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  ensure_list_capacity(4096);
  // The top-k select keeps a slice's keys in shared memory where the device lets a block have
  // that much beside the kernel's own; the merge sorts up to kMaxSlices x kSelectMax
  // candidates there.
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  CUDA_CHECK(cudaFuncGetAttributes(&attr, topk_slice_kernel));
  const size_t slice_bytes = size_t(slice_keys(vocab_size)) * sizeof(uint32_t);
  if (slice_bytes + attr.sharedSizeBytes <= size_t(optin)) {
    select_smem_ = slice_bytes;
    CUDA_CHECK(cudaFuncSetAttribute(topk_slice_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(slice_bytes)));
  }
  merge_smem_ = size_t(select_slices(vocab_size)) * kSelectMax * sizeof(unsigned long long);
  CUDA_CHECK(cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(merge_smem_)));
  slice_candidates_ = device_alloc(size_t(max_rows * select_slices(vocab_size) * kSelectMax) * sizeof(unsigned long long),
                                   owner, "sampler top-k candidates");
}

void GpuSampler::argmax(int32_t* tokens, const float* logits, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return;
  if (rows > max_rows_ || rows > 65535)
    throw Error(owner_ + ": argmax of " + std::to_string(rows) + " rows, built for " + std::to_string(max_rows_));
  LAUNCH_PDL("argmax_split_kernel", argmax_split_kernel, dim3{unsigned(rows), unsigned(kArgmaxSplit), 1u},
             dim3(kArgmaxThreads), 0, stream, tokens, logits, vocab_, argmax_partial_.as<ArgMax>(),
             argmax_counters_.as<int>());
}

GpuSampler::~GpuSampler() {
  if (copied_) {
    cudaEventSynchronize(copied_);
    cudaEventDestroy(copied_);
  }
}

int64_t GpuSampler::device_bytes() const {
  return int64_t(sorted_keys_.bytes() + sorted_ids_.bytes() + iota_.bytes() + cum_.bytes() + offsets_.bytes() +
                 slice_candidates_.bytes() +
                 cub_temp_.bytes() + params_dev_.bytes() + lists_dev_.bytes() + argmax_partial_.bytes() +
                 argmax_counters_.bytes());
}

void GpuSampler::ensure_list_capacity(int64_t ints) {
  if (ints <= list_capacity_) return;
  const int64_t cap = std::max<int64_t>(ints, 2 * list_capacity_);
  CUDA_CHECK(cudaEventSynchronize(copied_));  // the old host buffer may still be in a copy
  lists_dev_ = device_alloc(size_t(cap) * sizeof(int32_t), owner_, "sampler penalty lists");
  lists_host_ = PinnedBuffer(size_t(cap) * sizeof(int32_t), "sampler penalty lists");
  list_capacity_ = cap;
}

bool GpuSampler::needs_sampler(const SamplingParams& p, size_t generated_len) {
  return p.temperature != 0.f || p.repetition_penalty != 1.f || p.presence_penalty != 0.f ||
         p.frequency_penalty != 0.f || !p.logit_bias.empty() || generated_len < size_t(std::max(p.min_tokens, 0));
}

namespace {

// One row's parameters for the kernels; its logit_bias, repetition ids, (id, count) pairs and
// masked stop ids appended to `lists` (scratch: the caller's, reused between rows).
RowParams row_params(const SampleRow& row, std::vector<int32_t>& lists, std::vector<int32_t>& scratch) {
  RowParams p{};  // zeros, padding included, as the vector of them was
  const SamplingParams& sp = *row.params;
  p.temperature = sp.temperature;
  p.top_p = sp.top_p;
  p.top_k = sp.top_k;
  p.repetition = sp.repetition_penalty;
  p.presence = sp.presence_penalty;
  p.frequency = sp.frequency_penalty;
  p.seed = sp.seed;
  p.step = uint64_t(row.generated.size());
  p.sample_index = row.sample_index;
  p.bias_begin = int32_t(lists.size());
  for (const auto& [id, bias] : sp.logit_bias) {  // the bias travels as its float bits
    int32_t bits;
    std::memcpy(&bits, &bias, sizeof bits);
    lists.push_back(id);
    lists.push_back(bits);
  }
  p.bias_end = int32_t(lists.size());
  p.rep_begin = p.rep_end = int32_t(lists.size());
  if (sp.repetition_penalty != 1.f) {
    scratch.assign(row.prompt.begin(), row.prompt.end());
    scratch.insert(scratch.end(), row.generated.begin(), row.generated.end());
    std::sort(scratch.begin(), scratch.end());
    scratch.erase(std::unique(scratch.begin(), scratch.end()), scratch.end());
    lists.insert(lists.end(), scratch.begin(), scratch.end());
    p.rep_end = int32_t(lists.size());
  }
  p.freq_begin = p.freq_end = int32_t(lists.size());
  if (sp.presence_penalty != 0.f || sp.frequency_penalty != 0.f) {
    scratch.assign(row.generated.begin(), row.generated.end());
    std::sort(scratch.begin(), scratch.end());
    for (size_t i = 0; i < scratch.size();) {
      size_t j = i;
      while (j < scratch.size() && scratch[j] == scratch[i]) ++j;
      lists.push_back(scratch[i]);
      lists.push_back(int32_t(j - i));
      i = j;
    }
    p.freq_end = int32_t(lists.size());
  }
  p.stop_begin = p.stop_end = int32_t(lists.size());
  if (row.generated.size() < size_t(std::max(sp.min_tokens, 0))) {
    lists.insert(lists.end(), sp.stop_token_ids.begin(), sp.stop_token_ids.end());
    p.stop_end = int32_t(lists.size());
  }
  return p;
}

}  // namespace

void GpuSampler::sample(float* logits, std::span<const SampleRow> rows, int32_t* tokens, cudaStream_t stream) {
  const int64_t n = int64_t(rows.size());
  if (n == 0) return;
  if (n > max_rows_)
    throw Error(owner_ + ": sampler asked for " + std::to_string(n) + " rows, built for " + std::to_string(max_rows_));

  // Bias and penalty lists, as apply_penalties builds them (distinct ids; (id, count) pairs).
  thread_local std::vector<int32_t> lists, scratch;
  lists.clear();
  std::vector<RowParams> params(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    const SampleRow& row = rows[size_t(r)];
    if (row.params == nullptr) throw Error(owner_ + ": sampler row " + std::to_string(r) + " has no parameters");
    params[size_t(r)] = row_params(row, lists, scratch);
  }

  // The previous call's copies must be done before the pinned buffers are rewritten.
  CUDA_CHECK(cudaEventSynchronize(copied_));
  ensure_list_capacity(std::max<int64_t>(1, int64_t(lists.size())));
  std::memcpy(params_host_.get(), params.data(), params.size() * sizeof(RowParams));
  if (!lists.empty()) std::memcpy(lists_host_.get(), lists.data(), lists.size() * sizeof(int32_t));
  CUDA_CHECK(cudaMemcpyAsync(params_dev_.get(), params_host_.get(), params.size() * sizeof(RowParams),
                             cudaMemcpyHostToDevice, stream));
  if (!lists.empty())
    CUDA_CHECK(cudaMemcpyAsync(lists_dev_.get(), lists_host_.get(), lists.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaEventRecord(copied_, stream));

  const auto* pd = params_dev_.as<RowParams>();
  int* seg_begin = offsets_.as<int>();
  int* seg_end = seg_begin + max_rows_;
  prepare_kernel<<<unsigned(n), kThreads, 0, stream>>>(logits, pd, lists_dev_.as<int32_t>(), vocab_, tokens,
                                                       seg_begin, seg_end);
  CUDA_CHECK(cudaGetLastError());
  // Rows that sample: a top-k small enough is selected, any other is radix sorted whole.
  bool any_select = false, any_sort = false;
  for (const RowParams& p : params) {
    if (p.temperature == 0.f) continue;
    const bool select = selects_top_k(p, vocab_);
    any_select = any_select || select;
    any_sort = any_sort || !select;
  }
  if (any_sort) {
    size_t temp_bytes = 0;
    const int items = int(n * vocab_);
    CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        nullptr, temp_bytes, static_cast<const float*>(logits), sorted_keys_.as<float>(), iota_.as<int32_t>(),
        sorted_ids_.as<int32_t>(), items, int(n), seg_begin, seg_end, 0, 32, stream));
    if (temp_bytes > cub_temp_.bytes()) throw Error(owner_ + ": sampler sort workspace too small");
    temp_bytes = cub_temp_.bytes();
    CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        cub_temp_.get(), temp_bytes, static_cast<const float*>(logits), sorted_keys_.as<float>(),
        static_cast<const int32_t*>(iota_.as<int32_t>()), sorted_ids_.as<int32_t>(), items, int(n), seg_begin,
        seg_end, 0, 32, stream));
  }
  if (any_select) {
    auto* candidates = slice_candidates_.as<unsigned long long>();
    topk_slice_kernel<<<dim3(unsigned(n), unsigned(select_slices(vocab_))), kSliceThreads, select_smem_, stream>>>(
        logits, pd, vocab_, select_smem_ > 0, candidates);
    CUDA_CHECK(cudaGetLastError());
    topk_merge_kernel<<<unsigned(n), kMergeThreads, merge_smem_, stream>>>(pd, vocab_, candidates,
                                                                          sorted_keys_.as<float>(),
                                                                          sorted_ids_.as<int32_t>());
    CUDA_CHECK(cudaGetLastError());
  }
  draw_kernel<<<unsigned(n), kDrawThreads, 0, stream>>>(pd, sorted_keys_.as<float>(), sorted_ids_.as<int32_t>(),
                                                    cum_.as<double>(), vocab_, tokens);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace conveyor::cuda

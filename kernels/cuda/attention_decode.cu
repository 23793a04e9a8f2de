// Masked multi-head attention for decode (one query row per sequence), reading the K/V cache.
//
// Grid (head, sequence, split); 128 threads. Within a block the threads form groups of G
// lanes (G = head_dim / 8 rounded up to a power of two: 16 for head_dim 128); a group holds
// one cached position at a time, each lane 16 bytes of its K and of its V, and keeps its
// own online-softmax state (running max m, sum l, output accumulator) in registers, so K
// and V are read in one pass and no score array exists. The groups then merge through
// shared memory; with num_splits > 1 the blocks of one (sequence, head) merge through a
// global workspace, the last block to finish doing it (threadfence + counter). The fused
// append (paged mode) has split 0 copy the new token's K/V into the cache while every
// block reads that one position straight from qkv, so no block reads what another writes.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_kv.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace conveyor::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 128;
constexpr int kMaxSplits = 16;

template <class T, int VEC>
__device__ __forceinline__ void load_chunk(const T* p, int d0, int D, float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    if (d0 < D) {
      unpack8<T>(*reinterpret_cast<const uint4*>(p + d0), f);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = 0.f;
    }
  } else {
    f[0] = d0 < D ? to_float(p[d0]) : 0.f;
  }
}

// Loads the K and V of U positions per group (base + u * ngroups + group) into registers;
// positions at or past t_end are zero and marked invalid. The new position t_new (paged
// mode) comes from qkv, and only when new_ready (it is written by the kernel before).
template <class T, int VEC, int MAXC, int U, bool APPEND, class Kv>
__device__ __forceinline__ void load_batch(float (&kf)[U][MAXC][VEC], float (&vf)[U][MAXC][VEC], bool (&valid)[U],
                                           const Kv& kv, const T* new_k, const T* new_v, int s, int h, int base,
                                           int ngroups, int group, int gl, int G, int D, int t_end, int t_new,
                                           bool new_ready) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = base + u * ngroups + group;
    valid[u] = t < t_end;
    const T* kp = nullptr;
    const T* vp = nullptr;
    if (valid[u]) {
      if (APPEND && t == t_new) {
        if (new_ready) kp = new_k, vp = new_v;
      } else {
        kp = kv.key(s, h, t);
        vp = kv.value(s, h, t);
      }
    }
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      const int d0 = (gl + c * G) * VEC;
      load_chunk<T, VEC>(kp, kp ? d0 : D, D, kf[u][c]);
      load_chunk<T, VEC>(vp, vp ? d0 : D, D, vf[u][c]);
    }
  }
}

// Paged mode (APPEND) relies on this: the cached positions before kv_len - 1 of this layer
// were written by earlier steps, which a host copy separates from this step, and the step
// metadata (kv_lens, block tables) too; so the block reads kv_len, the tables and its first
// batch of K/V before grid_dependency_wait(), overlapping the QKV projection's tail. Only q
// and the new token's K/V, the QKV projection's output, wait.
template <class T, int VEC, int MAXC, bool APPEND, class Kv>
__global__ void __launch_bounds__(kThreads)
    attention_decode_kernel(T* __restrict__ out, const T* q_base, int64_t q_stride, Kv kv,
                            const int32_t* __restrict__ kv_lens, int fixed_kv_len, int n_head, int D, int G,
                            float scale, int num_splits, float* partial, int* counters) {
  extern __shared__ float sm[];  // [ngroups][D + 2]: m, l, acc[D]
  __shared__ int is_last;
  grid_dependents_launch();
  if constexpr (!APPEND) grid_dependency_wait();  // contiguous K/V may come from the kernel before
  const int h = blockIdx.x, s = blockIdx.y, split = blockIdx.z;
  const int kv_len = kv_lens != nullptr ? kv_lens[s] : fixed_kv_len;
  if (kv_len <= 0) return;  // padding row: every block of it leaves, no counter touched
  const int C = n_head * D;
  const T* q = q_base + int64_t(s) * q_stride + int64_t(h) * D;
  const T* new_k = q + C;
  const T* new_v = q + 2 * C;
  const int ngroups = blockDim.x / G;
  const int group = threadIdx.x / G, gl = threadIdx.x % G;

  int chunk = (kv_len + num_splits - 1) / num_splits;
  chunk = (chunk + kPageTokens - 1) / kPageTokens * kPageTokens;
  const int t_begin = min(kv_len, split * chunk), t_end = min(kv_len, t_begin + chunk);
  const int t_new = APPEND ? kv_len - 1 : -1;

  constexpr int U = MAXC >= 4 ? 1 : 4 / MAXC;  // positions per group per step (loads in flight)
  const int step = ngroups * U;
  float kf[U][MAXC][VEC], vf[U][MAXC][VEC];
  bool valid[U];
  load_batch<T, VEC, MAXC, U, APPEND>(kf, vf, valid, kv, new_k, new_v, s, h, t_begin, ngroups, group, gl, G, D, t_end,
                                      t_new, /*new_ready=*/!APPEND);
  if constexpr (APPEND) {
    grid_dependency_wait();  // q and the new K/V are the QKV projection's output
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t_begin + u * ngroups + group == t_new && t_new < t_end) {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          load_chunk<T, VEC>(new_k, (gl + c * G) * VEC, D, kf[u][c]);
          load_chunk<T, VEC>(new_v, (gl + c * G) * VEC, D, vf[u][c]);
        }
      }
    }
    if (split == 0) {
      T* kd = kv.k + kv.offset(s, h, t_new);
      T* vd = kv.v + kv.offset(s, h, t_new);
      for (int i = threadIdx.x; i < D; i += blockDim.x) {
        kd[i] = new_k[i];
        vd[i] = new_v[i];
      }
    }
  }

  float qf[MAXC][VEC];
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    load_chunk<T, VEC>(q, (gl + c * G) * VEC, D, qf[c]);
#pragma unroll
    for (int j = 0; j < VEC; ++j) qf[c][j] *= scale;
  }
  float m = -INFINITY, l = 0.f;
  float acc[MAXC][VEC];
#pragma unroll
  for (int c = 0; c < MAXC; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[c][j] = 0.f;

  // The loop bound is uniform over the block, so every lane reaches every shuffle.
  for (int base = t_begin; base < t_end; base += step) {
    if (base != t_begin)
      load_batch<T, VEC, MAXC, U, APPEND>(kf, vf, valid, kv, new_k, new_v, s, h, base, ngroups, group, gl, G, D, t_end,
                                          t_new, /*new_ready=*/true);
    float dot[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dot[u] = 0.f;
#pragma unroll
      for (int c = 0; c < MAXC; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot[u] = fmaf(qf[c][j], kf[u][c][j], dot[u]);
      for (int o = G >> 1; o > 0; o >>= 1) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!valid[u]) continue;
      const float m_new = fmaxf(m, dot[u]);
      const float corr = expf(m - m_new);  // 0 when m was -inf
      const float p = expf(dot[u] - m_new);
      l = l * corr + p;
#pragma unroll
      for (int c = 0; c < MAXC; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[c][j] = fmaf(p, vf[u][c][j], acc[c][j] * corr);
      m = m_new;
    }
  }

  // Merge the groups of this block.
  float* mine = sm + group * (D + 2);
  if (gl == 0) {
    mine[0] = m;
    mine[1] = l;
  }
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int d0 = (gl + c * G) * VEC;
    if (d0 < D)
#pragma unroll
      for (int j = 0; j < VEC; ++j) mine[2 + d0 + j] = acc[c][j];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int g = 0; g < ngroups; ++g) M = fmaxf(M, sm[g * (D + 2)]);
  float L = 0.f;
  for (int g = 0; g < ngroups; ++g) {
    const float mg = sm[g * (D + 2)];
    if (mg != -INFINITY) L += sm[g * (D + 2) + 1] * expf(mg - M);
  }
  T* o = out + int64_t(s) * C + int64_t(h) * D;
  if (num_splits == 1) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      float acc_i = 0.f;
      for (int g = 0; g < ngroups; ++g) {
        const float mg = sm[g * (D + 2)];
        if (mg != -INFINITY) acc_i += sm[g * (D + 2) + 2 + i] * expf(mg - M);
      }
      o[i] = from_float<T>(acc_i / L);
    }
    return;
  }

  // Several splits: write this block's (M, L, O[D]) and let the last block merge them.
  float* parts = partial + (int64_t(s) * n_head + h) * num_splits * (D + 2);
  float* part = parts + int64_t(split) * (D + 2);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float acc_i = 0.f;
    for (int g = 0; g < ngroups; ++g) {
      const float mg = sm[g * (D + 2)];
      if (mg != -INFINITY) acc_i += sm[g * (D + 2) + 2 + i] * expf(mg - M);
    }
    part[2 + i] = acc_i;
  }
  if (threadIdx.x == 0) {
    part[0] = M;
    part[1] = L;
  }
  __threadfence();  // this block's partial is visible device-wide before the counter moves
  __syncthreads();
  int* counter = counters + int64_t(s) * n_head + h;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == num_splits - 1;
  __syncthreads();
  if (!is_last) return;
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (next layer, next step)
  __threadfence();
  float Ms = -INFINITY;
  for (int sp = 0; sp < num_splits; ++sp) Ms = fmaxf(Ms, __ldcg(parts + sp * (D + 2)));
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int sp = 0; sp < num_splits; ++sp) {
      const float ms = __ldcg(parts + sp * (D + 2));
      if (ms == -INFINITY) continue;  // an empty piece
      const float w = expf(ms - Ms);
      num += __ldcg(parts + sp * (D + 2) + 2 + i) * w;
      den += __ldcg(parts + sp * (D + 2) + 1) * w;
    }
    o[i] = from_float<T>(num / den);
  }
}

int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

template <class T, bool APPEND, class Kv>
void launch_decode(T* out, const T* q, int64_t q_stride, const Kv& kv, const int32_t* kv_lens, int fixed_kv_len,
                   int64_t rows, int64_t n_head, int64_t D, int num_splits, float* partial, int* counters,
                   bool vec, cudaStream_t stream) {
  if (rows <= 0) return;
  if (rows > 65535) throw Error("attention_decode: more than 65535 rows in one launch");
  const int nch = int(vec ? D / kVec : D);
  const int G = std::min(32, next_pow2(nch));
  const int maxc = (nch + G - 1) / G;
  const size_t smem = size_t(kThreads / G) * size_t(D + 2) * sizeof(float);
  const dim3 grid{unsigned(n_head), unsigned(rows), unsigned(num_splits)};
  const float scale = 1.f / std::sqrt(float(D));
  const int nh = int(n_head), d = int(D);
#define CONVEYOR_DECODE_LAUNCH(V, M)                                                                          \
  LAUNCH_PDL("attention_decode_kernel", attention_decode_kernel<T, V, M, APPEND, Kv>, grid, dim3(kThreads), smem, \
             stream, out, q, q_stride, kv, kv_lens, fixed_kv_len, nh, d, G, scale, num_splits, partial, counters)
  if (vec) {
    if (maxc == 1) CONVEYOR_DECODE_LAUNCH(8, 1);
    else if (maxc == 2) CONVEYOR_DECODE_LAUNCH(8, 2);
    else if (maxc <= 4) CONVEYOR_DECODE_LAUNCH(8, 4);
    else throw Error("attention_decode: head_dim " + std::to_string(D) + " > 1024");
  } else {
    if (maxc == 1) CONVEYOR_DECODE_LAUNCH(1, 1);
    else if (maxc == 2) CONVEYOR_DECODE_LAUNCH(1, 2);
    else if (maxc <= 4) CONVEYOR_DECODE_LAUNCH(1, 4);
    else if (maxc <= 8) CONVEYOR_DECODE_LAUNCH(1, 8);
    else throw Error("attention_decode: head_dim " + std::to_string(D) + " not a multiple of 8 and > 256");
  }
#undef CONVEYOR_DECODE_LAUNCH
}

}  // namespace

int64_t decode_partial_floats(int64_t rows, int64_t n_head, int64_t head_dim, int num_splits) {
  return num_splits > 1 ? rows * n_head * num_splits * (head_dim + 2) : 0;
}

int decode_splits_for(int64_t rows, int64_t n_head, int64_t max_kv_len, int num_sms) {
  const int64_t blocks = std::max<int64_t>(1, rows * n_head);
  int64_t splits = (2 * int64_t(num_sms) + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, (max_kv_len + 63) / 64));
  return int(std::clamp<int64_t>(splits, 1, kMaxSplits));
}

template <class T>
void attention_decode(T* out, const T* q, const T* k, const T* v, int64_t kv_stride, int64_t kv_len,
                      int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (kv_len <= 0 || n_head <= 0 || head_dim <= 0) return;
  const bool vec = head_dim % kVec == 0 && kv_stride % kVec == 0 && aligned16(q) && aligned16(k) &&
                   aligned16(v) && aligned16(out);
  const ContiguousKv<T> kv{k, v, kv_stride, int(head_dim)};
  launch_decode<T, false>(out, q, 0, kv, nullptr, int(kv_len), 1, n_head, head_dim, 1, nullptr, nullptr, vec,
                          stream);
}

template <class T>
void attention_decode_paged(T* out, const T* qkv, const KvLayerView& view, const int32_t* kv_lens,
                            int64_t num_rows, int64_t n_head, int64_t head_dim, int num_splits,
                            const DecodeWorkspace& ws, cudaStream_t stream) {
  if (num_rows <= 0) return;
  if (num_splits < 1 || num_splits > kMaxSplits) throw Error("attention_decode_paged: bad num_splits");
  if (num_splits > 1 &&
      (decode_partial_floats(num_rows, n_head, head_dim, num_splits) > ws.partial_floats ||
       num_rows * n_head > ws.counter_entries || !ws.partial || !ws.counters))
    throw Error("attention_decode_paged: workspace too small for " + std::to_string(num_rows) + " rows x " +
                std::to_string(num_splits) + " splits");
  const int64_t C = n_head * head_dim;
  const bool vec = head_dim % kVec == 0 && aligned16(qkv) && aligned16(out) && aligned16(view.k) &&
                   aligned16(view.v);
  launch_decode<T, true>(out, qkv, 3 * C, paged<T>(view, int(head_dim)), kv_lens, 0, num_rows, n_head, head_dim,
                         num_splits, ws.partial, ws.counters, vec, stream);
}

template void attention_decode<half>(half*, const half*, const half*, const half*, int64_t, int64_t, int64_t,
                                     int64_t, cudaStream_t);
template void attention_decode<bf16>(bf16*, const bf16*, const bf16*, const bf16*, int64_t, int64_t, int64_t,
                                     int64_t, cudaStream_t);
template void attention_decode_paged<half>(half*, const half*, const KvLayerView&, const int32_t*, int64_t,
                                           int64_t, int64_t, int, const DecodeWorkspace&, cudaStream_t);
template void attention_decode_paged<bf16>(bf16*, const bf16*, const KvLayerView&, const int32_t*, int64_t,
                                           int64_t, int64_t, int, const DecodeWorkspace&, cudaStream_t);

}  // namespace conveyor::cuda

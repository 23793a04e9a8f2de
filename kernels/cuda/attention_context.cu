// Causal attention for the context phase (prefill), flash-attention style: one block of 4
// warps per (64-query tile, head, sequence) walks the keys in 64-position tiles, keeping
// the running max and sum per query row and the output accumulator, so memory stays
// O(tile) whatever the prompt length. Both products run on the tensor cores through wmma
// (16x16x16, fp16/bf16 operands, fp32 accumulation): S = Q K^T and O += P V.
//
// Shared memory per block (DP = head_dim rounded up to 32/64/128/256; padding columns are
// zero so they add nothing to the dot products):
//   sQ, sK, sV [64][DP + 8] (T)   sS [64][68] (fp32)   sP [64][72] (T)   sO [64][DP + 4] (fp32)
// Warp w owns query rows 16w..16w+15 of S, P and O, so only the K/V tile loads need a block
// barrier; the rest is ordered by __syncwarp. The wmma accumulator's element-to-row mapping
// is unspecified, so the per-row rescale of O happens in shared memory (sO), not registers.
//
// Key tiles always start at position 0 and step by 64, whatever the query tile, so a query
// row's result does not depend on how the prompt was chunked.
#include <mma.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_kv.cuh"
#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace conveyor::cuda {
namespace {

using namespace detail;
namespace wmma = nvcuda::wmma;

constexpr int kBr = 64;  // query rows per block
constexpr int kBc = 64;  // keys per tile
constexpr int kThreads = 128;
constexpr int kLdS = kBc + 4;
constexpr int kLdP = kBc + 8;

template <int DP>
constexpr size_t flash_smem_bytes(size_t elem) {
  return 3 * kBr * (DP + 8) * elem + kBr * kLdS * 4 + kBr * kLdP * elem + kBr * (DP + 4) * 4;
}

// Loads up to kBr rows of D elements into a [kBr][DP + 8] tile; row r comes from row_ptr(r)
// when r < nrows, zeros elsewhere (padding rows and columns D..DP).
template <class T, int DP, class RowPtr>
__device__ __forceinline__ void load_tile(T* tile, int nrows, int D, bool vec, RowPtr row_ptr) {
  constexpr int kLd = DP + 8;
  if (vec) {
    constexpr int kChunks = DP / kVec;
    for (int idx = threadIdx.x; idx < kBr * kChunks; idx += blockDim.x) {
      const int r = idx / kChunks, d0 = (idx % kChunks) * kVec;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < nrows && d0 < D) val = *reinterpret_cast<const uint4*>(row_ptr(r) + d0);
      *reinterpret_cast<uint4*>(tile + r * kLd + d0) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < kBr * DP; idx += blockDim.x) {
      const int r = idx / DP, d = idx % DP;
      tile[r * kLd + d] = (r < nrows && d < D) ? row_ptr(r)[d] : from_float<T>(0.f);
    }
  }
}

// S[16w.., :] = Q[16w.., :] K^T: this warp's 16 query rows against the key tile, into sS.
template <class T, int DP>
__device__ __forceinline__ void warp_scores(float* sS, const T* sQ, const T* sK, int warp) {
  constexpr int kLdT = DP + 8;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBc / 16];
#pragma unroll
  for (int j = 0; j < kBc / 16; ++j) wmma::fill_fragment(acc[j], 0.f);
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
    wmma::load_matrix_sync(a, sQ + warp * 16 * kLdT + kk * 16, kLdT);
#pragma unroll
    for (int j = 0; j < kBc / 16; ++j) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
      wmma::load_matrix_sync(b, sK + j * 16 * kLdT + kk * 16, kLdT);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kBc / 16; ++j)
    wmma::store_matrix_sync(sS + warp * 16 * kLdS + j * 16, acc[j], kLdS, wmma::mem_row_major);
}

// Online softmax of this warp's 16 rows over the key tile at kt0 (causal: row r sees
// positions up to pos0 + r); lane owns columns lane and lane + 32. P goes to sP, the rows of
// sO are rescaled, m_row and l_row move on.
template <class T, int DP>
__device__ __forceinline__ void warp_online_softmax(float (&m_row)[16], float (&l_row)[16], T* sP, float* sO,
                                                    const float* sS, int warp, int lane, int pos0, int kt0, int n_kv,
                                                    float scale) {
  constexpr int kLdO = DP + 4;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = warp * 16 + i;
    const int qpos = pos0 + r;
    const int t_a = kt0 + lane, t_b = kt0 + lane + 32;
    const float sa = (t_a <= qpos && t_a < n_kv) ? sS[r * kLdS + lane] * scale : -INFINITY;
    const float sb = (t_b <= qpos && t_b < n_kv) ? sS[r * kLdS + lane + 32] * scale : -INFINITY;
    const float m_new = fmaxf(m_row[i], warp_max(fmaxf(sa, sb)));
    float alpha = 1.f, pa = 0.f, pb = 0.f;
    if (m_new != -INFINITY) {
      alpha = expf(m_row[i] - m_new);
      pa = expf(sa - m_new);
      pb = expf(sb - m_new);
    }
    l_row[i] = l_row[i] * alpha + warp_sum(pa + pb);
    m_row[i] = m_new;
    sP[r * kLdP + lane] = from_float<T>(pa);
    sP[r * kLdP + lane + 32] = from_float<T>(pb);
    if (alpha != 1.f)
      for (int d = lane; d < DP; d += 32) sO[r * kLdO + d] *= alpha;
  }
}

// O[16w.., :] += P[16w.., :] V for this warp's 16 rows.
template <class T, int DP>
__device__ __forceinline__ void warp_accumulate_pv(float* sO, const T* sP, const T* sV, int warp) {
  constexpr int kLdT = DP + 8, kLdO = DP + 4;
#pragma unroll
  for (int dj = 0; dj < DP / 16; ++dj) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
    wmma::load_matrix_sync(o, sO + warp * 16 * kLdO + dj * 16, kLdO, wmma::mem_row_major);
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
      wmma::load_matrix_sync(a, sP + warp * 16 * kLdP + kk * 16, kLdP);
      wmma::load_matrix_sync(b, sV + kk * 16 * kLdT + dj * 16, kLdT);
      wmma::mma_sync(o, a, b, o);
    }
    wmma::store_matrix_sync(sO + warp * 16 * kLdO + dj * 16, o, kLdO, wmma::mem_row_major);
  }
}

template <class T, int DP, class Kv>
__global__ void __launch_bounds__(kThreads)
    flash_attention_kernel(T* __restrict__ out, const T* q_base, int64_t q_stride, Kv kv,
                           const int32_t* __restrict__ q_begins, const int32_t* __restrict__ q_lens,
                           const int32_t* __restrict__ kv_lens, int fixed_q_len, int fixed_kv_len, int n_head,
                           int D, float scale, bool vec) {
  constexpr int kLdT = DP + 8, kLdO = DP + 4;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBr * kLdT;
  T* sV = sK + kBc * kLdT;
  float* sS = reinterpret_cast<float*>(sV + kBc * kLdT);
  T* sP = reinterpret_cast<T*>(sS + kBr * kLdS);
  float* sO = reinterpret_cast<float*>(sP + kBr * kLdP);

  grid_dependents_launch();
  grid_dependency_wait();
  const int s = blockIdx.z, h = blockIdx.y;
  const int q_len = q_lens != nullptr ? q_lens[s] : fixed_q_len;
  const int q0 = blockIdx.x * kBr;
  if (q0 >= q_len) return;  // whole block
  const int kv_len = kv_lens != nullptr ? kv_lens[s] : fixed_kv_len;
  const int q_begin = q_begins != nullptr ? q_begins[s] : 0;
  const int rows = min(kBr, q_len - q0);
  const int pos0 = kv_len - q_len + q0;  // position of tile row 0
  const int n_kv = pos0 + rows;          // keys [0, n_kv) are visible to some row of the tile
  const int C = n_head * D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  load_tile<T, DP>(sQ, rows, D, vec, [&](int r) { return q_base + int64_t(q_begin + q0 + r) * q_stride + int64_t(h) * D; });
  for (int i = threadIdx.x; i < kBr * kLdO; i += blockDim.x) sO[i] = 0.f;

  float m_row[16], l_row[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) m_row[i] = -INFINITY, l_row[i] = 0.f;

  for (int kt0 = 0; kt0 < n_kv; kt0 += kBc) {
    const int nk = min(kBc, n_kv - kt0);
    __syncthreads();  // the previous tile's readers of sK/sV are done (and sQ/sO are written)
    load_tile<T, DP>(sK, nk, D, vec, [&](int r) { return kv.key(s, h, kt0 + r); });
    load_tile<T, DP>(sV, nk, D, vec, [&](int r) { return kv.value(s, h, kt0 + r); });
    __syncthreads();
    warp_scores<T, DP>(sS, sQ, sK, warp);
    __syncwarp();
    warp_online_softmax<T, DP>(m_row, l_row, sP, sO, sS, warp, lane, pos0, kt0, n_kv, scale);
    __syncwarp();
    warp_accumulate_pv<T, DP>(sO, sP, sV, warp);
    __syncwarp();
  }

#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = warp * 16 + i;
    if (r >= rows) continue;
    const float inv = 1.f / l_row[i];
    T* o = out + int64_t(q_begin + q0 + r) * C + int64_t(h) * D;
    for (int d = lane; d < D; d += 32) o[d] = from_float<T>(sO[r * kLdO + d] * inv);
  }
}

template <class T, int DP, class Kv>
void launch_flash_dp(T* out, const T* q, int64_t q_stride, const Kv& kv, const int32_t* q_begins,
                     const int32_t* q_lens, const int32_t* kv_lens, int fixed_q_len, int fixed_kv_len,
                     int64_t max_q_len, int64_t num_seqs, int64_t n_head, int64_t D, bool vec,
                     cudaStream_t stream) {
  const size_t smem = flash_smem_bytes<DP>(sizeof(T));
  auto kernel = flash_attention_kernel<T, DP, Kv>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid{unsigned((max_q_len + kBr - 1) / kBr), unsigned(n_head), unsigned(num_seqs)};
  LAUNCH_PDL("flash_attention_kernel", kernel, grid, dim3(kThreads), smem, stream, out, q, q_stride, kv, q_begins, q_lens,
             kv_lens, fixed_q_len, fixed_kv_len, int(n_head), int(D), 1.f / std::sqrt(float(D)), vec);
}

template <class T, class Kv>
void launch_flash(T* out, const T* q, int64_t q_stride, const Kv& kv, const int32_t* q_begins,
                  const int32_t* q_lens, const int32_t* kv_lens, int fixed_q_len, int fixed_kv_len,
                  int64_t max_q_len, int64_t num_seqs, int64_t n_head, int64_t D, bool vec, cudaStream_t stream) {
  if (max_q_len <= 0 || num_seqs <= 0) return;
  if (num_seqs > 65535 || n_head > 65535) throw Error("attention_context: too many sequences or heads");
  if (D <= 32)
    launch_flash_dp<T, 32>(out, q, q_stride, kv, q_begins, q_lens, kv_lens, fixed_q_len, fixed_kv_len, max_q_len,
                           num_seqs, n_head, D, vec, stream);
  else if (D <= 64)
    launch_flash_dp<T, 64>(out, q, q_stride, kv, q_begins, q_lens, kv_lens, fixed_q_len, fixed_kv_len, max_q_len,
                           num_seqs, n_head, D, vec, stream);
  else if (D <= 128)
    launch_flash_dp<T, 128>(out, q, q_stride, kv, q_begins, q_lens, kv_lens, fixed_q_len, fixed_kv_len,
                            max_q_len, num_seqs, n_head, D, vec, stream);
  else if (D <= 256)
    launch_flash_dp<T, 256>(out, q, q_stride, kv, q_begins, q_lens, kv_lens, fixed_q_len, fixed_kv_len,
                            max_q_len, num_seqs, n_head, D, vec, stream);
  else
    throw Error("attention_context: head_dim " + std::to_string(D) + " > 256");
}

}  // namespace

template <class T>
void attention_context(T* out, const T* q, int64_t q_stride, const T* k, const T* v, int64_t kv_stride,
                       int64_t q_len, int64_t kv_len, int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (q_len <= 0 || n_head <= 0 || head_dim <= 0) return;
  if (kv_len < q_len) throw Error("attention_context: kv_len < q_len");
  const bool vec = head_dim % kVec == 0 && q_stride % kVec == 0 && kv_stride % kVec == 0 && aligned16(q) &&
                   aligned16(k) && aligned16(v);
  const ContiguousKv<T> kv{k, v, kv_stride, int(head_dim)};
  launch_flash<T>(out, q, q_stride, kv, nullptr, nullptr, nullptr, int(q_len), int(kv_len), q_len, 1, n_head,
                  head_dim, vec, stream);
}

template <class T>
void attention_context_paged(T* out, const T* qkv, const KvLayerView& view, const SeqArrays& seqs,
                             int64_t max_q_len, int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  // The tile order is 3-5x faster than this kernel on the H100 (conveyor-bench-attention), and
  // in decode's order: fast mode takes it too where it exists.
  if (tile_order_head_dim(head_dim) || view.fp8())  // (FP8 K/V: the tile order or a clear error)
    return attention_context_fixed_paged<T>(out, qkv, view, seqs, max_q_len, n_head, head_dim, stream);
  const int64_t C = n_head * head_dim;
  const bool vec = head_dim % kVec == 0 && aligned16(qkv) && aligned16(view.k) && aligned16(view.v);
  launch_flash<T>(out, qkv, 3 * C, paged<T>(view, int(head_dim)), seqs.q_begins, seqs.q_lens, seqs.kv_lens, 0, 0,
                  max_q_len, seqs.num_seqs, n_head, head_dim, vec, stream);
}

template void attention_context<half>(half*, const half*, int64_t, const half*, const half*, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, cudaStream_t);
template void attention_context<bf16>(bf16*, const bf16*, int64_t, const bf16*, const bf16*, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, cudaStream_t);
template void attention_context_paged<half>(half*, const half*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);
template void attention_context_paged<bf16>(bf16*, const bf16*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda

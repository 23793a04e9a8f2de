// Fixed-order attention over the K/V cache: decode (one query row per sequence, the new K/V
// appended on the way) and its context twin (many query rows per sequence, for prefill and
// for rebuilding a replayed sequence), which give a query row bitwise the same result.
//
// The order. A query row at kv_len visible positions cuts them into pieces of kPiece
// positions: [0, kPiece), [kPiece, 2 kPiece), ... The block's threads form groups of G lanes
// (G = head_dim / 8 rounded up to a power of two: 16 for head_dim 128); in a piece, group g
// takes positions piece_begin + g, + ngroups, + 2 ngroups, ... in increasing order, its lanes
// holding 16 bytes of each position's K and V, and keeps its own online-softmax state (max m,
// sum l, accumulator) with the update of online_update(). The groups of a piece merge in
// group order (piece_state()), and the pieces in piece order (merge_piece()). Every step uses
// explicit roundings (fmaf, __fmul_rn, __fadd_rn, __fdiv_rn), so the compiler contracts
// nothing differently in the two kernels. The result depends on kv_len, the position's K/V
// and q, and on nothing else: not on the batch, on which block ran which piece, or on how a
// prompt was chunked.
//
// Decode: grid (head, row, Z); block z takes pieces z, z + Z, ... (Z only spreads a small
// batch over the GPU). A row of one piece is written by its block; otherwise each piece's
// state goes to a global workspace and the last block to finish (threadfence + counter)
// merges them. The fused append (paged mode) has block 0 copy the new token's K/V into the
// cache while every block reads that position straight from qkv, so no block reads what
// another writes.
//
// Context: grid (head, sequence, tile of kContextRows rows); a block walks every piece the
// tile's rows see, reading each position's K/V once for all of them, and merges each row's
// pieces in shared memory as it goes. Its cost over the flash kernel (attention_context.cu,
// the faster and not order-preserving choice) is CUDA-core arithmetic instead of tensor cores:
// 2 x head_dim FMAs per (row, position, head).
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

constexpr int kThreads = 128;
constexpr int kMaxSplits = 16;
constexpr int kPiece = kDecodePiece;
static_assert(kPiece % kPageTokens == 0, "pieces are whole pages");

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

// A lane's chunks of a row of D values (zeros where p is null).
template <class T, int VEC, int MAXC>
__device__ __forceinline__ void load_row(const T* p, int gl, int G, int D, float (&f)[MAXC][VEC]) {
#pragma unroll
  for (int c = 0; c < MAXC; ++c) load_chunk<T, VEC>(p, p ? (gl + c * G) * VEC : D, D, f[c]);
}

// q . k over the group: each lane's chunks in order, then a butterfly over the G lanes.
template <int VEC, int MAXC>
__device__ __forceinline__ float group_dot(const float (&q)[MAXC][VEC], const float (&k)[MAXC][VEC], int G) {
  float dot = 0.f;
#pragma unroll
  for (int c = 0; c < MAXC; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dot = fmaf(q[c][j], k[c][j], dot);
  for (int o = G >> 1; o > 0; o >>= 1) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
  return dot;
}

// One position into a group's online softmax.
template <int VEC, int MAXC>
__device__ __forceinline__ void online_update(float& m, float& l, float (&acc)[MAXC][VEC], float dot,
                                              const float (&v)[MAXC][VEC]) {
  const float m_new = fmaxf(m, dot);
  const float corr = expf(m - m_new);  // 0 when m was -inf
  const float p = expf(dot - m_new);
  l = __fadd_rn(__fmul_rn(l, corr), p);
#pragma unroll
  for (int c = 0; c < MAXC; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[c][j] = fmaf(p, v[c][j], __fmul_rn(acc[c][j], corr));
  m = m_new;
}

// A group's state into shared memory: gs[group * (D + 2)] = {m, l, acc[D]}.
template <int VEC, int MAXC>
__device__ __forceinline__ void store_group(float* gs, int group, int gl, int G, int D, float m, float l,
                                            const float (&acc)[MAXC][VEC]) {
  float* mine = gs + group * (D + 2);
  if (gl == 0) mine[0] = m, mine[1] = l;
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int d0 = (gl + c * G) * VEC;
    if (d0 < D)
#pragma unroll
      for (int j = 0; j < VEC; ++j) mine[2 + d0 + j] = acc[c][j];
  }
}

// The piece's state from its groups' (after a barrier): max M, sum L, and element i. Group
// g's weight expf(m_g - M) is computed once, by thread g, into fac[g]; piece_ml ends with a
// barrier (every thread of the block must call it), after which piece_acc may read fac.
struct PieceMl {
  float M, L;
};
__device__ __forceinline__ PieceMl piece_ml(const float* gs, float* fac, int ngroups, int D) {
  float M = -INFINITY;
  for (int g = 0; g < ngroups; ++g) M = fmaxf(M, gs[g * (D + 2)]);
  if (int(threadIdx.x) < ngroups) {
    const float mg = gs[threadIdx.x * (D + 2)];
    fac[threadIdx.x] = mg != -INFINITY ? expf(mg - M) : 0.f;
  }
  __syncthreads();
  float L = 0.f;
  for (int g = 0; g < ngroups; ++g)
    if (gs[g * (D + 2)] != -INFINITY) L = __fadd_rn(L, __fmul_rn(gs[g * (D + 2) + 1], fac[g]));
  return {M, L};
}
__device__ __forceinline__ float piece_acc(const float* gs, const float* fac, int ngroups, int D, int i) {
  float a = 0.f;
  for (int g = 0; g < ngroups; ++g)
    if (gs[g * (D + 2)] != -INFINITY) a = __fadd_rn(a, __fmul_rn(gs[g * (D + 2) + 2 + i], fac[g]));
  return a;
}

// Pieces merge in order: the running (M, L, O) absorbs piece (Mp, Lp, Op). The first piece
// is taken as it is (no arithmetic), so a one-piece row ends as Op / Lp.
struct MergeFactors {
  float M, a, b;
};
__device__ __forceinline__ MergeFactors merge_factors(float M, float Mp) {
  const float Mn = fmaxf(M, Mp);
  return {Mn, expf(M - Mn), expf(Mp - Mn)};
}
__device__ __forceinline__ float merge_value(float run, float piece, const MergeFactors& f) {
  return __fadd_rn(__fmul_rn(run, f.a), __fmul_rn(piece, f.b));
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
    load_row<T, VEC, MAXC>(kp, gl, G, D, kf[u]);
    load_row<T, VEC, MAXC>(vp, gl, G, D, vf[u]);
  }
}

// q's row into qf (null: zeros), each value times scale.
template <class T, int VEC, int MAXC>
__device__ __forceinline__ void load_scaled_q(float (&qf)[MAXC][VEC], const T* q, int gl, int G, int D, float scale) {
  load_row<T, VEC, MAXC>(q, gl, G, D, qf);
#pragma unroll
  for (int c = 0; c < MAXC; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) qf[c][j] = __fmul_rn(qf[c][j], scale);
}

// Paged mode, once q and the new K/V are written: the new position's K and V into the first
// batch where it is in it, and (block z == 0) into the cache.
template <class T, int VEC, int MAXC, int U, class Kv>
__device__ __forceinline__ void take_new_token(float (&kf)[U][MAXC][VEC], float (&vf)[U][MAXC][VEC],
                                               const bool (&valid)[U], const Kv& kv, const T* new_k, const T* new_v,
                                               int s, int h, int z, int t_new, int ngroups, int group, int gl, int G,
                                               int D) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (z * kPiece + u * ngroups + group == t_new && valid[u]) {
      load_row<T, VEC, MAXC>(new_k, gl, G, D, kf[u]);
      load_row<T, VEC, MAXC>(new_v, gl, G, D, vf[u]);
    }
  if (z == 0) {
    T* kd = kv.k + kv.offset(s, h, t_new);
    T* vd = kv.v + kv.offset(s, h, t_new);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      kd[i] = new_k[i];
      vd[i] = new_v[i];
    }
  }
}

// A group's pass over positions [t_begin, t_end) of a piece, `step` at a time (U batches;
// block z's first batch is loaded already): its running max m, sum l and accumulator acc.
template <class T, int VEC, int MAXC, int U, bool APPEND, class Kv>
__device__ __forceinline__ void scan_piece(float& m, float& l, float (&acc)[MAXC][VEC], float (&kf)[U][MAXC][VEC],
                                           float (&vf)[U][MAXC][VEC], bool (&valid)[U],
                                           const float (&qf)[MAXC][VEC], const Kv& kv, const T* new_k,
                                           const T* new_v, int s, int h, int z, int t_begin, int t_end, int step,
                                           int ngroups, int group, int gl, int G, int D, int t_new) {
  m = -INFINITY, l = 0.f;
#pragma unroll
  for (int c = 0; c < MAXC; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[c][j] = 0.f;
  // The loop bound is uniform over the block, so every lane reaches every shuffle.
  for (int base = t_begin; base < t_end; base += step) {
    if (base != z * kPiece)
      load_batch<T, VEC, MAXC, U, APPEND>(kf, vf, valid, kv, new_k, new_v, s, h, base, ngroups, group, gl, G, D,
                                          t_end, t_new, /*new_ready=*/true);
    float dot[U];
#pragma unroll
    for (int u = 0; u < U; ++u) dot[u] = group_dot<VEC, MAXC>(qf, kf[u], G);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (valid[u]) online_update<VEC, MAXC>(m, l, acc, dot[u], vf[u]);
  }
}

// Several pieces: the last of the row's `participants` blocks to finish (counted in
// *counter, which it resets for the next launch) merges the pieces' states in piece order
// into o; the others leave.
template <class T>
__device__ __forceinline__ void merge_pieces_if_last(T* o, const float* parts, int* counter, int participants,
                                                     int pieces, int D, int& is_last) {
  __threadfence();  // this block's pieces are visible device-wide before the counter moves
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == participants - 1;
  __syncthreads();
  if (!is_last) return;
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (next layer, next step)
  __threadfence();
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float M = __ldcg(parts), L = __ldcg(parts + 1), O = __ldcg(parts + 2 + i);
    for (int p = 1; p < pieces; ++p) {
      const float* part = parts + int64_t(p) * (D + 2);
      const MergeFactors f = merge_factors(M, __ldcg(part));
      L = merge_value(L, __ldcg(part + 1), f);
      O = merge_value(O, __ldcg(part + 2 + i), f);
      M = f.M;
    }
    o[i] = from_float<T>(__fdiv_rn(O, L));
  }
}

// ---- decode ---------------------------------------------------------------------------------
//
// Paged mode (APPEND) relies on this: the cached positions before kv_len - 1 of this layer
// were written by earlier steps, which a host copy separates from this step, and the step
// metadata (kv_lens, block tables) too; so the block reads kv_len, the tables and its first
// batch of K/V before grid_dependency_wait(), overlapping the QKV projection's tail. Only q
// and the new token's K/V, the QKV projection's output, wait.
// Four blocks per SM at least (at most 128 registers a thread): decode is a stream of K/V
// bytes, and the loads in flight are what reach the bandwidth.
template <class T, int VEC, int MAXC, bool APPEND, class Kv>
__global__ void __launch_bounds__(kThreads, 4)
    attention_decode_kernel(T* __restrict__ out, const T* q_base, int64_t q_stride, Kv kv,
                            const int32_t* __restrict__ kv_lens, int n_head, int D, int G, float scale, int max_pieces,
                            float* partial, int* counters) {
  extern __shared__ float sm[];  // [ngroups][D + 2]: m, l, acc[D]
  __shared__ float fac[kThreads];  // the groups' weights in the piece's merge
  __shared__ int is_last;
  grid_dependents_launch();
  if constexpr (!APPEND) grid_dependency_wait();
  const int h = blockIdx.x, s = blockIdx.y, z = blockIdx.z, Z = gridDim.z;
  const int kv_len = kv_lens[s];
  if (kv_len <= 0) return;  // padding row: every block of it leaves, no counter touched
  const int pieces = (kv_len + kPiece - 1) / kPiece;
  if (z >= pieces) return;  // no piece for this block (block 0 always has one)
  const int C = n_head * D;
  const T* q = q_base + int64_t(s) * q_stride + int64_t(h) * D;
  const T* new_k = q + C;
  const T* new_v = q + 2 * C;
  T* o = out + int64_t(s) * C + int64_t(h) * D;
  const int ngroups = blockDim.x / G;
  const int group = threadIdx.x / G, gl = threadIdx.x % G;
  const int t_new = APPEND ? kv_len - 1 : -1;
  if (pieces > 1 && pieces > max_pieces) {  // outside the workspace's contract: NaN, not garbage
    if (z == 0)
      for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = from_float<T>(NAN);
    return;
  }

  constexpr int U = MAXC >= 4 ? 1 : 4 / MAXC;  // positions per group per step (loads in flight)
  const int step = ngroups * U;
  float kf[U][MAXC][VEC], vf[U][MAXC][VEC];
  bool valid[U];
  // The first batch of the first piece, before the wait (the new position excepted).
  {
    const int t_begin = z * kPiece, t_end = min(kv_len, t_begin + kPiece);
    load_batch<T, VEC, MAXC, U, APPEND>(kf, vf, valid, kv, new_k, new_v, s, h, t_begin, ngroups, group, gl, G, D,
                                        t_end, t_new, /*new_ready=*/!APPEND);
  }
  if constexpr (APPEND) {
    grid_dependency_wait();  // q and the new K/V are the QKV projection's output
    take_new_token<T, VEC, MAXC, U>(kf, vf, valid, kv, new_k, new_v, s, h, z, t_new, ngroups, group, gl, G, D);
  }

  float qf[MAXC][VEC];
  load_scaled_q<T, VEC, MAXC>(qf, q, gl, G, D, scale);

  float* parts = partial + (int64_t(s) * n_head + h) * max_pieces * (D + 2);
  for (int p = z; p < pieces; p += Z) {
    const int t_begin = p * kPiece, t_end = min(kv_len, t_begin + kPiece);
    float m, l;
    float acc[MAXC][VEC];
    scan_piece<T, VEC, MAXC, U, APPEND>(m, l, acc, kf, vf, valid, qf, kv, new_k, new_v, s, h, z, t_begin, t_end, step,
                                        ngroups, group, gl, G, D, t_new);
    __syncthreads();  // the previous piece's readers of sm are done
    store_group<VEC, MAXC>(sm, group, gl, G, D, m, l, acc);
    __syncthreads();
    const PieceMl ml = piece_ml(sm, fac, ngroups, D);
    if (pieces == 1) {
      for (int i = threadIdx.x; i < D; i += blockDim.x)
        o[i] = from_float<T>(__fdiv_rn(piece_acc(sm, fac, ngroups, D, i), ml.L));
      return;
    }
    float* part = parts + int64_t(p) * (D + 2);
    for (int i = threadIdx.x; i < D; i += blockDim.x) part[2 + i] = piece_acc(sm, fac, ngroups, D, i);
    if (threadIdx.x == 0) part[0] = ml.M, part[1] = ml.L;
  }

  // Several pieces: the last block to finish merges them in piece order.
  merge_pieces_if_last<T>(o, parts, counters + int64_t(s) * n_head + h, min(Z, pieces), pieces, D, is_last);
}

// ---- context --------------------------------------------------------------------------------

template <int MAXC>
constexpr int context_rows() {
  return 8 / MAXC > 0 ? 8 / MAXC : 1;
}

// A row's running state rs = [M, L, acc[D]] takes the piece its groups left in gs: set by the
// first piece, merged with the later ones (merge_factors), the same order decode takes.
__device__ __forceinline__ void merge_into_running(float* rs, const float* gs, float* fac, int ngroups, int D,
                                                   bool first) {
  const PieceMl ml = piece_ml(gs, fac, ngroups, D);
  if (first) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) rs[2 + i] = piece_acc(gs, fac, ngroups, D, i);
    __syncthreads();
    if (threadIdx.x == 0) rs[0] = ml.M, rs[1] = ml.L;
    return;
  }
  const MergeFactors f = merge_factors(rs[0], ml.M);
  const float L = merge_value(rs[1], ml.L, f);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    rs[2 + i] = merge_value(rs[2 + i], piece_acc(gs, fac, ngroups, D, i), f);
  __syncthreads();  // every thread has read rs[0], rs[1]
  if (threadIdx.x == 0) rs[0] = f.M, rs[1] = L;
}

// The output row: the running state's acc / L, rounded once.
template <class T>
__device__ __forceinline__ void write_context_row(T* o, const float* rs, int D) {
  for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = from_float<T>(__fdiv_rn(rs[2 + i], rs[1]));
}

template <class T, int VEC, int MAXC, class Kv>
__global__ void __launch_bounds__(kThreads)
    attention_context_fixed_kernel(T* __restrict__ out, const T* q_base, int64_t q_stride, Kv kv,
                                   const int32_t* __restrict__ q_begins, const int32_t* __restrict__ q_lens,
                                   const int32_t* __restrict__ kv_lens, int fixed_q_len, int fixed_kv_len,
                                   int n_head, int D, int G, float scale) {
  constexpr int R = context_rows<MAXC>();
  extern __shared__ float sm[];  // groups [ngroups][D + 2], then the rows' running state [R][D + 2]
  __shared__ float fac[kThreads];  // the groups' weights in a piece's merge
  grid_dependents_launch();
  grid_dependency_wait();
  const int h = blockIdx.x, s = blockIdx.y;
  const int q_len = q_lens != nullptr ? q_lens[s] : fixed_q_len;
  const int q0 = blockIdx.z * R;
  if (q0 >= q_len) return;  // whole block
  const int kv_len = kv_lens != nullptr ? kv_lens[s] : fixed_kv_len;
  const int q_begin = q_begins != nullptr ? q_begins[s] : 0;
  const int rows = min(R, q_len - q0);
  const int pos0 = kv_len - q_len + q0;  // position of row 0: row r sees positions [0, pos0 + r]
  const int n_kv = pos0 + rows;
  const int C = n_head * D;
  const int ngroups = blockDim.x / G;
  const int group = threadIdx.x / G, gl = threadIdx.x % G;
  float* gs = sm;
  float* run = sm + ngroups * (D + 2);

  float qf[R][MAXC][VEC];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const T* q = r < rows ? q_base + int64_t(q_begin + q0 + r) * q_stride + int64_t(h) * D : nullptr;
    load_row<T, VEC, MAXC>(q, gl, G, D, qf[r]);
#pragma unroll
    for (int c = 0; c < MAXC; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) qf[r][c][j] = __fmul_rn(qf[r][c][j], scale);
  }

  const int pieces = (n_kv + kPiece - 1) / kPiece;
  for (int p = 0; p < pieces; ++p) {
    const int t_begin = p * kPiece, t_end = min(n_kv, t_begin + kPiece);
    float m[R], l[R], acc[R][MAXC][VEC];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      m[r] = -INFINITY, l[r] = 0.f;
#pragma unroll
      for (int c = 0; c < MAXC; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[r][c][j] = 0.f;
    }
    for (int base = t_begin; base < t_end; base += ngroups) {
      const int t = base + group;
      const bool in_piece = t < t_end;
      float kf[MAXC][VEC], vf[MAXC][VEC];
      load_row<T, VEC, MAXC>(in_piece ? kv.key(s, h, t) : nullptr, gl, G, D, kf);
      load_row<T, VEC, MAXC>(in_piece ? kv.value(s, h, t) : nullptr, gl, G, D, vf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float dot = group_dot<VEC, MAXC>(qf[r], kf, G);
        if (in_piece && t <= pos0 + r) online_update<VEC, MAXC>(m[r], l[r], acc[r], dot, vf);
      }
    }
    // Each row that sees this piece: its groups merged, then merged into its running state.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= rows || t_begin > pos0 + r) continue;  // uniform over the block
      __syncthreads();  // the previous readers of gs are done
      store_group<VEC, MAXC>(gs, group, gl, G, D, m[r], l[r], acc[r]);
      __syncthreads();
      merge_into_running(run + r * (D + 2), gs, fac, ngroups, D, p == 0);
    }
  }
  __syncthreads();
  for (int r = 0; r < rows; ++r)
    write_context_row(out + int64_t(q_begin + q0 + r) * C + int64_t(h) * D, run + r * (D + 2), D);
}

int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Lanes per group (G) and chunks per lane (MAXC) for head_dim D.
struct GroupShape {
  int G, maxc;
};
GroupShape group_shape(int64_t D, bool vec) {
  const int nch = int(vec ? D / kVec : D);
  const int G = std::min(32, next_pow2(nch));
  return {G, (nch + G - 1) / G};
}

// Calls f.template operator()<VEC, MAXC>() for the instantiation that holds head_dim.
template <class F>
void with_group_shape(const GroupShape& gs, bool vec, int64_t D, const char* what, F&& f) {
  if (vec) {
    if (gs.maxc == 1) return f.template operator()<8, 1>();
    if (gs.maxc == 2) return f.template operator()<8, 2>();
    if (gs.maxc <= 4) return f.template operator()<8, 4>();
    throw Error(std::string(what) + ": head_dim " + std::to_string(D) + " > 1024");
  }
  if (gs.maxc == 1) return f.template operator()<1, 1>();
  if (gs.maxc == 2) return f.template operator()<1, 2>();
  if (gs.maxc <= 4) return f.template operator()<1, 4>();
  if (gs.maxc <= 8) return f.template operator()<1, 8>();
  throw Error(std::string(what) + ": head_dim " + std::to_string(D) + " not a multiple of 8 and > 256");
}

template <class T, class Kv>
void launch_context_fixed(T* out, const T* q, int64_t q_stride, const Kv& kv, const int32_t* q_begins,
                          const int32_t* q_lens, const int32_t* kv_lens, int fixed_q_len, int fixed_kv_len,
                          int64_t max_q_len, int64_t num_seqs, int64_t n_head, int64_t D, bool vec,
                          cudaStream_t stream) {
  if (max_q_len <= 0 || num_seqs <= 0) return;
  if (num_seqs > 65535 || n_head > 65535) throw Error("attention_context_fixed: too many sequences or heads");
  const GroupShape shape = group_shape(D, vec);
  const float scale = 1.f / std::sqrt(float(D));
  with_group_shape(shape, vec, D, "attention_context_fixed", [&]<int V, int M>() {
    constexpr int R = context_rows<M>();
    const size_t smem = size_t(kThreads / shape.G + R) * size_t(D + 2) * sizeof(float);
    const dim3 grid{unsigned(n_head), unsigned(num_seqs), unsigned((max_q_len + R - 1) / R)};
    LAUNCH_PDL("attention_context_fixed_kernel", attention_context_fixed_kernel<T, V, M, Kv>, grid, dim3(kThreads),
               smem, stream, out, q, q_stride, kv, q_begins, q_lens, kv_lens, fixed_q_len, fixed_kv_len, int(n_head),
               int(D), shape.G, scale);
  });
}

// Which order a call takes: the tile order where head_dim has it (its pointers must then be
// 16-byte aligned), else the CUDA-core order, which cannot read an FP8 cache. `what` names
// the caller in the errors.
bool takes_tile_order(const char* what, const KvLayerView& view, int64_t head_dim, const void* qkv, const void* out) {
  if (!tile_order_head_dim(head_dim)) {
    if (view.fp8())
      throw Error(std::string(what) + ": an FP8 K/V cache needs head_dim a multiple of 16 up to 128, not " +
                  std::to_string(head_dim));
    return false;
  }
  if (!aligned16(qkv) || !aligned16(out) || !aligned16(view.k) || !aligned16(view.v))
    throw Error(std::string(what) + ": the tile order needs 16-byte aligned qkv, out and cache");
  return true;
}

}  // namespace

int64_t decode_pieces(int64_t max_kv_len) { return std::max<int64_t>(1, (max_kv_len + kPiece - 1) / kPiece); }

int64_t decode_partial_floats(int64_t rows, int64_t n_head, int64_t head_dim, int64_t max_kv_len) {
  return rows * n_head * decode_pieces(max_kv_len) * (head_dim + 2);
}

int decode_splits_for(int64_t rows, int64_t n_head, int64_t max_kv_len, int num_sms) {
  const int64_t blocks = std::max<int64_t>(1, rows * n_head);
  int64_t splits = (2 * int64_t(num_sms) + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, decode_pieces(max_kv_len));
  return int(std::clamp<int64_t>(splits, 1, kMaxSplits));
}

template <class T>
void attention_decode(T* out, const T* q, const T* k, const T* v, int64_t kv_stride, int64_t kv_len,
                      int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (kv_len <= 0 || n_head <= 0 || head_dim <= 0) return;
  const bool vec = head_dim % kVec == 0 && kv_stride % kVec == 0 && aligned16(q) && aligned16(k) &&
                   aligned16(v) && aligned16(out);
  const ContiguousKv<T> kv{k, v, kv_stride, int(head_dim)};
  // One query row at the last position: the context kernel, which merges every piece itself.
  launch_context_fixed<T>(out, q, 0, kv, nullptr, nullptr, nullptr, 1, int(kv_len), 1, 1, n_head, head_dim, vec,
                          stream);
}

template <class T>
void attention_decode_paged(T* out, const T* qkv, const KvLayerView& view, const int32_t* kv_lens,
                            int64_t num_rows, int64_t n_head, int64_t head_dim, int num_splits,
                            const DecodeWorkspace& ws, cudaStream_t stream, Fp8Sums qkv_sums) {
  if (num_rows <= 0) return;
  if (qkv_sums && !attention_decode_reads_sums(view, head_dim))
    throw Error("attention_decode_paged: a deferred QKV epilogue is read with an FP8 K/V cache only");
  if (!takes_tile_order("attention_decode_paged", view, head_dim, qkv, out))
    return attention_decode_cores<T>(out, qkv, view, kv_lens, num_rows, n_head, head_dim, num_splits, ws, stream);
  attention_decode_tiles<T>(out, qkv, view, kv_lens, num_rows, n_head, head_dim, ws, stream, qkv_sums);
}

bool attention_decode_reads_sums(const KvLayerView& view, int64_t head_dim) {
  return view.fp8() && tile_order_head_dim(head_dim);
}

template <class T>
void attention_decode_cores(T* out, const T* qkv, const KvLayerView& view, const int32_t* kv_lens, int64_t num_rows,
                            int64_t n_head, int64_t head_dim, int num_splits, const DecodeWorkspace& ws,
                            cudaStream_t stream) {
  if (num_rows <= 0) return;
  if (view.fp8()) throw Error("attention_decode_cores: the CUDA-core order does not read FP8 K/V");
  if (num_rows > 65535) throw Error("attention_decode_paged: more than 65535 rows in one launch");
  if (num_splits < 1 || num_splits > kMaxSplits) throw Error("attention_decode_paged: bad num_splits");
  if (ws.max_kv_len > kPiece &&
      (decode_partial_floats(num_rows, n_head, head_dim, ws.max_kv_len) > ws.partial_floats ||
       num_rows * n_head > ws.counter_entries || !ws.partial || !ws.counters))
    throw Error("attention_decode_paged: workspace too small for " + std::to_string(num_rows) + " rows of up to " +
                std::to_string(ws.max_kv_len) + " positions");
  const int64_t C = n_head * head_dim;
  const bool vec = head_dim % kVec == 0 && aligned16(qkv) && aligned16(out) && aligned16(view.k) &&
                   aligned16(view.v);
  const GroupShape shape = group_shape(head_dim, vec);
  const size_t smem = size_t(kThreads / shape.G) * size_t(head_dim + 2) * sizeof(float);
  const int max_pieces = int(decode_pieces(ws.max_kv_len));
  const dim3 grid{unsigned(n_head), unsigned(num_rows), unsigned(std::min(num_splits, max_pieces))};
  const float scale = 1.f / std::sqrt(float(head_dim));
  const auto kv = paged<T>(view, int(head_dim));
  with_group_shape(shape, vec, head_dim, "attention_decode", [&]<int V, int M>() {
    LAUNCH_PDL("attention_decode_kernel", attention_decode_kernel<T, V, M, true, PagedKv<T>>, grid, dim3(kThreads),
               smem, stream, out, qkv, 3 * C, kv, kv_lens, int(n_head), int(head_dim), shape.G, scale, max_pieces,
               ws.partial, ws.counters);
  });
}

template <class T>
void attention_context_fixed_paged(T* out, const T* qkv, const KvLayerView& view, const SeqArrays& seqs,
                                   int64_t max_q_len, int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (!takes_tile_order("attention_context_fixed_paged", view, head_dim, qkv, out))
    return attention_context_cores<T>(out, qkv, view, seqs, max_q_len, n_head, head_dim, stream);
  attention_context_tiles<T>(out, qkv, view, seqs, max_q_len, n_head, head_dim, stream);
}

template <class T>
void attention_context_cores(T* out, const T* qkv, const KvLayerView& view, const SeqArrays& seqs, int64_t max_q_len,
                             int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (view.fp8()) throw Error("attention_context_cores: the CUDA-core order does not read FP8 K/V");
  const int64_t C = n_head * head_dim;
  const bool vec = head_dim % kVec == 0 && aligned16(qkv) && aligned16(out) && aligned16(view.k) &&
                   aligned16(view.v);
  launch_context_fixed<T>(out, qkv, 3 * C, paged<T>(view, int(head_dim)), seqs.q_begins, seqs.q_lens, seqs.kv_lens,
                          0, 0, max_q_len, seqs.num_seqs, n_head, head_dim, vec, stream);
}

template void attention_decode<half>(half*, const half*, const half*, const half*, int64_t, int64_t, int64_t,
                                     int64_t, cudaStream_t);
template void attention_decode<bf16>(bf16*, const bf16*, const bf16*, const bf16*, int64_t, int64_t, int64_t,
                                     int64_t, cudaStream_t);
template void attention_decode_paged<half>(half*, const half*, const KvLayerView&, const int32_t*, int64_t,
                                           int64_t, int64_t, int, const DecodeWorkspace&, cudaStream_t, Fp8Sums);
template void attention_decode_paged<bf16>(bf16*, const bf16*, const KvLayerView&, const int32_t*, int64_t,
                                           int64_t, int64_t, int, const DecodeWorkspace&, cudaStream_t, Fp8Sums);
template void attention_decode_cores<half>(half*, const half*, const KvLayerView&, const int32_t*, int64_t,
                                           int64_t, int64_t, int, const DecodeWorkspace&, cudaStream_t);
template void attention_decode_cores<bf16>(bf16*, const bf16*, const KvLayerView&, const int32_t*, int64_t,
                                           int64_t, int64_t, int, const DecodeWorkspace&, cudaStream_t);
template void attention_context_cores<half>(half*, const half*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);
template void attention_context_cores<bf16>(bf16*, const bf16*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);
template void attention_context_fixed_paged<half>(half*, const half*, const KvLayerView&, const SeqArrays&, int64_t,
                                                  int64_t, int64_t, cudaStream_t);
template void attention_context_fixed_paged<bf16>(bf16*, const bf16*, const KvLayerView&, const SeqArrays&, int64_t,
                                                  int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda

// Attention over the paged K/V cache in the tile order, on the tensor cores (mma.sync
// m16n8k16, fp32 accumulation): decode and its context twin give a query row bitwise the
// same result, as attention_decode.cu's CUDA-core order does, at tensor-core speed. Taken for
// head_dim a multiple of 16 up to 128 (tile_order_head_dim); other head sizes keep the
// CUDA-core order.
//
// The order. A query row at position p sees positions [0, p], cut into pieces of kTilePiece
// (64) positions. A piece's state, fresh for each piece:
//   S  = q K^T             mma over head_dim in 16-element steps, from zero
//   s  = S * scale log2 e  (fp32; positions past p are -inf)
//   m  = max s,  e = exp2(s - m),  l = sum of e (fixed order: the lane's 16 values, then
//        the quad's butterfly),  O = rnd_T(e) V   (mma over the positions in 16-steps).
// The pieces merge in piece order into the running (M, L, O): the first is taken as it is,
// then M' = max(M, m), a = exp2(M - M'), b = exp2(m - M'), L = fma(l, b, L a),
// O = fma(O_p, b, O a); the row's output is O / L. Every step is written with explicit
// roundings, so the decode and the context kernel, which share piece_state() and merge(),
// compile to the same arithmetic. An mma's row depends on its own operands only, and the
// positions a row does not see add exact zeros, so the result depends on p, the row's q and
// the K/V of [0, p]: not on the batch, the other rows of a tile, the chunking of a prompt,
// or which warp ran which piece.
//
// Decode: one warp per (row, head, z); warp z takes pieces z, z + Z, ... . With Z = 1 it
// merges as it goes; with Z > 1 (a small batch spread over the GPU) each piece's state goes
// to the workspace and the last warp of the (row, head) merges them in piece order. The new
// token's K/V is read from qkv (warp z = 0 also writes it to the cache), so no warp reads
// what another writes. Each warp streams its pieces through its own shared memory with
// cp.async, the next piece's K loading while this piece's softmax and P V run.
//
// Context: a block of 4 warps per (64-row query tile, head, sequence); the warps share each
// piece's K and V (double-buffered) and each holds 16 query rows. A warp skips the pieces
// none of its rows sees, the identity for them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <set>
#include <utility>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_kv.cuh"
#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/fp8.cuh"
#include "kernels/cuda/int8_mma.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace conveyor::cuda {
namespace {

using namespace detail;

constexpr int kPiece = kTilePiece;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kContextWarps = 4;
constexpr int kDecodeWarps = 2;

// Elements per shared-memory row of a piece (head_dim plus 16 bytes: ldmatrix's 8 rows then
// fall in 8 different bank groups).
template <int D>
constexpr int pitch() {
  return D + 8;
}
template <int D>
constexpr size_t piece_smem_bytes(size_t elem) {  // one piece's K and V
  return size_t(2) * kPiece * pitch<D>() * elem;
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <class T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const typename Pair<T>::type v = from_float2<T>(make_float2(lo, hi));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A lane's share of one piece (or of the running state) for its rows g = lane / 4 and
// g + 8: o[j][2r + c] is row (g + 8r), element 8j + 2(lane % 4) + c.
template <int D>
struct TileState {
  float o[D / 8][4];
  float m[2], l[2];
};

// The state of the piece at kb (its K and V in sK, sV) for the warp's 16 rows; pos[r]: the
// position of the lane's row g + 8r (-1: none). q: the rows' A fragments, one per 16-step.
// In two halves: piece_scores() reads sK and leaves m, l and P (the A fragments of
// rnd_T(e)); piece_values() reads sV.
template <class T, int D>
__device__ __forceinline__ void piece_scores(TileState<D>& st, uint32_t (&p)[4][4], const uint32_t (&q)[D / 16][4],
                                             const T* sK, int kb, const int (&pos)[2], float scale_log2) {
  constexpr int P = pitch<D>();
  const int lane = threadIdx.x & 31, t = lane & 3, mtx = lane >> 3;
  float s[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t b[4];
      ldsm_x4(b, sK + (16 * jj + (lane & 7) + (mtx >> 1) * 8) * P + 16 * kk + (mtx & 1) * 8);
      mma_m16n8k16<T>(s[2 * jj], q[kk], b[0], b[1]);
      mma_m16n8k16<T>(s[2 * jj + 1], q[kk], b[2], b[3]);
    }

  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1, key = kb + 8 * j + 2 * t + (e & 1);
      s[j][e] = key <= pos[r] ? __fmul_rn(s[j][e], scale_log2) : -INFINITY;
      mx[r] = fmaxf(mx[r], s[j][e]);
    }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
  const float base[2] = {mx[0] == -INFINITY ? 0.f : mx[0], mx[1] == -INFINITY ? 0.f : mx[1]};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      s[j][e] = exp2f(__fsub_rn(s[j][e], base[r]));
      sum[r] = __fadd_rn(sum[r], s[j][e]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] = __fadd_rn(sum[r], __shfl_xor_sync(0xffffffffu, sum[r], 1));
    sum[r] = __fadd_rn(sum[r], __shfl_xor_sync(0xffffffffu, sum[r], 2));
    st.m[r] = mx[r];
    st.l[r] = sum[r];
  }

  // The C fragments of S tiles 2kk, 2kk + 1 are the A fragment of P's 16-step kk.
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    p[kk][0] = pack_pair<T>(s[2 * kk][0], s[2 * kk][1]);
    p[kk][1] = pack_pair<T>(s[2 * kk][2], s[2 * kk][3]);
    p[kk][2] = pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    p[kk][3] = pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

template <class T, int D>
__device__ __forceinline__ void piece_values(TileState<D>& st, const uint32_t (&p)[4][4], const T* sV) {
  constexpr int P = pitch<D>();
  const int lane = threadIdx.x & 31, mtx = lane >> 3;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[j][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      uint32_t b[4];
      ldsm_x4_trans(b, sV + (16 * kk + (lane & 7) + (mtx & 1) * 8) * P + 16 * dd + (mtx >> 1) * 8);
      mma_m16n8k16<T>(st.o[2 * dd], p[kk], b[0], b[1]);
      mma_m16n8k16<T>(st.o[2 * dd + 1], p[kk], b[2], b[3]);
    }
}

template <class T, int D>
__device__ __forceinline__ void piece_state(TileState<D>& st, const uint32_t (&q)[D / 16][4], const T* sK,
                                            const T* sV, int kb, const int (&pos)[2], float scale_log2) {
  uint32_t p[4][4];
  piece_scores<T, D>(st, p, q, sK, kb, pos, scale_log2);
  piece_values<T, D>(st, p, sV);
}

// The merge of one piece into the running state, for one value (factor a on the running
// value, b on the piece's); merge() applies it to the lane's row r.
struct MergeFactors {
  float M, a, b;
};
__device__ __forceinline__ MergeFactors merge_factors(float M, float m) {
  const float Mn = fmaxf(M, m);
  return {Mn, exp2f(__fsub_rn(M, Mn)), exp2f(__fsub_rn(m, Mn))};
}
__device__ __forceinline__ float merge_value(float run, float piece, const MergeFactors& f) {
  return __fmaf_rn(piece, f.b, f.a == 1.f ? run : __fmul_rn(run, f.a));  // run * 1 is run: same bits
}
template <int D>
__device__ __forceinline__ void merge(TileState<D>& run, const TileState<D>& piece, int r, bool first) {
  if (first) {
    run.m[r] = piece.m[r], run.l[r] = piece.l[r];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) run.o[j][2 * r] = piece.o[j][2 * r], run.o[j][2 * r + 1] = piece.o[j][2 * r + 1];
    return;
  }
  const MergeFactors f = merge_factors(run.m[r], piece.m[r]);
  run.m[r] = f.M;
  run.l[r] = merge_value(run.l[r], piece.l[r], f);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    run.o[j][2 * r] = merge_value(run.o[j][2 * r], piece.o[j][2 * r], f);
    run.o[j][2 * r + 1] = merge_value(run.o[j][2 * r + 1], piece.o[j][2 * r + 1], f);
  }
}

// The A fragments of 16 query rows: row g + 8r of the lane from rows[r] (null: zeros).
template <int D>
__device__ __forceinline__ void load_q(uint32_t (&q)[D / 16][4], const void* row_g, const void* row_g8) {
  const int t = threadIdx.x & 3;
  const uint32_t* a = static_cast<const uint32_t*>(row_g);
  const uint32_t* b = static_cast<const uint32_t*>(row_g8);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    q[kk][0] = a ? a[8 * kk + t] : 0u;
    q[kk][1] = b ? b[8 * kk + t] : 0u;
    q[kk][2] = a ? a[8 * kk + 4 + t] : 0u;
    q[kk][3] = b ? b[8 * kk + 4 + t] : 0u;
  }
}

// The lane's row r of the running state, divided by its sum, into out_row (elements of T).
template <class T, int D>
__device__ __forceinline__ void store_row(T* out_row, const TileState<D>& run, int r) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
    *reinterpret_cast<uint32_t*>(out_row + 8 * j + 2 * t) =
        pack_pair<T>(__fdiv_rn(run.o[j][2 * r], run.l[r]), __fdiv_rn(run.o[j][2 * r + 1], run.l[r]));
}

// cp.async of positions [kb, kb + kPiece) into sK and/or sV (null: not loaded) by `threads`
// threads (index i): a position at or past n gives zeros; src(t, &k, &v) names a position's
// rows, and a position for which it returns false is skipped (loaded later).
template <class T, int D, class Src>
__device__ __forceinline__ void load_piece(T* sK, T* sV, int kb, int n, int i, int threads, Src src) {
  constexpr int kChunks = D / 8;
  for (int c = i; c < kPiece * kChunks; c += threads) {
    const int r = c / kChunks, d = (c % kChunks) * 8;
    const int tpos = kb + r;
    const T* k = nullptr;
    const T* v = nullptr;
    const bool inside = tpos < n;
    if (inside && !src(tpos, k, v)) continue;
    if (sK) cp_async16(sK + r * pitch<D>() + d, inside ? k + d : sK, inside ? 16 : 0);
    if (sV) cp_async16(sV + r * pitch<D>() + d, inside ? v + d : sV, inside ? 16 : 0);
  }
}

// ---- FP8 K/V --------------------------------------------------------------------------------
//
// An FP8 piece comes into shared memory as bytes and scales (cp.async), then is dequantised
// into the dtype's tile (fp8.cuh: q * s, exact, s a power of two) that piece_state() reads,
// so everything after the load is the tile order above, on the dequantised values. The decode's
// new token is quantised in the kernel exactly as kv_cache_append quantises it.

// The FP8 cache of a layer: bytes through PagedKv<uint8_t>, one scale per (position, head).
struct Fp8Kv {
  PagedKv<uint8_t> kv;
  const float* ks = nullptr;
  const float* vs = nullptr;
  int64_t scale_page_stride = 0;
  __device__ __forceinline__ int64_t scale_offset(int s, int h, int t) const {
    const int64_t page = __ldg(kv.tables + int64_t(s) * kv.max_pages + (t / kPageTokens));
    return page * scale_page_stride + int64_t(h) * kPageTokens + t % kPageTokens;
  }
};

// A staged FP8 piece: K bytes [kPiece][D], V bytes, K scales [kPiece], V scales.
template <int D>
constexpr size_t fp8_stage_bytes() {
  return size_t(2) * kPiece * D + size_t(2) * kPiece * sizeof(float);
}

__device__ __forceinline__ void cp_async4(void* smem, const void* src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// cp.async of the FP8 piece at kb into st by `threads` threads (index i): positions at or past
// n are zeros (bytes and scales); positions skip(t) names are left alone.
template <int D, class Skip>
__device__ __forceinline__ void load_piece_fp8(uint8_t* st, const Fp8Kv& f, int s, int h, int kb, int n, int i,
                                               int threads, Skip skip) {
  constexpr int kChunks = D / 16;
  uint8_t* sk = st;
  uint8_t* sv = st + kPiece * D;
  float* sks = reinterpret_cast<float*>(st + 2 * kPiece * D);
  float* svs = sks + kPiece;
  for (int c = i; c < kPiece * kChunks; c += threads) {
    const int r = c / kChunks, d = (c % kChunks) * 16, t = kb + r;
    const bool inside = t < n;
    if (inside && skip(t)) continue;
    cp_async16(sk + r * D + d, inside ? f.kv.key(s, h, t) + d : sk, inside ? 16 : 0);
    cp_async16(sv + r * D + d, inside ? f.kv.value(s, h, t) + d : sv, inside ? 16 : 0);
  }
  for (int r = i; r < kPiece; r += threads) {
    const int t = kb + r;
    const bool inside = t < n;
    if (inside && skip(t)) continue;
    const int64_t o = inside ? f.scale_offset(s, h, t) : 0;
    cp_async4(sks + r, f.ks + o, inside ? 4 : 0);
    cp_async4(svs + r, f.vs + o, inside ? 4 : 0);
  }
}

// The staged piece at kb dequantised into sK and/or sV (null: that half not); position t_new
// (decode; -1: none) comes from new_k, new_v with scales s_new[0], s_new[1], quantised here.
template <class T, int D>
__device__ __forceinline__ void dequant_piece(T* sK, T* sV, const uint8_t* st, int kb, int i, int threads, int t_new,
                                              const T* new_k, const T* new_v, const float (&s_new)[2]) {
  constexpr int kChunks = D / 16;
  const float* scales = reinterpret_cast<const float*>(st + 2 * kPiece * D);
  const int first = sK ? 0 : 1, last = sV ? 1 : 0;
  for (int c = i + first * kPiece * kChunks; c < (last + 1) * kPiece * kChunks; c += threads) {
    const int which = c / (kPiece * kChunks), rc = c % (kPiece * kChunks);
    const int r = rc / kChunks, d = (rc % kChunks) * 16;
    uint4 q;
    float sc;
    if (kb + r == t_new) {  // the bytes and scale kv_cache_append would have stored
      const T* src = (which == 0 ? new_k : new_v) + d;
      sc = s_new[which];
      uint8_t* b = reinterpret_cast<uint8_t*>(&q);
#pragma unroll
      for (int j = 0; j < 16; ++j) b[j] = quantize_one(to_float(src[j]), sc);
    } else {
      q = *reinterpret_cast<const uint4*>(st + which * kPiece * D + r * D + d);
      sc = scales[which * kPiece + r];
    }
    uint4 x[2];
    dequant16<T>(q, sc, x);
    T* dst = (which == 0 ? sK : sV) + r * pitch<D>() + d;
    *reinterpret_cast<uint4*>(dst) = x[0];
    *reinterpret_cast<uint4*>(dst + 8) = x[1];
  }
}

// The scales of the new token's K and V heads (every lane gets both).
template <class T, int D>
__device__ __forceinline__ void new_token_scales(float (&s_new)[2], const T* new_k, const T* new_v) {
  const int lane = threadIdx.x & 31;
  float ak = 0.f, av = 0.f;
  for (int d = lane; d < D; d += 32) ak = fmaxf(ak, fabsf(to_float(new_k[d]))), av = fmaxf(av, fabsf(to_float(new_v[d])));
  s_new[0] = kv_fp8_scale(warp_max(ak));
  s_new[1] = kv_fp8_scale(warp_max(av));
}

// ---- decode ---------------------------------------------------------------------------------

// Row 0's piece state (lanes 0-3 hold it) into the workspace: {m, l, O[D], pad}.
template <int D>
__device__ __forceinline__ void store_partial(float* part, const TileState<D>& piece) {
  const int lane = threadIdx.x & 31;
  if (lane >= 4) return;
  if (lane == 0) part[0] = piece.m[0], part[1] = piece.l[0];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) part[2 + 8 * j + 2 * lane] = piece.o[j][0], part[3 + 8 * j + 2 * lane] = piece.o[j][1];
}

// A spread row's end: the last warp of the (row, head) to finish merges the pieces' states in
// piece order into o. The states come into `scratch` (the warp's shared memory, free now,
// scratch_bytes of it) in chunks, with every load in flight at once; the merge then reads
// them there. (Merging straight from global memory waited out one L2 round trip per piece:
// 58 us for one row of 4,096 positions.)
template <class T, int D>
__device__ __forceinline__ void merge_spread(T* o, const float* parts, int pieces, int participants, int* counter,
                                             float* scratch, size_t scratch_bytes) {
  constexpr int kStride = D + 4;
  const int lane = threadIdx.x & 31;
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(counter, 1) == participants - 1;
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  if (lane == 0) *counter = 0;  // ready for the next launch
  __threadfence();
  constexpr int kPer = (D + 31) / 32;  // elements of O per lane: lane, lane + 32, ...
  const int cap = int(scratch_bytes / (kStride * sizeof(float)));
  float M = 0.f, L = 0.f, O[kPer];
  for (int c0 = 0; c0 < pieces; c0 += cap) {
    const int n = min(cap, pieces - c0);
    __syncwarp();  // the previous chunk's readers are done
    for (int i = lane; i < n * kStride / 4; i += 32)
      cp_async16(scratch + 4 * i, parts + int64_t(c0) * kStride + 4 * i, 16);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    for (int k = 0; k < n; ++k) {
      const float* part = scratch + k * kStride;
      if (c0 + k == 0) {
        M = part[0], L = part[1];
#pragma unroll
        for (int i = 0; i < kPer; ++i) O[i] = lane + 32 * i < D ? part[2 + lane + 32 * i] : 0.f;
        continue;
      }
      const MergeFactors f = merge_factors(M, part[0]);
      L = merge_value(L, part[1], f);
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (lane + 32 * i < D) O[i] = merge_value(O[i], part[2 + lane + 32 * i], f);
      M = f.M;
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (lane + 32 * i < D) o[lane + 32 * i] = from_float<T>(__fdiv_rn(O[i], L));
}

// Shared memory of one decode warp: its piece tile (K and V), or (FP8) half of one, which holds
// the dequantised K and then V, and the staged piece. (Six warps a SM either way.)
template <class T, int D, bool FP8>
constexpr size_t decode_warp_smem() {
  return FP8 ? piece_smem_bytes<D>(sizeof(T)) / 2 + fp8_stage_bytes<D>() : piece_smem_bytes<D>(sizeof(T));
}

template <class T, int D, bool FP8>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_tiles_kernel(T* __restrict__ out, const T* qkv, PagedKv<T> kv, Fp8Kv f8,
                        const int32_t* __restrict__ kv_lens, int rows, int n_head, int Z, float scale_log2,
                        int max_pieces, float* partial, int* counters) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  grid_dependents_launch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * kDecodeWarps + warp;
  if (item >= int64_t(rows) * n_head * Z) return;  // no block-wide barrier below
  const int z = int(item % Z), h = int(item / Z % n_head), s = int(item / Z / n_head);
  const int kv_len = kv_lens[s];
  if (kv_len <= 0) return;  // padding row
  const int pieces = (kv_len + kPiece - 1) / kPiece;
  if (z >= pieces) return;
  unsigned char* mine = smem_raw + size_t(warp) * decode_warp_smem<T, D, FP8>();
  T* sK = reinterpret_cast<T*>(mine);
  T* sV = FP8 ? sK : sK + kPiece * pitch<D>();           // FP8: V after K in the same rows
  uint8_t* st = mine + piece_smem_bytes<D>(sizeof(T)) / 2;  // FP8 only
  const int t_new = kv_len - 1;
  const int64_t C = int64_t(n_head) * D;
  const T* q_row = qkv + int64_t(s) * 3 * C + int64_t(h) * D;
  const T* new_k = q_row + C;
  const T* new_v = q_row + 2 * C;
  auto cached = [&](int t, const T*& k, const T*& v) {
    if (t == t_new) return false;
    k = kv.key(s, h, t), v = kv.value(s, h, t);
    return true;
  };
  auto any = [&](int t, const T*& k, const T*& v) {
    if (t == t_new) k = new_k, v = new_v;
    else k = kv.key(s, h, t), v = kv.value(s, h, t);
    return true;
  };
  auto only_new = [&](int t, const T*& k, const T*& v) {
    k = new_k, v = new_v;
    return t == t_new;
  };
  auto is_new = [&](int t) { return t == t_new; };

  // The first piece's cached positions stream before the wait (written by earlier steps);
  // q and the new token are the QKV projection's output.
  if constexpr (FP8) load_piece_fp8<D>(st, f8, s, h, z * kPiece, kv_len, lane, 32, is_new);
  else load_piece<T, D>(sK, sV, z * kPiece, kv_len, lane, 32, cached);
  grid_dependency_wait();
  float s_new[2] = {0.f, 0.f};
  if constexpr (FP8) {
    new_token_scales<T, D>(s_new, new_k, new_v);
  } else {
    load_piece<T, D>(sK, sV, z * kPiece, kv_len, lane, 32, only_new);
  }
  cp_async_commit();
  cp_async_commit();  // an empty group: one group per piece, the newest always empty at a wait
  if (z == 0) {  // the fused append
    if constexpr (FP8) {
      uint8_t* kd = f8.kv.k + f8.kv.offset(s, h, t_new);
      uint8_t* vd = f8.kv.v + f8.kv.offset(s, h, t_new);
      for (int d = lane; d < D; d += 32) kd[d] = quantize_one(to_float(new_k[d]), s_new[0]), vd[d] = quantize_one(to_float(new_v[d]), s_new[1]);
      if (lane == 0) {
        const int64_t o = f8.scale_offset(s, h, t_new);
        const_cast<float*>(f8.ks)[o] = s_new[0];
        const_cast<float*>(f8.vs)[o] = s_new[1];
      }
    } else {
      T* kd = kv.k + kv.offset(s, h, t_new);
      T* vd = kv.v + kv.offset(s, h, t_new);
      for (int d = lane * 8; d < D; d += 32 * 8) {
        *reinterpret_cast<uint4*>(kd + d) = *reinterpret_cast<const uint4*>(new_k + d);
        *reinterpret_cast<uint4*>(vd + d) = *reinterpret_cast<const uint4*>(new_v + d);
      }
    }
  }

  uint32_t q[D / 16][4];
  load_q<D>(q, (lane >> 2) == 0 ? q_row : nullptr, nullptr);
  const int pos[2] = {(lane >> 2) == 0 ? t_new : -1, -1};
  const bool spread = Z > 1 && pieces > 1;
  constexpr int kStride = D + 4;  // floats per piece state {m, l, O[D], pad}: 16-byte aligned
  float* parts = partial + (int64_t(s) * n_head + h) * max_pieces * kStride;

  // One group in flight per piece, the next piece's issued as soon as this one's is in the
  // tile: bf16/fp16 after its P V has read the tile, FP8 right after the dequantisation.
  // (Loading the next K during this piece's P V measured slower on the H100: 89% of the
  // floor against 96% at batch 256.)
  TileState<D> run, piece;
  for (int pc = z; pc < pieces; pc += Z) {
    const int next = pc + Z < pieces ? pc + Z : -1;
    cp_async_wait<1>();  // all but the newest group: this piece's (the newest is empty)
    __syncwarp();
    if constexpr (FP8) {
      // K dequantised into the tile, the scores, then V into the same rows; the next piece
      // loads from then on, during P V. (Loading the next K as soon as this K was dequantised,
      // V after, measured slower on the H100: 5,910 against 5,548 us at batch 256 and 4,096.)
      dequant_piece<T, D>(sK, nullptr, st, pc * kPiece, lane, 32, t_new, new_k, new_v, s_new);
      __syncwarp();
      uint32_t p[4][4];
      piece_scores<T, D>(piece, p, q, sK, pc * kPiece, pos, scale_log2);
      __syncwarp();  // every lane is done with K: V takes its rows
      dequant_piece<T, D>(nullptr, sV, st, pc * kPiece, lane, 32, t_new, new_k, new_v, s_new);
      __syncwarp();  // the staging is free
      if (next >= 0) load_piece_fp8<D>(st, f8, s, h, next * kPiece, kv_len, lane, 32, is_new);
      cp_async_commit();
      cp_async_commit();
      piece_values<T, D>(piece, p, sV);
    } else {
      piece_state<T, D>(piece, q, sK, sV, pc * kPiece, pos, scale_log2);
    }
    __syncwarp();  // every lane is done with this piece's K and V
    if constexpr (!FP8) {
      if (next >= 0) load_piece<T, D>(sK, sV, next * kPiece, kv_len, lane, 32, any);
      cp_async_commit();
      cp_async_commit();
    }
    if (spread) store_partial<D>(parts + int64_t(pc) * kStride, piece);
    else merge<D>(run, piece, 0, pc == 0);
  }
  cp_async_wait<0>();
  T* o = out + int64_t(s) * C + int64_t(h) * D;
  if (!spread) {
    if (lane < 4) store_row<T, D>(o, run, 0);
    return;
  }
  merge_spread<T, D>(o, parts, pieces, min(Z, pieces), counters + int64_t(s) * n_head + h,
                     reinterpret_cast<float*>(mine), decode_warp_smem<T, D, FP8>());
}

// ---- context --------------------------------------------------------------------------------

// Shared memory of a context block: two pieces' tiles (bf16/fp16), or one tile and two staged
// FP8 pieces.
template <class T, int D, bool FP8>
constexpr size_t context_smem() {
  return FP8 ? piece_smem_bytes<D>(sizeof(T)) + 2 * fp8_stage_bytes<D>() : 2 * piece_smem_bytes<D>(sizeof(T));
}

template <class T, int D, bool FP8>
__global__ void __launch_bounds__(kContextWarps * 32)
    context_tiles_kernel(T* __restrict__ out, const T* q_base, int64_t q_stride, PagedKv<T> kv, Fp8Kv f8,
                         const int32_t* __restrict__ q_begins, const int32_t* __restrict__ q_lens,
                         const int32_t* __restrict__ kv_lens, int n_head, float scale_log2) {
  constexpr int kRows = kContextWarps * 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  grid_dependents_launch();
  grid_dependency_wait();
  const int s = blockIdx.z, h = blockIdx.y;
  const int q_len = q_lens[s];
  const int q0 = blockIdx.x * kRows;
  if (q0 >= q_len) return;  // whole block
  const int kv_len = kv_lens[s], q_begin = q_begins[s];
  const int rows = min(kRows, q_len - q0);
  const int pos0 = kv_len - q_len + q0;  // position of tile row 0
  const int n_kv = pos0 + rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int64_t C = int64_t(n_head) * D;
  // bf16/fp16: stage b's K at stage_k(b), its V kPiece rows after. FP8: one tile at stage_k(0),
  // the staged pieces after it.
  auto stage_k = [&](int b) { return reinterpret_cast<T*>(smem_raw) + b * 2 * kPiece * pitch<D>(); };
  auto staged = [&](int b) { return smem_raw + piece_smem_bytes<D>(sizeof(T)) + b * fp8_stage_bytes<D>(); };
  auto cached = [&](int t, const T*& k, const T*& v) {
    k = kv.key(s, h, t), v = kv.value(s, h, t);
    return true;
  };
  auto none = [](int) { return false; };
  auto load = [&](int pc) {
    if constexpr (FP8)
      load_piece_fp8<D>(staged(pc & 1), f8, s, h, pc * kPiece, n_kv, threadIdx.x, blockDim.x, none);
    else
      load_piece<T, D>(stage_k(pc & 1), stage_k(pc & 1) + kPiece * pitch<D>(), pc * kPiece, n_kv, threadIdx.x,
                       blockDim.x, cached);
  };

  int pos[2];
  const T* qrow[2];
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    pos[r] = row < rows ? pos0 + row : -1;
    qrow[r] = row < rows ? q_base + int64_t(q_begin + q0 + row) * q_stride + int64_t(h) * D : nullptr;
  }
  uint32_t q[D / 16][4];
  load_q<D>(q, qrow[0], qrow[1]);
  const int warp_last = warp * 16 < rows ? min(pos0 + warp * 16 + 15, n_kv - 1) : -1;

  const int n_pieces = (n_kv + kPiece - 1) / kPiece;
  load(0);
  cp_async_commit();
  TileState<D> run, piece;
  const float no_new[2] = {0.f, 0.f};
  for (int pc = 0; pc < n_pieces; ++pc) {
    if (pc + 1 < n_pieces) {
      load(pc + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* sK = stage_k(FP8 ? 0 : pc & 1);
    if constexpr (FP8) {
      dequant_piece<T, D>(stage_k(0), stage_k(0) + kPiece * pitch<D>(), staged(pc & 1), pc * kPiece, threadIdx.x,
                          blockDim.x, -1, nullptr, nullptr, no_new);
      __syncthreads();
    }
    const int kb = pc * kPiece;
    if (kb <= warp_last) {
      piece_state<T, D>(piece, q, sK, sK + kPiece * pitch<D>(), kb, pos, scale_log2);
      for (int r = 0; r < 2; ++r)
        if (kb <= pos[r]) merge<D>(run, piece, r, pc == 0);
    }
    __syncthreads();  // the stage (the tile) is free for the piece after next (the next)
  }
  for (int r = 0; r < 2; ++r)
    if (pos[r] >= 0) store_row<T, D>(out + int64_t(q_begin + q0 + warp * 16 + g + 8 * r) * C + int64_t(h) * D, run, r);
}

// Calls f.template operator()<D>() for the instantiated head_dim.
template <class F>
void with_head_dim(int64_t D, F&& f) {
  switch (D) {
    case 16: return f.template operator()<16>();
    case 32: return f.template operator()<32>();
    case 64: return f.template operator()<64>();
    case 80: return f.template operator()<80>();
    case 96: return f.template operator()<96>();
    case 128: return f.template operator()<128>();
    default: throw Error("attention (tile order): head_dim " + std::to_string(D) + " is not instantiated");
  }
}

// Raises a kernel's dynamic shared memory limit, once per kernel and device (the attribute
// belongs to the device's context; several ranks of one process drive several devices). No
// lock is held across the CUDA call: ranks are threads whose kernels wait for each other
// (the custom all-reduce), and a rank blocked on a lock here while another sat in a CUDA call
// that waited on its device could never arrive. Two threads may both set it: harmless.
template <class... A>
void allow_smem(void (*kernel)(A...), size_t bytes) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), dev};
  {
    std::lock_guard lk(mu);
    if (done.count(key)) return;
  }
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  std::lock_guard lk(mu);
  done.insert(key);
}

// The device's SM count, asked once (no lock held across the CUDA call, as above).
int sm_count() {
  static std::atomic<int> cached{0};
  if (const int n = cached.load(std::memory_order_relaxed); n > 0) return n;
  int dev = 0, n = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  cached.store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

bool tile_order_head_dim(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128; }

int64_t tile_pieces(int64_t max_kv_len) { return std::max<int64_t>(1, (max_kv_len + kPiece - 1) / kPiece); }

int64_t tile_partial_floats(int64_t rows, int64_t n_head, int64_t head_dim, int64_t max_kv_len) {
  return rows * n_head * tile_pieces(max_kv_len) * (head_dim + 4);
}

int tile_decode_splits(int64_t rows, int64_t n_head, int64_t head_dim, const DecodeWorkspace& ws) {
  const int64_t pieces = tile_pieces(ws.max_kv_len);
  if (pieces <= 1 || !ws.partial || !ws.counters || rows * n_head > ws.counter_entries ||
      tile_partial_floats(rows, n_head, head_dim, ws.max_kv_len) > ws.partial_floats)
    return 1;
  // A small batch's warps spread until there are about 16 per SM (six are resident at a
  // time). Measured on the H100: spreading further (eight waves) was slower, the pieces'
  // states written and merged costing more than the shorter tail saves.
  const int sms = sm_count();
  const int64_t warps = std::max<int64_t>(1, rows * n_head);
  const int64_t want = (int64_t(sms) * 16 + warps - 1) / warps;
  return int(std::clamp<int64_t>(want, 1, pieces));
}

Fp8Kv fp8_view(const KvLayerView& view, int64_t head_dim) {
  Fp8Kv f;
  if (!view.fp8()) return f;
  f.kv = paged<uint8_t>(view, int(head_dim));
  f.ks = view.k_scale, f.vs = view.v_scale, f.scale_page_stride = view.scale_page_stride;
  return f;
}

template <class T>
void attention_decode_tiles(T* out, const T* qkv, const KvLayerView& view, const int32_t* kv_lens, int64_t num_rows,
                            int64_t n_head, int64_t head_dim, const DecodeWorkspace& ws, cudaStream_t stream) {
  if (num_rows <= 0) return;
  const int Z = tile_decode_splits(num_rows, n_head, head_dim, ws);
  const int64_t warps = num_rows * n_head * Z;
  const int64_t blocks = (warps + kDecodeWarps - 1) / kDecodeWarps;
  if (blocks > INT32_MAX) throw Error("attention_decode (tile order): too many rows");
  const float scale_log2 = kLog2e / std::sqrt(float(head_dim));
  const auto kv = paged<T>(view, int(head_dim));
  const Fp8Kv f8 = fp8_view(view, head_dim);
  with_head_dim(head_dim, [&]<int D>() {
    auto launch = [&]<bool FP8>() {
      const size_t smem = kDecodeWarps * decode_warp_smem<T, D, FP8>();
      allow_smem(decode_tiles_kernel<T, D, FP8>, smem);
      LAUNCH_PDL("decode_tiles_kernel", decode_tiles_kernel<T, D, FP8>, dim3(unsigned(blocks)),
                 dim3(kDecodeWarps * 32), smem, stream, out, qkv, kv, f8, kv_lens, int(num_rows), int(n_head), Z,
                 scale_log2, int(tile_pieces(ws.max_kv_len)), ws.partial, ws.counters);
    };
    if (view.fp8()) launch.template operator()<true>();
    else launch.template operator()<false>();
  });
}

template <class T>
void attention_context_tiles(T* out, const T* qkv, const KvLayerView& view, const SeqArrays& seqs, int64_t max_q_len,
                             int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  if (max_q_len <= 0 || seqs.num_seqs <= 0) return;
  if (seqs.num_seqs > 65535 || n_head > 65535) throw Error("attention_context (tile order): too many sequences or heads");
  const int64_t C = n_head * head_dim;
  const float scale_log2 = kLog2e / std::sqrt(float(head_dim));
  const auto kv = paged<T>(view, int(head_dim));
  const Fp8Kv f8 = fp8_view(view, head_dim);
  constexpr int kRows = kContextWarps * 16;
  const dim3 grid{unsigned((max_q_len + kRows - 1) / kRows), unsigned(n_head), unsigned(seqs.num_seqs)};
  with_head_dim(head_dim, [&]<int D>() {
    auto launch = [&]<bool FP8>() {
      const size_t smem = context_smem<T, D, FP8>();
      allow_smem(context_tiles_kernel<T, D, FP8>, smem);
      LAUNCH_PDL("context_tiles_kernel", context_tiles_kernel<T, D, FP8>, grid, dim3(kContextWarps * 32), smem, stream,
                 out, qkv, 3 * C, kv, f8, seqs.q_begins, seqs.q_lens, seqs.kv_lens, int(n_head), scale_log2);
    };
    if (view.fp8()) launch.template operator()<true>();
    else launch.template operator()<false>();
  });
}

template void attention_decode_tiles<half>(half*, const half*, const KvLayerView&, const int32_t*, int64_t, int64_t,
                                           int64_t, const DecodeWorkspace&, cudaStream_t);
template void attention_decode_tiles<bf16>(bf16*, const bf16*, const KvLayerView&, const int32_t*, int64_t, int64_t,
                                           int64_t, const DecodeWorkspace&, cudaStream_t);
template void attention_context_tiles<half>(half*, const half*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);
template void attention_context_tiles<bf16>(bf16*, const bf16*, const KvLayerView&, const SeqArrays&, int64_t,
                                            int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda

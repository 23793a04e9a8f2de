// The tile order of attention (attention_tiles.h), shared by its decode kernel
// (attention_tiles_decode.cu) and its context kernel (attention_tiles_context.cu):
// attention over the paged K/V cache on the tensor cores on the tensor cores (mma.sync
// m16n8k16, fp32 accumulation): decode and its context twin give a query row bitwise the
// same result, as attention_decode.cu's CUDA-core order does, at tensor-core speed. Taken for
// head_dim a multiple of 16 up to 128 (tile_order_head_dim); other head sizes keep the
// CUDA-core order.
//
// The order. A query row at position p sees positions [0, p], cut into pieces of kTilePiece
// (64) positions. A piece's state, fresh for each piece:
//   S  = q K^T             mma over head_dim in 16-element steps, from zero
//   s  = S * scale log2 e  (fp32; positions past p are -inf)
//   m  = max s,  e = exp2(s - m),  l = sum of e (fixed order: finish_class_sum),
//   O  = rnd_T(e) V                (mma over the positions in 16-steps).
// The pieces merge in piece order into the running (M, L, O): the first is taken as it is,
// then M' = max(M, m), a = exp2(M - M'), b = exp2(m - M'), L = fma(l, b, L a),
// O = fma(O_p, b, O a); the row's output is O / L. Every step is written with explicit
// roundings, so the decode and the context kernel, which share merge() and every step's
// arithmetic, compute the same numbers. An mma's row depends on its own operands only, and the
// positions a row does not see add exact zeros, so the result depends on p, the row's q and
// the K/V of [0, p]: not on the batch, the other rows of a tile, the chunking of a prompt,
// or which warp ran which piece.
//
// Decode: one warp per (row, head, z); warp z takes pieces z, z + Z, ... . It puts the piece,
// not its one query row, in the mma's A operand (attention_tiles_decode.cu): the same dot
// products in the same steps. With Z = 1 it merges as it goes; with Z > 1 (a
// small batch spread over the GPU) each piece's state goes to the workspace and the last
// warp of the (row, head) merges them in piece order. The new
// token's K/V is read from qkv (warp z = 0 also writes it to the cache), so no warp reads
// what another writes. Each warp streams its pieces through its own shared memory with
// cp.async, the next piece's K loading while this piece's softmax and P V run.
//
// Context: a block of 4 warps per (64-row query tile, head, sequence); the warps share each
// piece's K and V (double-buffered) and each holds 16 query rows. A warp skips the pieces
// none of its rows sees, the identity for them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <set>
#include <type_traits>
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

// Zeros N mma accumulator fragments (four floats a lane each): S before q K^T, O before P V.
template <int N, int E>
__device__ __forceinline__ void zero_fragments(float (&a)[N][E]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < E; ++e) a[j][e] = 0.f;
}

// A lane's share of one piece (or of the running state) for its two rows g = lane / 4 and
// g + 8: o[j][2r + c] is row (g + 8r), element 8j + 2(lane % 4) + c.
template <int D>
struct TileState {
  float o[D / 8][4];
  float m[2], l[2];
};

// The sum l of a piece's e, in one order whichever way a warp's lanes hold the piece: with c_k
// the sum of e over the positions k, k + 8, ..., k + 56 in that order (class k mod 8),
// l = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)). part is the lane's share (c_2t +
// c_2t+1 for scores_to_p's lane t; c_g for the FP8 decode's lane g); the butterflies over the
// lane distances D0, 2 D0, ..., D1 finish the tree (fp32 addition commutes, so both lanes of a
// butterfly hold the same bits).
template <int D0, int D1>
__device__ __forceinline__ float finish_class_sum(float part) {
#pragma unroll
  for (int d = D0; d <= D1; d <<= 1) part = __fadd_rn(part, __shfl_xor_sync(0xffffffffu, part, d));
  return part;
}

// The softmax half of piece_scores(): from S (the C fragments of q K^T for the piece's 8
// tiles of 8 positions, lane's column 8j + 2t + (e & 1)) to m, l and P (the A fragments of
// rnd_T(e)). FP8 V: fold (null otherwise) holds a factor per position of the piece, and row
// r's P is rnd_T(e * fold * fold_rcp[r]) ("FP8 V's scales on P" says why); l is the sum of e as
// always.
template <class T>
__device__ __forceinline__ void scores_to_p(float (&m)[2], float (&l)[2], uint32_t (&p)[4][4], float (&s)[8][4],
                                            int kb, const int (&pos)[2], float scale_log2,
                                            const float* fold = nullptr, const float* fold_rcp = nullptr) {
  const int t = threadIdx.x & 3;
  float mx[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) mx[r] = -INFINITY;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1, key = kb + 8 * j + 2 * t + (e & 1);
      s[j][e] = key <= pos[r] ? __fmul_rn(s[j][e], scale_log2) : -INFINITY;
      mx[r] = fmaxf(mx[r], s[j][e]);
    }
  float sum[4], base[2];  // sum[e]: the class of positions 2t + (e & 1) (mod 8)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    base[r] = mx[r] == -INFINITY ? 0.f : mx[r];
    sum[2 * r] = sum[2 * r + 1] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(__fsub_rn(s[j][e], base[e >> 1]));
      sum[e] = __fadd_rn(sum[e], s[j][e]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = mx[r];
    l[r] = finish_class_sum<1, 2>(__fadd_rn(sum[2 * r], sum[2 * r + 1]));
  }

  if (fold) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 f = *reinterpret_cast<const float2*>(fold + 8 * j + 2 * t);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s[j][2 * r] = __fmul_rn(s[j][2 * r], __fmul_rn(f.x, fold_rcp[r]));
        s[j][2 * r + 1] = __fmul_rn(s[j][2 * r + 1], __fmul_rn(f.y, fold_rcp[r]));
      }
    }
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

// The four ldmatrix registers of a 16 x 16 tile of a staged bf16/fp16 piece, positions 16 pj
// on and head elements 16 ek on: K's (the B fragments of S's n-tiles 2 pj and 2 pj + 1) and
// V's transposed (those of O's n-tiles 2 ek and 2 ek + 1). The decode takes the same
// registers as A (attention_tiles_decode.cu), so both kernels multiply the same values.
template <class T, int D>
__device__ __forceinline__ void load_k_tile(uint32_t (&b)[4], const T* sK, int pj, int ek) {
  const int lane = threadIdx.x & 31, mtx = lane >> 3;
  ldsm_x4(b, sK + (16 * pj + (lane & 7) + (mtx >> 1) * 8) * pitch<D>() + 16 * ek + (mtx & 1) * 8);
}
template <class T, int D>
__device__ __forceinline__ void load_vt_tile(uint32_t (&b)[4], const T* sV, int pj, int ek) {
  const int lane = threadIdx.x & 31, mtx = lane >> 3;
  ldsm_x4_trans(b, sV + (16 * pj + (lane & 7) + (mtx & 1) * 8) * pitch<D>() + 16 * ek + (mtx >> 1) * 8);
}

// The state of the piece at kb (its K and V in sK, sV) for the warp's 16 rows; pos[r]: the
// position of the lane's row g + 8r (-1: none). q: the rows' A fragments, one per 16-step.
// In two halves: piece_scores() reads sK and leaves m, l and P; piece_values() reads sV.
template <class T, int D>
__device__ __forceinline__ void piece_scores(TileState<D>& st, uint32_t (&p)[4][4], const uint32_t (&q)[D / 16][4],
                                             const T* sK, int kb, const int (&pos)[2], float scale_log2) {
  float s[8][4];
  zero_fragments(s);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t b[4];
      load_k_tile<T, D>(b, sK, jj, kk);
      mma_m16n8k16<T>(s[2 * jj], q[kk], b[0], b[1]);
      mma_m16n8k16<T>(s[2 * jj + 1], q[kk], b[2], b[3]);
    }
  scores_to_p<T>(st.m, st.l, p, s, kb, pos, scale_log2);
}

// P V's 16-steps KK0..KK1-1 added to the accumulators o in order, sV holding positions 16 KK0
// on (a whole piece's V, or part of one: the sums are the same whichever way the steps are cut).
template <class T, int D, int KK0, int KK1>
__device__ __forceinline__ void piece_values_steps(float (&o)[D / 8][4], const uint32_t (&p)[4][4], const T* sV) {
#pragma unroll
  for (int kk = KK0; kk < KK1; ++kk)
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      uint32_t b[4];
      load_vt_tile<T, D>(b, sV, kk - KK0, dd);
      mma_m16n8k16<T>(o[2 * dd], p[kk], b[0], b[1]);
      mma_m16n8k16<T>(o[2 * dd + 1], p[kk], b[2], b[3]);
    }
}
template <class T, int D>
__device__ __forceinline__ void piece_values(TileState<D>& st, const uint32_t (&p)[4][4], const T* sV) {
  zero_fragments(st.o);
  piece_values_steps<T, D, 0, 4>(st.o, p, sV);
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
// State: TileState (two rows), or the decode's ColState (attention_tiles_decode.cu: one): o[n][2R],
// m[R], l[R], the lane's values of row r at o[j][2r], o[j][2r + 1].
template <class State>
__device__ __forceinline__ void merge(State& run, const State& piece, int r, bool first) {
  constexpr int N = int(std::extent_v<decltype(State::o)>);
  if (first) {
    run.m[r] = piece.m[r], run.l[r] = piece.l[r];
#pragma unroll
    for (int j = 0; j < N; ++j) run.o[j][2 * r] = piece.o[j][2 * r], run.o[j][2 * r + 1] = piece.o[j][2 * r + 1];
    return;
  }
  const MergeFactors f = merge_factors(run.m[r], piece.m[r]);
  run.m[r] = f.M;
  run.l[r] = merge_value(run.l[r], piece.l[r], f);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    run.o[j][2 * r] = merge_value(run.o[j][2 * r], piece.o[j][2 * r], f);
    run.o[j][2 * r + 1] = merge_value(run.o[j][2 * r + 1], piece.o[j][2 * r + 1], f);
  }
}

// The A fragments of 16 query rows: row g + 8r of the lane from rows[r] (null: zeros).
// FP8 K/V: each 16-step takes its elements in piece_scores_fp8's order (the lane's k = 2t,
// 2t + 1 are elements 4t, 4t + 1 of the step; k = 2t + 8, 2t + 9 are 4t + 2, 4t + 3).
template <int D, bool FP8 = false>
__device__ __forceinline__ void load_q(uint32_t (&q)[D / 16][4], const void* row_g, const void* row_g8) {
  const int t = threadIdx.x & 3;
  const uint32_t* a = static_cast<const uint32_t*>(row_g);
  const uint32_t* b = static_cast<const uint32_t*>(row_g8);
  const int lo = FP8 ? 2 * t : t, hi = FP8 ? 2 * t + 1 : 4 + t;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    q[kk][0] = a ? a[8 * kk + lo] : 0u;
    q[kk][1] = b ? b[8 * kk + lo] : 0u;
    q[kk][2] = a ? a[8 * kk + hi] : 0u;
    q[kk][3] = b ? b[8 * kk + hi] : 0u;
  }
}

// The lane's row r of the running state, divided by its sum, into out_row (elements of T).
template <class T, int D>
__device__ __forceinline__ void store_row(T* out_row, const TileState<D>& run, int r) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const float a = __fdiv_rn(run.o[j][2 * r], run.l[r]), b = __fdiv_rn(run.o[j][2 * r + 1], run.l[r]);
    *reinterpret_cast<uint32_t*>(out_row + 8 * j + 2 * t) = pack_pair<T>(a, b);
  }
}

// ---- loading a piece -------------------------------------------------------------------------
//
// A piece loads by pages: the block table is read once per page, and a 16-byte chunk's
// address is its page's base plus a constant. (Reading the table once per chunk, as this did
// before, was about 1,300 of a decode warp's 3,400 instructions per piece, FP8 K/V at batch
// 256 x 1,024 on the H100 (ncu), and the chunks waited on the table's loads one by one.)
// Rows [0, limit) of the piece come from the cache, rows [limit, kPiece) are zeros, and row
// `skip` (-1: none) is left alone: the decode's new token, loaded from qkv instead.
constexpr int kPiecePages = kPiece / kPageTokens;
static_assert(kPiecePages == 4, "page_of() picks among four pages");

struct PiecePages {
  int32_t id[kPiecePages];
};

// The pages that hold rows [0, limit) of the piece at kb (the others are never read: 0).
template <class T>
__device__ __forceinline__ PiecePages piece_pages(const PagedKv<T>& kv, int s, int kb, int limit) {
  const int32_t* row = kv.tables + int64_t(s) * kv.max_pages + kb / kPageTokens;
  PiecePages p;
#pragma unroll
  for (int i = 0; i < kPiecePages; ++i) p.id[i] = i * kPageTokens < limit ? __ldg(row + i) : 0;
  return p;
}

// A select, not an index: a register array indexed by a value known only at run time would
// go to local memory. With i known at compile time it folds away.
__device__ __forceinline__ int32_t page_of(const PiecePages& p, int i) {
  return i == 0 ? p.id[0] : i == 1 ? p.id[1] : i == 2 ? p.id[2] : p.id[3];
}

// cp.async of the kPiece rows of one head (ROW_BYTES each; in a page, a head's kPageTokens
// rows are contiguous from head0 + page * page_bytes) into dst rows of PITCH bytes, by
// THREADS threads (index i). WHOLE: limit is kPiece and nothing is skipped.
template <int ROW_BYTES, int PITCH, int THREADS, bool WHOLE>
__device__ __forceinline__ void copy_piece_rows(unsigned char* dst, const unsigned char* head0, int64_t page_bytes,
                                                const PiecePages& pages, int i, int limit, int skip) {
  constexpr int kChunks = ROW_BYTES / 16;
  static_assert(ROW_BYTES % 16 == 0, "rows of whole chunks");
  auto copy = [&](int row, int col) {
    if (!WHOLE && row == skip) return;
    const bool inside = WHOLE || row < limit;
    cp_async16(dst + row * PITCH + col,
               head0 + int64_t(page_of(pages, row / kPageTokens)) * page_bytes + (row % kPageTokens) * ROW_BYTES + col,
               inside ? 16 : 0);
  };
  if constexpr (THREADS % kChunks == 0) {  // a thread keeps its column: the rows step by a constant
    const int lrow = i / kChunks, col = (i % kChunks) * 16;
#pragma unroll
    for (int r0 = 0; r0 < kPiece; r0 += THREADS / kChunks)
      if (r0 + lrow < kPiece) copy(r0 + lrow, col);
  } else {  // head_dim 80 or 96
#pragma unroll 4
    for (int c = i; c < kPiece * kChunks; c += THREADS) copy(c / kChunks, (c % kChunks) * 16);
  }
}

template <int ROW_BYTES, int PITCH, int THREADS>
__device__ __forceinline__ void copy_piece_rows(unsigned char* dst, const unsigned char* head0, int64_t page_bytes,
                                                const PiecePages& pages, int i, int limit, int skip) {
  if (limit >= kPiece && skip < 0)
    copy_piece_rows<ROW_BYTES, PITCH, THREADS, true>(dst, head0, page_bytes, pages, i, limit, skip);
  else
    copy_piece_rows<ROW_BYTES, PITCH, THREADS, false>(dst, head0, page_bytes, pages, i, limit, skip);
}

// The piece at kb of the dtype's cache into sK and sV (rows of pitch<D>() elements), rows
// [0, n - kb) from the cache, the rest zeros, row skip - kb left alone.
template <class T, int D, int THREADS>
__device__ __forceinline__ void load_piece(T* sK, T* sV, const PagedKv<T>& kv, int s, int h, int kb, int n, int skip,
                                           int i) {
  const int limit = min(kPiece, n - kb);
  const PiecePages pages = piece_pages(kv, s, kb, limit);
  const int64_t head = int64_t(h) * kPageTokens * D, page_bytes = kv.page_stride * int64_t(sizeof(T));
  constexpr int kRow = D * int(sizeof(T)), kPitch = pitch<D>() * int(sizeof(T));
  const int r_skip = skip >= kb && skip < kb + kPiece ? skip - kb : -1;
  copy_piece_rows<kRow, kPitch, THREADS>(reinterpret_cast<unsigned char*>(sK),
                                         reinterpret_cast<const unsigned char*>(kv.k + head), page_bytes, pages, i,
                                         limit, r_skip);
  copy_piece_rows<kRow, kPitch, THREADS>(reinterpret_cast<unsigned char*>(sV),
                                         reinterpret_cast<const unsigned char*>(kv.v + head), page_bytes, pages, i,
                                         limit, r_skip);
}

// One row of sK and sV (row r) from k and v (head_dim elements each), by the warp's lanes.
template <class T, int D>
__device__ __forceinline__ void load_row(T* sK, T* sV, int r, const T* k, const T* v, int lane) {
  constexpr int kChunks = D / 8;
  for (int c = lane; c < 2 * kChunks; c += 32) {
    const bool is_v = c >= kChunks;
    const int d = 8 * (is_v ? c - kChunks : c);
    cp_async16((is_v ? sV : sK) + r * pitch<D>() + d, (is_v ? v : k) + d, 16);
  }
}

// ---- FP8 K/V --------------------------------------------------------------------------------
//
// An FP8 piece comes into shared memory as bytes and scales (cp.async). K stays bytes: the
// scores' mma operands are converted from them in registers (two E4M3 to two halves, one
// instruction) and each position's S is multiplied by its K scale after the mma (a power of
// two: the same as scaling K first, with no rounding of q * s in the dtype). V stays bytes
// too: V's scales ride on P, and P V's operands are paired from the bytes (decode,
// attention_tiles_decode.cu) or read from the bytes widened to T (context: widen_values). So
// after the load both kernels run the same arithmetic on the same values, and a row's bits
// still depend on its position alone. The decode's new token is quantised in the kernel
// exactly as kv_cache_append quantises it.

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

// A staged FP8 piece: K bytes [kPiece][fp8_pitch], V bytes, K scales [kPiece], V scales. A
// row is head_dim bytes plus 16, so the 8 positions of a B fragment fall in 8 bank groups.
template <int D>
constexpr int fp8_pitch() {
  return D + 16;
}
template <int D>
constexpr size_t fp8_stage_bytes() {
  return size_t(2) * kPiece * fp8_pitch<D>() + size_t(2) * kPiece * sizeof(float);
}
template <int D>
__device__ __forceinline__ float* fp8_stage_scales(uint8_t* st) {  // K's, then V's
  return reinterpret_cast<float*>(st + 2 * kPiece * fp8_pitch<D>());
}

// The FP8 piece at kb into st: rows [0, n - kb) from the cache (bytes and scales), the rest
// zeros (a scale chunk of four rows reads only its rows inside: past the sequence's end a page
// holds whatever an earlier sequence left there). A page's kPageTokens scales of a head are
// contiguous (64 bytes, 16-byte aligned: a page's bytes are a multiple of 16). The decode's
// new token is loaded with the rest and replaced in shared memory once the piece is in.
// In two parts, so that the decode can wait for each on its own: what the scores read (K's
// bytes, K's and V's scales: P carries V's scales) and what P V reads (V's bytes); both read
// the piece's pages from one Fp8PieceRows.
struct Fp8PieceRows {
  PiecePages pages;
  int limit;  // rows [0, limit) are the sequence's
};
__device__ __forceinline__ Fp8PieceRows fp8_piece_rows(const Fp8Kv& f, int s, int kb, int n) {
  const int limit = min(kPiece, n - kb);
  return {piece_pages(f.kv, s, kb, limit), limit};
}
template <int D, int THREADS>
__device__ __forceinline__ void load_piece_fp8_keys(uint8_t* st, const Fp8Kv& f, int h, const Fp8PieceRows& r, int i) {
  constexpr int KP = fp8_pitch<D>();
  copy_piece_rows<D, KP, THREADS>(st, f.kv.k + int64_t(h) * kPageTokens * D, f.kv.page_stride, r.pages, i, r.limit,
                                  -1);
  constexpr int kScaleChunks = kPiece / 4;  // 16 bytes: four positions' scales
  float* sks = fp8_stage_scales<D>(st);
  for (int c = i; c < 2 * kScaleChunks; c += THREADS) {
    const bool v = c >= kScaleChunks;
    const int row = 4 * (v ? c - kScaleChunks : c);
    const float* src = (v ? f.vs : f.ks) + int64_t(page_of(r.pages, row / kPageTokens)) * f.scale_page_stride +
                       int64_t(h) * kPageTokens + row % kPageTokens;
    cp_async16(sks + (v ? kPiece : 0) + row, src, 4 * min(4, max(0, r.limit - row)));
  }
}
template <int D, int THREADS>
__device__ __forceinline__ void load_piece_fp8_values(uint8_t* st, const Fp8Kv& f, int h, const Fp8PieceRows& r,
                                                      int i) {
  constexpr int KP = fp8_pitch<D>();
  copy_piece_rows<D, KP, THREADS>(st + kPiece * KP, f.kv.v + int64_t(h) * kPageTokens * D, f.kv.page_stride, r.pages,
                                  i, r.limit, -1);
}
template <int D, int THREADS>
__device__ __forceinline__ void load_piece_fp8(uint8_t* st, const Fp8Kv& f, int s, int h, int kb, int n, int i) {
  const Fp8PieceRows r = fp8_piece_rows(f, s, kb, n);
  load_piece_fp8_keys<D, THREADS>(st, f, h, r, i);
  load_piece_fp8_values<D, THREADS>(st, f, h, r, i);
}

// The decode's new token in FP8: its K and V heads quantised once, as kv_cache_append
// quantises them (the scales of the heads, then e4m3(x / s) with s a power of two, here
// x times 1 / s: the same rounding of the same exact value), for both the cache and the
// staged piece. A lane holds elements lane, lane + 32, ... (kPer of them) of each.
template <int D>
struct NewTokenFp8 {
  static constexpr int kPer = (D + 31) / 32;
  uint8_t k[kPer], v[kPer];
  float s[2];  // K's and V's scale
};
// k_at(d), v_at(d): element d of the new K and V head as a float (a value of T).
template <int D, class KAt, class VAt>
__device__ __forceinline__ NewTokenFp8<D> new_token_fp8(KAt k_at, VAt v_at) {
  constexpr int kPer = NewTokenFp8<D>::kPer;
  const int lane = threadIdx.x & 31;
  float k[kPer], v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    k[i] = d < D ? k_at(d) : 0.f, v[i] = d < D ? v_at(d) : 0.f;
  }
  NewTokenFp8<D> n;
  n.s[0] = quantize_kv_head(k, n.k);
  n.s[1] = quantize_kv_head(v, n.v);
  return n;
}

template <class T, int D>
__device__ __forceinline__ NewTokenFp8<D> new_token_fp8(const T* new_k, const T* new_v) {
  return new_token_fp8<D>([&](int d) { return to_float(new_k[d]); }, [&](int d) { return to_float(new_v[d]); });
}

// A decode row's q, new K and new V from the QKV product's deferred FP8 epilogue (Fp8Sums,
// fp8.h) instead of its output row: row r of the sums, N = 3C columns. at(c) is column c as
// the epilogue would have stored it (a value of T), pair(c) columns c and c + 1 packed as T
// (c even): the bits the decode reads from qkv otherwise.
template <class T>
struct QkvSumsRow {
  Fp8Sums x;          // a copy: a reference to the kernel's parameter would put it in local memory
  const __half* row;  // the row's sums
  float row_scale;
  __device__ QkvSumsRow(const Fp8Sums& sums, int64_t r, int64_t N)
      : x(sums), row(sums.sums + r * N), row_scale(sums.row_scales[r]) {}
  __device__ float value(float sum, int64_t c) const {
    return epilogue_value<T>(sum, x.unscale, row_scale, x.col_scales, static_cast<const T*>(x.bias), c, 0);
  }
  __device__ float at(int64_t c) const { return to_float(from_float<T>(value(__half2float(row[c]), c))); }
  __device__ uint32_t pair(int64_t c) const {
    const float2 s = __half22float2(*reinterpret_cast<const __half2*>(row + c));
    return pack_pair<T>(value(s.x, c), value(s.y, c + 1));
  }
};

// load_q<D, true>'s fragments for the decode's one row (lanes 0-3 hold tile row 0; the rest
// zeros) from a deferred epilogue: the row's q at column c0 on (its head), the same values.
// Every lane makes four elements (4 lane to 4 lane + 3: two pairs), and lane t of 0-3 takes
// 16-step kk's pairs (elements 16 kk + 4t on) from lane 4 kk + t: one round of loads and
// arithmetic for the warp, not D / 4 on four lanes.
template <class T, int D>
__device__ __forceinline__ void load_q_sums(uint32_t (&q)[D / 16][4], const QkvSumsRow<T>& row, int64_t c0) {
  static_assert(D <= 128, "a 16-step's pairs come from lanes 4 kk to 4 kk + 3");
  const int lane = threadIdx.x & 31;
  uint32_t lo = 0u, hi = 0u;
  if (4 * lane < D) lo = row.pair(c0 + 4 * lane), hi = row.pair(c0 + 4 * lane + 2);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int from = 4 * kk + (lane & 3);
    const uint32_t a = __shfl_sync(0xffffffffu, lo, from), b = __shfl_sync(0xffffffffu, hi, from);
    q[kk][0] = lane < 4 ? a : 0u;
    q[kk][1] = 0u;
    q[kk][2] = lane < 4 ? b : 0u;
    q[kk][3] = 0u;
  }
}

// Decode: the new token's K and V bytes and scales into the staged piece (its row r =
// t_new - kb), as kv_cache_append stores them, so the piece reads it as any cached position.
// The parts of load_piece_fp8: K's bytes and both scales (KEYS), or V's bytes.
template <int D, bool KEYS>
__device__ __forceinline__ void stage_new_token(uint8_t* st, int r, const NewTokenFp8<D>& n) {
  constexpr int KP = fp8_pitch<D>();
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < NewTokenFp8<D>::kPer; ++i)
    if (const int d = lane + 32 * i; d < D) {
      if constexpr (KEYS) st[r * KP + d] = n.k[i];
      else st[(kPiece + r) * KP + d] = n.v[i];
    }
  if (KEYS && lane == 0) fp8_stage_scales<D>(st)[r] = n.s[0], fp8_stage_scales<D>(st)[kPiece + r] = n.s[1];
}

// Two E4M3 bytes as an mma operand register of T (the lower byte in the lower half): exact.
// e4m3_pair() takes them as 16 bits; e4m3_half() takes the lower or upper half of a 32-bit word
// (one conversion reading that half, no shift before it).
template <class T>
__device__ __forceinline__ uint32_t halves_as(uint32_t h2) {
  if constexpr (std::is_same_v<T, __half>) {
    return h2;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}
template <class T>
__device__ __forceinline__ uint32_t e4m3_pair(uint16_t bytes) {
  const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bytes), __NV_E4M3));
  return halves_as<T>(*reinterpret_cast<const uint32_t*>(&h));
}
template <class T, bool UPPER>
__device__ __forceinline__ uint32_t e4m3_half(uint32_t w) {
  uint32_t h;
  if constexpr (UPPER)
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(h) : "r"(w));
  else
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(h) : "r"(w));
  return halves_as<T>(h);
}

// O of a piece times S, row r by S[r] (a power of two: exact unless it leaves fp32's range).
template <int D>
__device__ __forceinline__ void scale_values(TileState<D>& st_out, const float (&S)[2]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st_out.o[j][e] = __fmul_rn(st_out.o[j][e], S[e >> 1]);
}

// S of the lane's rows g and g + 8 (at positions pos[0], pos[1]): the largest V scale of the
// staged piece's positions kb to pos[r], the positions the row sees (a power of two; 1 where
// that is none, or all zeros: the row's P times those bytes is zero either way). A row's S
// depends on its own positions alone: a later position of the piece (a prompt's next rows in
// the context kernel, what a page held past the sequence's end) never enters it, so decode
// and context give the row the same S, and a P below T's normal range rounds the same way
// in both. Every lane of the warp takes part (shuffles).
template <int D, int R = 2>
__device__ __forceinline__ void v_scale_rows(float (&S)[R], const uint8_t* st, int kb, const int (&pos)[R]) {
  const float* vs = fp8_stage_scales<D>(const_cast<uint8_t*>(st)) + kPiece;
  const int lane = threadIdx.x & 31;
  float lo = vs[lane], hi = vs[lane + 32];  // then their running maximum from position 0
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float a = __shfl_up_sync(0xffffffffu, lo, d), b = __shfl_up_sync(0xffffffffu, hi, d);
    if (lane >= d) lo = fmaxf(lo, a), hi = fmaxf(hi, b);
  }
  hi = fmaxf(hi, __shfl_sync(0xffffffffu, lo, 31));
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = min(max(pos[r] - kb, 0), kPiece - 1);
    const float a = __shfl_sync(0xffffffffu, lo, i & 31), b = __shfl_sync(0xffffffffu, hi, i & 31);
    const float m = i < 32 ? a : b;
    S[r] = m > 0.f ? m : 1.f;
  }
}

// piece_scores() over a staged FP8 piece (st: its bytes and scales, load_piece_fp8's layout):
// the same mma steps in the same order, each B fragment converted from the bytes, then S
// times the position's K scale. A lane's B fragment of a 16-step is four neighbouring bytes of
// its position 8j + g (elements 4t to 4t + 3 of the step: one 32-bit load), so the step's
// elements go in load_q<D, true>'s order. S: v_scale_rows() of the piece.
template <class T, int D>
__device__ __forceinline__ void piece_scores_fp8(TileState<D>& st_out, uint32_t (&p)[4][4],
                                                 const uint32_t (&q)[D / 16][4], const uint8_t* st, int kb,
                                                 const int (&pos)[2], float scale_log2, const float (&S)[2]) {
  constexpr int KP = fp8_pitch<D>();
  const int lane = threadIdx.x & 31, t = lane & 3, g = lane >> 2;
  float s[8][4];
  zero_fragments(s);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(st + (8 * j + g) * KP + 16 * kk + 4 * t);
      mma_m16n8k16<T>(s[j], q[kk], e4m3_half<T, false>(w), e4m3_half<T, true>(w));
    }
  const float* ks = fp8_stage_scales<D>(const_cast<uint8_t*>(st));
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 sc = *reinterpret_cast<const float2*>(ks + 8 * j + 2 * t);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      s[j][2 * r] = __fmul_rn(s[j][2 * r], sc.x), s[j][2 * r + 1] = __fmul_rn(s[j][2 * r + 1], sc.y);
  }
  const float* vs = ks + kPiece;
  const float rcp[2] = {__frcp_rn(S[0]), __frcp_rn(S[1])};
  scores_to_p<T>(st_out.m, st_out.l, p, s, kb, pos, scale_log2, vs, rcp);
}

// ---- FP8 V's scales on P -----------------------------------------------------------------
//
// The V bytes carry no scale, so the scale goes on P: position p's P is rnd_T(e * s_p / S),
// S the largest V scale of the positions the row sees in the piece (v_scale_rows; a power of
// two, as every s_p), and the row's O is multiplied by S after the mma. Every s_p / S is a
// power of two at most 1, so the products are rnd_T(e) * s_p * q exactly as P times the
// dequantised V (q * s_p) gave them, unless e * s_p / S falls below T's normal range. The
// decode pairs V's bytes into its mma operands (attention_tiles_decode.cu); the context
// kernel reads the same values from a widened tile.

// The context kernel's P V over FP8 V: its four warps share one widening of the piece's V
// bytes into a tile of T (exact, no scale: widen_values), which piece_values() reads, then O
// times S as above. Each element of O is the same dot product as the decode's, over the same
// values in the same 16-steps, so the two give every element the same bits (FP8
// decode-equals-context test).
template <class T, int D>
__device__ __forceinline__ void widen_values(T* sV, const uint8_t* st, int i, int threads) {
  constexpr int kChunks = D / 16, KP = fp8_pitch<D>();
  for (int c = i; c < kPiece * kChunks; c += threads) {
    const int r = c / kChunks, d = (c % kChunks) * 16;
    const uint4 q = *reinterpret_cast<const uint4*>(st + (kPiece + r) * KP + d);
    const uint16_t* pairs = reinterpret_cast<const uint16_t*>(&q);
    uint32_t x[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = e4m3_pair<T>(pairs[k]);
    T* dst = sV + r * pitch<D>() + d;
    *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<uint4*>(dst + 8) = make_uint4(x[4], x[5], x[6], x[7]);
  }
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

// The FP8 side of a K/V layer view (empty when the cache holds the dtype).
inline Fp8Kv fp8_view(const KvLayerView& view, int64_t head_dim) {
  Fp8Kv f;
  if (!view.fp8()) return f;
  f.kv = paged<uint8_t>(view, int(head_dim));
  f.ks = view.k_scale, f.vs = view.v_scale, f.scale_page_stride = view.scale_page_stride;
  return f;
}

}  // namespace
}  // namespace conveyor::cuda

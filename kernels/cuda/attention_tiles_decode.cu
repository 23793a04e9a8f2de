// The decode kernel of the tile order (attention_tiles.cuh says the order): one warp per
// (row, head, z), spread over the GPU when the batch is small.
#include "kernels/cuda/attention_tiles.cuh"

namespace conveyor::cuda {
namespace {

using namespace detail;

// ---- the piece as the mma's A operand ---------------------------------------------------------
//
// The decode has one query row. Where the context kernel puts its 16 query rows in the mma's
// A operand, the decode puts the piece there: S^T = K q^T and O^T = V^T P^T, with q (and
// P) as column 0 of B, held by lanes 0-3. A tile then covers 16 positions (or 16 elements of
// V), not 8: a piece takes half the mmas, every A register is converted bytes (no zero rows to
// fill), and the softmax runs on 8 values a lane, not 16. Each element of S and O is the same
// dot product as the context kernel's, over the same k in the same 16-steps from zero, so it
// has the same bits (the decode-equals-context tests hold it). Column 0 of the results sits
// on the lanes g = lane / 4 with t = lane % 4 = 0: S of positions 16j + g and 16j + g + 8
// (registers 0 and 2 of tile j), O of the elements col_element(i, g) and (i, g + 8) over FP8
// K/V, 16i + g and 16i + g + 8 over bf16/fp16. The other lanes compute columns 1-7 (zeros, or
// values never read).

// A piece's (or the running) state in the column layout: o[i][h] is O of element
// col_element(i, g + 8h) (FP8) or 16i + g + 8h (bf16/fp16), on the lanes t = 0; m and l of
// the one row (merge() takes this or TileState).
template <int D>
struct ColState {
  float o[D / 16][2];
  float m[1], l[1];
};

// The head's element at row r (0-15) of O^T's tile i. In a group of 32 elements, tiles 2k and
// 2k + 1 take the four neighbouring bytes 4g to 4g + 3 of V's rows (one 32-bit load); a last
// group of 16 (head_dim 16, 80) is one tile, two bytes 2g, 2g + 1.
template <int D>
__device__ __forceinline__ int col_element(int i, int r) {
  constexpr int kFull = D / 32;
  const int g = r & 7, h = r >> 3;
  if (i < 2 * kFull) return 32 * (i / 2) + 4 * g + 2 * (i % 2) + h;
  return 32 * kFull + 2 * g + h;
}

// S^T of the staged piece st (load_piece_fp8's layout): tile j (positions 16j to 16j + 15) over
// the head in 16-steps from zero. A's rows g and g + 8 are four bytes each of positions 16j + g
// and 16j + g + 8 (elements 4t to 4t + 3 of the step, load_q<D, true>'s order); qb[kk]: q's B
// fragment of step kk (load_q's registers 0 and 2).
template <class T, int D>
__device__ __forceinline__ void col_scores(float (&s)[4][4], const uint32_t (&qb)[D / 16][2], const uint8_t* st) {
  constexpr int KP = fp8_pitch<D>();
  const int lane = threadIdx.x & 31, t = lane & 3, g = lane >> 2;
  zero_fragments(s);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint8_t* r = st + (16 * j + g) * KP + 16 * kk + 4 * t;
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(r), w8 = *reinterpret_cast<const uint32_t*>(r + 8 * KP);
      const uint32_t a[4] = {e4m3_half<T, false>(w0), e4m3_half<T, false>(w8), e4m3_half<T, true>(w0),
                             e4m3_half<T, true>(w8)};
      mma_m16n8k16<T>(s[j], a, qb[kk][0], qb[kk][1]);
    }
}

// The softmax of scores_to_p() on the column layout (the same operations on each value, the
// sum in finish_class_sum's order: the lane's class g, then the lanes 4, 8 and 16 apart), and
// P as B fragments: pb[j] holds positions 16j + 2t, + 1 and 16j + 2t + 8, + 9 on lanes 0-3.
// FP8 (st, a staged piece: its scales): S times each position's K scale first, and P's fold
// by the V scales over S, the row's V scale (v_scale_rows); bf16/fp16 (st null): neither.
template <class T, int D, bool FP8 = true>
__device__ __forceinline__ void col_softmax(ColState<D>& out, uint32_t (&pb)[4][2], float (&s)[4][4], const uint8_t* st,
                                            int kb, int pos, float scale_log2, float S) {
  const int lane = threadIdx.x & 31, t = lane & 3, g = lane >> 2;
  const float* ks = FP8 ? fp8_stage_scales<D>(const_cast<uint8_t*>(st)) : nullptr;
  const float* vs = FP8 ? ks + kPiece : nullptr;
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 16 * j + 8 * h + g;
      const float x = FP8 ? __fmul_rn(s[j][2 * h], ks[i]) : s[j][2 * h];
      s[j][2 * h] = kb + i <= pos ? __fmul_rn(x, scale_log2) : -INFINITY;
      mx = fmaxf(mx, s[j][2 * h]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
  const float base = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // positions g, g + 8, g + 16, ...: class g in order
      s[j][2 * h] = exp2f(__fsub_rn(s[j][2 * h], base));
      sum = __fadd_rn(sum, s[j][2 * h]);
    }
  out.m[0] = mx;
  out.l[0] = finish_class_sum<4, 16>(sum);
  const float rcp = __frcp_rn(S);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float e0 = FP8 ? __fmul_rn(s[j][0], __fmul_rn(vs[16 * j + g], rcp)) : s[j][0];
    const float e8 = FP8 ? __fmul_rn(s[j][2], __fmul_rn(vs[16 * j + g + 8], rcp)) : s[j][2];
    const uint32_t mine = pack_pair<T>(e0, e8);  // positions g, g + 8
    const uint32_t a = __shfl_sync(0xffffffffu, mine, 8 * t), b = __shfl_sync(0xffffffffu, mine, 8 * t + 4);
    pb[j][0] = __byte_perm(a, b, 0x5410);  // positions 2t, 2t + 1
    pb[j][1] = __byte_perm(a, b, 0x7632);  // 2t + 8, 2t + 9
  }
}

// O^T's tiles I and I + 1 (a group of 32 elements at V's byte column col; W: uint32_t) or tile I
// alone (a last group of 16; W: uint16_t) over the piece's four 16-steps of positions, times S,
// into out.o. A lane reads W of V's rows 2t, 2t + 1, 2t + 8, 2t + 9 of each step and pairs
// the positions' bytes (prmt): one element of two positions a register.
template <class T, int D, class W>
__device__ __forceinline__ void col_values_group(ColState<D>& out, const uint32_t (&pb)[4][2], const uint8_t* sv, int I,
                                                 int col, float S) {
  constexpr int KP = fp8_pitch<D>(), N = sizeof(W) == 4 ? 2 : 1;
  const int t = threadIdx.x & 3;
  float o[N][4];
  zero_fragments(o);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint8_t* r = sv + (16 * kk + 2 * t) * KP + col;
    const uint32_t w0 = *reinterpret_cast<const W*>(r), w1 = *reinterpret_cast<const W*>(r + KP);
    const uint32_t w8 = *reinterpret_cast<const W*>(r + 8 * KP), w9 = *reinterpret_cast<const W*>(r + 9 * KP);
#pragma unroll
    for (int n = 0; n < N; ++n) {  // bytes 2n (rows g) and 2n + 1 (rows g + 8) of the words
      const uint32_t lo = __byte_perm(w0, w1, n == 0 ? 0x5140 : 0x7362);
      const uint32_t hi = __byte_perm(w8, w9, n == 0 ? 0x5140 : 0x7362);
      const uint32_t a[4] = {e4m3_half<T, false>(lo), e4m3_half<T, true>(lo), e4m3_half<T, false>(hi),
                             e4m3_half<T, true>(hi)};
      mma_m16n8k16<T>(o[n], a, pb[kk][0], pb[kk][1]);
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) out.o[I + n][0] = __fmul_rn(o[n][0], S), out.o[I + n][1] = __fmul_rn(o[n][2], S);
}

template <class T, int D>
__device__ __forceinline__ void col_values(ColState<D>& out, const uint32_t (&pb)[4][2], const uint8_t* st, float S) {
  constexpr int kFull = D / 32;
  static_assert(kPiece == 64 && D % 16 == 0, "four 16-steps of positions; whole 16-element tiles");
  const int g = (threadIdx.x & 31) >> 2;
  const uint8_t* sv = st + kPiece * fp8_pitch<D>();
#pragma unroll
  for (int k = 0; k < kFull; ++k) col_values_group<T, D, uint32_t>(out, pb, sv, 2 * k, 32 * k + 4 * g, S);
  if constexpr (D % 32 == 16) col_values_group<T, D, uint16_t>(out, pb, sv, 2 * kFull, 32 * kFull + 2 * g, S);
}

// bf16/fp16 K/V in the column layout: the same ldmatrix loads as piece_scores() and
// piece_values() (load_k_tile, load_vt_tile: the row-major fragments of a K or V^T tile are
// those of B there), the registers taken as A: S^T tile j over the head's 16-steps from zero,
// O^T tile i (elements 16i to 16i + 15) over the piece's four 16-steps of positions.
template <class T, int D>
__device__ __forceinline__ void col_scores_dtype(float (&s)[4][4], const uint32_t (&qb)[D / 16][2], const T* sK) {
  zero_fragments(s);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b[4];
      load_k_tile<T, D>(b, sK, j, kk);
      const uint32_t a[4] = {b[0], b[2], b[1], b[3]};
      mma_m16n8k16<T>(s[j], a, qb[kk][0], qb[kk][1]);
    }
}
template <class T, int D>
__device__ __forceinline__ void col_values_dtype(ColState<D>& out, const uint32_t (&pb)[4][2], const T* sV) {
  float o[D / 16][4];
  zero_fragments(o);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      uint32_t b[4];
      load_vt_tile<T, D>(b, sV, kk, i);
      const uint32_t a[4] = {b[0], b[2], b[1], b[3]};
      mma_m16n8k16<T>(o[i], a, pb[kk][0], pb[kk][1]);
    }
#pragma unroll
  for (int i = 0; i < D / 16; ++i) out.o[i][0] = o[i][0], out.o[i][1] = o[i][2];
}

// The lanes holding the state's O (t = 0) call put(element, value) for each of their elements.
template <int D, bool FP8, class Put>
__device__ __forceinline__ void for_each_element(const ColState<D>& st, Put put) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  if ((lane & 3) != 0) return;
#pragma unroll
  for (int i = 0; i < D / 16; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) put(FP8 ? col_element<D>(i, g + 8 * h) : 16 * i + g + 8 * h, st.o[i][h]);
}

// ---- decode ---------------------------------------------------------------------------------

// The row's piece state into the workspace: {m, l, O[D], pad}, O in the head's element order.
template <int D, bool FP8>
__device__ __forceinline__ void store_partial(float* part, const ColState<D>& piece) {
  if ((threadIdx.x & 31) == 0) part[0] = piece.m[0], part[1] = piece.l[0];
  for_each_element<D, FP8>(piece, [&](int d, float v) { part[2 + d] = v; });
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

// Shared memory of one decode warp: its piece tile (K and V; six warps a SM), or (FP8) one
// staged piece (bytes and scales; eight warps a SM). Measured on the H100 (gpt3-6.7b heads):
// two whole staged pieces a warp (six warps a SM) took 175 us at batch 256 x 128 positions
// against 134, three (four warps) 229; at 1,024 positions and more all three were within 3%.
// So the FP8 piece is staged in its two parts instead (decode_pieces_fp8).
template <class T, int D, bool FP8>
constexpr size_t decode_warp_smem() {
  return FP8 ? fp8_stage_bytes<D>() : piece_smem_bytes<D>(sizeof(T));
}

// A decode warp's row: sequence s, head h, the K/V length, and the new token at t_new (new_k,
// new_v: its K and V in the QKV projection's output).
template <class T>
struct DecodeRow {
  int s, h, kv_len, t_new;
  const T* new_k;
  const T* new_v;
};

// The fused append: the new token's K and V into the cache (FP8: its bytes and scales, n).
template <class T, int D, bool FP8>
__device__ __forceinline__ void append_new_token(PagedKv<T> kv, Fp8Kv f8, const DecodeRow<T>& row,
                                                 const NewTokenFp8<D>& n, int lane) {
  const int s = row.s, h = row.h, t_new = row.t_new;
  if constexpr (FP8) {
    uint8_t* kd = f8.kv.k + f8.kv.offset(s, h, t_new);
    uint8_t* vd = f8.kv.v + f8.kv.offset(s, h, t_new);
#pragma unroll
    for (int i = 0; i < NewTokenFp8<D>::kPer; ++i)
      if (const int d = lane + 32 * i; d < D) kd[d] = n.k[i], vd[d] = n.v[i];
    if (lane == 0) {
      const int64_t o = f8.scale_offset(s, h, t_new);
      const_cast<float*>(f8.ks)[o] = n.s[0];
      const_cast<float*>(f8.vs)[o] = n.s[1];
    }
  } else {
    T* kd = kv.k + kv.offset(s, h, t_new);
    T* vd = kv.v + kv.offset(s, h, t_new);
    for (int d = lane * 8; d < D; d += 32 * 8) {
      *reinterpret_cast<uint4*>(kd + d) = *reinterpret_cast<const uint4*>(row.new_k + d);
      *reinterpret_cast<uint4*>(vd + d) = *reinterpret_cast<const uint4*>(row.new_v + d);
    }
  }
}

// The row's output: O / L, lane by lane over the head's elements. The lanes holding the row
// (run) put O and L in `scratch` (the warp's shared memory, free now), so that every lane
// takes its share of the divisions.
template <class T, int D, bool FP8>
__device__ __forceinline__ void store_decode_row(T* o, const ColState<D>& run, float* scratch, int lane) {
  __syncwarp();  // every lane is done with the staged pieces
  for_each_element<D, FP8>(run, [&](int d, float v) { scratch[d] = v; });
  if (lane == 0) scratch[D] = run.l[0];
  __syncwarp();
  const float L = scratch[D];
  for (int d = lane; d < D; d += 32) o[d] = from_float<T>(__fdiv_rn(scratch[d], L));
}

// How many of the Z warps launched for a row take its pieces: about one wave of the warps the
// GPU holds at once (`resident`) over the launch's rows, more when the row is long (a warp's
// pieces run one after another: one for every kLongPieces), never more than Z. A few rows of a
// few hundred positions spread Z ways (Z follows the longest row the stage allows) ran at a
// third of the bandwidth: most warps took one or two pieces and then the merge (48 heads, 8 x
// 512 on an H200: 50 us at Z = 3, 37 us at Z = 2; docs/PERFORMANCE.md). Every warp of a row
// computes the same number from the row's own length; the pieces' states are merged in piece
// order however many warps took them, so the row's bits do not depend on it.
constexpr int kLongPieces = 16;
__device__ __forceinline__ int row_spread(int Z, int pieces, int64_t row_warps, int resident) {
  const int wave = int(max(int64_t(1), int64_t(resident) / max(int64_t(1), row_warps)));
  const int by_length = (pieces + kLongPieces - 1) / kLongPieces;
  return max(1, min(Z, max(wave, by_length)));
}

// bf16/fp16: the pieces z, z + Z, ... of the row: each one's state, stored to parts
// (`spread`) or merged into run. One group in flight per piece, the next piece's issued as
// soon as this one's P V has read the tile. (Loading the next K during this piece's P V
// measured slower on the H100: 89% of the floor against 96% at batch 256.) The new token's
// K and V come from qkv, not the cache.
template <class T, int D>
__device__ __forceinline__ void decode_pieces(ColState<D>& run, float* parts, bool spread, T* sK, T* sV,
                                              const PagedKv<T>& kv, const DecodeRow<T>& row,
                                              const uint32_t (&qb)[D / 16][2], int z, int Z, int pieces, int lane,
                                              float scale_log2) {
  constexpr int kStride = D + 4;  // floats per piece state {m, l, O[D], pad}: 16-byte aligned
  const int s = row.s, h = row.h, kv_len = row.kv_len, t_new = row.t_new;
  ColState<D> piece;
  for (int pc = z; pc < pieces; pc += Z) {
    const int next = pc + Z < pieces ? pc + Z : -1;
    cp_async_wait<1>();  // all but the newest group: this piece's (the newest is empty)
    __syncwarp();
    {
      uint32_t pb[4][2];
      float sc[4][4];
      col_scores_dtype<T, D>(sc, qb, sK);
      col_softmax<T, D, false>(piece, pb, sc, nullptr, pc * kPiece, t_new, scale_log2, 1.f);
      col_values_dtype<T, D>(piece, pb, sV);
    }
    __syncwarp();  // every lane is done with this piece's K and V
    if (next >= 0) {
      load_piece<T, D, 32>(sK, sV, kv, s, h, next * kPiece, kv_len, t_new, lane);
      if (t_new / kPiece == next) load_row<T, D>(sK, sV, t_new - next * kPiece, row.new_k, row.new_v, lane);
    }
    cp_async_commit();
    cp_async_commit();
    if (spread) store_partial<D, false>(parts + int64_t(pc) * kStride, piece);
    else merge(run, piece, 0, pc == 0);
  }
}

// FP8: the pieces z, z + Z, ... through the one staged piece, whose two parts (load_piece_fp8's
// keys and values) come in as two groups: the next piece's keys are loaded as soon as this
// piece's scores have read them, and stream while P V reads this piece's values; the next
// values stream while the next scores run. (The kernel loaded the first piece.) The new token
// is put among its piece's staged positions first, each part once it is in.
template <class T, int D>
__device__ __forceinline__ void decode_pieces_fp8(ColState<D>& run, float* parts, bool spread, uint8_t* st,
                                                  const Fp8Kv& f8, const DecodeRow<T>& row,
                                                  const uint32_t (&qb)[D / 16][2], const NewTokenFp8<D>& n, int z,
                                                  int Z, int pieces, int lane, float scale_log2) {
  constexpr int kStride = D + 4;  // floats per piece state {m, l, O[D], pad}: 16-byte aligned
  const int t_new = row.t_new;
  const int pos[1] = {t_new};
  ColState<D> piece;
  for (int pc = z; pc < pieces; pc += Z) {
    const int next = pc + Z < pieces ? pc + Z : -1;
    const bool has_new = t_new / kPiece == pc;
    cp_async_wait<1>();  // this piece's keys (its values are the newest group)
    __syncwarp();
    if (has_new) {
      stage_new_token<D, true>(st, t_new - pc * kPiece, n);
      __syncwarp();
    }
    uint32_t pb[4][2];
    float S[1], s[4][4];
    v_scale_rows<D>(S, st, pc * kPiece, pos);
    col_scores<T, D>(s, qb, st);
    col_softmax<T, D>(piece, pb, s, st, pc * kPiece, t_new, scale_log2, S[0]);
    __syncwarp();  // the keys and scales are free
    Fp8PieceRows next_rows{};
    if (next >= 0) {
      next_rows = fp8_piece_rows(f8, row.s, next * kPiece, row.kv_len);
      load_piece_fp8_keys<D, 32>(st, f8, row.h, next_rows, lane);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this piece's values (the next keys are the newest group)
    __syncwarp();
    if (has_new) {
      stage_new_token<D, false>(st, t_new - pc * kPiece, n);
      __syncwarp();
    }
    col_values<T, D>(piece, pb, st, S[0]);
    __syncwarp();  // the values are free
    if (next >= 0) load_piece_fp8_values<D, 32>(st, f8, row.h, next_rows, lane);
    cp_async_commit();
    if (spread) store_partial<D, true>(parts + int64_t(pc) * kStride, piece);
    else merge(run, piece, 0, pc == z);
  }
}

// SUMS (FP8 K/V only): q and the new token come from the QKV product's deferred epilogue
// (qkv_sums), not from qkv.
template <class T, int D, bool FP8, bool SUMS>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_tiles_kernel(T* __restrict__ out, const T* qkv, Fp8Sums qkv_sums, PagedKv<T> kv, Fp8Kv f8,
                        const int32_t* __restrict__ kv_lens, int rows, int n_head, int Z, int resident,
                        float scale_log2, int max_pieces, float* partial, int* counters) {
  static_assert(FP8 || !SUMS, "the deferred epilogue is read by the FP8 K/V path");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  grid_dependents_launch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * kDecodeWarps + warp;
  if (item >= int64_t(rows) * n_head * Z) return;  // no block-wide barrier below
  // z-major: the warps of z = 0 of every (row, head) first, then z = 1, ...: a row that uses
  // fewer than Z (row_spread) leaves whole blocks at the grid's end idle, not a warp in each.
  const int64_t row_heads = int64_t(rows) * n_head;
  const int z = int(item / row_heads), h = int(item % row_heads % n_head), s = int(item % row_heads / n_head);
  const int kv_len = kv_lens[s];
  if (kv_len <= 0) return;  // padding row
  const int pieces = (kv_len + kPiece - 1) / kPiece;
  const int Zr = row_spread(Z, pieces, row_heads, resident);  // the warps this row uses
  if (z >= min(Zr, pieces)) return;
  unsigned char* mine = smem_raw + size_t(warp) * decode_warp_smem<T, D, FP8>();
  T* sK = reinterpret_cast<T*>(mine);
  T* sV = sK + kPiece * pitch<D>();                          // bf16/fp16
  uint8_t* st = reinterpret_cast<uint8_t*>(mine);  // FP8
  const int t_new = kv_len - 1;
  const int64_t C = int64_t(n_head) * D;
  const int64_t q_col = int64_t(h) * D;  // the head's q in the row's 3C columns; its K at + C, V at + 2C
  const T* q_row = SUMS ? nullptr : qkv + int64_t(s) * 3 * C + q_col;
  const T* new_k = SUMS ? nullptr : q_row + C;
  const T* new_v = SUMS ? nullptr : q_row + 2 * C;
  const DecodeRow<T> row{s, h, kv_len, t_new, new_k, new_v};

  // The first pieces' cached positions stream before the wait (written by earlier steps);
  // q and the new token are the QKV projection's output. (FP8 loads the new token's slot
  // too, and replaces it in shared memory once its piece is in.)
  if constexpr (FP8) {
    const Fp8PieceRows first = fp8_piece_rows(f8, s, z * kPiece, kv_len);  // z < pieces
    load_piece_fp8_keys<D, 32>(st, f8, h, first, lane);
    cp_async_commit();
    load_piece_fp8_values<D, 32>(st, f8, h, first, lane);
    cp_async_commit();  // two groups a piece: keys, then values
    grid_dependency_wait();
  } else {
    load_piece<T, D, 32>(sK, sV, kv, s, h, z * kPiece, kv_len, t_new, lane);
    grid_dependency_wait();
    if (t_new / kPiece == z) load_row<T, D>(sK, sV, t_new - z * kPiece, new_k, new_v, lane);
    cp_async_commit();
    cp_async_commit();  // an empty group: one group per piece, the newest always empty at a wait
  }
  // q, and the new token quantised (FP8), from qkv or from the deferred epilogue's sums.
  NewTokenFp8<D> n{};
  uint32_t q[D / 16][4];
  if constexpr (SUMS) {
    const QkvSumsRow<T> sums(qkv_sums, s, 3 * C);
    n = new_token_fp8<D>([&](int d) { return sums.at(C + q_col + d); },
                         [&](int d) { return sums.at(2 * C + q_col + d); });
    load_q_sums<T, D>(q, sums, q_col);
  } else {
    if constexpr (FP8) n = new_token_fp8<T, D>(new_k, new_v);
    load_q<D, FP8>(q, (lane >> 2) == 0 ? q_row : nullptr, nullptr);
  }
  if (z == 0) append_new_token<T, D, FP8>(kv, f8, row, n, lane);
  const bool spread = Zr > 1 && pieces > 1;
  constexpr int kStride = D + 4;  // floats per piece state {m, l, O[D], pad}: 16-byte aligned
  float* parts = partial + (int64_t(s) * n_head + h) * max_pieces * kStride;
  ColState<D> run;
  uint32_t qb[D / 16][2];  // q as B (load_q's registers 0 and 2)
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) qb[kk][0] = q[kk][0], qb[kk][1] = q[kk][2];
  if constexpr (FP8) decode_pieces_fp8<T, D>(run, parts, spread, st, f8, row, qb, n, z, Zr, pieces, lane, scale_log2);
  else decode_pieces<T, D>(run, parts, spread, sK, sV, kv, row, qb, z, Zr, pieces, lane, scale_log2);
  cp_async_wait<0>();
  T* o = out + int64_t(s) * C + int64_t(h) * D;
  if (!spread) {
    store_decode_row<T, D, FP8>(o, run, reinterpret_cast<float*>(mine), lane);
    return;
  }
  merge_spread<T, D>(o, parts, pieces, min(Zr, pieces), counters + int64_t(s) * n_head + h,
                     reinterpret_cast<float*>(mine), decode_warp_smem<T, D, FP8>());
}

}  // namespace

bool tile_order_head_dim(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 80 || D == 96 || D == 128; }

int64_t tile_pieces(int64_t max_kv_len) { return std::max<int64_t>(1, (max_kv_len + kPiece - 1) / kPiece); }

int64_t tile_partial_floats(int64_t rows, int64_t n_head, int64_t head_dim, int64_t max_kv_len) {
  return rows * n_head * tile_pieces(max_kv_len) * (head_dim + 4);
}

// A small batch's warps spread until there are about 8 per SM (six to eight are resident at
// a time). Measured on the H100: spreading further (eight waves) was slower, the pieces'
// states written and merged costing more than the shorter tail saves. 8 against 16, once a
// decode warp kept only its own row (2026-11-27, two rounds): gpt2-xl heads 64 x 4,096 fp16
// 651 -> 591 us and 16 x 4,096 FP8 126 -> 110; gpt3-6.7b 64 x 4,096 1,609 -> 1,487 (FP8
// 881 -> 783), 64 x 128 FP8 32.5 -> 30.6, 4 x 1,024 and 2 x 2,048 FP8 9% faster; slower:
// gpt3-6.7b 16 x 4,096 FP8 230 -> 249 (three warps a row: 1.45 waves) and 32 x 4,096 fp16
// by 1%; the rest within 1%.
constexpr int64_t kSpreadWarpsPerSm = 8;

int tile_decode_splits(int64_t rows, int64_t n_head, int64_t head_dim, const DecodeWorkspace& ws) {
  const int64_t pieces = tile_pieces(ws.max_kv_len);
  if (pieces <= 1 || !ws.partial || !ws.counters || rows * n_head > ws.counter_entries ||
      tile_partial_floats(rows, n_head, head_dim, ws.max_kv_len) > ws.partial_floats)
    return 1;
  const int64_t warps = std::max<int64_t>(1, rows * n_head);
  const int64_t want = (int64_t(sm_count()) * kSpreadWarpsPerSm + warps - 1) / warps;
  return int(std::clamp<int64_t>(want, 1, pieces));
}

int64_t tile_spread_rows(int64_t n_head, int num_sms) {
  return std::max<int64_t>(0, (int64_t(num_sms) * kSpreadWarpsPerSm - 1) / std::max<int64_t>(1, n_head));
}


// The decode's blocks an SM is given (its shared memory padded to leave room for no more): all
// it holds (per_sm), unless the grid is under two waves of them. There the last wave's few
// warps stream their rows' whole length alone, with most SMs idle. So the count whose waves
// come out most even, if by 5% or more, never under half. FP8 K/V, gpt3-6.7b's heads, batch
// 64 (2,048 warps) on an H200: 12 warps an SM (1.3 waves) against 8 (1.9 waves), us:
// 1,024 positions 159 -> 144, 4,096 614-649 -> 545, 129 29.0 -> 26.6; the FP8 step at batch
// 64 and 1,024 positions 8.9 -> 7.8 ms (2026-11-28).
namespace {
int decode_blocks_per_sm(int64_t blocks, int per_sm) {
  const int64_t sms = sm_count();
  if (blocks >= 2 * int64_t(per_sm) * sms) return per_sm;
  int best = per_sm;
  double best_even = 0.;
  for (int b = per_sm; 2 * b >= per_sm; --b) {
    const int64_t slots = int64_t(b) * sms;
    const double even = double(blocks) / double((blocks + slots - 1) / slots * slots);
    if (even > best_even + 0.05) best = b, best_even = even;
  }
  return best;
}
}  // namespace

template <class T>
void attention_decode_tiles(T* out, const T* qkv, const KvLayerView& view, const int32_t* kv_lens, int64_t num_rows,
                            int64_t n_head, int64_t head_dim, const DecodeWorkspace& ws, cudaStream_t stream,
                            Fp8Sums qkv_sums) {
  if (num_rows <= 0) return;
  if (qkv_sums && !view.fp8())
    throw Error("attention_decode (tile order): a deferred QKV epilogue is read with an FP8 K/V cache only");
  if (qkv_sums && (qkv_sums.row_scales == nullptr || qkv_sums.col_scales == nullptr))
    throw Error("attention_decode (tile order): the deferred QKV epilogue needs its row and column scales");
  if (!qkv_sums && qkv == nullptr) throw Error("attention_decode (tile order): qkv is null");
  const int Z = tile_decode_splits(num_rows, n_head, head_dim, ws);
  const int64_t warps = num_rows * n_head * Z;
  const int64_t blocks = (warps + kDecodeWarps - 1) / kDecodeWarps;
  if (blocks > INT32_MAX) throw Error("attention_decode (tile order): too many rows");
  const float scale_log2 = kLog2e / std::sqrt(float(head_dim));
  const auto kv = paged<T>(view, int(head_dim));
  const Fp8Kv f8 = fp8_view(view, head_dim);
  with_head_dim(head_dim, [&]<int D>() {
    auto launch = [&]<bool FP8, bool SUMS>() {
      const size_t natural = kDecodeWarps * decode_warp_smem<T, D, FP8>();
      // Both per kernel and device (launch.cuh): the first GPU's alone left a second GPU of the
      // process without the shared memory limit, and its launch failed (tensor parallel hung).
      allow_smem(decode_tiles_kernel<T, D, FP8, SUMS>, natural + spread_pad(1, natural));  // any b below
      const int per_sm = blocks_per_sm(decode_tiles_kernel<T, D, FP8, SUMS>, kDecodeWarps * 32, natural);
      const int b = decode_blocks_per_sm(blocks, per_sm);
      const size_t smem = natural + (b == per_sm ? 0 : spread_pad(int64_t(b) * sm_count(), natural));
      const int resident = b * kDecodeWarps * sm_count();  // warps the current GPU holds at once
      LAUNCH_PDL("decode_tiles_kernel", decode_tiles_kernel<T, D, FP8, SUMS>, dim3(unsigned(blocks)),
                 dim3(kDecodeWarps * 32), smem, stream, out, qkv, qkv_sums, kv, f8, kv_lens, int(num_rows),
                 int(n_head), Z, resident, scale_log2, int(tile_pieces(ws.max_kv_len)), ws.partial, ws.counters);
    };
    if (qkv_sums) launch.template operator()<true, true>();
    else if (view.fp8()) launch.template operator()<true, false>();
    else launch.template operator()<false, false>();
  });
}

template void attention_decode_tiles<half>(half*, const half*, const KvLayerView&, const int32_t*, int64_t, int64_t,
                                           int64_t, const DecodeWorkspace&, cudaStream_t, Fp8Sums);
template void attention_decode_tiles<bf16>(bf16*, const bf16*, const KvLayerView&, const int32_t*, int64_t, int64_t,
                                           int64_t, const DecodeWorkspace&, cudaStream_t, Fp8Sums);

}  // namespace conveyor::cuda

// The sequential-order GEMV (gemv.h): every output element is summed as cuBLASLt's
// unsplit tensor-core kernels sum it, so that small T can run here and large T on cuBLASLt
// with the same bits.
//
// Order: acc = 0; for k0 = 0, 16, 32, ... (increasing): acc = mma_k16(W[n, k0:k0+16],
// in[t, k0:k0+16], acc), one m16n8k16 tensor-core MMA (fp32 accumulation) per step, the 16
// products of a step in their natural positions; then out = round(acc). Whether Hopper's
// wgmma kernels inside cuBLASLt give the same bits as this mma.sync loop is a measurement,
// not a given: conveyor-bench-gemm-order compares them on every product shape.
//
// Layout of the work: one warp (one block) per 16 output rows n and up to 8 tokens t (the
// MMA's m16 x n8). The warp streams its 16 weight rows and the chunk's token rows together
// through kStages shared-memory stages of kChunk K-elements (cp.async, 16 bytes a lane; the
// first stages' weights are asked for before the kernel waits on the kernel before it, since
// weights never change) and reads the weights with ldmatrix (fp16/bf16) or dequantises their
// bytes in registers (int8), the tokens with 32-bit shared loads. No split along K, so the
// order above holds; the bandwidth comes from N / 16 warps with kStages - 1 stages of 8 KiB
// of weights each in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/int8_mma.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda::detail {
namespace {

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 16 weight rows (from n0; rows past N re-read the last) of chunk `chunk` (kChunk elements a
// row) into dst, in 16-byte pieces; pieces past K are zeros (adding +0 leaves a sum's bits).
// K a multiple of a piece's elements: a piece is wholly in or out.
template <int kChunk, class Elem, int kPitch>
__device__ __forceinline__ void load_weight_rows(Elem (*dst)[kPitch], const Elem* w, int chunk, int lane, int n0, int K,
                                                 int N) {
  constexpr int kPerPiece = 16 / int(sizeof(Elem)), kRowPieces = kChunk / kPerPiece;
  const int k0 = chunk * kChunk;
#pragma unroll
  for (int i = 0; i < 16 * kRowPieces / 32; ++i) {
    const int piece = lane + 32 * i, r = piece / kRowPieces, c = (piece % kRowPieces) * kPerPiece;
    const int row = min(n0 + r, N - 1);
    const bool in_k = k0 + c < K;
    cp_async16(&dst[r][c], w + int64_t(row) * K + (in_k ? k0 + c : 0), in_k ? 16 : 0);
  }
}

// The weights of a GEMV, as a policy of the kernel below: what a stage holds, how it is
// loaded, and how a step's A fragment (16 rows x 16 k) is made from it.
//
// HalfWeights: W in T. A stage is 16 rows x 256 k (512 contiguous bytes a row); the fragment
// comes by ldmatrix. Three stages of 16 weight rows and 8 token rows (37 KiB) let five warps
// share an SM. Since the grids spread over every SM (spread_smem), this beats the 128 k x 5
// stages of before (H100, 2026-11-27, us per call at T = 1, alone: gpt2-xl projection 6.55 ->
// 5.45, QKV 7.78 -> 7.48, FC 9.3 -> 9.2; gpt3-6.7b projection 14.7 -> 13.9, the rest within
// 1%; gpt2-xl's decode step 2.18-2.31 -> 2.09 ms). Measured there and not kept: 8 weight rows a
// warp as the MMA's B operand (256 k x 4 or 5 stages, 128 k x 9), and a stage of one token row
// at T = 1 (so eight warps fit an SM): each slower on gpt2-xl, by 2-20%.
// S = 2 (one stage in flight, nine warps an SM) serves the grids that three stages would
// run in more than one wave (gemv_seq).
template <class T, int S = 3>
struct HalfWeights {
  using Elem = T;
  static constexpr int kChunk = 256, kStages = S, kPitch = kChunk + 8;  // 16 bytes of padding: no bank conflicts
  const T* w;
  __device__ HalfWeights(const T* w_, const float*, int, int, int) : w(w_) {}
  // K % 8 == 0.
  __device__ __forceinline__ void load(Elem (*dst)[kPitch], int chunk, int lane, int n0, int K, int N) const {
    load_weight_rows<kChunk>(dst, w, chunk, lane, n0, K, N);
  }
  // ldmatrix: lane i gives row (i & 15), column 8 (i >> 4) of a 16 x 16 piece: matrices
  // (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15), mma's
  // a0..a3 in that order.
  __device__ __forceinline__ void fragment(uint32_t (&a)[4], const Elem (*st)[kPitch], int step, int lane) const {
    ldmatrix_x4(a, &st[lane & 15][step * 16 + (lane >> 4) * 8]);
  }
};

// Int8Weights: q [N, K] int8 with a scale per row (quant.h), dequantised in the producer:
// the fragment holds T(q[n, k] * s[n]) rounded once, the very values dequantize_rows_int8
// writes, so this GEMV gives the bits of the sequential order over the dequantised matrix.
// A stage is 16 rows x 256 k (4 KiB); four stages let six warps share an SM.
// Lane (g, q) reads its pairs (row g or g + 8, k 2q and 2q + 1, and 8 further) with 16-bit
// shared loads (a row pitch of 272 bytes puts the eight rows on distinct banks) and makes each
// value from its byte without a conversion instruction: 2^23 + 128 + q as fp32 bits, less
// 2^23 + 128, is q exactly.
template <class T>
struct Int8Weights {
  using Elem = int8_t;
  static constexpr int kChunk = 256, kStages = 4, kPitch = kChunk + 16;
  const int8_t* w;
  float s_lo, s_hi;  // rows g and g + 8
  __device__ Int8Weights(const int8_t* w_, const float* scales, int n0, int g, int N)
      : w(w_), s_lo(scales[min(n0 + g, N - 1)]), s_hi(scales[min(n0 + g + 8, N - 1)]) {}
  // K % 16 == 0.
  __device__ __forceinline__ void load(Elem (*dst)[kPitch], int chunk, int lane, int n0, int K, int N) const {
    load_weight_rows<kChunk>(dst, w, chunk, lane, n0, K, N);
  }
  static __device__ __forceinline__ float byte_value(uint32_t biased, uint32_t selector) {
    return __fsub_rn(__int_as_float(int(__byte_perm(biased, 0x4B000000u, selector))), 8388736.f);
  }
  // Two int8 (lowest byte first) times s, each rounded once to T, as one register.
  static __device__ __forceinline__ uint32_t pair(uint16_t two, float s) {
    const uint32_t biased = uint32_t(two) ^ 0x8080u;
    const float lo = __fmul_rn(byte_value(biased, 0x7540u), s), hi = __fmul_rn(byte_value(biased, 0x7541u), s);
    const auto p = from_float2<T>(make_float2(lo, hi));
    return *reinterpret_cast<const uint32_t*>(&p);
  }
  __device__ __forceinline__ void fragment(uint32_t (&a)[4], const Elem (*st)[kPitch], int step, int lane) const {
    const int g = lane >> 2, c = step * 16 + 2 * (lane & 3);
    a[0] = pair(*reinterpret_cast<const uint16_t*>(&st[g][c]), s_lo);
    a[1] = pair(*reinterpret_cast<const uint16_t*>(&st[g + 8][c]), s_hi);
    a[2] = pair(*reinterpret_cast<const uint16_t*>(&st[g][c + 8]), s_lo);
    a[3] = pair(*reinterpret_cast<const uint16_t*>(&st[g + 8][c + 8]), s_hi);
  }
};

template <class T, class P>
struct Stages {
  typename P::Elem w[P::kStages][16][P::kPitch];  // [stage][weight row][k]
  T x[P::kStages][8][P::kChunk + 8];               // [stage][token][k]: rows past the block's tokens never read
};

// Stage `stage`'s token rows: T_ rows x the chunk's 16-byte pieces of x [T_, K]; pieces
// past K are zeros. `async`: with cp.async (the caller commits it with the weights);
// otherwise plain loads stored at once. Both read through L2, never the non-coherent
// read-only path (__ldg): with PDL this kernel runs beside the one still writing the tokens,
// and __ldg there read stale rows (the GPU stage's determinism suite failed with it, passed
// with CONVEYOR_PDL=0 or with loads through L2; H100, 2026-11-25).
template <class T, class P>
__device__ __forceinline__ void load_token_stage(Stages<T, P>& sm, int stage, const T* x, int chunk, int lane, int T_,
                                                 int K, bool async) {
  constexpr int kPieces = P::kChunk / 8;
  const int k0 = chunk * P::kChunk;
  for (int piece = lane; piece < T_ * kPieces; piece += 32) {
    const int t = piece / kPieces, c = (piece % kPieces) * 8;
    const bool in_k = k0 + c < K;
    const T* src = x + int64_t(t) * K + (in_k ? k0 + c : 0);
    if (async) {
      cp_async16(&sm.x[stage][t][c], src, in_k ? 16 : 0);
    } else {
      const uint4 v = in_k ? __ldcg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(&sm.x[stage][t][c]) = v;
    }
  }
}

// A chunk's MMAs on acc, in k order: all of its fragments from stage st first (token g's
// (k 2q, 2q + 1) and (k 8 + 2q, 9 + 2q) of each step, zeros past the tokens), then the MMA
// chain.
template <class T, class P>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const P& wp, const Stages<T, P>& sm, int st, int lane,
                                          bool token) {
  constexpr int kSteps = P::kChunk / 16;
  const int g = lane >> 2, q = lane & 3;
  uint32_t a[kSteps][4], b[kSteps][2];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    wp.fragment(a[s], sm.w[st], s, lane);
    b[s][0] = token ? *reinterpret_cast<const uint32_t*>(&sm.x[st][g][s * 16 + 2 * q]) : 0u;
    b[s][1] = token ? *reinterpret_cast<const uint32_t*>(&sm.x[st][g][s * 16 + 8 + 2 * q]) : 0u;
  }
#pragma unroll
  for (int s = 0; s < kSteps; ++s) mma_m16n8k16<T>(acc, a[s], b[s][0], b[s][1]);
}

// acc: (row g, tokens 2q, 2q + 1) and (row g + 8, the same tokens), with the bias and
// activation, into out [T_, N].
template <class T, class OutT>
__device__ __forceinline__ void write_outputs(OutT* out, const float (&acc)[4], const T* bias, int n0, int g, int q,
                                              int T_, int N, int act) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = n0 + g + (i >> 1) * 8, t = 2 * q + (i & 1);
    if (n >= N || t >= T_) continue;
    float v = acc[i];
    if constexpr (!std::is_same_v<OutT, float>) {
      // As Gemm's cuBLASLt path: with an activation, the product is rounded to T and then
      // add_bias_gelu's arithmetic follows; with a bias alone, cuBLASLt's bias epilogue adds
      // it to the fp32 sum before the one rounding.
      const float bv = bias ? to_float(bias[n]) : 0.f;
      v = act != 0 ? activate(to_float(from_float<OutT>(v)) + bv, act) : v + bv;
    }
    out[int64_t(t) * N + n] = from_float<OutT>(v);
  }
}

// Block (x, y): tokens [8x, 8x + 8) and weight rows [16y, 16y + 16). The token groups of one
// row block are neighbours in launch order, so beyond the first they read the weights from L2.
template <class T, class OutT, class P>
__global__ void __launch_bounds__(32) gemv_seq_kernel(OutT* __restrict__ out, const T* __restrict__ x,
                                                      const typename P::Elem* __restrict__ w,
                                                      const float* __restrict__ scales, const T* __restrict__ bias,
                                                      int T_, int K, int N, int act) {
  constexpr int kStages = P::kStages;
  __shared__ __align__(16) Stages<T, P> sm;
  const int lane = threadIdx.x;
  const int n0 = blockIdx.y * 16, t0 = blockIdx.x * 8;
  const int tokens = min(8, T_ - t0);
  x += int64_t(t0) * K;
  out += int64_t(t0) * N;
  const int nchunks = (K + P::kChunk - 1) / P::kChunk;
  const int g = lane >> 2;
  const bool token = g < tokens;
  const P wp(w, scales, n0, g, N);

  grid_dependents_launch();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) wp.load(sm.w[s], s, lane, n0, K, N);
    cp_async_commit();
  }
  grid_dependency_wait();  // the activations come from the kernel before
  for (int s = 0; s < kStages - 1 && s < nchunks; ++s) load_token_stage<T, P>(sm, s, x, s, lane, tokens, K, false);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int next = chunk + kStages - 1;
    if (next < nchunks) {
      wp.load(sm.w[next % kStages], next, lane, n0, K, N);
      load_token_stage<T, P>(sm, next % kStages, x, next, lane, tokens, K, true);
    }
    cp_async_commit();
    mma_chunk<T, P>(acc, wp, sm, chunk % kStages, lane, token);
    __syncwarp();
  }
  cp_async_wait<0>();
  write_outputs<T, OutT>(out, acc, bias, n0, g, lane & 3, tokens, N, act);
}

// The unused shared memory that spreads `blocks` of `kernel` (stages of policy P) over every
// SM (spread_pad), with the kernel's limit raised first to the most any grid asks. Six
// blocks fit on an SM; a narrow product's grid (256 blocks for N = 4,096) spreads over all
// of them. H100, 2026-11-27, us per call: 4096 x 4096 15.5 -> 14.4, 1600 x 4800 9.1 -> 7.9,
// 1600 x 6400 10.6 -> 9.1, 16384 x 4096 52.9 -> 51.6, at T = 8 88.8 -> 70.3; unchanged from
// 768 blocks up.
template <class T, class P, class... A>
size_t spread_smem(void (*kernel)(A...), int64_t blocks) {
  const size_t stages = sizeof(Stages<T, P>);
  allow_smem(kernel, spread_pad(1, stages));
  return spread_pad(blocks, stages);
}

bool shape_fits(int64_t K, int64_t N, const void* in, const void* w) {
  return K > 0 && N > 0 && K < (int64_t(1) << 30) && N < (int64_t(1) << 30) && (N + 15) / 16 <= 65535 &&
         reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

template <class OutT, class T>
void check_call(const char* what, OutT* out, const T* in, const void* w, const T* bias, GemmAct act) {
  if (out == nullptr || in == nullptr || w == nullptr) throw Error(std::string(what) + ": null out, in or w");
  if constexpr (std::is_same_v<OutT, float>) {
    if (bias != nullptr || act != GemmAct::None)
      throw Error(std::string(what) + ": fp32 output takes neither bias nor activation");
  }
}

}  // namespace

bool gemv_seq_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  return T_ >= 1 && T_ <= kGemvMaxTokens && K % 8 == 0 && shape_fits(K, N, in, w);
}

bool gemv_seq_int8_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  return T_ >= 1 && T_ <= kGemvSeqInt8MaxTokens && K % 16 == 0 && shape_fits(K, N, in, w);
}

template <class T, class OutT>
void gemv_seq(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N, GemmAct act,
              cudaStream_t stream) {
  check_call("gemv_seq", out, in, w, bias, act);
  if (!gemv_seq_supported(T_, K, N, in, w))
    throw Error("gemv_seq: cannot run T=" + std::to_string(T_) + " K=" + std::to_string(K) + " N=" +
                std::to_string(N) + " (needs T <= 8, K % 8 == 0, 16-byte aligned in and w)");
  // A grid that three stages a warp would run in more than one wave and two stages in one
  // (gpt3-6.7b's QKV and FC1: 768 and 1,024 blocks; an H100 holds 660 and 1,056) takes two:
  // every block then starts at once, before the kernel it waits for ends, instead of a last
  // wave of a part of the SMs' warps.
  const int64_t blocks = (N + 15) / 16;
  auto wave = [](size_t stage_bytes) { return smem_blocks_per_sm(stage_bytes) * sm_count(); };
  const bool two = blocks > wave(sizeof(Stages<T, HalfWeights<T, 3>>)) &&
                   blocks <= wave(sizeof(Stages<T, HalfWeights<T, 2>>));
  auto launch = [&]<int S>() {
    auto kernel = gemv_seq_kernel<T, OutT, HalfWeights<T, S>>;
    const size_t pad = spread_smem<T, HalfWeights<T, S>>(kernel, blocks);
    LAUNCH_PDL("gemv_seq_kernel", kernel, dim3(1, unsigned(blocks)), dim3(32), pad, stream, out, in, w,
               static_cast<const float*>(nullptr), bias, int(T_), int(K), int(N), int(act));
  };
  if (two) launch.template operator()<2>();
  else launch.template operator()<3>();
}

template <class T, class OutT>
void gemv_seq_int8(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int64_t T_, int64_t K,
                   int64_t N, GemmAct act, cudaStream_t stream) {
  check_call("gemv_seq_int8", out, in, w, bias, act);
  if (scales == nullptr) throw Error("gemv_seq_int8: null scales");
  if (!gemv_seq_int8_supported(T_, K, N, in, w))
    throw Error("gemv_seq_int8: cannot run T=" + std::to_string(T_) + " K=" + std::to_string(K) + " N=" +
                std::to_string(N) + " (needs T <= " + std::to_string(kGemvSeqInt8MaxTokens) +
                ", K % 16 == 0, 16-byte aligned in and w)");
  auto kernel = gemv_seq_kernel<T, OutT, Int8Weights<T>>;
  const dim3 grid(unsigned((T_ + 7) / 8), unsigned((N + 15) / 16));
  const size_t pad = spread_smem<T, Int8Weights<T>>(kernel, int64_t(grid.x) * grid.y);
  LAUNCH_PDL("gemv_seq_int8_kernel", kernel, grid, dim3(32), pad, stream, out, in, w, scales, bias, int(T_), int(K),
             int(N), int(act));
}

#define CONVEYOR_GEMV_SEQ(T, OutT)                                                                                 \
  template void gemv_seq<T, OutT>(OutT*, const T*, const T*, const T*, int64_t, int64_t, int64_t, GemmAct,         \
                                  cudaStream_t);                                                                  \
  template void gemv_seq_int8<T, OutT>(OutT*, const T*, const int8_t*, const float*, const T*, int64_t, int64_t,   \
                                       int64_t, GemmAct, cudaStream_t);
CONVEYOR_GEMV_SEQ(__half, __half)
CONVEYOR_GEMV_SEQ(__half, float)
CONVEYOR_GEMV_SEQ(__nv_bfloat16, __nv_bfloat16)
CONVEYOR_GEMV_SEQ(__nv_bfloat16, float)
#undef CONVEYOR_GEMV_SEQ

}  // namespace conveyor::cuda::detail

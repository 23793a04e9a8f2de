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
// MMA's m16 x n8). The warp streams its 16 weight rows through kStages shared-memory stages
// of kChunk K-elements (cp.async, 16 bytes a lane; the first stages are asked for before the
// kernel waits on the one before it, since weights never change) and reads them with
// ldmatrix; the token fragments come straight from global memory through L2 (a few KiB),
// kAhead chunks ahead. No split along K, so the order above holds; the bandwidth comes from N / 16
// warps with kStages x 4 KiB each in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/dtype.cuh"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/int8_mma.cuh"
#include "kernels/cuda/launch.cuh"

namespace conveyor::cuda::detail {
namespace {

constexpr int kChunk = 128;            // K elements per stage
constexpr int kRowPitch = kChunk + 8;  // elements per shared row: 16 bytes of padding against bank conflicts
constexpr int kStages = 8;
constexpr int kSteps = kChunk / 16;    // MMAs per stage
constexpr int kAhead = 512 / kChunk;   // chunks of token fragments loaded ahead (512 K elements)
constexpr int kRowPieces = kChunk / 8; // 16-byte pieces of a weight row in a stage
constexpr int kPieces = 16 * kRowPieces;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Stage `stage` of sw: 16 weight rows (from n0, rows past N re-reading the last) x kRowPieces
// pieces of 16 bytes of chunk `chunk`; pieces past K are zeros (adding +0 leaves a sum's bits).
template <class T>
__device__ __forceinline__ void load_weight_stage(T (&sw)[kStages][16][kRowPitch], int stage, const T* w, int chunk,
                                                  int lane, int n0, int K, int N) {
  const int k0 = chunk * kChunk;
#pragma unroll
  for (int i = 0; i < kPieces / 32; ++i) {
    const int piece = lane + 32 * i, r = piece / kRowPieces, c = (piece % kRowPieces) * 8;
    const int row = min(n0 + r, N - 1);
    const bool in_k = k0 + c < K;  // K % 8 == 0: a piece is wholly in or out
    cp_async16(&sw[stage][r][c], w + int64_t(row) * K + (in_k ? k0 + c : 0), in_k ? 16 : 0);
  }
}

// Token fragments of a chunk: b[s] = (token g, k 2q..2q+1) and (token g, k 8+2q..) of step s
// (xr: token g's row); zeros past T (`token` false) or K. Loaded through L2 (ld.global.cg),
// never the non-coherent read-only path (__ldg): with PDL this kernel runs beside the one
// still writing the tokens, and __ldg there read stale rows (the GPU stage's determinism
// suite failed with it, passed with CONVEYOR_PDL=0 or with these loads; H100, 2026-11-25).
template <class T>
__device__ __forceinline__ void load_token_fragments(uint32_t (&b)[kSteps][2], const T* xr, bool token, int chunk,
                                                     int q, int K) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int k = chunk * kChunk + s * 16 + 2 * q;
    b[s][0] = token && k < K ? __ldcg(reinterpret_cast<const unsigned*>(xr + k)) : 0u;
    b[s][1] = token && k + 8 < K ? __ldcg(reinterpret_cast<const unsigned*>(xr + k + 8)) : 0u;
  }
}

// A chunk's kSteps MMAs on acc, in k order: all of its weight fragments (ldmatrix from stage
// st of sw, at this lane's a_row, a_col) first, then the MMA chain.
template <class T>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const T (&sw)[kStages][16][kRowPitch], int st,
                                          const uint32_t (&b)[kSteps][2], int a_row, int a_col) {
  uint32_t a[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) ldmatrix_x4(a[s], &sw[st][a_row][s * 16 + a_col]);
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

template <class T, class OutT>
__global__ void __launch_bounds__(32) gemv_seq_kernel(OutT* __restrict__ out, const T* __restrict__ x,
                                                      const T* __restrict__ w, const T* __restrict__ bias, int T_,
                                                      int K, int N, int act) {
  __shared__ __align__(16) T sw[kStages][16][kRowPitch];  // [stage][weight row][k]
  const int lane = threadIdx.x;
  const int n0 = blockIdx.x * 16;
  const int nchunks = (K + kChunk - 1) / kChunk;
  const int g = lane >> 2, q = lane & 3;  // the MMA's group (token, row) and lane-in-group
  const bool token = g < T_;
  const T* xr = x + int64_t(token ? g : 0) * K;

  grid_dependents_launch();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load_weight_stage<T>(sw, s, w, s, lane, n0, K, N);
    cp_async_commit();
  }
  grid_dependency_wait();  // the activations come from the kernel before
  // The token fragments of kAhead chunks in registers, each refilled kAhead chunks ahead: a
  // chunk's MMAs take less than an L2 round trip. (H100, gpt3-6.7b at T = 1, one chunk ahead
  // against four: FC2 92 -> 70 us, QKV 60 -> 55, projection 27.5 -> 24; cuBLASLt's unsplit
  // kernels still take 49, 38 and 15. Longer chunks, 256 or 512, changed nothing.)
  uint32_t b[kAhead][kSteps][2];
#pragma unroll
  for (int u = 0; u < kAhead; ++u)
    if (u < nchunks) load_token_fragments<T>(b[u], xr, token, u, q, K);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // ldmatrix: lane i gives row (i & 15), column 8 (i >> 4) of a 16 x 16 piece: matrices
  // (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15), mma's
  // a0..a3 in that order.
  const int a_row = lane & 15, a_col = (lane >> 4) * 8;
  for (int chunk0 = 0; chunk0 < nchunks; chunk0 += kAhead) {
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {  // unrolled: b[u] stays in registers
      const int chunk = chunk0 + u;
      if (chunk >= nchunks) break;
      cp_async_wait<kStages - 2>();
      __syncwarp();
      const int next = chunk + kStages - 1;
      if (next < nchunks) load_weight_stage<T>(sw, next % kStages, w, next, lane, n0, K, N);
      cp_async_commit();
      const int st = chunk % kStages;
      mma_chunk<T>(acc, sw, st, b[u], a_row, a_col);
      if (chunk + kAhead < nchunks) load_token_fragments<T>(b[u], xr, token, chunk + kAhead, q, K);
      __syncwarp();
    }
  }
  cp_async_wait<0>();
  write_outputs<T, OutT>(out, acc, bias, n0, g, q, T_, N, act);
}

}  // namespace

bool gemv_seq_supported(int64_t T_, int64_t K, int64_t N, const void* in, const void* w) {
  return T_ >= 1 && T_ <= kGemvMaxTokens && K % 8 == 0 && K > 0 && N > 0 && K < (int64_t(1) << 30) &&
         N < (int64_t(1) << 30) && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

template <class T, class OutT>
void gemv_seq(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N, GemmAct act,
              cudaStream_t stream) {
  if (out == nullptr || in == nullptr || w == nullptr) throw Error("gemv_seq: null out, in or w");
  if (!gemv_seq_supported(T_, K, N, in, w))
    throw Error("gemv_seq: cannot run T=" + std::to_string(T_) + " K=" + std::to_string(K) + " N=" +
                std::to_string(N) + " (needs T <= 8, K % 8 == 0, 16-byte aligned in and w)");
  if constexpr (std::is_same_v<OutT, float>) {
    if (bias != nullptr || act != GemmAct::None) throw Error("gemv_seq: fp32 output takes neither bias nor activation");
  }
  const unsigned blocks = unsigned((N + 15) / 16);
  LAUNCH_PDL("gemv_seq_kernel", gemv_seq_kernel<T, OutT>, dim3(blocks), dim3(32), 0, stream, out, in, w, bias,
             int(T_), int(K), int(N), int(act));
}

template void gemv_seq<__half, __half>(__half*, const __half*, const __half*, const __half*, int64_t, int64_t,
                                       int64_t, GemmAct, cudaStream_t);
template void gemv_seq<__half, float>(float*, const __half*, const __half*, const __half*, int64_t, int64_t, int64_t,
                                      GemmAct, cudaStream_t);
template void gemv_seq<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                                                     const __nv_bfloat16*, int64_t, int64_t, int64_t, GemmAct,
                                                     cudaStream_t);
template void gemv_seq<__nv_bfloat16, float>(float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                             const __nv_bfloat16*, int64_t, int64_t, int64_t, GemmAct, cudaStream_t);

}  // namespace conveyor::cuda::detail

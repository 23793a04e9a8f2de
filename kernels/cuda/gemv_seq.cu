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
// weights never change) and reads the weights with ldmatrix, the tokens with 32-bit shared
// loads. No split along K, so the order above holds; the bandwidth comes from N / 16 warps
// with kStages - 1 stages of 4 KiB each in flight.
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
// Five stages of 16 weight rows and 8 token rows (6.4 KiB) let six warps share an SM, as
// many as gpt3-6.7b's QKV (768 warps) needs for one wave on an H100's 132 SMs.
constexpr int kStages = 5;
constexpr int kSteps = kChunk / 16;    // MMAs per stage
constexpr int kRowPieces = kChunk / 8; // 16-byte pieces of a row in a stage
constexpr int kPieces = 16 * kRowPieces;

template <class T>
struct Stages {
  T w[kStages][16][kRowPitch];  // [stage][weight row][k]
  T x[kStages][8][kRowPitch];   // [stage][token][k]: rows past T never read
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Stage `stage` of sw: 16 weight rows (from n0, rows past N re-reading the last) x kRowPieces
// pieces of 16 bytes of chunk `chunk`; pieces past K are zeros (adding +0 leaves a sum's bits).
template <class T>
__device__ __forceinline__ void load_weight_stage(Stages<T>& sm, int stage, const T* w, int chunk, int lane, int n0,
                                                  int K, int N) {
  const int k0 = chunk * kChunk;
#pragma unroll
  for (int i = 0; i < kPieces / 32; ++i) {
    const int piece = lane + 32 * i, r = piece / kRowPieces, c = (piece % kRowPieces) * 8;
    const int row = min(n0 + r, N - 1);
    const bool in_k = k0 + c < K;  // K % 8 == 0: a piece is wholly in or out
    cp_async16(&sm.w[stage][r][c], w + int64_t(row) * K + (in_k ? k0 + c : 0), in_k ? 16 : 0);
  }
}

// Stage `stage`'s token rows: T_ rows x kRowPieces pieces of chunk `chunk` of x [T_, K];
// pieces past K are zeros. `async`: with cp.async (the caller commits it with the weights);
// otherwise plain loads stored at once. Both read through L2, never the non-coherent
// read-only path (__ldg): with PDL this kernel runs beside the one still writing the tokens,
// and __ldg there read stale rows (the GPU stage's determinism suite failed with it, passed
// with CONVEYOR_PDL=0 or with loads through L2; H100, 2026-11-25).
template <class T>
__device__ __forceinline__ void load_token_stage(Stages<T>& sm, int stage, const T* x, int chunk, int lane, int T_,
                                                 int K, bool async) {
  const int k0 = chunk * kChunk;
  for (int piece = lane; piece < T_ * kRowPieces; piece += 32) {
    const int t = piece / kRowPieces, c = (piece % kRowPieces) * 8;
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

// A chunk's kSteps MMAs on acc, in k order: all of its fragments from stage st first (the
// weights with ldmatrix at this lane's a_row, a_col; token g's (k 2q, 2q + 1) and (k 8 + 2q,
// 9 + 2q) of each step, zeros past T), then the MMA chain.
template <class T>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const Stages<T>& sm, int st, int a_row, int a_col, int g,
                                          int q, bool token) {
  uint32_t a[kSteps][4], b[kSteps][2];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    ldmatrix_x4(a[s], &sm.w[st][a_row][s * 16 + a_col]);
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

template <class T, class OutT>
__global__ void __launch_bounds__(32) gemv_seq_kernel(OutT* __restrict__ out, const T* __restrict__ x,
                                                      const T* __restrict__ w, const T* __restrict__ bias, int T_,
                                                      int K, int N, int act) {
  __shared__ __align__(16) Stages<T> sm;
  const int lane = threadIdx.x;
  const int n0 = blockIdx.x * 16;
  const int nchunks = (K + kChunk - 1) / kChunk;
  const int g = lane >> 2, q = lane & 3;  // the MMA's group (token, row) and lane-in-group
  const bool token = g < T_;

  grid_dependents_launch();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load_weight_stage<T>(sm, s, w, s, lane, n0, K, N);
    cp_async_commit();
  }
  grid_dependency_wait();  // the activations come from the kernel before
  for (int s = 0; s < kStages - 1 && s < nchunks; ++s) load_token_stage<T>(sm, s, x, s, lane, T_, K, false);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // ldmatrix: lane i gives row (i & 15), column 8 (i >> 4) of a 16 x 16 piece: matrices
  // (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15), mma's
  // a0..a3 in that order.
  const int a_row = lane & 15, a_col = (lane >> 4) * 8;
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int next = chunk + kStages - 1;
    if (next < nchunks) {
      load_weight_stage<T>(sm, next % kStages, w, next, lane, n0, K, N);
      load_token_stage<T>(sm, next % kStages, x, next, lane, T_, K, true);
    }
    cp_async_commit();
    mma_chunk<T>(acc, sm, chunk % kStages, a_row, a_col, g, q, token);
    __syncwarp();
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

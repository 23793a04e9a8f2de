// FP8 (E4M3) quantisation for Hopper's FP8 tensor cores: a matrix [rows, K] of fp16, bf16 or
// fp32 becomes one byte per element, E4M3 (4 exponent bits, 3 mantissa bits, largest finite
// value 448), with one fp32 scale per row, symmetric:
//
//   s[r] = max_k |x[r, k]| / 448,   q[r, k] = e4m3(x[r, k] * (1 / s[r]))   (nearest even, saturating)
//
// so x[r, k] ~ s[r] * q[r, k] (an all-zero row gets s = 0 and q = 0). The bytes are made with
// the scale's reciprocal, rounded to fp32 once a row, not by a division an element: the same
// E4M3 value but where x / s lies within an ulp or two of fp32 from a tie between two of
// E4M3's, for about a tenth of the quantising arithmetic (measured: FC1's epilogue with FC2's
// quantiser was bound by it, at a fifth of the memory bandwidth in prefill). One function
// serves both operands of Gemm::run_fp8 (gemm.h):
//   - weights [N, K] (output channels as rows): quantised once at load, a scale per channel;
//   - activations [T, K]: quantised per row (per token) at every product, a dynamic scale per
//     row. A row's scale and bytes depend on that row alone, never on the batch around it: no
//     per-tensor amax over the batch (issue 17's promise that an answer depends only on its
//     request).
// The product then is out[t, n] = act(sa[t] * sw[n] * sum_k qa[t, k] qw[n, k] + bias[n]):
// cuBLASLt's FP8 GEMM writes the unscaled sums times a power of two as fp16 (its A and B
// scales left at 1: Hopper's cuBLASLt has no per-row scale vectors; fp8_sum_exponent), then
// fp8_scale_epilogue undoes the power of two, applies both scales, the bias and the
// activation, and writes fp16/bf16.
//
// The GPU quantiser and the host reference perform the same IEEE fp32 operations (|x| and max
// are exact, one correctly rounded division for s and one for 1 / s, a correctly rounded
// product an element, the E4M3 conversion
// rounds to nearest even and saturates to +-448), so they agree bit for bit.
//
// Floors, before any optimisation (H100 SXM: dense FP8 ~1979 TFLOPS, fp16 ~989, HBM3 3.35
// TB/s; H200: the same tensor cores, HBM3e 4.8 TB/s). gpt3-6.7b: 32 layers of C = 4096, 6.44e9
// matrix weights, K/V 0.52 MB a token of context (fp16):
//   - the matrices are read once a step: 6.4 GB in FP8 (12.9 GB fp16) -> 1.9 ms (3.8 ms) on
//     the H100, 1.3 ms (2.7 ms) on the H200;
//   - their products cost 2 x 6.44e9 x B flops a step: B x 6.5 us at FP8 peak (B x 13 us fp16),
//     so they are compute-bound above B ~ 300 (H100) / ~ 200 (H200), where FP8's gain over
//     fp16 tends to 2x; below, FP8 gains by halving the bytes;
//   - decode attention reads each sequence's K/V once a step: prompt 128 + 128 new tokens is
//     192 positions on average, 100 MB a sequence -> at B = 512, 51 GB: 15 ms (H100), 11 ms
//     (H200), more than the products (3.3 ms): at large B the K/V read bounds the step.
//     TensorRT-LLM's 27,304 tokens/s (GPT-J 6B, H200) is 37.5 ms a step at B = 1024, whose
//     fp16 K/V (137 GB at 256 tokens) does not fit beside the weights in 141 GB.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/cuda/paged_kv.h"

namespace conveyor::cuda {

inline constexpr float kFp8E4M3Max = 448.f;

// A matrix's rows as quantize_rows_fp8 makes them: E4M3 bytes [rows, K] and a scale a row
// (device memory). A LayerNorm writes them beside its output (ops.h) so that the product
// after it (Gemm::run_fp8, run_fp8_mlp) need not quantise that output again. Empty: none.
struct Fp8Rows {
  uint8_t* q = nullptr;
  float* scales = nullptr;
  explicit operator bool() const { return q != nullptr; }
};

// A product's sums left for the kernel after it to scale: run_fp8's epilogue deferred
// (Gemm::run_fp8, run_fp8_mlp). Row r's element n is
//   round_T(sums[r, n] * unscale * row_scales[r] * col_scales[n] + bias[n])
// exactly as fp8_scale_epilogue writes it without an activation. The consumers: the
// residual's LayerNorm (ops.h) and the decode attention over an FP8 K/V cache (attention.h).
// sums is fp16 [rows, N], row-major, in the FP8 workspace: valid until the next FP8 product
// on the same Gemm. Empty: none (the product wrote its output).
struct Fp8Sums {
  const __half* sums = nullptr;
  float unscale = 1.f;  // 2^e, e = fp8_sum_exponent(K): exact
  const float* row_scales = nullptr;
  const float* col_scales = nullptr;
  const void* bias = nullptr;  // [N] of the product's T, or none
  explicit operator bool() const { return sums != nullptr; }
};

// q [rows, K] (E4M3 bytes) and scales [rows] from x [rows, K] (row-major, device pointers),
// asynchronous on `stream`, deterministic, no allocation (capturable). T is __half,
// __nv_bfloat16 or float. Throws conveyor::Error for null pointers or rows, K <= 0.
template <class T>
void quantize_rows_fp8(uint8_t* q, float* scales, const T* x, int64_t rows, int64_t K, cudaStream_t stream);

// The power of two e that keeps a product's unscaled sums within fp16: |sum| <= 448^2 K, and
// 448^2 K 2^-e <= 65504 (the largest finite fp16). cuBLASLt writes sum x 2^-e (alpha, exact)
// rounded to fp16: half the bytes of fp32 sums, 11 significant bits where E4M3's operands
// have 4; below 2^(e-14) (sums far under their bound) fp16's subnormals keep absolute
// precision only.
int fp8_sum_exponent(int64_t K);

// out[r, n] = act(sums[r, n] * 2^e * row_scales[r] * col_scales[n] + bias[n]) over [rows, N],
// in fp32 then rounded once to T (__half or __nv_bfloat16): run_fp8's epilogue. sums is fp16
// [rows, N] row-major (e = fp8_sum_exponent(K): times 2^e is exact); bias (length N) may be
// null; act is a GemmAct code (0 none, 1 tanh GeLU, 2 erf GeLU). Each element depends on its
// own inputs alone (no reduction). Device pointers, asynchronous on `stream`, no allocation
// (capturable). Throws conveyor::Error for a null out, sums or scale vector.
template <class T>
void fp8_scale_epilogue(T* out, const __half* sums, int e, const float* row_scales, const float* col_scales,
                        const T* bias, int64_t rows, int64_t N, int act, cudaStream_t stream);

// QKV's epilogue for prompt rows whose K and V go straight into an FP8 K/V cache: rows of
// [q | k | v] (n_head * head_dim columns each). q's columns are written to out as
// fp8_scale_epilogue writes them (no activation); K's and V's are not: each (token, head) is
// rounded to T as the epilogue would, quantised as kv_cache_append quantises it, and written
// to the cache at block-table row token_rows[r], position token_pos[r] (negative: padding).
// The same bytes and scales as fp8_scale_epilogue then kv_cache_append, without the T rows of
// K and V in memory. sums, out, col_scales and bias 16-byte aligned; head_dim 16, 32, 64 or 128
// (fp8_scale_epilogue_kv_supported). Throws conveyor::Error otherwise.
bool fp8_scale_epilogue_kv_supported(const KvLayerView& kv, int64_t head_dim);
template <class T>
void fp8_scale_epilogue_kv(T* out, const __half* sums, int e, const float* row_scales, const float* col_scales,
                           const T* bias, int64_t rows, int64_t n_head, int64_t head_dim, const KvLayerView& kv,
                           const int32_t* token_rows, const int32_t* token_pos, cudaStream_t stream);

// fp8_scale_epilogue into a T row, then quantize_rows_fp8 of that row, in one kernel without
// the T row in memory: q [rows, N] (E4M3) and q_scales [rows] are the bytes and scales the two
// would give (one block a row; the row lives in shared memory). The FP8 MLP's FC1 feeding
// FC2 (Gemm::run_fp8_mlp). N at most fp8_epilogue_quantize_max_n(). Throws conveyor::Error
// for a null pointer or a row too long.
int64_t fp8_epilogue_quantize_max_n();
template <class T>
void fp8_epilogue_quantize(uint8_t* q, float* q_scales, const __half* sums, int e, const float* row_scales,
                           const float* col_scales, const T* bias, int64_t rows, int64_t N, int act,
                           cudaStream_t stream);

// The host twin of quantize_rows_fp8 (plain C++, fp8.cc): the reference.
void quantize_rows_fp8_reference(uint8_t* q, float* scales, const float* x, int64_t rows, int64_t K);
// One E4M3 byte as a float (exact), and a float rounded to E4M3 (nearest even, saturating).
float fp8_e4m3_to_float(uint8_t bits);
uint8_t float_to_fp8_e4m3(float x);

// Whether `device` has FP8 tensor cores (compute capability 8.9 or newer): an error naming the
// device, its name and its compute capability otherwise.
Status fp8_device_check(int device);

}  // namespace conveyor::cuda

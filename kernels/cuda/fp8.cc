// The host side of fp8.h: the reference quantiser (the same IEEE fp32 operations as the
// kernel: exact |x| and max, a correctly rounded division for the scale and its reciprocal,
// products by the reciprocal, E4M3 rounding through cuda_fp8.h's
// host conversion, nearest even and saturating like the device's cvt.rn.satfinite), E4M3
// decoding, and the device check.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/fp8.h"

namespace conveyor::cuda {

uint8_t float_to_fp8_e4m3(float x) { return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); }

float fp8_e4m3_to_float(uint8_t bits) {
  const int sign = bits >> 7, exponent = (bits >> 3) & 0xf, mantissa = bits & 7;
  float v;
  if (exponent == 0xf && mantissa == 7) v = NAN;  // E4M3 has no infinities; S.1111.111 is NaN
  else if (exponent == 0) v = std::ldexp(float(mantissa) / 8.f, -6);  // subnormal
  else v = std::ldexp(1.f + float(mantissa) / 8.f, exponent - 7);
  return sign ? -v : v;
}

void quantize_rows_fp8_reference(uint8_t* q, float* scales, const float* x, int64_t rows, int64_t K) {
  if (q == nullptr || scales == nullptr || x == nullptr)
    throw Error("quantize_rows_fp8_reference: null pointer (q, scales and x are required)");
  if (rows <= 0 || K <= 0)
    throw Error("quantize_rows_fp8_reference: rows and K must be positive (rows=" + std::to_string(rows) +
                " K=" + std::to_string(K) + ")");
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
    const float s = amax / kFp8E4M3Max, rs = s > 0.f ? 1.f / s : 0.f;
    scales[r] = s;
    for (int64_t k = 0; k < K; ++k) q[r * K + k] = rs > 0.f ? float_to_fp8_e4m3(row[k] * rs) : 0;
  }
}

int fp8_sum_exponent(int64_t K) {
  const double bound = double(kFp8E4M3Max) * double(kFp8E4M3Max) * double(std::max<int64_t>(K, 1));
  int e = 0;
  while (bound > 65504.0 * std::ldexp(1.0, e)) ++e;
  return e;
}

Status fp8_device_check(int device) {
  cudaDeviceProp p{};
  if (cudaError_t e = cudaGetDeviceProperties(&p, device); e != cudaSuccess)
    return Status::error("fp8: cannot read the properties of CUDA device " + std::to_string(device) + ": " +
                         cudaGetErrorString(e));
  if (p.major * 10 + p.minor < 89)
    return Status::error("fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                         "CUDA device " + std::to_string(device) + " (" + p.name + ") is " + std::to_string(p.major) +
                         "." + std::to_string(p.minor));
  return ok_status();
}

}  // namespace conveyor::cuda

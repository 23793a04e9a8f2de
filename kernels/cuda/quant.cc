// The host twin of quantize_rows_int8 (quant.h). Each step is one IEEE fp32 operation, as in
// the kernel: |w| and max are exact, s = amax / 127 and w / s are correctly rounded divisions,
// and nearbyint rounds ties to even like __float2int_rn.
#include <algorithm>
#include <cmath>
#include <string>

#include "common/status.h"
#include "kernels/cuda/quant.h"

namespace conveyor::cuda {

void quantize_rows_int8_reference(int8_t* q, float* scales, const float* w, int64_t N, int64_t K) {
  if (q == nullptr || scales == nullptr || w == nullptr)
    throw Error("quantize_rows_int8_reference: null pointer (q, scales and w are required)");
  if (N <= 0 || K <= 0)
    throw Error("quantize_rows_int8_reference: N and K must be positive (N=" + std::to_string(N) +
                " K=" + std::to_string(K) + ")");
  for (int64_t n = 0; n < N; ++n) {
    const float* row = w + n * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(row[k]));
    const float s = amax / 127.f;
    scales[n] = s;
    for (int64_t k = 0; k < K; ++k) {
      float v = amax > 0.f ? row[k] / s : 0.f;
      if (std::isnan(v)) v = 0.f;
      v = std::clamp(std::nearbyint(v), -127.f, 127.f);
      q[n * K + k] = static_cast<int8_t>(v);
    }
  }
}

}  // namespace conveyor::cuda

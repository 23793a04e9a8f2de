// FP8 (E4M3) quantisation and products (kernels/cuda/fp8.h, Gemm::run_fp8):
//   - on the host (no GPU needed): E4M3 encoding rounds to nearest even and saturates,
//     decoding is exact, the reference quantiser's scales and bytes;
//   - the GPU quantiser equals the host reference bit for bit (fp16, bf16, fp32 rows, the
//     vector and the element-wise paths, a zero row);
//   - the scaling epilogue (the power of two back, both scales, bias, activation on cuBLASLt's
//     fp16 sums) equals the host's fp32 operations bit for bit without activation, within T's
//     rounding with one; the power of two keeps the largest sum within fp16;
//   - run_fp8 against a double-precision product of the unquantised inputs (within FP8's
//     error) and of the quantised ones (within fp32 accumulation and output rounding), with
//     and without bias, each activation, fp16 and bf16, several T;
//   - in deterministic mode a row's result is the same bits for every T = 1..256 and any place
//     among the rows (the fixed cuBLASLt algorithm per (K, N), no split-K), at the gpt3-6.7b
//     shapes, and when the rows run in blocks of a small workspace; a captured CUDA graph
//     replays the same bits;
//   - the epilogue and the next product's quantiser in one kernel give their bytes and scales,
//     and run_fp8_mlp (FC1 then FC2 through it) the bits of run_fp8 twice;
//   - a LayerNorm's rows quantised beside its output (both LayerNorm kernels, every row
//     length path) are the quantiser's bytes and scales of that output, and run_fp8 and
//     run_fp8_mlp reading them give the bits of quantising their input themselves;
//   - Gemm::fp8_supported's probe passes on compute capability 9.0;
//   - fp8_workspace_bytes (host) holds the sums, the quantised rows and their scales.
// Outputs are poisoned (NaN) before each run, so an element the product fails to write fails.
// The GPU tests skip cleanly where no GPU is present (or, for products, where the GPU fails
// Gemm::fp8_supported: they print why).
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(Fp8, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

using cuda::GemmAct;
using half = __half;
using bf16 = __nv_bfloat16;
using testing::from_bits;
using testing::have_gpu;
using testing::to_bits;

// ---- host: E4M3 and the reference quantiser ------------------------------------------------

TEST(Fp8Host, E4M3EncodingRoundsToNearestEvenAndSaturates) {
  using cuda::float_to_fp8_e4m3;
  EXPECT_EQ(float_to_fp8_e4m3(0.f), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(1.f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3(-1.f), 0xB8);
  EXPECT_EQ(float_to_fp8_e4m3(448.f), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(1000.f), 0x7E);   // saturates to the largest finite value
  EXPECT_EQ(float_to_fp8_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);  // halfway between 1 and 1.125: to the even 1
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3A);  // halfway between 1.125 and 1.25: to the even 1.25
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.f, -9)), 0x01);  // the smallest subnormal
  // Every code but NaN decodes exactly and encodes back to itself.
  for (int b = 0; b < 256; ++b) {
    const float v = cuda::fp8_e4m3_to_float(uint8_t(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << b;
      continue;
    }
    EXPECT_EQ(float_to_fp8_e4m3(v), b) << "code " << b << " = " << v;
  }
  EXPECT_EQ(cuda::fp8_e4m3_to_float(0x7E), 448.f);
  EXPECT_EQ(cuda::fp8_e4m3_to_float(0x01), std::ldexp(1.f, -9));
}

TEST(Fp8Host, ReferenceQuantiserScalesEachRowToItsLargestValue) {
  const int64_t rows = 3, K = 5;
  const std::vector<float> x = {1.f, -2.f, 0.5f, 0.25f, 2.f,  // amax 2: s = 2/448, +-2 -> +-448
                                0.f, 0.f,  0.f,  0.f,   0.f,  // all zero: s = 0, q = 0
                                -896.f, 3.f, 7.f, 1e-3f, 0.f};
  std::vector<uint8_t> q(static_cast<size_t>(rows * K));
  std::vector<float> s(static_cast<size_t>(rows));
  cuda::quantize_rows_fp8_reference(q.data(), s.data(), x.data(), rows, K);
  EXPECT_EQ(s[0], 2.f / 448.f);
  EXPECT_EQ(q[1], 0xFE);
  EXPECT_EQ(q[4], 0x7E);
  EXPECT_EQ(s[1], 0.f);
  for (int k = 0; k < K; ++k) EXPECT_EQ(q[size_t(K + k)], 0) << k;
  EXPECT_EQ(s[2], 2.f);
  EXPECT_EQ(q[size_t(2 * K)], 0xFE);  // -896 / 2 = -448
  // Dequantised, every value is within half an E4M3 step (2^-4 relative) of the original, or
  // below the smallest step of its row.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float v = x[size_t(r * K + k)], d = s[size_t(r)] * cuda::fp8_e4m3_to_float(q[size_t(r * K + k)]);
      EXPECT_LE(std::fabs(d - v), std::max(std::fabs(v) / 16.f, s[size_t(r)] * std::ldexp(1.f, -10)))
          << r << "," << k;
    }
  EXPECT_THROW(cuda::quantize_rows_fp8_reference(nullptr, s.data(), x.data(), 1, 1), Error);
  EXPECT_THROW(cuda::quantize_rows_fp8_reference(q.data(), s.data(), x.data(), 0, 1), Error);
}

// The bytes are made with the scale's reciprocal, x * RN(1 / s), not by a division: for this
// row's second value, x / s lies just above a tie between two E4M3 values (136, between 128
// and 144) and x * (1 / s) on it, so the two give different bytes, and the reference (like
// the kernels) takes the tie's even side.
TEST(Fp8Host, ReferenceQuantiserMultipliesByTheReciprocal) {
  const float amax = 0x1.f1a3bap+1f, x = 0x1.2e2368p+0f;
  const std::vector<float> row = {amax, x};
  std::vector<uint8_t> q(2);
  std::vector<float> s(1);
  cuda::quantize_rows_fp8_reference(q.data(), s.data(), row.data(), 1, 2);
  ASSERT_EQ(s[0], amax / 448.f);
  EXPECT_EQ(q[1], cuda::float_to_fp8_e4m3(x * (1.f / s[0])));
  EXPECT_EQ(cuda::fp8_e4m3_to_float(q[1]), 128.f);
  EXPECT_EQ(cuda::fp8_e4m3_to_float(cuda::float_to_fp8_e4m3(x / s[0])), 144.f);
}

// The workspace of one product: the fp16 sums (2 N bytes a row), the E4M3 rows (K bytes) and
// their scales (4 bytes), each part at a 256-byte boundary, plus 256 bytes for the base's own.
TEST(Fp8Host, WorkspaceHoldsTheSumsTheRowsAndTheirScales) {
  using cuda::Gemm;
  EXPECT_EQ(Gemm::fp8_workspace_bytes(1, 64, 32), size_t(256 + 256 + 256 + 4));
  EXPECT_EQ(Gemm::fp8_workspace_bytes(70, 2048, 1024), size_t(256 + 70 * 1024 * 2 + 70 * 2048 + 70 * 4));
  // gpt3-6.7b's FC1 at 4096 rows: 128 MiB of sums, 16 MiB of rows.
  EXPECT_EQ(Gemm::fp8_workspace_bytes(4096, 4096, 16384),
            size_t(256) + (size_t(128) << 20) + (size_t(16) << 20) + 4096 * 4);
  for (int64_t rows : {1, 3, 17, 255, 4096})
    EXPECT_GE(Gemm::fp8_workspace_bytes(rows, 4096, 12288), size_t(rows) * (4096 + 4 + 2 * 12288) + 256) << rows;
  EXPECT_LT(Gemm::fp8_workspace_bytes(69, 2048, 1024), Gemm::fp8_workspace_bytes(70, 2048, 1024));
  EXPECT_EQ(Gemm::fp8_workspace_bytes(0, 64, 32), 0u);
}

// The fp16 sums' power of two: the smallest e with 448^2 K 2^-e within fp16's 65504, so the
// largest sum E4M3 rows can make fits, and twice it would not.
TEST(Fp8Host, SumExponentKeepsTheLargestSumWithinFp16) {
  EXPECT_EQ(cuda::fp8_sum_exponent(1), 2);
  EXPECT_EQ(cuda::fp8_sum_exponent(64), 8);
  EXPECT_EQ(cuda::fp8_sum_exponent(4096), 14);
  EXPECT_EQ(cuda::fp8_sum_exponent(16384), 16);
  for (int64_t K : {1, 16, 1600, 4096, 6400, 12288, 16384, 24576, 49152}) {
    const int e = cuda::fp8_sum_exponent(K);
    const double largest = 448.0 * 448.0 * double(K);
    EXPECT_LE(std::ldexp(largest, -e), 65504.0) << K;
    EXPECT_GT(std::ldexp(largest, 1 - e), 65504.0) << K;
  }
}

// ---- device helpers --------------------------------------------------------------------------

struct Rng {
  uint32_t seed;
  std::mt19937 gen;
  Rng() : seed(std::random_device{}()), gen(seed) {}
  std::vector<float> normal(size_t n, float stddev) {
    std::normal_distribution<float> d(0.f, stddev);
    std::vector<float> v(n);
    for (auto& x : v) x = d(gen);
    return v;
  }
};
#define SEED_TRACE(rng) SCOPED_TRACE("seed " + std::to_string((rng).seed))

// Host values rounded to T, as bits (for the device) and floats (for the host).
template <class T>
struct Rounded {
  std::vector<uint16_t> bits;
  std::vector<float> values;
  explicit Rounded(const std::vector<float>& v) : bits(v.size()), values(v.size()) {
    for (size_t i = 0; i < v.size(); ++i) bits[i] = to_bits<T>(v[i]), values[i] = from_bits<T>(bits[i]);
  }
};

// `n` elements of E on the device, poisoned with 0xff bytes (NaN in every float type).
template <class E>
struct Dev {
  cuda::DeviceBuffer buf;
  size_t n = 0;
  explicit Dev(size_t count) : buf(cuda::device_alloc(std::max<size_t>(count, 1) * sizeof(E), "test_fp8", "buffer")), n(count) {
    CUDA_CHECK(cudaMemset(buf.get(), 0xff, buf.bytes()));
  }
  template <class H>
  explicit Dev(const std::vector<H>& h) : Dev(h.size()) {
    static_assert(sizeof(H) == sizeof(E));
    CUDA_CHECK(cudaMemcpy(buf.get(), h.data(), h.size() * sizeof(E), cudaMemcpyHostToDevice));
  }
  E* p() const { return buf.as<E>(); }
  template <class H>
  std::vector<H> get() const {
    static_assert(sizeof(H) == sizeof(E));
    std::vector<H> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), buf.get(), n * sizeof(E), cudaMemcpyDeviceToHost));
    return v;
  }
};

double act_host(double v, GemmAct act) {
  if (act == GemmAct::GeluTanh) return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  if (act == GemmAct::GeluErf) return 0.5 * v * (1.0 + std::erf(v * 0.7071067811865476));
  return v;
}

// act(x @ w^T + bias) in double, x [T, K], w [N, K].
std::vector<double> product(const std::vector<double>& x, const std::vector<double>& w, const std::vector<float>* bias,
                            int64_t T_, int64_t K, int64_t N, GemmAct act) {
  std::vector<double> out(static_cast<size_t>(T_ * N));
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x[size_t(t * K + k)] * w[size_t(n * K + k)];
      out[size_t(t * N + n)] = act_host(acc + (bias ? double((*bias)[size_t(n)]) : 0.0), act);
    }
  return out;
}

// Rows quantised on the host and dequantised, in double.
std::vector<double> dequantised(const std::vector<float>& v, int64_t rows, int64_t K) {
  std::vector<uint8_t> q(v.size());
  std::vector<float> s(static_cast<size_t>(rows));
  cuda::quantize_rows_fp8_reference(q.data(), s.data(), v.data(), rows, K);
  std::vector<double> d(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) d[size_t(r * K + k)] = double(s[size_t(r)]) * cuda::fp8_e4m3_to_float(q[size_t(r * K + k)]);
  return d;
}

double worst_row_error(const std::vector<float>& out, const std::vector<double>& ref, int64_t T_, int64_t N) {
  double worst = 0;
  for (int64_t t = 0; t < T_; ++t) {
    double num = 0, den = 0;
    for (int64_t n = 0; n < N; ++n) {
      const float o = out[size_t(t * N + n)];
      if (!std::isfinite(o)) return INFINITY;
      const double d = double(o) - ref[size_t(t * N + n)];
      num += d * d, den += ref[size_t(t * N + n)] * ref[size_t(t * N + n)];
    }
    worst = std::max(worst, den == 0 ? std::sqrt(num) : std::sqrt(num / den));
  }
  return worst;
}

template <class T>
std::vector<float> as_floats(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = from_bits<T>(bits[i]);
  return v;
}

// The skip for GPUs where run_fp8 does not work (below compute capability 8.9, or its probe fails).
#define SKIP_WITHOUT_FP8(gemm)                                                               \
  do {                                                                                       \
    if (Status fp8_ok = (gemm).fp8_supported(); !fp8_ok) GTEST_SKIP() << fp8_ok.message(); \
  } while (0)

template <class T>
class Fp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  }
};
using Types = ::testing::Types<half, bf16>;
TYPED_TEST_SUITE(Fp8, Types);

// ---- the quantiser ---------------------------------------------------------------------------

template <class T>
void check_quantiser(Rng& rng, int64_t rows, int64_t K) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " K " + std::to_string(K));
  std::vector<float> v = rng.normal(size_t(rows * K), 3.f);
  for (int64_t k = 0; k < K; ++k) v[size_t(K + k)] = 0.f;  // row 1: all zero
  v[0] = 1e4f;                                              // row 0: one outlier
  std::vector<float> values;
  cuda::DeviceBuffer x;
  if constexpr (std::is_same_v<T, float>) {
    values = v;
    x = cuda::device_alloc(v.size() * 4, "test_fp8", "x");
    CUDA_CHECK(cudaMemcpy(x.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  } else {
    Rounded<T> r(v);
    values = r.values;
    x = cuda::device_alloc(v.size() * 2, "test_fp8", "x");
    CUDA_CHECK(cudaMemcpy(x.get(), r.bits.data(), v.size() * 2, cudaMemcpyHostToDevice));
  }
  Dev<uint8_t> q(static_cast<size_t>(rows * K));
  Dev<float> s(static_cast<size_t>(rows));
  cuda::quantize_rows_fp8<T>(q.p(), s.p(), x.as<T>(), rows, K, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> q_ref(static_cast<size_t>(rows * K));
  std::vector<float> s_ref(static_cast<size_t>(rows));
  cuda::quantize_rows_fp8_reference(q_ref.data(), s_ref.data(), values.data(), rows, K);
  const auto q_got = q.template get<uint8_t>();
  const auto s_got = s.template get<float>();
  for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(std::memcmp(&s_got[size_t(r)], &s_ref[size_t(r)], 4), 0) << "scale " << r;
  for (size_t i = 0; i < q_ref.size(); ++i)
    ASSERT_EQ(q_got[i], q_ref[i]) << "row " << i / size_t(K) << " k " << i % size_t(K) << " of "
                                  << values[i];
}

TYPED_TEST(Fp8, QuantiserEqualsTheHostReference) {
  Rng rng;
  SEED_TRACE(rng);
  for (auto [rows, K] : {std::pair<int64_t, int64_t>{5, 4096}, {3, 100}, {7, 16384}, {2, 8}})
    check_quantiser<TypeParam>(rng, rows, K);
  if (std::is_same_v<TypeParam, half>) check_quantiser<float>(rng, 4, 1000);
}

// ---- the epilogue ----------------------------------------------------------------------------

// fp8_scale_epilogue against the host: without activation the same fp32 operations (fp16 sum
// x 2^e, exact, then x row scale, x column scale, + bias, each rounded), then one rounding to
// T: the same bits; with a GeLU within a few units of T's last place (tanhf/erff may differ by
// an ulp). Both the 8-wide path (N % 8 == 0) and the element-wise one (N not a multiple of 8,
// or out not 16-byte aligned).
template <class T>
void check_epilogue(Rng& rng, int64_t rows, int64_t N, int64_t out_offset, bool with_bias, GemmAct act) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " N " + std::to_string(N) + " offset " + std::to_string(out_offset) +
               (with_bias ? " bias" : "") + " act " + std::to_string(int(act)));
  const int e = 12;
  std::vector<float> unscaled = rng.normal(size_t(rows * N), 3000.f);
  for (float& v : unscaled) v = std::ldexp(v, -e);
  Rounded<half> sums(unscaled);
  std::vector<float> rs = rng.normal(size_t(rows), 0.01f), cs = rng.normal(size_t(N), 0.03f);
  rs[0] = 0.f;  // an all-zero input row
  Rounded<T> b(rng.normal(size_t(N), 0.5f));
  Dev<uint16_t> dsums(sums.bits);
  Dev<float> drs(rs), dcs(cs);
  Dev<uint16_t> db(b.bits), out(static_cast<size_t>(rows * N + out_offset));
  cuda::fp8_scale_epilogue<T>(reinterpret_cast<T*>(out.p()) + out_offset, reinterpret_cast<const __half*>(dsums.p()),
                              e, drs.p(), dcs.p(), with_bias ? reinterpret_cast<const T*>(db.p()) : nullptr, rows, N,
                              int(act), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = out.template get<uint16_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const size_t i = size_t(r * N + n);
      volatile float scaled = std::ldexp(sums.values[i], e) * rs[size_t(r)];
      scaled = scaled * cs[size_t(n)];
      const float pre = scaled + (with_bias ? b.values[size_t(n)] : 0.f);
      const uint16_t g = got[i + size_t(out_offset)];
      if (act == GemmAct::None) {
        ASSERT_EQ(g, to_bits<T>(pre)) << "row " << r << " col " << n;
      } else {
        const double want = act_host(double(pre), act), v = from_bits<T>(g);
        ASSERT_LE(std::fabs(v - want), 1e-2 * std::fabs(want) + 1e-3) << "row " << r << " col " << n;
      }
    }
}

TYPED_TEST(Fp8, EpilogueAppliesBothScalesBiasAndActivation) {
  Rng rng;
  SEED_TRACE(rng);
  for (GemmAct act : {GemmAct::None, GemmAct::GeluTanh, GemmAct::GeluErf})
    for (bool with_bias : {false, true}) {
      check_epilogue<TypeParam>(rng, 37, 96, 0, with_bias, act);  // 8-wide
      check_epilogue<TypeParam>(rng, 5, 33, 0, with_bias, act);   // element-wise: N odd
      check_epilogue<TypeParam>(rng, 4, 36, 0, with_bias, act);   // element-wise: N % 8 == 4
      check_epilogue<TypeParam>(rng, 6, 48, 1, with_bias, act);   // element-wise: out misaligned
    }
  Dev<float> x(4);
  const auto* h = reinterpret_cast<const __half*>(x.p());
  EXPECT_THROW(cuda::fp8_scale_epilogue<TypeParam>(nullptr, h, 0, x.p(), x.p(), nullptr, 1, 4, 0, nullptr), Error);
  EXPECT_THROW(cuda::fp8_scale_epilogue<TypeParam>(reinterpret_cast<TypeParam*>(x.p()), h, 0, nullptr, x.p(), nullptr,
                                                   1, 4, 0, nullptr),
               Error);
}

// fp8_epilogue_quantize equals fp8_scale_epilogue into a T row and quantize_rows_fp8 of it,
// bytes and scales, on the 8-wide path (N % 8 == 0) and the element-wise one, with and
// without programmatic dependent launch (up to 64 rows with it).
template <class T>
void check_epilogue_quantize(Rng& rng, int64_t rows, int64_t N, bool with_bias, GemmAct act) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " N " + std::to_string(N) + (with_bias ? " bias" : "") + " act " +
               std::to_string(int(act)));
  const int e = 10;
  std::vector<float> unscaled = rng.normal(size_t(rows * N), 3000.f);
  for (float& v : unscaled) v = std::ldexp(v, -e);
  Rounded<half> sums(unscaled);
  std::vector<float> rs = rng.normal(size_t(rows), 0.01f), cs = rng.normal(size_t(N), 0.03f);
  rs[0] = 0.f;  // an all-zero row
  Rounded<T> b(rng.normal(size_t(N), 0.5f));
  Dev<uint16_t> dsums(sums.bits), db(b.bits), row(static_cast<size_t>(rows * N));
  Dev<float> drs(rs), dcs(cs), s_two(static_cast<size_t>(rows)), s_one(static_cast<size_t>(rows));
  Dev<uint8_t> q_two(static_cast<size_t>(rows * N)), q_one(static_cast<size_t>(rows * N));
  const auto* hs = reinterpret_cast<const __half*>(dsums.p());
  const T* bias = with_bias ? reinterpret_cast<const T*>(db.p()) : nullptr;
  cuda::fp8_scale_epilogue<T>(reinterpret_cast<T*>(row.p()), hs, e, drs.p(), dcs.p(), bias, rows, N, int(act), nullptr);
  cuda::quantize_rows_fp8<T>(q_two.p(), s_two.p(), reinterpret_cast<const T*>(row.p()), rows, N, nullptr);
  cuda::fp8_epilogue_quantize<T>(q_one.p(), s_one.p(), hs, e, drs.p(), dcs.p(), bias, rows, N, int(act), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(q_one.template get<uint8_t>(), q_two.template get<uint8_t>());
  EXPECT_EQ(s_one.template get<float>(), s_two.template get<float>());
}

TYPED_TEST(Fp8, EpilogueQuantiseEqualsEpilogueThenQuantiser) {
  Rng rng;
  SEED_TRACE(rng);
  for (GemmAct act : {GemmAct::None, GemmAct::GeluTanh, GemmAct::GeluErf})
    for (bool with_bias : {false, true}) {
      check_epilogue_quantize<TypeParam>(rng, 5, 4096, with_bias, act);  // 8-wide, launched early
      check_epilogue_quantize<TypeParam>(rng, 70, 96, with_bias, act);   // 8-wide, launched plainly
      check_epilogue_quantize<TypeParam>(rng, 3, 33, with_bias, act);    // element-wise
    }
  const int64_t too_long = cuda::fp8_epilogue_quantize_max_n() + 8;
  Dev<uint8_t> q(8);
  Dev<float> f(8);
  EXPECT_THROW(cuda::fp8_epilogue_quantize<TypeParam>(q.p(), f.p(), reinterpret_cast<const __half*>(f.p()), 0, f.p(),
                                                      f.p(), nullptr, 1, too_long, 0, nullptr),
               Error);
  EXPECT_THROW(cuda::fp8_epilogue_quantize<TypeParam>(nullptr, f.p(), reinterpret_cast<const __half*>(f.p()), 0, f.p(),
                                                      f.p(), nullptr, 1, 8, 0, nullptr),
               Error);
}

// ---- the product -----------------------------------------------------------------------------

TYPED_TEST(Fp8, ProductMatchesTheReferenceWithinFp8Error) {
  using T = TypeParam;
  cuda::Gemm gemm;
  SKIP_WITHOUT_FP8(gemm);
  Rng rng;
  SEED_TRACE(rng);
  for (auto [K, N] : {std::pair<int64_t, int64_t>{1024, 768}, {64, 48}, {4096, 256}}) {
    const int64_t Tmax = 300;
    Rounded<T> x(rng.normal(size_t(Tmax * K), 1.f)), w(rng.normal(size_t(N * K), 0.05f)), b(rng.normal(size_t(N), 0.5f));
    Dev<uint16_t> dx(x.bits), dw16(w.bits), db(b.bits);
    Dev<uint8_t> w8(static_cast<size_t>(N * K));
    Dev<float> ws(static_cast<size_t>(N));
    cuda::quantize_rows_fp8<T>(w8.p(), ws.p(), reinterpret_cast<const T*>(dw16.p()), N, K, nullptr);
    std::vector<double> xd(x.values.begin(), x.values.end()), wd(w.values.begin(), w.values.end());
    const std::vector<double> wq = dequantised(w.values, N, K);
    for (int64_t T_ : {int64_t(1), int64_t(7), int64_t(64), Tmax}) {
      const std::vector<double> xq = dequantised(std::vector<float>(x.values.begin(), x.values.begin() + T_ * K), T_, K);
      const std::vector<double> xs(xd.begin(), xd.begin() + T_ * K);
      // The sums, once: bias and activation are applied per case below.
      const std::vector<double> sums_q = product(xq, wq, nullptr, T_, K, N, GemmAct::None);
      const std::vector<double> sums = product(xs, wd, nullptr, T_, K, N, GemmAct::None);
      auto finish = [&](const std::vector<double>& raw, bool with_bias, GemmAct act) {
        std::vector<double> r(raw.size());
        for (size_t i = 0; i < r.size(); ++i)
          r[i] = act_host(raw[i] + (with_bias ? double(b.values[i % size_t(N)]) : 0.0), act);
        return r;
      };
      for (bool with_bias : {false, true})
        for (GemmAct act : {GemmAct::None, GemmAct::GeluTanh, GemmAct::GeluErf}) {
          SCOPED_TRACE("K " + std::to_string(K) + " N " + std::to_string(N) + " T " + std::to_string(T_) +
                       (with_bias ? " bias" : "") + " act " + std::to_string(int(act)));
          Dev<uint16_t> out(static_cast<size_t>(T_ * N));
          gemm.run_fp8<T>(reinterpret_cast<T*>(out.p()), reinterpret_cast<const T*>(dx.p()), w8.p(), ws.p(),
                          with_bias ? reinterpret_cast<const T*>(db.p()) : nullptr, T_, K, N, act, nullptr);
          CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<float> got = as_floats<T>(out.template get<uint16_t>());
          // Against the quantised operands: only accumulation and the output's rounding.
          const double e_q = worst_row_error(got, finish(sums_q, with_bias, act), T_, N);
          EXPECT_LT(e_q, (std::is_same_v<T, half> ? 4e-3 : 1.2e-2));
          // Against the unquantised operands: FP8's own error (3 mantissa bits per operand).
          const double e = worst_row_error(got, finish(sums, with_bias, act), T_, N);
          EXPECT_LT(e, 0.08);
          if (T_ == Tmax && with_bias && act == GemmAct::GeluTanh)
            std::cout << "[fp8] K " << K << " N " << N << " T " << T_ << ": worst row error " << e
                      << " vs the unquantised product, " << e_q << " vs the quantised one\n";
        }
    }
  }
  std::cout << gemm.describe_plans();
}

// Deterministic mode: a row's bits whatever T and wherever it sits among the rows, at the
// gpt3-6.7b shapes, every row compared (the question issue 21's note left open: measured on
// an H100, 2026-11-25, conveyor-bench-gemm-order found every unsplit FP8 algorithm
// row-invariant for T up to 4,096).
TYPED_TEST(Fp8, DeterministicRowsIgnoreTheBatch) {
  using T = TypeParam;
  cuda::Gemm gemm;
  SKIP_WITHOUT_FP8(gemm);
  ASSERT_TRUE(gemm.deterministic());
  Rng rng;
  SEED_TRACE(rng);
  const int64_t Tmax = 300;
  for (auto [K, N] : {std::pair<int64_t, int64_t>{4096, 12288}, {4096, 4096}, {4096, 16384}, {16384, 4096}}) {
    Rounded<T> x(rng.normal(size_t(Tmax * K), 1.f)), w(rng.normal(size_t(N * K), 0.02f)), b(rng.normal(size_t(N), 0.5f));
    Dev<uint16_t> dx(x.bits), dw16(w.bits), db(b.bits), ref(size_t(Tmax * N)), out(size_t(Tmax * N));
    Dev<uint8_t> w8(static_cast<size_t>(N * K));
    Dev<float> ws(static_cast<size_t>(N));
    cuda::quantize_rows_fp8<T>(w8.p(), ws.p(), reinterpret_cast<const T*>(dw16.p()), N, K, nullptr);
    const T* xp = reinterpret_cast<const T*>(dx.p());
    gemm.run_fp8<T>(reinterpret_cast<T*>(ref.p()), xp, w8.p(), ws.p(), reinterpret_cast<const T*>(db.p()), Tmax, K, N,
                    GemmAct::None, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto want = ref.template get<uint16_t>();
    for (int64_t T_ : {1, 2, 3, 7, 8, 9, 16, 17, 31, 64, 100, 128, 200, 255, 256, 299}) {
      for (int64_t first : {int64_t(0), std::min<int64_t>(7, Tmax - T_), Tmax - T_}) {
        gemm.run_fp8<T>(reinterpret_cast<T*>(out.p()), xp + first * K, w8.p(), ws.p(),
                        reinterpret_cast<const T*>(db.p()), T_, K, N, GemmAct::None, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const auto got = out.template get<uint16_t>();
        int64_t differing = 0, first_bad = -1;
        for (int64_t r = 0; r < T_; ++r)
          if (!std::equal(got.begin() + r * N, got.begin() + (r + 1) * N, want.begin() + (first + r) * N))
            differing++, first_bad = first_bad < 0 ? r : first_bad;
        ASSERT_EQ(differing, 0) << "K " << K << " N " << N << " T " << T_ << " from row " << first << ": first row "
                                << first_bad << "\n" << gemm.describe_plans();
      }
    }
  }
  std::cout << gemm.describe_plans();
}

// A workspace smaller than the call: the rows run in blocks, with the same bits.
TYPED_TEST(Fp8, RowBlocksGiveTheSameBits) {
  using T = TypeParam;
  cuda::Gemm whole, blocks;
  SKIP_WITHOUT_FP8(whole);
  Rng rng;
  SEED_TRACE(rng);
  const int64_t T_ = 300, K = 2048, N = 1024;
  Rounded<T> x(rng.normal(static_cast<size_t>(T_ * K), 1.f)), w(rng.normal(static_cast<size_t>(N * K), 0.03f));
  Dev<uint16_t> dx(x.bits), dw16(w.bits), a(static_cast<size_t>(T_ * N)), b(static_cast<size_t>(T_ * N));
  Dev<uint8_t> w8(static_cast<size_t>(N * K));
  Dev<float> ws(static_cast<size_t>(N));
  cuda::quantize_rows_fp8<T>(w8.p(), ws.p(), reinterpret_cast<const T*>(dw16.p()), N, K, nullptr);
  Dev<uint8_t> small(cuda::Gemm::fp8_workspace_bytes(70, K, N));  // 70 rows a block
  blocks.set_fp8_workspace(small.p(), small.n);
  for (cuda::Gemm* g : {&whole, &blocks})
    g->run_fp8<T>(reinterpret_cast<T*>((g == &whole ? a : b).p()), reinterpret_cast<const T*>(dx.p()), w8.p(), ws.p(),
                  nullptr, T_, K, N, GemmAct::None, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(a.template get<uint16_t>(), b.template get<uint16_t>());
  EXPECT_NE(blocks.describe_plans().find("T=70 "), std::string::npos) << blocks.describe_plans();
}

// The LayerNorm's FP8 rows (ops.h) against quantize_rows_fp8 of the rows it wrote: the same
// bytes and scales, with and without the fused residual add, for row lengths of each of the
// kernel's paths (8 elements a thread with one, two and four items, one element a thread, and
// a quarter of the threads from 512 rows); the LayerNorm's own output is the same bits with
// them as without, and without it (out null) the rows are the same.
TYPED_TEST(Fp8, LayerNormRowsQuantisedEqualTheQuantiser) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  const std::pair<int64_t, int64_t> shapes[] = {{4096, 5}, {1600, 5}, {16384, 5}, {24576, 5}, {100, 5}, {4096, 1030}};
  for (auto [C, rows] : shapes) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE("C " + std::to_string(C) + " rows " + std::to_string(rows) + (fused ? " fused" : ""));
      const size_t n = size_t(rows * C);
      Rounded<T> x(rng.normal(n, 2.f)), res(rng.normal(n, 2.f)), g(rng.normal(size_t(C), 1.f)),
          b(rng.normal(size_t(C), 0.5f)), bias(rng.normal(size_t(C), 0.5f));
      Dev<uint16_t> dx(x.bits), dg(g.bits), db(b.bits), dbias(bias.bits), res_a(res.bits), res_b(res.bits), out_a(n),
          out_b(n);
      Dev<uint8_t> q(n), q_ref(n);
      Dev<float> sc(static_cast<size_t>(rows)), sc_ref(static_cast<size_t>(rows));
      auto* px = reinterpret_cast<const T*>(dx.p());
      auto* pg = reinterpret_cast<const T*>(dg.p());
      auto* pb = reinterpret_cast<const T*>(db.p());
      auto* pbias = reinterpret_cast<const T*>(dbias.p());
      auto* oa = reinterpret_cast<T*>(out_a.p());
      auto* ob = reinterpret_cast<T*>(out_b.p());
      const cuda::Fp8Rows rows_q{q.p(), sc.p()};
      if (fused) {
        cuda::add_bias_residual_layernorm<T>(reinterpret_cast<T*>(res_a.p()), oa, px, pbias, pg, pb, rows, C, 1e-5f,
                                             nullptr, rows_q);
        cuda::add_bias_residual_layernorm<T>(reinterpret_cast<T*>(res_b.p()), ob, px, pbias, pg, pb, rows, C, 1e-5f,
                                             nullptr);
      } else {
        cuda::layernorm_forward<T>(oa, px, pg, pb, rows, C, 1e-5f, nullptr, rows_q);
        cuda::layernorm_forward<T>(ob, px, pg, pb, rows, C, 1e-5f, nullptr);
      }
      cuda::quantize_rows_fp8<T>(q_ref.p(), sc_ref.p(), ob, rows, C, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(out_a.template get<uint16_t>(), out_b.template get<uint16_t>());
      EXPECT_EQ(res_a.template get<uint16_t>(), res_b.template get<uint16_t>());
      const auto s_got = sc.template get<float>(), s_want = sc_ref.template get<float>();
      ASSERT_EQ(std::memcmp(s_got.data(), s_want.data(), s_got.size() * 4), 0);
      const auto q_got = q.template get<uint8_t>(), q_want = q_ref.template get<uint8_t>();
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(q_got[i], q_want[i]) << "row " << i / size_t(C) << " k " << i % size_t(C);
      // The quantised rows alone.
      Dev<uint16_t> res_c(res.bits);
      Dev<uint8_t> q_only(n);
      Dev<float> sc_only(static_cast<size_t>(rows));
      const cuda::Fp8Rows only{q_only.p(), sc_only.p()};
      if (fused)
        cuda::add_bias_residual_layernorm<T>(reinterpret_cast<T*>(res_c.p()), nullptr, px, pbias, pg, pb, rows, C,
                                             1e-5f, nullptr, only);
      else
        cuda::layernorm_forward<T>(nullptr, px, pg, pb, rows, C, 1e-5f, nullptr, only);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(q_only.template get<uint8_t>(), q_got);
      const auto s_only = sc_only.template get<float>();
      EXPECT_EQ(std::memcmp(s_only.data(), s_got.data(), s_got.size() * 4), 0);
      if (fused) {
        EXPECT_EQ(res_c.template get<uint16_t>(), res_a.template get<uint16_t>());
      }
    }
  }
  Dev<uint16_t> x(16);
  auto* px = reinterpret_cast<const T*>(x.p());
  EXPECT_THROW(cuda::layernorm_forward<T>(nullptr, px, px, px, 1, 16, 1e-5f, nullptr), Error);  // no output at all
}

// The MLP the run_fp8_mlp tests run: input rows in [kRows, K], FC1 w1 [I, K] with bias b1,
// FC2 w2 [N, I], the weights quantised (w18, s1; w28, s2); `small`, a workspace that holds 70
// rows a block of run_fp8_mlp.
template <class T>
struct Fp8Mlp {
  static constexpr int64_t K = 512, I = 2048, N = 512, kRows = 300;
  Rounded<T> x, w1, w2, b1;
  Dev<uint16_t> dx, dw1, dw2, db1;
  Dev<uint8_t> w18, w28, small;
  Dev<float> s1, s2;
  explicit Fp8Mlp(Rng& rng)
      : x(rng.normal(static_cast<size_t>(kRows * K), 1.f)),
        w1(rng.normal(static_cast<size_t>(I * K), 0.05f)),
        w2(rng.normal(static_cast<size_t>(N * I), 0.02f)),
        b1(rng.normal(static_cast<size_t>(I), 0.2f)),
        dx(x.bits), dw1(w1.bits), dw2(w2.bits), db1(b1.bits),
        w18(static_cast<size_t>(I * K)), w28(static_cast<size_t>(N * I)),
        small(cuda::Gemm::fp8_mlp_workspace_bytes(70, K, I, N)),
        s1(static_cast<size_t>(I)), s2(static_cast<size_t>(N)) {
    cuda::quantize_rows_fp8<T>(w18.p(), s1.p(), reinterpret_cast<const T*>(dw1.p()), I, K, nullptr);
    cuda::quantize_rows_fp8<T>(w28.p(), s2.p(), reinterpret_cast<const T*>(dw2.p()), N, I, nullptr);
  }
  const T* in() const { return reinterpret_cast<const T*>(dx.p()); }
  const T* bias() const { return reinterpret_cast<const T*>(db1.p()); }
};

// run_fp8 and run_fp8_mlp given their input's rows quantised already (in_q) give the bits of
// quantising it themselves, in one block of rows and in blocks of 70, and then never read the
// T rows (null there: the step's FP8 LayerNorms write none).
TYPED_TEST(Fp8, QuantisedInputGivesTheSameBits) {
  using T = TypeParam;
  using M = Fp8Mlp<T>;
  constexpr int64_t K = M::K, I = M::I, N = M::N, T_ = M::kRows;
  cuda::Gemm gemm, blocks;
  SKIP_WITHOUT_FP8(gemm);
  Rng rng;
  SEED_TRACE(rng);
  M m(rng);
  const T* in = m.in();
  const T* bias = m.bias();
  auto &w18 = m.w18, &w28 = m.w28;
  auto &s1 = m.s1, &s2 = m.s2;
  Dev<uint8_t> xq(static_cast<size_t>(T_ * K));
  Dev<float> xs(static_cast<size_t>(T_));
  cuda::quantize_rows_fp8<T>(xq.p(), xs.p(), in, T_, K, nullptr);
  const cuda::Fp8Rows in_q{xq.p(), xs.p()};
  blocks.set_fp8_workspace(m.small.p(), m.small.n);
  Dev<uint16_t> want(static_cast<size_t>(T_ * I)), got(static_cast<size_t>(T_ * I)), got_blocks(static_cast<size_t>(T_ * I));
  auto out = [](Dev<uint16_t>& d) { return reinterpret_cast<T*>(d.p()); };
  gemm.run_fp8<T>(out(want), in, w18.p(), s1.p(), bias, T_, K, I, GemmAct::GeluTanh, nullptr);
  gemm.run_fp8<T>(out(got), nullptr, w18.p(), s1.p(), bias, T_, K, I, GemmAct::GeluTanh, nullptr, in_q);
  blocks.run_fp8<T>(out(got_blocks), nullptr, w18.p(), s1.p(), bias, T_, K, I, GemmAct::GeluTanh, nullptr, in_q);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(got.template get<uint16_t>(), want.template get<uint16_t>());
  EXPECT_EQ(got_blocks.template get<uint16_t>(), want.template get<uint16_t>());
  Dev<uint16_t> mlp_want(static_cast<size_t>(T_ * N)), mlp_got(static_cast<size_t>(T_ * N)),
      mlp_blocks(static_cast<size_t>(T_ * N));
  gemm.run_fp8_mlp<T>(out(mlp_want), in, w18.p(), s1.p(), bias, GemmAct::GeluTanh, w28.p(), s2.p(), T_, K, I, N, nullptr);
  gemm.run_fp8_mlp<T>(out(mlp_got), in, w18.p(), s1.p(), bias, GemmAct::GeluTanh, w28.p(), s2.p(), T_, K, I, N, nullptr,
                      in_q);
  blocks.run_fp8_mlp<T>(out(mlp_blocks), nullptr, w18.p(), s1.p(), bias, GemmAct::GeluTanh, w28.p(), s2.p(), T_, K, I,
                        N, nullptr, in_q);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto w = mlp_want.template get<uint16_t>();
  EXPECT_EQ(mlp_got.template get<uint16_t>(), w);
  EXPECT_EQ(mlp_blocks.template get<uint16_t>(), w);
  for (uint16_t bits : w) ASSERT_TRUE(std::isfinite(from_bits<T>(bits)));
  const cuda::Fp8Rows no_scales{xq.p(), nullptr};
  EXPECT_THROW(gemm.run_fp8<T>(out(got), in, w18.p(), s1.p(), bias, T_, K, I, GemmAct::None, nullptr, no_scales),
               Error);
  EXPECT_THROW(gemm.run_fp8<T>(out(got), nullptr, w18.p(), s1.p(), bias, T_, K, I, GemmAct::None, nullptr), Error);
  EXPECT_THROW(gemm.run_fp8_mlp<T>(out(mlp_got), nullptr, w18.p(), s1.p(), bias, GemmAct::GeluTanh, w28.p(), s2.p(), T_,
                                   K, I, N, nullptr),
               Error);
}

// run_fp8_mlp gives the bits of its two products through run_fp8 (FC1 with bias and GeLU into a
// T row, FC2 of that row), deterministic mode, for several T, in one block of rows and in
// blocks of 70.
TYPED_TEST(Fp8, MlpGivesTheBitsOfItsTwoProducts) {
  using T = TypeParam;
  using M = Fp8Mlp<T>;
  constexpr int64_t K = M::K, I = M::I, N = M::N, T_max = M::kRows;
  cuda::Gemm gemm, blocks;
  SKIP_WITHOUT_FP8(gemm);
  Rng rng;
  SEED_TRACE(rng);
  M m(rng);
  const T* in = m.in();
  const T* bias = m.bias();
  auto &w18 = m.w18, &w28 = m.w28;
  auto &s1 = m.s1, &s2 = m.s2;
  Dev<uint16_t> fc(static_cast<size_t>(T_max * I));
  blocks.set_fp8_workspace(m.small.p(), m.small.n);
  ASSERT_TRUE(cuda::Gemm::fp8_mlp_supported(I));
  for (int64_t t : {int64_t(1), int64_t(5), int64_t(64), int64_t(65), T_max}) {
    SCOPED_TRACE("T " + std::to_string(t));
    Dev<uint16_t> want(static_cast<size_t>(t * N)), got(static_cast<size_t>(t * N)), got_blocks(static_cast<size_t>(t * N));
    gemm.run_fp8<T>(reinterpret_cast<T*>(fc.p()), in, w18.p(), s1.p(), bias, t, K, I, GemmAct::GeluTanh, nullptr);
    gemm.run_fp8<T>(reinterpret_cast<T*>(want.p()), reinterpret_cast<const T*>(fc.p()), w28.p(), s2.p(), nullptr, t, I,
                    N, GemmAct::None, nullptr);
    gemm.run_fp8_mlp<T>(reinterpret_cast<T*>(got.p()), in, w18.p(), s1.p(), bias, GemmAct::GeluTanh, w28.p(), s2.p(), t,
                        K, I, N, nullptr);
    blocks.run_fp8_mlp<T>(reinterpret_cast<T*>(got_blocks.p()), in, w18.p(), s1.p(), bias, GemmAct::GeluTanh, w28.p(),
                          s2.p(), t, K, I, N, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto w = want.template get<uint16_t>();
    EXPECT_EQ(got.template get<uint16_t>(), w);
    EXPECT_EQ(got_blocks.template get<uint16_t>(), w);
    for (uint16_t bits : w) ASSERT_TRUE(std::isfinite(from_bits<T>(bits)));
  }
  EXPECT_FALSE(cuda::Gemm::fp8_mlp_supported(cuda::fp8_epilogue_quantize_max_n() + 16));
}

// A product's epilogue deferred to the residual's LayerNorm (Gemm::run_fp8's `defer`, ops.h's
// x_sums) gives the bits of the epilogue writing the product's rows and the LayerNorm reading
// them: the residual, the LayerNorm's rows and their FP8 bytes and scales, for run_fp8 with a
// bias (C = I) and run_fp8_mlp's FC2 (C = N), at one row and at 300. A call whose rows take
// several blocks of the workspace does not defer: it writes its rows, with the same bits.
TYPED_TEST(Fp8, DeferredEpilogueInTheLayerNormGivesTheSameBits) {
  using T = TypeParam;
  using M = Fp8Mlp<T>;
  constexpr int64_t K = M::K, I = M::I, N = M::N;
  cuda::Gemm gemm, blocks;
  SKIP_WITHOUT_FP8(gemm);
  Rng rng;
  SEED_TRACE(rng);
  M m(rng);
  blocks.set_fp8_workspace(m.small.p(), m.small.n);
  auto t_ = [](Dev<uint16_t>& d) { return reinterpret_cast<T*>(d.p()); };
  for (bool mlp : {false, true})
    for (int64_t rows : {int64_t(1), M::kRows}) {
      SCOPED_TRACE(std::string(mlp ? "run_fp8_mlp" : "run_fp8") + ", rows " + std::to_string(rows));
      const int64_t C = mlp ? N : I;
      const size_t n = size_t(rows * C);
      Rounded<T> res(rng.normal(n, 2.f)), g(rng.normal(size_t(C), 1.f)), b(rng.normal(size_t(C), 0.5f)),
          bias(rng.normal(size_t(C), 0.5f));
      Dev<uint16_t> dg(g.bits), db(b.bits), dbias(bias.bits), out(n);
      auto product = [&](cuda::Gemm& on, cuda::Fp8Sums* defer) {
        if (mlp)
          on.run_fp8_mlp<T>(t_(out), m.in(), m.w18.p(), m.s1.p(), m.bias(), GemmAct::GeluTanh, m.w28.p(), m.s2.p(), rows,
                            K, I, N, nullptr, {}, defer);
        else
          on.run_fp8<T>(t_(out), m.in(), m.w18.p(), m.s1.p(), m.bias(), rows, K, I, GemmAct::None, nullptr, {}, defer);
      };
      struct Result {
        std::vector<uint16_t> res, ln;
        std::vector<uint8_t> q;
        std::vector<float> s;
      };
      auto layer_norm = [&](const T* x, cuda::Fp8Sums sums) {
        Dev<uint16_t> r(res.bits), ln(n);
        Dev<uint8_t> q(n);
        Dev<float> sc(static_cast<size_t>(rows));
        cuda::add_bias_residual_layernorm<T>(t_(r), t_(ln), x, reinterpret_cast<const T*>(dbias.p()),
                                             reinterpret_cast<const T*>(dg.p()), reinterpret_cast<const T*>(db.p()),
                                             rows, C, 1e-5f, nullptr, cuda::Fp8Rows{q.p(), sc.p()}, sums);
        CUDA_CHECK(cudaDeviceSynchronize());
        return Result{r.template get<uint16_t>(), ln.template get<uint16_t>(), q.template get<uint8_t>(),
                      sc.template get<float>()};
      };
      product(gemm, nullptr);
      const Result want = layer_norm(t_(out), {});
      CUDA_CHECK(cudaMemset(out.p(), 0xff, n * 2));  // NaN: a read of out would show
      cuda::Fp8Sums sums;
      product(gemm, &sums);
      ASSERT_TRUE(sums) << "one block of rows defers";
      const Result got = layer_norm(nullptr, sums);
      EXPECT_EQ(got.res, want.res);
      EXPECT_EQ(got.ln, want.ln);
      EXPECT_EQ(got.q, want.q);
      ASSERT_EQ(std::memcmp(got.s.data(), want.s.data(), got.s.size() * 4), 0);
      for (uint16_t bits : got.ln) ASSERT_TRUE(std::isfinite(from_bits<T>(bits)));
      cuda::Fp8Sums none{.sums = reinterpret_cast<const __half*>(out.p())};  // overwritten below
      product(blocks, &none);
      EXPECT_EQ(bool(none), rows <= 70) << "a call of several blocks writes its rows";
      const Result from_blocks = none ? layer_norm(nullptr, none) : layer_norm(t_(out), {});
      EXPECT_EQ(from_blocks.ln, want.ln);
      EXPECT_EQ(from_blocks.res, want.res);
    }
  cuda::Fp8Sums sums;
  Dev<uint16_t> out(static_cast<size_t>(4 * I));
  EXPECT_THROW(gemm.run_fp8<T>(t_(out), m.in(), m.w18.p(), m.s1.p(), m.bias(), 4, K, I, GemmAct::GeluTanh, nullptr, {},
                               &sums),
               Error);  // a deferred epilogue has no activation
  EXPECT_THROW(cuda::add_bias_residual_layernorm<T>(t_(out), nullptr, nullptr, nullptr, nullptr, nullptr, 4, I, 1e-5f,
                                                    nullptr),
               Error);  // neither x nor its sums
}

TYPED_TEST(Fp8, GraphReplayGivesTheEagerBits) {
  using T = TypeParam;
  cuda::Gemm gemm;
  SKIP_WITHOUT_FP8(gemm);
  Rng rng;
  SEED_TRACE(rng);
  const int64_t T_ = 64, K = 1024, N = 3072;
  Rounded<T> x(rng.normal(size_t(T_ * K), 1.f)), w(rng.normal(size_t(N * K), 0.03f)), b(rng.normal(size_t(N), 0.5f));
  Dev<uint16_t> dx(x.bits), dw16(w.bits), db(b.bits), eager(size_t(T_ * N)), replay(static_cast<size_t>(T_ * N));
  Dev<uint8_t> w8(static_cast<size_t>(N * K));
  Dev<float> ws(static_cast<size_t>(N));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cuda::quantize_rows_fp8<T>(w8.p(), ws.p(), reinterpret_cast<const T*>(dw16.p()), N, K, stream);
  auto run = [&](Dev<uint16_t>& out) {
    gemm.run_fp8<T>(reinterpret_cast<T*>(out.p()), reinterpret_cast<const T*>(dx.p()), w8.p(), ws.p(),
                    reinterpret_cast<const T*>(db.p()), T_, K, N, GemmAct::GeluTanh, stream);
  };
  run(eager);  // plans the shape outside capture
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  run(replay);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(eager.template get<uint16_t>(), replay.template get<uint16_t>());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TYPED_TEST(Fp8, ChecksItsArguments) {
  using T = TypeParam;
  cuda::Gemm gemm;
  Dev<uint16_t> x(64 * 64), out(64 * 64);
  Dev<uint8_t> w(64 * 64);
  Dev<float> s(64);
  T* o = reinterpret_cast<T*>(out.p());
  const T* in = reinterpret_cast<const T*>(x.p());
  EXPECT_THROW(gemm.run_fp8<T>(o, in, nullptr, s.p(), nullptr, 4, 64, 64, GemmAct::None, nullptr), Error);
  EXPECT_THROW(gemm.run_fp8<T>(o, in, w.p(), nullptr, nullptr, 4, 64, 64, GemmAct::None, nullptr), Error);
  EXPECT_THROW(gemm.run_fp8<T>(o, in, w.p(), s.p(), nullptr, 4, 72, 64, GemmAct::None, nullptr), Error);  // K % 16
  EXPECT_THROW(gemm.run_fp8<T>(o, in, w.p(), s.p(), nullptr, 4, 64, 40, GemmAct::None, nullptr), Error);  // N % 16
  EXPECT_THROW(gemm.run_fp8<T>(o, in, w.p(), s.p(), nullptr, 0, 64, 64, GemmAct::None, nullptr), Error);
  EXPECT_THROW(gemm.run_fp8<T>(o + 1, in, w.p(), s.p(), nullptr, 4, 64, 64, GemmAct::None, nullptr), Error);
  EXPECT_THROW(cuda::quantize_rows_fp8<T>(nullptr, s.p(), in, 1, 64, nullptr), Error);
}

TEST(Fp8Device, HopperRunsFp8Products) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  cudaDeviceProp p{};
  ASSERT_EQ(cudaGetDeviceProperties(&p, 0), cudaSuccess);
  cuda::Gemm gemm;
  const Status s = gemm.fp8_supported();
  std::cout << "[fp8] " << p.name << " (" << p.major << "." << p.minor << "): "
            << (s ? std::string("FP8 products (cuBLASLt E4M3 -> fp32, scaling epilogue)") : s.message()) << "\n";
  if (p.major == 9) {
    EXPECT_TRUE(s.ok()) << s.message();
  }
  if (p.major * 10 + p.minor < 89) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("compute capability"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace conveyor

#endif

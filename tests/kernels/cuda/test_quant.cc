// Int8 weight-only quantisation and products (kernels/cuda/quant.h) against host references:
// the GPU quantiser equals quantize_rows_int8_reference bit for bit; every int8 kernel, and
// Gemm::run_int8's own choice, match a double-precision product of the same fp16/bf16 inputs
// with the dequantised weights s[n] q[n, k], output row by output row, for every batch size
// the stage uses, odd K and N, with and without bias, each activation, fp16/bf16 and fp32
// output; a second run is bitwise identical, and so are replays of a captured CUDA graph.
// Outputs are poisoned (NaN) before each run, so an element a kernel fails to write fails.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#include <iostream>

#ifndef CONVEYOR_HAVE_CUDA

TEST(Quant, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/quant.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

using cuda::GemmAct;
using cuda::detail::Int8Kernel;
using half = __half;
using bf16 = __nv_bfloat16;

using testing::have_gpu;

// ---- host values in a device element type ----

using testing::from_bits;
using testing::to_bits;
// The values rounded to T, as bits (for the device) and as floats (for the host).
template <class T>
struct Rounded {
  std::vector<uint16_t> bits;
  std::vector<float> values;
  explicit Rounded(const std::vector<float>& v) : bits(v.size()), values(v.size()) {
    for (size_t i = 0; i < v.size(); ++i) bits[i] = to_bits<T>(v[i]), values[i] = from_bits<T>(bits[i]);
  }
};

// `count` elements of E on the device, `offset_bytes` into a fresh buffer (to misalign them).
template <class E>
struct Dev {
  cuda::DeviceBuffer buf;
  size_t count = 0, offset = 0;
  Dev(size_t n, size_t offset_bytes = 0)
      : buf(cuda::device_alloc(n * sizeof(E) + offset_bytes + 16, "test_quant", "buffer")), count(n),
        offset(offset_bytes) {
    poison();
  }
  template <class H>
  Dev(const std::vector<H>& host, size_t offset_bytes = 0) : Dev(host.size(), offset_bytes) {
    static_assert(sizeof(H) == sizeof(E));
    CUDA_CHECK(cudaMemcpy(ptr(), host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice));
  }
  E* ptr() const { return reinterpret_cast<E*>(static_cast<char*>(buf.get()) + offset); }
  void poison() { CUDA_CHECK(cudaMemset(buf.get(), 0xff, buf.bytes())); }  // NaN in fp16, bf16, fp32
  template <class H>
  std::vector<H> get() const {
    static_assert(sizeof(H) == sizeof(E));
    std::vector<H> v(count);
    CUDA_CHECK(cudaMemcpy(v.data(), ptr(), count * sizeof(E), cudaMemcpyDeviceToHost));
    return v;
  }
};

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

double gelu_host(double v, GemmAct act) {
  if (act == GemmAct::GeluTanh) return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  if (act == GemmAct::GeluErf) return 0.5 * v * (1.0 + std::erf(v * 0.7071067811865476));
  return v;
}
const char* act_name(GemmAct a) {
  return a == GemmAct::None ? "none" : a == GemmAct::GeluTanh ? "gelu_tanh" : "gelu_erf";
}

// sum_k x[t, k] s[n] q[n, k] in double: the product every kernel must approximate.
std::vector<double> reference_products(const std::vector<float>& x, const std::vector<int8_t>& q,
                                       const std::vector<float>& s, int T, int K, int N) {
  std::vector<double> wd(q.size());
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) wd[size_t(n) * K + k] = double(s[n]) * q[size_t(n) * K + k];
  std::vector<double> out(size_t(T) * N);
  for (int t = 0; t < T; ++t) {
    const float* xr = x.data() + size_t(t) * K;
    for (int n = 0; n < N; ++n) {
      const double* wr = wd.data() + size_t(n) * K;
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += double(xr[k]) * wr[k];
      out[size_t(t) * N + n] = acc;
    }
  }
  return out;
}

// The worst over output rows t of ||out[t] - ref[t]|| / ||ref[t]|| (infinite on NaN/inf).
double worst_row_error(const std::vector<float>& out, const std::vector<double>& ref, int T, int N) {
  double worst = 0;
  for (int t = 0; t < T; ++t) {
    double num = 0, den = 0;
    for (int n = 0; n < N; ++n) {
      const float o = out[size_t(t) * N + n];
      if (!std::isfinite(o)) return INFINITY;
      const double d = double(o) - ref[size_t(t) * N + n];
      num += d * d;
      den += ref[size_t(t) * N + n] * ref[size_t(t) * N + n];
    }
    worst = std::max(worst, den == 0 ? std::sqrt(num) : std::sqrt(num / den));
  }
  return worst;
}

// One problem on the device: activations [T, K], int8 weights [N, K], scales, bias.
template <class T>
struct Problem {
  int T_ = 0, K = 0, N = 0;
  Dev<T> x;
  Dev<int8_t> q;
  Dev<float> s;
  Dev<T> bias;
  std::vector<double> products;  // reference, without bias and activation
  std::vector<float> bias_values;
  Problem(const Rounded<T>& xs, const std::vector<int8_t>& qs, const std::vector<float>& ss, const Rounded<T>& b,
          int T__, int K_, int N_, size_t x_offset = 0, size_t q_offset = 0)
      : T_(T__), K(K_), N(N_), x(xs.bits, x_offset), q(qs, q_offset), s(ss), bias(b.bits),
        products(reference_products(xs.values, qs, ss, T__, K_, N_)), bias_values(b.values) {}

  std::vector<double> expected(bool with_bias, GemmAct act) const {
    std::vector<double> r(products.size());
    for (size_t i = 0; i < r.size(); ++i) r[i] = gelu_host(products[i] + (with_bias ? bias_values[i % N] : 0.0), act);
    return r;
  }
};

// Runs kernel k (or Gemm::run_int8's choice when k < 0) into a poisoned output; returns it.
template <class T, class OutT>
std::vector<float> run_product(const Problem<T>& p, int k, bool with_bias, GemmAct act, cuda::Gemm& gemm,
                               cudaStream_t stream) {
  Dev<OutT> out(size_t(p.T_) * p.N);
  const T* b = with_bias ? p.bias.ptr() : nullptr;
  if (k < 0)
    gemm.run_int8<T, OutT>(out.ptr(), p.x.ptr(), p.q.ptr(), p.s.ptr(), b, p.T_, p.K, p.N, act, stream);
  else
    cuda::detail::int8_matmul<T, OutT>(Int8Kernel(k), out.ptr(), p.x.ptr(), p.q.ptr(), p.s.ptr(), b, p.T_, p.K, p.N,
                                       act, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  if constexpr (std::is_same_v<OutT, float>) {
    return out.template get<float>();
  } else {
    const auto bits = out.template get<uint16_t>();
    std::vector<float> v(bits.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = from_bits<T>(bits[i]);
    return v;
  }
}

std::vector<uint32_t> bit_pattern(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * 4);
  return b;
}

// Quantises w [N, K] on the host (the reference).
void quantize_host(const std::vector<float>& w, int N, int K, std::vector<int8_t>& q, std::vector<float>& s) {
  q.assign(size_t(N) * K, 0);
  s.assign(size_t(N), 0.f);
  cuda::quantize_rows_int8_reference(q.data(), s.data(), w.data(), N, K);
}

template <class T>
class Quant : public testing::GpuTypedTest<T> {};
using ElemTypes = ::testing::Types<half, bf16>;
TYPED_TEST_SUITE(Quant, ElemTypes);

// ---- quantisation ----

TYPED_TEST(Quant, QuantizeMatchesReference) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int K : {300, 4096}) {
    const int N = 37;
    std::vector<float> w = rng.normal(size_t(N) * K, 0.02f);
    for (int k = 0; k < K; ++k) w[size_t(5) * K + k] = 0.f;  // an all-zero row
    w[size_t(7) * K + 3] = 3.5f;                                // an outlier
    // Ties: with amax 127 the scale is 1, so w / s is w, and x.5 rounds to even.
    const float ties[] = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 126.5f, -127.f};
    for (int i = 0; i < 8; ++i) w[size_t(9) * K + i] = ties[i];
    for (int k = 8; k < K; ++k) w[size_t(9) * K + k] = 0.25f;
    const Rounded<T> wr(w);

    std::vector<int8_t> q_ref;
    std::vector<float> s_ref;
    quantize_host(wr.values, N, K, q_ref, s_ref);
    Dev<T> dw(wr.bits);
    Dev<int8_t> dq(static_cast<size_t>(N) * K);
    Dev<float> ds(static_cast<size_t>(N));
    cuda::quantize_rows_int8<T>(dq.ptr(), ds.ptr(), dw.ptr(), N, K, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto q = dq.template get<int8_t>();
    const auto s = ds.template get<float>();
    EXPECT_EQ(bit_pattern(s), bit_pattern(s_ref)) << "K=" << K;
    EXPECT_EQ(q, q_ref) << "K=" << K;

    EXPECT_EQ(s_ref[5], 0.f);
    for (int k = 0; k < K; ++k) ASSERT_EQ(q_ref[size_t(5) * K + k], 0);
    EXPECT_EQ(s_ref[9], 1.f);
    const int8_t want[] = {127, 0, 2, 2, 0, -2, 126, -127};
    for (int i = 0; i < 8; ++i) EXPECT_EQ(q_ref[size_t(9) * K + i], want[i]) << "tie " << ties[i];
    for (int n = 0; n < N; ++n) {
      if (n == 5) continue;
      int amax = 0;
      for (int k = 0; k < K; ++k) amax = std::max(amax, std::abs(int(q_ref[size_t(n) * K + k])));
      EXPECT_EQ(amax, 127) << "row " << n;
    }
  }
}

TEST(QuantF32, QuantizeMatchesReference) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  const int N = 19, K = 1001;
  const std::vector<float> w = rng.normal(size_t(N) * K, 1.f);
  std::vector<int8_t> q_ref;
  std::vector<float> s_ref;
  quantize_host(w, N, K, q_ref, s_ref);
  Dev<float> dw(w);
  Dev<int8_t> dq(static_cast<size_t>(N) * K);
  Dev<float> ds(static_cast<size_t>(N));
  cuda::quantize_rows_int8<float>(dq.ptr(), ds.ptr(), dw.ptr(), N, K, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dq.get<int8_t>(), q_ref);
  EXPECT_EQ(bit_pattern(ds.get<float>()), bit_pattern(s_ref));
}

// ---- products ----

// Each kernel (and Gemm's choice) on each problem, with one (bias, activation, output type)
// combination per run, rotating so that every combination meets every kernel and batch size.
template <class T>
void check_all_kernels(Problem<T>& p, int rotation, cuda::Gemm& gemm, const std::string& what) {
  for (int k = -1; k < cuda::detail::kInt8Kernels; ++k) {
    if (k >= 0 && !cuda::detail::int8_kernel_supported(Int8Kernel(k), p.T_, p.K, p.N, p.x.ptr(), p.q.ptr())) continue;
    const int combo = (rotation + k + 1) % 12;
    const bool with_bias = combo & 1, out_float = combo >= 6;
    const GemmAct act = GemmAct((combo >> 1) % 3);
    const std::vector<double> ref = p.expected(with_bias, act);
    std::vector<float> first, second;
    if (out_float) {
      first = run_product<T, float>(p, k, with_bias, act, gemm, nullptr);
      second = run_product<T, float>(p, k, with_bias, act, gemm, nullptr);
    } else {
      first = run_product<T, T>(p, k, with_bias, act, gemm, nullptr);
      second = run_product<T, T>(p, k, with_bias, act, gemm, nullptr);
    }
    const double tol = out_float ? 1e-4 : std::is_same_v<T, half> ? 2e-3 : 1e-2;
    const std::string label = what + " kernel=" + (k < 0 ? "gemm-choice" : cuda::detail::int8_kernel_name(Int8Kernel(k))) +
                              " bias=" + std::to_string(with_bias) + " act=" + act_name(act) +
                              " out=" + (out_float ? "f32" : "T");
    EXPECT_LT(worst_row_error(first, ref, p.T_, p.N), tol) << label;
    EXPECT_EQ(bit_pattern(first), bit_pattern(second)) << label << ": not reproducible";
  }
}

TYPED_TEST(Quant, KernelsMatchReference) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  cuda::Gemm gemm;
  struct Shape {
    int K, N;
    std::vector<int> tokens;
  };
  const std::vector<int> all = {1, 2, 3, 5, 8, 9, 16, 33, 64, 128, 300};
  // K % 64 != 0 (272: the GEMV's partial chunk), K % 16 != 0 (300, 120: the guarded tile
  // loader), odd N; 4096 x 1000 gives the GEMV several runs per warp (its prefetch).
  const std::vector<Shape> shapes = {{256, 256, all},  {768, 2304, all}, {272, 1013, all},
                                     {300, 1013, all}, {120, 77, all},   {4096, 1000, {1, 3, 8, 16, 64}}};
  int rotation = 0;
  for (const Shape& sh : shapes) {
    const Rounded<T> w(rng.normal(size_t(sh.N) * sh.K, 0.02f));
    std::vector<int8_t> q;
    std::vector<float> s;
    quantize_host(w.values, sh.N, sh.K, q, s);
    const Rounded<T> bias(rng.normal(size_t(sh.N), 0.1f));
    for (int Tn : sh.tokens) {
      const Rounded<T> x(rng.normal(size_t(Tn) * sh.K, 1.f));
      Problem<T> p(x, q, s, bias, Tn, sh.K, sh.N);
      check_all_kernels(p, rotation++, gemm, "T=" + std::to_string(Tn) + " K=" + std::to_string(sh.K) +
                                                 " N=" + std::to_string(sh.N));
    }
  }
  SCOPED_TRACE(gemm.describe_plans());
}

// dequantize_rows_int8 gives q * s rounded once to T (vector and element paths), and
// run_int8 with a dequantisation workspace (its dequantise-then-cuBLASLt candidate, which
// prefill-sized products usually take) still matches the reference.
TYPED_TEST(Quant, DequantisingPathMatchesReference) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (const auto& [N, K] : {std::pair{96, 512}, std::pair{37, 300}}) {
    const Rounded<T> w(rng.normal(size_t(N) * K, 0.02f));
    std::vector<int8_t> q;
    std::vector<float> sc;
    quantize_host(w.values, N, K, q, sc);
    Dev<int8_t> dq(q);
    Dev<float> ds(sc);
    Dev<T> out(size_t(N) * K);
    cuda::dequantize_rows_int8<T>(out.ptr(), dq.ptr(), ds.ptr(), N, K, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto bits = out.template get<uint16_t>();
    for (size_t i = 0; i < bits.size(); ++i)
      ASSERT_EQ(bits[i], to_bits<T>(float(q[i]) * sc[i / size_t(K)])) << "N " << N << " K " << K << " element " << i;
  }
  const int Tn = 1024, K = 1024, N = 1536;
  const Rounded<T> w(rng.normal(size_t(N) * K, 0.02f));
  std::vector<int8_t> q;
  std::vector<float> sc;
  quantize_host(w.values, N, K, q, sc);
  const Rounded<T> bias(rng.normal(size_t(N), 0.1f)), x(rng.normal(size_t(Tn) * K, 1.f));
  Problem<T> p(x, q, sc, bias, Tn, K, N);
  cuda::Gemm gemm;
  Dev<T> workspace(size_t(N) * K);
  gemm.set_dequant_workspace(workspace.ptr(), size_t(N) * K * sizeof(T));
  const auto got = run_product<T, T>(p, -1, true, GemmAct::GeluTanh, gemm, nullptr);
  const double tol = std::is_same_v<T, half> ? 2e-3 : 1e-2;
  EXPECT_LT(worst_row_error(got, p.expected(true, GemmAct::GeluTanh), Tn, N), tol) << gemm.describe_plans();
  std::cout << "[plan] " << gemm.describe_plans();
}

// in and w not 16-byte aligned: no GEMV; the tiles take their guarded loader.
TYPED_TEST(Quant, MisalignedPointers) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  cuda::Gemm gemm;
  const int K = 256, N = 130;
  const Rounded<T> w(rng.normal(size_t(N) * K, 0.02f));
  std::vector<int8_t> q;
  std::vector<float> s;
  quantize_host(w.values, N, K, q, s);
  const Rounded<T> bias(rng.normal(size_t(N), 0.1f));
  int rotation = 0;
  for (int Tn : {1, 9, 64}) {
    const Rounded<T> x(rng.normal(size_t(Tn) * K, 1.f));
    Problem<T> p(x, q, s, bias, Tn, K, N, /*x_offset=*/sizeof(T), /*q_offset=*/3);
    EXPECT_FALSE(cuda::detail::int8_kernel_supported(Int8Kernel::Gemv, Tn, K, N, p.x.ptr(), p.q.ptr()));
    check_all_kernels(p, rotation++, gemm, "misaligned T=" + std::to_string(Tn));
  }
}

// The stage replays decode steps from CUDA graphs: a captured run_int8 replays bit for bit
// what it computed eagerly, for shapes planned before capture and for one first seen inside it.
TYPED_TEST(Quant, GraphCaptureReplaysEagerResult) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  cuda::Gemm gemm;
  // The int8 kernels' own planning (timed, or the untimed default when first seen in a
  // capture); deterministic mode's fixed-order tiles are test_cuda_determinism's.
  gemm.set_deterministic(false);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Case {
    int T_, K, N;
    bool planned;  // run eagerly first (planned outside capture)
  };
  for (const Case& c : {Case{1, 768, 2304, true}, Case{64, 768, 2304, true}, Case{300, 300, 1013, true},
                        Case{5, 512, 1000, false}, Case{40, 512, 1000, false}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T_) + " K=" + std::to_string(c.K) + " N=" + std::to_string(c.N) +
                 (c.planned ? " planned" : " first seen in capture"));
    const Rounded<T> w(rng.normal(size_t(c.N) * c.K, 0.02f));
    std::vector<int8_t> q;
    std::vector<float> s;
    quantize_host(w.values, c.N, c.K, q, s);
    const Rounded<T> bias(rng.normal(size_t(c.N), 0.1f)), x(rng.normal(size_t(c.T_) * c.K, 1.f));
    Problem<T> p(x, q, s, bias, c.T_, c.K, c.N);
    const size_t n_out = size_t(c.T_) * c.N;
    Dev<T> out(n_out);
    auto call = [&] {
      gemm.run_int8<T, T>(out.ptr(), p.x.ptr(), p.q.ptr(), p.s.ptr(), p.bias.ptr(), c.T_, c.K, c.N, GemmAct::GeluTanh,
                          stream);
    };
    std::vector<uint16_t> eager;
    if (c.planned) {
      call();
      CUDA_CHECK(cudaStreamSynchronize(stream));
      eager = out.template get<uint16_t>();
    } else {  // the untimed choice, run directly
      const Int8Kernel k = cuda::detail::int8_default_kernel(c.T_, c.K, c.N, p.x.ptr(), p.q.ptr());
      cuda::detail::int8_matmul<T, T>(k, out.ptr(), p.x.ptr(), p.q.ptr(), p.s.ptr(), p.bias.ptr(), c.T_, c.K, c.N,
                                      GemmAct::GeluTanh, stream);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      eager = out.template get<uint16_t>();
    }
    std::vector<float> eager_values(n_out);
    for (size_t i = 0; i < n_out; ++i) eager_values[i] = from_bits<T>(eager[i]);
    const double tol = std::is_same_v<T, half> ? 2e-3 : 1e-2;
    EXPECT_LT(worst_row_error(eager_values, p.expected(true, GemmAct::GeluTanh), c.T_, c.N), tol);

    out.poison();
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    call();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    for (int replay = 0; replay < 2; ++replay) {
      out.poison();
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(out.template get<uint16_t>(), eager) << "replay " << replay;
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// The int8 GEMV with each forced K split (GemmOptions::int8_gemv_k_split, for measurements):
// every split sums the same products, within the GEMV's tolerance, and a Gemm built with one
// runs it.
TYPED_TEST(Quant, ForcedGemvSplitsMatchReference) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (auto [K, N] : {std::pair{4096, 1000}, {768, 2304}}) {
    const Rounded<T> w(rng.normal(size_t(N) * K, 0.02f));
    std::vector<int8_t> q;
    std::vector<float> s;
    quantize_host(w.values, N, K, q, s);
    const Rounded<T> bias(rng.normal(size_t(N), 0.1f));
    for (int Tn : {1, 3, 8}) {
      const Rounded<T> x(rng.normal(size_t(Tn) * K, 1.f));
      Problem<T> p(x, q, s, bias, Tn, K, N);
      const std::vector<double> ref = p.expected(true, GemmAct::None);
      const double tol = std::is_same_v<T, half> ? 2e-3 : 1e-2;
      for (int split : {1, 2, 4, 8}) {
        const std::string label = "T=" + std::to_string(Tn) + " K=" + std::to_string(K) + " N=" +
                                  std::to_string(N) + " split=" + std::to_string(split);
        Dev<T> out(size_t(Tn) * N);
        cuda::detail::int8_matmul<T, T>(Int8Kernel::Gemv, out.ptr(), p.x.ptr(), p.q.ptr(), p.s.ptr(),
                                        p.bias.ptr(), Tn, K, N, GemmAct::None, nullptr, split);
        CUDA_CHECK(cudaDeviceSynchronize());
        const auto bits = out.template get<uint16_t>();
        std::vector<float> got(bits.size());
        for (size_t i = 0; i < got.size(); ++i) got[i] = from_bits<T>(bits[i]);
        EXPECT_LT(worst_row_error(got, ref, Tn, N), tol) << label;
      }
    }
  }
}

TYPED_TEST(Quant, ErrorsNameTheProblem) {
  using T = TypeParam;
  cuda::Gemm gemm;
  Dev<T> x(64 * 64), out(64 * 64);
  Dev<int8_t> q(64 * 64);
  Dev<float> s(64);
  auto message_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(message_of([&] {
              gemm.run_int8<T, T>(out.ptr(), x.ptr(), q.ptr(), nullptr, nullptr, 4, 64, 64, GemmAct::None, nullptr);
            }).find("scales"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              gemm.run_int8<T, T>(nullptr, x.ptr(), nullptr, s.ptr(), nullptr, 4, 64, 64, GemmAct::None, nullptr);
            }).find("out, w"),
            std::string::npos);
  for (auto [t, k, n] : {std::tuple{0, 64, 64}, {4, 0, 64}, {4, 64, -1}})
    EXPECT_NE(message_of([&, t = t, k = k, n = n] {
                gemm.run_int8<T, float>(reinterpret_cast<float*>(out.ptr()), x.ptr(), q.ptr(), s.ptr(), nullptr, t, k,
                                        n, GemmAct::None, nullptr);
              }).find("must be positive"),
              std::string::npos)
        << t << " " << k << " " << n;
  EXPECT_NE(message_of([&] {
              cuda::detail::int8_matmul<T, T>(Int8Kernel::Gemv, out.ptr(), x.ptr(), q.ptr(), s.ptr(), nullptr, 9, 64,
                                              64, GemmAct::None, nullptr);
            }).find("gemv cannot run T=9"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              cuda::detail::int8_matmul<T, T>(Int8Kernel::Gemv, out.ptr(), x.ptr(), q.ptr(), s.ptr(), nullptr, 4, 64,
                                              64, GemmAct::None, nullptr, 3);
            }).find("gemv_k_split 3 (0: chosen by shape, or 1, 2, 4, 8)"),
            std::string::npos);
  EXPECT_NE(message_of([&] { cuda::quantize_rows_int8<T>(q.ptr(), nullptr, x.ptr(), 64, 64, nullptr); }).find("null"),
            std::string::npos);
  EXPECT_NE(message_of([&] { cuda::quantize_rows_int8<T>(q.ptr(), s.ptr(), x.ptr(), 0, 64, nullptr); }).find("N=0"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              std::vector<int8_t> hq(4);
              std::vector<float> hs(1), hw(4);
              cuda::quantize_rows_int8_reference(hq.data(), hs.data(), hw.data(), 1, -4);
            }).find("K=-4"),
            std::string::npos);
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

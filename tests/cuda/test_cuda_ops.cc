// Every CUDA op (kernels/cuda) against its CPU reference (kernels/cpu, fp32) on fresh random
// inputs of odd sizes, in fp16 and bf16. The inputs are rounded to the element type first,
// so the CPU sees exactly what the GPU sees; the check is ||gpu - cpu|| / ||cpu|| under a
// bound per dtype and op. Outputs are poisoned (NaN) before each op, so an element the
// kernel fails to write fails the check. The seed of each test is printed on failure.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(CudaOps, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/kv_cache.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/synthetic.h"
#include "model/sampling.h"
#include "tests/cuda/gpu_test_util.h"

namespace conveyor {
namespace {

using cuda::bf16;
using cuda::half;

using testing::have_gpu;

// ---- host <-> device in a given element type ----

using testing::from_bits;
using testing::to_bits;

template <class T>
float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  else return from_bits<T>(to_bits<T>(f));
}

template <class T>
void round_all(std::vector<float>& v) {
  for (float& x : v) x = round_to<T>(x);
}

// A device array of T (half, bf16, float or int32_t) with float/int transfers.
template <class T>
struct Dev {
  cuda::DeviceBuffer buf;
  int64_t n = 0;
  explicit Dev(int64_t count) : buf(cuda::device_alloc(static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T), "test", "buffer")), n(count) {
    poison();
  }
  Dev(const std::vector<float>& v) : Dev(int64_t(v.size())) { put(v); }  // NOLINT
  T* p() const { return buf.as<T>(); }
  void poison() { CUDA_CHECK(cudaMemset(buf.get(), 0xff, buf.bytes())); }  // NaN in every float type
  void put(const std::vector<float>& v) {
    if constexpr (std::is_same_v<T, float>) {
      CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
    } else {
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i) b[i] = to_bits<T>(v[i]);
      CUDA_CHECK(cudaMemcpy(buf.get(), b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    }
  }
  std::vector<float> get() const {
    std::vector<float> v(static_cast<size_t>(n));
    if constexpr (std::is_same_v<T, float>) {
      CUDA_CHECK(cudaMemcpy(v.data(), buf.get(), v.size() * sizeof(float), cudaMemcpyDeviceToHost));
    } else {
      std::vector<uint16_t> b(v.size());
      CUDA_CHECK(cudaMemcpy(b.data(), buf.get(), b.size() * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < v.size(); ++i) v[i] = from_bits<T>(b[i]);
    }
    return v;
  }
};

struct DevInts {
  cuda::DeviceBuffer buf;
  explicit DevInts(const std::vector<int32_t>& v)
      : buf(cuda::device_alloc(std::max<size_t>(v.size(), 1) * 4, "test", "ints")) {
    CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  }
  int32_t* p() const { return buf.as<int32_t>(); }
};

// ||a - ref|| / ||ref||; infinity when a holds NaN/inf or sizes differ.
double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

template <class T>
double tol(double fp16, double bf16_) {
  return std::is_same_v<T, half> ? fp16 : bf16_;
}

// Fresh randomness per test; the seed goes into the failure message.
struct Rng {
  uint32_t seed;
  std::mt19937 gen;
  Rng() : seed(std::random_device{}()), gen(seed) {}
  std::vector<float> normal(size_t n, float stddev = 1.f, float mean = 0.f) {
    std::normal_distribution<float> d(mean, stddev);
    std::vector<float> v(n);
    for (auto& x : v) x = d(gen);
    return v;
  }
  int pick(std::initializer_list<int> xs) {
    std::vector<int> v(xs);
    return v[gen() % v.size()];
  }
  int uniform(int lo, int hi) { return lo + int(gen() % uint32_t(hi - lo + 1)); }  // [lo, hi]
};
#define SEED_TRACE(rng) SCOPED_TRACE("seed " + std::to_string((rng).seed))

cudaStream_t s0 = nullptr;  // the default stream

template <class T>
class CudaOps : public testing::GpuTypedTest<T> {};
using ElemTypes = ::testing::Types<half, bf16>;
TYPED_TEST_SUITE(CudaOps, ElemTypes);

// ---- the twins ----

TYPED_TEST(CudaOps, Embedding) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int C : {77, 1600, 24}) {
    const int V = 113, P = 61, Tn = rng.pick({1, 5, 33});
    auto wte = rng.normal(static_cast<size_t>(V) * C), wpe = rng.normal(static_cast<size_t>(P) * C);
    round_all<T>(wte), round_all<T>(wpe);
    std::vector<int32_t> ids(static_cast<size_t>(Tn)), pos(static_cast<size_t>(Tn));
    for (auto& x : ids) x = rng.uniform(0, V - 1);
    for (auto& x : pos) x = rng.uniform(0, P - 1);
    std::vector<float> ref(static_cast<size_t>(Tn) * C);
    cpu::embedding_forward(ref.data(), ids.data(), pos.data(), Tn, wte.data(), wpe.data(), C);
    Dev<T> dwte(wte), dwpe(wpe), out(int64_t(Tn) * C);
    DevInts dids(ids), dpos(pos);
    cuda::embedding_forward<T>(out.p(), dids.p(), dpos.p(), Tn, dwte.p(), dwpe.p(), C, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(1e-3, 6e-3)) << "C=" << C;
  }
}

TYPED_TEST(CudaOps, LayerNorm) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int C : {77, 1600, 12288, 8}) {
    const int Tn = rng.pick({1, 3, 17});
    auto in = rng.normal(static_cast<size_t>(Tn) * C, 2.f, 0.5f), g = rng.normal(static_cast<size_t>(C), 0.2f, 1.f), b = rng.normal(static_cast<size_t>(C), 0.1f);
    round_all<T>(in), round_all<T>(g), round_all<T>(b);
    std::vector<float> ref(in.size());
    cpu::layernorm_forward(ref.data(), in.data(), g.data(), b.data(), Tn, C, 1e-5f);
    Dev<T> din(in), dg(g), db(b), out(int64_t(in.size()));
    cuda::layernorm_forward<T>(out.p(), din.p(), dg.p(), db.p(), Tn, C, 1e-5f, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(1e-3, 6e-3)) << "C=" << C;
    // In place.
    cuda::layernorm_forward<T>(din.p(), din.p(), dg.p(), db.p(), Tn, C, 1e-5f, s0);
    EXPECT_LT(rel_err(din.get(), ref), tol<T>(1e-3, 6e-3)) << "in place, C=" << C;
  }
}

TYPED_TEST(CudaOps, MatmulKN) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  struct Shape { int T, K, N; bool bias; };
  for (Shape s : {Shape{1, 64, 37, true}, Shape{3, 77, 45, true}, Shape{13, 128, 256, false}, Shape{65, 96, 300, true},
                  Shape{8, 1600, 4800, true}}) {
    auto in = rng.normal(static_cast<size_t>(s.T) * s.K), w = rng.normal(static_cast<size_t>(s.K) * s.N, 0.05f), b = rng.normal(static_cast<size_t>(s.N), 0.1f);
    round_all<T>(in), round_all<T>(w), round_all<T>(b);
    std::vector<float> ref(static_cast<size_t>(s.T) * s.N);
    cpu::matmul_forward(ref.data(), in.data(), w.data(), s.bias ? b.data() : nullptr, s.T, s.K, s.N);
    Dev<T> din(in), dw(w), db(b), out(int64_t(ref.size()));
    cuda::matmul_forward<T>(out.p(), din.p(), dw.p(), s.bias ? db.p() : nullptr, s.T, s.K, s.N, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(2e-3, 8e-3)) << s.T << "x" << s.K << "x" << s.N;
  }
}

TYPED_TEST(CudaOps, LmHead) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int Tn : {1, 3, 9}) {
    const int C = rng.pick({64, 96, 80}), V = rng.pick({1013, 503});
    auto in = rng.normal(static_cast<size_t>(Tn) * C), head = rng.normal(static_cast<size_t>(V) * C, 0.05f);
    round_all<T>(in), round_all<T>(head);
    std::vector<float> ref(static_cast<size_t>(Tn) * V);
    cpu::lm_head_forward(ref.data(), in.data(), head.data(), Tn, C, V);
    Dev<T> din(in), dh(head);
    Dev<float> out(int64_t(ref.size()));
    cuda::lm_head_forward<T>(out.p(), din.p(), dh.p(), Tn, C, V, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(1e-4, 1e-4)) << "T=" << Tn;  // fp32 out: only accumulation order
  }
}

TYPED_TEST(CudaOps, Gelu) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int n : {1, 77, 8 * 1001}) {
    auto x = rng.normal(static_cast<size_t>(n), 2.f);
    round_all<T>(x);
    for (bool erf_form : {false, true}) {
      std::vector<float> ref = x;
      if (erf_form) cpu::gelu_erf_forward(ref.data(), n);
      else cpu::gelu_forward(ref.data(), n);
      Dev<T> d(x);
      if (erf_form) cuda::gelu_erf_forward<T>(d.p(), n, s0);
      else cuda::gelu_forward<T>(d.p(), n, s0);
      EXPECT_LT(rel_err(d.get(), ref), tol<T>(1e-3, 6e-3)) << "n=" << n << " erf=" << erf_form;
    }
  }
}

TYPED_TEST(CudaOps, Residual) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int n : {1, 77, 8 * 4099}) {
    auto a = rng.normal(static_cast<size_t>(n)), b = rng.normal(static_cast<size_t>(n));
    round_all<T>(a), round_all<T>(b);
    std::vector<float> ref(a.size());
    cpu::residual_forward(ref.data(), a.data(), b.data(), n);
    Dev<T> da(a), db(b), out(n);
    cuda::residual_forward<T>(out.p(), da.p(), db.p(), n, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(1e-3, 6e-3));
    cuda::residual_forward<T>(da.p(), da.p(), db.p(), n, s0);  // out aliases a
    EXPECT_LT(rel_err(da.get(), ref), tol<T>(1e-3, 6e-3));
  }
}

TYPED_TEST(CudaOps, AttentionContext) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  struct Shape { int q_len, kv_len, H, D; };
  for (Shape s : {Shape{1, 1, 2, 64}, Shape{7, 7, 3, 64}, Shape{70, 70, 2, 128}, Shape{5, 150, 2, 64}, Shape{33, 100, 1, 5},
                  Shape{129, 200, 2, 40}, Shape{64, 64, 1, 256}, Shape{20, 20, 2, 32}}) {
    const int C = s.H * s.D;
    const int q_stride = 3 * C;  // q inside a qkv row, as the stage calls it
    const int kv_stride = 2 * C;  // k | v rows, as the CPU stage caches them
    auto qbuf = rng.normal(static_cast<size_t>(s.q_len) * q_stride), kv = rng.normal(static_cast<size_t>(s.kv_len) * kv_stride);
    round_all<T>(qbuf), round_all<T>(kv);
    std::vector<float> ref(static_cast<size_t>(s.q_len) * C);
    cpu::attention_context(ref.data(), qbuf.data(), q_stride, kv.data(), kv.data() + C, kv_stride, s.q_len, s.kv_len, s.H, s.D);
    Dev<T> dq(qbuf), dkv(kv), out(int64_t(ref.size()));
    cuda::attention_context<T>(out.p(), dq.p(), q_stride, dkv.p(), dkv.p() + C, kv_stride, s.q_len, s.kv_len, s.H, s.D, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(4e-3, 2e-2))
        << "q_len=" << s.q_len << " kv_len=" << s.kv_len << " H=" << s.H << " D=" << s.D;
  }
}

TYPED_TEST(CudaOps, AttentionContextChunksMatchOnePass) {
  // A query row's result must not depend on how the prompt was cut (key tiles start at 0).
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  const int L = 150, H = 2, D = 64, C = H * D;
  auto q = rng.normal(static_cast<size_t>(L) * C), kv = rng.normal(static_cast<size_t>(L) * 2 * C);
  Dev<T> dq(q), dkv(kv), full(int64_t(L) * C), part(int64_t(L) * C);
  cuda::attention_context<T>(full.p(), dq.p(), C, dkv.p(), dkv.p() + C, 2 * C, L, L, H, D, s0);
  for (int begin = 0; begin < L;) {
    const int len = std::min(L - begin, rng.uniform(1, 70));
    cuda::attention_context<T>(part.p() + int64_t(begin) * C, dq.p() + int64_t(begin) * C, C, dkv.p(), dkv.p() + C, 2 * C,
                               len, begin + len, H, D, s0);
    begin += len;
  }
  const auto a = full.get(), b = part.get();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TYPED_TEST(CudaOps, AttentionDecode) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  struct Shape { int kv_len, H, D; };
  for (Shape s : {Shape{1, 3, 64}, Shape{37, 2, 128}, Shape{1000, 4, 64}, Shape{19, 2, 5}, Shape{300, 1, 256}, Shape{77, 3, 40},
                  Shape{50, 2, 520}}) {
    const int C = s.H * s.D;
    auto q = rng.normal(static_cast<size_t>(C)), kv = rng.normal(static_cast<size_t>(s.kv_len) * 2 * C);
    round_all<T>(q), round_all<T>(kv);
    std::vector<float> ref(static_cast<size_t>(C));
    cpu::attention_decode(ref.data(), q.data(), kv.data(), kv.data() + C, 2 * C, s.kv_len, s.H, s.D);
    Dev<T> dq(q), dkv(kv), out(C);
    cuda::attention_decode<T>(out.p(), dq.p(), dkv.p(), dkv.p() + C, 2 * C, s.kv_len, s.H, s.D, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(2e-3, 8e-3)) << "kv_len=" << s.kv_len << " D=" << s.D;
  }
}

TEST(CudaOpsF32, LogSoftmax) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  for (int n : {1, 77, 50257}) {
    const int rows = rng.pick({1, 3});
    auto x = rng.normal(static_cast<size_t>(rows) * n, 4.f);
    std::vector<float> ref = x;
    cpu::log_softmax_forward(ref.data(), rows, n);
    Dev<float> d(x);
    cuda::log_softmax_forward(d.p(), rows, n, s0);
    EXPECT_LT(rel_err(d.get(), ref), 1e-5) << "n=" << n;
  }
}

// ---- fused kernels against compositions of CPU ops ----

TYPED_TEST(CudaOps, AddBiasResidualLayerNorm) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int C : {77, 1600, 4096}) {
    const int Tn = rng.pick({1, 4, 19});
    auto res = rng.normal(static_cast<size_t>(Tn) * C), x = rng.normal(static_cast<size_t>(Tn) * C), bias = rng.normal(static_cast<size_t>(C), 0.1f);
    auto g = rng.normal(static_cast<size_t>(C), 0.2f, 1.f), b = rng.normal(static_cast<size_t>(C), 0.1f);
    round_all<T>(res), round_all<T>(x), round_all<T>(bias), round_all<T>(g), round_all<T>(b);
    std::vector<float> sum(res.size()), ln(res.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = round_to<T>(res[i] + x[i] + bias[i % static_cast<size_t>(C)]);
    cpu::layernorm_forward(ln.data(), sum.data(), g.data(), b.data(), Tn, C, 1e-5f);
    Dev<T> dres(res), dx(x), dbias(bias), dg(g), db(b), out(int64_t(res.size()));
    cuda::add_bias_residual_layernorm<T>(dres.p(), out.p(), dx.p(), dbias.p(), dg.p(), db.p(), Tn, C, 1e-5f, s0);
    EXPECT_LT(rel_err(dres.get(), sum), tol<T>(1e-3, 6e-3)) << "residual, C=" << C;
    EXPECT_LT(rel_err(out.get(), ln), tol<T>(1e-3, 6e-3)) << "layernorm, C=" << C;
    // Without the LayerNorm (the last layer of a stage that hands the residual on).
    Dev<T> dres2(res);
    cuda::add_bias_residual_layernorm<T>(dres2.p(), nullptr, dx.p(), dbias.p(), nullptr, nullptr, Tn, C, 1e-5f, s0);
    EXPECT_LT(rel_err(dres2.get(), sum), tol<T>(1e-3, 6e-3)) << "add only, C=" << C;
  }
}

TYPED_TEST(CudaOps, AddBiasGelu) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int N : {300, 4096, 7}) {
    const int rows = rng.pick({1, 5});
    auto x = rng.normal(static_cast<size_t>(rows) * N), bias = rng.normal(static_cast<size_t>(N), 0.3f);
    round_all<T>(x), round_all<T>(bias);
    for (Activation act : {Activation::GeluNew, Activation::Gelu}) {
      std::vector<float> ref(x.size());
      for (size_t i = 0; i < x.size(); ++i) ref[i] = x[i] + bias[i % static_cast<size_t>(N)];
      if (act == Activation::GeluNew) cpu::gelu_forward(ref.data(), int64_t(ref.size()));
      else cpu::gelu_erf_forward(ref.data(), int64_t(ref.size()));
      Dev<T> d(x), db(bias);
      cuda::add_bias_gelu<T>(d.p(), db.p(), rows, N, act, s0);
      EXPECT_LT(rel_err(d.get(), ref), tol<T>(2e-3, 8e-3)) << "N=" << N;
    }
  }
}

// The GPU stage's matrix products: weights [N, K], optional bias and GeLU, every T the decode
// buckets use (the GEMV for T <= 8 and cuBLASLt, whichever wins the timing), tuned and untuned.
TYPED_TEST(CudaOps, GemmNK) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (bool tuned : {true, false}) {
    cuda::Gemm gemm;
    gemm.set_tuning(tuned);
    struct Shape { int T, K, N; bool bias; cuda::GemmAct act; };
    for (Shape s : {Shape{1, 1600, 4800, true, cuda::GemmAct::None}, Shape{2, 256, 1000, true, cuda::GemmAct::GeluTanh},
                    Shape{4, 96, 300, true, cuda::GemmAct::GeluErf}, Shape{8, 512, 520, false, cuda::GemmAct::None},
                    Shape{5, 77, 33, true, cuda::GemmAct::None}, Shape{32, 256, 768, true, cuda::GemmAct::GeluTanh},
                    Shape{128, 300, 96, false, cuda::GemmAct::None}}) {
      auto in = rng.normal(static_cast<size_t>(s.T) * s.K), w = rng.normal(static_cast<size_t>(s.N) * s.K, 0.05f), b = rng.normal(static_cast<size_t>(s.N), 0.1f);
      round_all<T>(in), round_all<T>(w), round_all<T>(b);
      std::vector<float> wt(w.size());  // [K, N] for the CPU
      for (int n = 0; n < s.N; ++n)
        for (int k = 0; k < s.K; ++k) wt[static_cast<size_t>(k) * s.N + n] = w[static_cast<size_t>(n) * s.K + k];
      std::vector<float> ref(static_cast<size_t>(s.T) * s.N);
      cpu::matmul_forward(ref.data(), in.data(), wt.data(), s.bias ? b.data() : nullptr, s.T, s.K, s.N);
      if (s.act == cuda::GemmAct::GeluTanh) cpu::gelu_forward(ref.data(), int64_t(ref.size()));
      if (s.act == cuda::GemmAct::GeluErf) cpu::gelu_erf_forward(ref.data(), int64_t(ref.size()));
      Dev<T> din(in), dw(w), db(b), out(int64_t(ref.size()));
      for (int rep = 0; rep < 2; ++rep) {  // planning call, then the cached plan
        out.poison();
        gemm.run<T, T>(out.p(), din.p(), dw.p(), s.bias ? db.p() : nullptr, s.T, s.K, s.N, cuda::WeightLayout::NK, s.act, s0);
        EXPECT_LT(rel_err(out.get(), ref), tol<T>(3e-3, 1.2e-2))
            << s.T << "x" << s.K << "x" << s.N << " tuned=" << tuned << " rep=" << rep;
      }
    }
    SCOPED_TRACE(gemm.describe_plans());
  }
}

// Token counts in one bucket share the first one's timed choice (gemm.h): T = 20 is timed,
// T = 25 and 32 take its algorithm (and stay correct), T = 33 starts the next bucket.
TYPED_TEST(CudaOps, GemmTokenCountsShareTheirBucketsPlan) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  cuda::Gemm gemm;
  const int K = 512, N = 768;
  auto w = rng.normal(static_cast<size_t>(N) * K, 0.05f);
  round_all<T>(w);
  std::vector<float> wt(w.size());
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) wt[static_cast<size_t>(k) * N + n] = w[static_cast<size_t>(n) * K + k];
  Dev<T> dw(w);
  for (int Tn : {20, 25, 32, 33}) {
    auto in = rng.normal(static_cast<size_t>(Tn) * K);
    round_all<T>(in);
    std::vector<float> ref(static_cast<size_t>(Tn) * N);
    cpu::matmul_forward(ref.data(), in.data(), wt.data(), nullptr, Tn, K, N);
    Dev<T> din(in), out(int64_t(ref.size()));
    out.poison();
    gemm.run<T, T>(out.p(), din.p(), dw.p(), nullptr, Tn, K, N, cuda::WeightLayout::NK, cuda::GemmAct::None, s0);
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(3e-3, 1.2e-2)) << "T=" << Tn;
  }
  const std::string plans = gemm.describe_plans();
  SCOPED_TRACE(plans);
  auto line_of = [&](int Tn) {
    const size_t at = plans.find("T=" + std::to_string(Tn) + " ");
    return at == std::string::npos ? std::string() : plans.substr(at, plans.find('\n', at) - at);
  };
  EXPECT_EQ(line_of(20).find("bucket"), std::string::npos);
  EXPECT_NE(line_of(25).find("as its bucket's timed plan"), std::string::npos);
  EXPECT_NE(line_of(32).find("as its bucket's timed plan"), std::string::npos);
  EXPECT_EQ(line_of(33).find("bucket"), std::string::npos);
}

TYPED_TEST(CudaOps, GemvKernelDirect) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int Tn = 1; Tn <= 8; ++Tn) {
    const int K = rng.pick({8, 264, 1600, 4096}), N = rng.pick({1, 17, 1001, 7000, 13000});
    auto in = rng.normal(static_cast<size_t>(Tn) * K), w = rng.normal(static_cast<size_t>(N) * K, 0.05f), b = rng.normal(static_cast<size_t>(N), 0.1f);
    round_all<T>(in), round_all<T>(w), round_all<T>(b);
    std::vector<float> ref(static_cast<size_t>(Tn) * N);
    cpu::lm_head_forward(ref.data(), in.data(), w.data(), Tn, K, N);  // in @ w^T, w [N, K]
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += b[i % static_cast<size_t>(N)];
    Dev<T> din(in), dw(w), db(b);
    Dev<float> out(int64_t(ref.size()));
    ASSERT_TRUE(cuda::detail::gemv_nk_supported(Tn, K, N, din.p(), dw.p()));
    // fp32 output is not allowed a bias through Gemm, but the kernel itself takes one.
    cuda::detail::gemv_nk<T, float>(out.p(), din.p(), dw.p(), db.p(), Tn, K, N, cuda::GemmAct::None, s0);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(rel_err(out.get(), ref), 1e-5) << "T=" << Tn << " K=" << K << " N=" << N;
  }
}

TYPED_TEST(CudaOps, ConvertTranspose) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  const int K = 77, N = 45;
  auto w = rng.normal(static_cast<size_t>(K) * N);
  Dev<float> dw(w);
  Dev<T> out(int64_t(K) * N);
  // Two row chunks, as the stage's upload does them.
  cuda::convert_transpose_from_float<T>(out.p(), dw.p(), 30, N, K, s0);
  cuda::convert_transpose_from_float<T>(out.p() + 30, dw.p() + 30 * N, K - 30, N, K, s0);
  const auto got = out.get();
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k)
      ASSERT_EQ(got[static_cast<size_t>(n) * K + k], round_to<T>(w[static_cast<size_t>(k) * N + n])) << n << "," << k;
}

// ---- the paged K/V cache and the batched attention kernels the stage uses ----

TYPED_TEST(CudaOps, PagedPrefillAndDecode) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int D : {64, 40, 128}) {
    const int H = 3, C = H * D;
    const std::vector<int> prompt = {1, 37, 100, 16};
    const int S = int(prompt.size());
    const DType dt = std::is_same_v<T, half> ? DType::F16 : DType::BF16;
    cuda::KvCache cache("test", /*layers=*/2, H, D, dt, /*pages=*/64);
    const int max_pages = 16;
    // Sequences get pages in an interleaved order so that tables are not the identity.
    std::vector<int32_t> tables(static_cast<size_t>(S) * max_pages, 0);
    for (int grow = 16; grow <= 128; grow += 16)
      for (int s = 0; s < S; ++s) ASSERT_TRUE(cache.reserve(uint64_t(s), std::min(grow, prompt[static_cast<size_t>(s)] + 1)).ok());
    for (int s = 0; s < S; ++s) {
      const auto& p = cache.pages(uint64_t(s));
      std::copy(p.begin(), p.end(), tables.begin() + int64_t(s) * max_pages);
    }
    DevInts dtables(tables);
    const int layer = 1;
    const cuda::KvLayerView view = cache.layer(layer, dtables.p(), max_pages);

    // Prefill: qkv rows of all prompts, appended then attended.
    int Tn = 0;
    for (int L : prompt) Tn += L;
    auto qkv = rng.normal(static_cast<size_t>(Tn) * 3 * C);
    round_all<T>(qkv);
    std::vector<int32_t> token_row, token_pos, q_begin, q_len, kv_len;
    for (int s = 0, row = 0; s < S; ++s) {
      q_begin.push_back(row), q_len.push_back(prompt[static_cast<size_t>(s)]), kv_len.push_back(prompt[static_cast<size_t>(s)]);
      for (int i = 0; i < prompt[static_cast<size_t>(s)]; ++i, ++row) token_row.push_back(s), token_pos.push_back(i);
    }
    Dev<T> dqkv(qkv), out(int64_t(Tn) * C);
    DevInts drow(token_row), dpos(token_pos), dqb(q_begin), dql(q_len), dkl(kv_len);
    cuda::kv_cache_append<T>(view, dqkv.p(), 3 * C, drow.p(), dpos.p(), Tn, H, D, s0);
    cuda::attention_context_paged<T>(out.p(), dqkv.p(), view, cuda::SeqArrays{dqb.p(), dql.p(), dkl.p(), S}, 100, H, D, s0);
    std::vector<float> ref(static_cast<size_t>(Tn) * C);
    for (int s = 0; s < S; ++s) {
      const float* base = qkv.data() + static_cast<size_t>(q_begin[static_cast<size_t>(s)]) * 3 * C;
      cpu::attention_context(ref.data() + static_cast<size_t>(q_begin[static_cast<size_t>(s)]) * C, base, 3 * C, base + C, base + 2 * C, 3 * C,
                             prompt[static_cast<size_t>(s)], prompt[static_cast<size_t>(s)], H, D);
    }
    EXPECT_LT(rel_err(out.get(), ref), tol<T>(4e-3, 2e-2)) << "prefill D=" << D;

    // Decode: one new token per sequence, appended by the kernel itself, with 1, 3 and 16 splits.
    auto step = rng.normal(static_cast<size_t>(S) * 3 * C);
    round_all<T>(step);
    std::vector<int32_t> lens;
    for (int L : prompt) lens.push_back(L + 1);
    DevInts dlens(lens);
    std::vector<float> dref(static_cast<size_t>(S) * C);
    for (int s = 0; s < S; ++s) {  // contiguous K/V: the prompt's rows then the new one
      const int L = prompt[static_cast<size_t>(s)];
      std::vector<float> kv(static_cast<size_t>(L + 1) * 2 * C);
      for (int i = 0; i < L; ++i)
        std::copy_n(qkv.data() + static_cast<size_t>(q_begin[static_cast<size_t>(s)] + i) * 3 * C + C, 2 * C, kv.data() + static_cast<size_t>(i) * 2 * C);
      std::copy_n(step.data() + static_cast<size_t>(s) * 3 * C + C, 2 * C, kv.data() + static_cast<size_t>(L) * 2 * C);
      cpu::attention_decode(dref.data() + static_cast<size_t>(s) * C, step.data() + static_cast<size_t>(s) * 3 * C, kv.data(), kv.data() + C, 2 * C,
                            L + 1, H, D);
    }
    const int max_splits = 16;
    Dev<float> partial(cuda::decode_partial_floats(S, H, D, max_splits));
    cuda::DeviceBuffer counters = cuda::device_alloc(static_cast<size_t>(S * H) * 4, "test", "counters");
    CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
    cuda::DecodeWorkspace ws{partial.p(), counters.as<int32_t>(), partial.n, S * H};
    for (int splits : {1, 3, 16}) {
      Dev<T> dstep(step), dout(int64_t(S) * C);
      cuda::attention_decode_paged<T>(dout.p(), dstep.p(), view, dlens.p(), S, H, D, splits, ws, s0);
      EXPECT_LT(rel_err(dout.get(), dref), tol<T>(2e-3, 8e-3)) << "decode D=" << D << " splits=" << splits;
      // Again: the counters were left at zero and the appended row is in the cache now.
      dout.poison();
      cuda::attention_decode_paged<T>(dout.p(), dstep.p(), view, dlens.p(), S, H, D, splits, ws, s0);
      EXPECT_LT(rel_err(dout.get(), dref), tol<T>(2e-3, 8e-3)) << "decode again D=" << D << " splits=" << splits;
    }
    std::vector<int32_t> zero(static_cast<size_t>(S * H));
    CUDA_CHECK(cudaMemcpy(zero.data(), counters.get(), zero.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(std::all_of(zero.begin(), zero.end(), [](int32_t c) { return c == 0; }));

    // Chunked prefill continues from the cache: the next 20 positions of sequence 2 at once.
    const int s = 2, L0 = prompt[static_cast<size_t>(s)] + 1, add = 20;
    ASSERT_TRUE(cache.reserve(uint64_t(s), L0 + add).ok());
    {
      const auto& p = cache.pages(uint64_t(s));
      std::copy(p.begin(), p.end(), tables.begin() + int64_t(s) * max_pages);
    }
    DevInts dtables2(tables);
    const cuda::KvLayerView view2 = cache.layer(layer, dtables2.p(), max_pages);
    auto more = rng.normal(static_cast<size_t>(add) * 3 * C);
    round_all<T>(more);
    std::vector<int32_t> rows2(static_cast<size_t>(add), s), pos2(static_cast<size_t>(add));
    std::iota(pos2.begin(), pos2.end(), L0);
    std::vector<int32_t> qb2(static_cast<size_t>(S), 0), ql2(static_cast<size_t>(S), 0), kl2(static_cast<size_t>(S), 0);
    ql2[static_cast<size_t>(s)] = add, kl2[static_cast<size_t>(s)] = L0 + add;
    Dev<T> dmore(more), out2(int64_t(add) * C);
    DevInts drows2(rows2), dpos2(pos2), dqb2(qb2), dql2(ql2), dkl2(kl2);
    cuda::kv_cache_append<T>(view2, dmore.p(), 3 * C, drows2.p(), dpos2.p(), add, H, D, s0);
    cuda::attention_context_paged<T>(out2.p(), dmore.p(), view2, cuda::SeqArrays{dqb2.p(), dql2.p(), dkl2.p(), S}, add, H, D, s0);
    std::vector<float> kv(static_cast<size_t>(L0 + add) * 2 * C);
    for (int i = 0; i < L0 - 1; ++i)
      std::copy_n(qkv.data() + static_cast<size_t>(q_begin[static_cast<size_t>(s)] + i) * 3 * C + C, 2 * C, kv.data() + static_cast<size_t>(i) * 2 * C);
    std::copy_n(step.data() + static_cast<size_t>(s) * 3 * C + C, 2 * C, kv.data() + static_cast<size_t>(L0 - 1) * 2 * C);
    for (int i = 0; i < add; ++i) std::copy_n(more.data() + static_cast<size_t>(i) * 3 * C + C, 2 * C, kv.data() + static_cast<size_t>(L0 + i) * 2 * C);
    std::vector<float> ref2(static_cast<size_t>(add) * C);
    cpu::attention_context(ref2.data(), more.data(), 3 * C, kv.data(), kv.data() + C, 2 * C, add, L0 + add, H, D);
    EXPECT_LT(rel_err(out2.get(), ref2), tol<T>(4e-3, 2e-2)) << "chunked prefill D=" << D;
  }
}

TEST(CudaKvCache, PagesAndErrors) {
  REQUIRE_GPU();
  cuda::KvCache cache("test", 1, 2, 64, DType::F16, 4);
  EXPECT_EQ(cache.free_pages(), 4);
  ASSERT_TRUE(cache.reserve(7, 17).ok());  // 2 pages
  EXPECT_EQ(cache.capacity_tokens(7), 32);
  ASSERT_TRUE(cache.reserve(7, 32).ok());  // no more
  EXPECT_EQ(cache.free_pages(), 2);
  const Status full = cache.reserve(8, 48);
  EXPECT_FALSE(full.ok());
  EXPECT_NE(full.message().find("KV cache full"), std::string::npos) << full.message();
  EXPECT_EQ(cache.free_pages(), 2);  // a failed reserve changes nothing
  EXPECT_FALSE(cache.contains(8));
  cache.release(7);
  EXPECT_EQ(cache.free_pages(), 4);
  EXPECT_THROW(cuda::KvCache("stage-x", 1, 1 << 20, 1 << 10, DType::F16, int64_t(1) << 20), Error);
  try {
    cuda::KvCache huge("stage-x", 1, 1 << 20, 1 << 10, DType::F16, int64_t(1) << 20);
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("stage-x"), std::string::npos) << m;
    EXPECT_NE(m.find("bytes asked"), std::string::npos) << m;
    EXPECT_NE(m.find("bytes free"), std::string::npos) << m;
  }
}

// ---- sampling: the same token as model/sampling.h's sample_next on the same logits ----

// The tokens `sampler` chooses for `rows` from host `logits` [rows, V].
std::vector<int32_t> sample_on_gpu(cuda::GpuSampler& sampler, const std::vector<float>& logits,
                                   const std::vector<cuda::SampleRow>& rows) {
  Dev<float> dlogits(logits);
  cuda::DeviceBuffer tokens = cuda::device_alloc(rows.size() * 4, "test", "tokens");
  sampler.sample(dlogits.p(), rows, tokens.as<int32_t>(), s0);
  std::vector<int32_t> got(rows.size());
  CUDA_CHECK(cudaMemcpy(got.data(), tokens.get(), got.size() * 4, cudaMemcpyDeviceToHost));
  return got;
}

TEST(CudaSampling, MatchesCpuSampleNext) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  const int V = 1013, rows = 24;
  cuda::GpuSampler sampler("test", rows, V);
  for (int round = 0; round < 8; ++round) {
    std::vector<SamplingParams> params(static_cast<size_t>(rows));
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(rows)), gens(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      SamplingParams& p = params[static_cast<size_t>(r)];
      p.seed = rng.gen();
      p.temperature = std::vector<float>{0.f, 0.7f, 1.f, 1.3f}[static_cast<size_t>(r % 4)];
      p.top_k = std::vector<int>{0, 1, 5, 50, 2000}[static_cast<size_t>(rng.uniform(0, 4))];
      p.top_p = std::vector<float>{1.f, 0.9f, 0.5f, 0.01f}[static_cast<size_t>(rng.uniform(0, 3))];
      if (rng.uniform(0, 2) == 0) p.repetition_penalty = 1.3f;
      if (rng.uniform(0, 2) == 0) p.presence_penalty = 0.5f, p.frequency_penalty = 0.25f;
      if (rng.uniform(0, 3) == 0) p.min_tokens = 5, p.stop_token_ids = {rng.uniform(0, V - 1), rng.uniform(0, V - 1)};
      for (int i = rng.uniform(0, 20); i > 0; --i) prompts[static_cast<size_t>(r)].push_back(rng.uniform(0, V - 1));
      for (int i = rng.uniform(0, 12); i > 0; --i) gens[static_cast<size_t>(r)].push_back(rng.uniform(0, 40));  // repeats
    }
    auto logits = rng.normal(static_cast<size_t>(rows) * V, 2.5f);
    std::vector<int32_t> expect(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      std::vector<float> row(logits.begin() + int64_t(r) * V, logits.begin() + int64_t(r + 1) * V);
      expect[static_cast<size_t>(r)] = sample_next(row, params[static_cast<size_t>(r)], prompts[static_cast<size_t>(r)], gens[static_cast<size_t>(r)], uint64_t(r % 3));
    }
    std::vector<cuda::SampleRow> srows(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r)
      srows[static_cast<size_t>(r)] = cuda::SampleRow{&params[static_cast<size_t>(r)], prompts[static_cast<size_t>(r)], gens[static_cast<size_t>(r)], uint64_t(r % 3)};
    const std::vector<int32_t> got = sample_on_gpu(sampler, logits, srows);
    for (int r = 0; r < rows; ++r)
      EXPECT_EQ(got[static_cast<size_t>(r)], expect[static_cast<size_t>(r)])
          << "round " << round << " row " << r << " T=" << params[static_cast<size_t>(r)].temperature << " k=" << params[static_cast<size_t>(r)].top_k
          << " p=" << params[static_cast<size_t>(r)].top_p;
  }
}

// Rows with a small top-k take the select kernel instead of the sort: the same tokens as
// sample_next, also where ties straddle the k-th candidate (logits on a coarse grid), with
// -0 and +0 among the best, a row masked but for a few ids, and rows of both kinds in one
// call; vocabularies whose row fits the kernel's shared memory and one that does not.
TEST(CudaSampling, TopKRowsMatchCpuSampleNext) {
  REQUIRE_GPU();
  Rng rng;
  SEED_TRACE(rng);
  for (int V : {1013, 50257, 100000}) {
    const int rows = 16;
    cuda::GpuSampler sampler("test", rows, V);
    for (int round = 0; round < 4; ++round) {
      std::vector<SamplingParams> params(static_cast<size_t>(rows));
      auto logits = rng.normal(static_cast<size_t>(rows) * V, 2.f);
      for (int r = 0; r < rows; ++r) {
        SamplingParams& p = params[static_cast<size_t>(r)];
        p.seed = rng.gen();
        p.temperature = std::vector<float>{0.7f, 1.f, 1.3f}[static_cast<size_t>(r % 3)];
        p.top_k = std::vector<int>{1, 2, 40, 256}[static_cast<size_t>(r % 4)];
        if (round == 3 && r == 5) p.top_k = 0;  // this call also sorts a row whole
        if (r % 5 == 1) p.top_p = 0.8f;
        float* row = logits.data() + static_cast<size_t>(r) * V;
        if (r % 2 == 0)  // coarse: long runs of equal logits around the k-th
          for (int i = 0; i < V; ++i) row[i] = std::round(row[i] * 2.f) / 2.f;
        if (r == 3) row[10] = 9.f, row[20] = -0.f, row[30] = 0.f, row[40] = 9.f;
        if (r == 7)
          for (int i = 0; i < V; ++i) row[i] = i % 97 == 0 ? 1.f : -INFINITY;
      }
      std::vector<int32_t> expect(static_cast<size_t>(rows));
      std::vector<cuda::SampleRow> srows(static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        std::vector<float> row(logits.begin() + int64_t(r) * V, logits.begin() + int64_t(r + 1) * V);
        expect[static_cast<size_t>(r)] = sample_next(row, params[static_cast<size_t>(r)], {}, {}, 0);
        srows[static_cast<size_t>(r)] = cuda::SampleRow{&params[static_cast<size_t>(r)], {}, {}, 0};
      }
      const std::vector<int32_t> got = sample_on_gpu(sampler, logits, srows);
      for (int r = 0; r < rows; ++r)
        EXPECT_EQ(got[static_cast<size_t>(r)], expect[static_cast<size_t>(r)])
            << "V " << V << " round " << round << " row " << r << " k=" << params[static_cast<size_t>(r)].top_k
            << " p=" << params[static_cast<size_t>(r)].top_p;
    }
  }
}

TEST(CudaSampling, ArgmaxLowestIdOnTies) {
  REQUIRE_GPU();
  const int V = 5000;
  std::vector<float> logits(static_cast<size_t>(2) * V, 1.f);
  logits[static_cast<size_t>(V) + 4321] = 3.f, logits[static_cast<size_t>(V) + 77] = 3.f;  // row 1: tie at 77 and 4321
  Dev<float> d(logits);
  cuda::DeviceBuffer tokens = cuda::device_alloc(8, "test", "tokens");
  cuda::argmax_rows(tokens.as<int32_t>(), d.p(), 2, V, s0);
  int32_t got[2];
  CUDA_CHECK(cudaMemcpy(got, tokens.get(), 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got[1], 77);
  // The split argmax (16 blocks a row, merged by the last): the same rule, twice in a row
  // (its counters must be left at zero), on random rows against argmax_token.
  Rng rng;
  SEED_TRACE(rng);
  cuda::GpuSampler sampler("test", 8, V);
  for (int rep = 0; rep < 2; ++rep) {
    auto r = rng.normal(static_cast<size_t>(8) * V);
    r[static_cast<size_t>(3) * V + 4000] = 9.f, r[static_cast<size_t>(3) * V + 10] = 9.f;    // tie across pieces
    r[static_cast<size_t>(5) * V + 301] = 9.f, r[static_cast<size_t>(5) * V + 300] = 9.f;    // tie in one piece
    for (int i = 0; i < V; ++i) r[static_cast<size_t>(6) * V + i] = -INFINITY;               // all masked
    Dev<float> dr(r);
    cuda::DeviceBuffer t8 = cuda::device_alloc(8 * 4, "test", "tokens");
    sampler.argmax(t8.as<int32_t>(), dr.p(), 8, s0);
    int32_t g8[8];
    CUDA_CHECK(cudaMemcpy(g8, t8.get(), sizeof g8, cudaMemcpyDeviceToHost));
    for (int row = 0; row < 8; ++row)
      EXPECT_EQ(g8[row], argmax_token(std::span<const float>(r.data() + static_cast<size_t>(row) * V, V))) << "row " << row;
    EXPECT_EQ(g8[3], 10);
    EXPECT_EQ(g8[5], 300);
    EXPECT_EQ(g8[6], 0);
  }
}

// ---- synthetic weights and errors ----

TYPED_TEST(CudaOps, SyntheticNormal) {
  using T = TypeParam;
  const int64_t n = 1 << 20;
  Dev<T> a(n), b(n);
  cuda::fill_normal<T>(a.p(), n, 0.f, 0.02f, 42, 7, s0);
  cuda::fill_normal<T>(b.p(), n, 0.f, 0.02f, 42, 7, s0);
  const auto va = a.get(), vb = b.get();
  EXPECT_EQ(0, std::memcmp(va.data(), vb.data(), va.size() * 4));  // deterministic
  double sum = 0, sq = 0;
  for (float x : va) sum += x, sq += double(x) * x;
  const double mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(sd, 0.02, 4e-4);
}

TEST(CudaCheck, NamesCallFileAndLine) {
  REQUIRE_GPU();
  try {
    CUDA_CHECK(cudaSetDevice(123456));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cudaSetDevice(123456)"), std::string::npos) << m;
    EXPECT_NE(m.find("test_cuda_ops.cc:"), std::string::npos) << m;
  }
  cudaGetLastError();
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

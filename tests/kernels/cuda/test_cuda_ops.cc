// The element-wise and normalisation CUDA ops (kernels/cuda/ops.h) against their CPU
// references (kernels/cpu, fp32) on fresh random inputs of odd sizes, in fp16 and bf16:
// embedding, LayerNorm, GeLU, residual, log-softmax, the fused bias/residual/LayerNorm and
// bias/GeLU kernels, synthetic weights, and CUDA_CHECK's message. The matrix products are
// test_cuda_ops_gemm.cc, attention test_cuda_ops_attention.cc, sampling
// test_cuda_ops_sampling.cc.
// The inputs are rounded to the element type first, so the CPU sees exactly what the GPU
// sees; the check is ||gpu - cpu|| / ||cpu|| under a bound per dtype and op. Outputs are
// poisoned (NaN) before each op, so an element the kernel fails to write fails the check.
// The seed of each test is printed on failure. Helpers: cuda_ops_test_util.h.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(CudaOps, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/synthetic.h"

#include "tests/kernels/cuda/cuda_ops_test_util.h"

namespace conveyor {
namespace {

using namespace cuda_ops_test;

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

// A row's LayerNorm keeps its bits whatever the launch's row count: from 512 rows the
// kernel runs blocks of a quarter of the threads, which reduce in the wide block's order
// (layernorm_kernel's W). C = 4,096 (512 threads, 128 narrow), 1,024 (128, 32) and 6,144
// (768, 192); plain and fused, the residual too.
TYPED_TEST(CudaOps, LayerNormRowKeepsItsBitsWhateverTheRowCount) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  const int many = 1100, few = 3;
  for (int C : {4096, 1024, 6144}) {
    const size_t n = size_t(many) * C;
    auto in = rng.normal(n, 2.f, 0.5f), x = rng.normal(n), bias = rng.normal(size_t(C), 0.1f);
    auto g = rng.normal(size_t(C), 0.2f, 1.f), b = rng.normal(size_t(C), 0.1f);
    round_all<T>(in), round_all<T>(x), round_all<T>(bias), round_all<T>(g), round_all<T>(b);
    Dev<T> din(in), dx(x), dbias(bias), dg(g), db(b), res_many(in), res_few(in);
    Dev<T> out_many{int64_t(n)}, out_few{int64_t(few) * C};
    auto same_rows = [&](const Dev<T>& a, const Dev<T>& f, const char* what) {
      const auto va = a.get(), vf = f.get();
      EXPECT_EQ(0, std::memcmp(va.data(), vf.data(), size_t(few) * C * sizeof(float))) << what << ", C=" << C;
    };
    cuda::layernorm_forward<T>(out_many.p(), din.p(), dg.p(), db.p(), many, C, 1e-5f, s0);
    cuda::layernorm_forward<T>(out_few.p(), din.p(), dg.p(), db.p(), few, C, 1e-5f, s0);
    same_rows(out_many, out_few, "layernorm");
    cuda::add_bias_residual_layernorm<T>(res_many.p(), out_many.p(), dx.p(), dbias.p(), dg.p(), db.p(), many, C,
                                         1e-5f, s0);
    cuda::add_bias_residual_layernorm<T>(res_few.p(), out_few.p(), dx.p(), dbias.p(), dg.p(), db.p(), few, C, 1e-5f,
                                         s0);
    same_rows(out_many, out_few, "fused layernorm");
    same_rows(res_many, res_few, "fused residual");
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

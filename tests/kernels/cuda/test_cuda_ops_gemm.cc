// The CUDA matrix products against the CPU reference (kernels/cpu, fp32) on fresh random
// inputs of odd sizes, in fp16 and bf16: matmul and the LM head (kernels/cuda/ops.h), the GPU
// stage's Gemm (cuBLASLt or the GEMV, tuned and untuned, with its per-bucket plans), the GEMV
// kernel itself, and the weight conversion the stage's upload does before them.
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

#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/ops.h"

#include "tests/kernels/cuda/cuda_ops_test_util.h"

namespace conveyor {
namespace {

using namespace cuda_ops_test;

TYPED_TEST_SUITE(CudaOps, ElemTypes);

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

// The GEMV with each forced K split and an L2 prefetch (GemmOptions::gemv_k_split and
// gemv_l2_prefetch_bytes, for measurements): the same products within the GEMV's bound, also
// through a Gemm built with them (fast mode, where the GEMV competes for T <= 8).
TYPED_TEST(CudaOps, GemvForcedSplitsAndPrefetch) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int Tn : {1, 4, 8}) {
    const int K = rng.pick({264, 1600, 4096}), N = rng.pick({17, 1001, 7000});
    auto in = rng.normal(static_cast<size_t>(Tn) * K), w = rng.normal(static_cast<size_t>(N) * K, 0.05f);
    round_all<T>(in), round_all<T>(w);
    std::vector<float> ref(static_cast<size_t>(Tn) * N);
    cpu::lm_head_forward(ref.data(), in.data(), w.data(), Tn, K, N);  // in @ w^T, w [N, K]
    Dev<T> din(in), dw(w);
    Dev<float> out(int64_t(ref.size()));
    for (int split : {1, 2, 4})
      for (int prefetch : {0, 4096}) {
        cuda::detail::gemv_nk<T, float>(out.p(), din.p(), dw.p(), nullptr, Tn, K, N, cuda::GemmAct::None, s0, split,
                                        prefetch);
        CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_LT(rel_err(out.get(), ref), 1e-5)
            << "T=" << Tn << " K=" << K << " N=" << N << " split=" << split << " prefetch=" << prefetch;
      }
    GemmOptions options;
    options.deterministic = false;
    options.gemv_k_split = 2;
    options.gemv_l2_prefetch_bytes = 8192;
    cuda::Gemm gemm(options);
    gemm.run<T, float>(out.p(), din.p(), dw.p(), nullptr, Tn, K, N, cuda::WeightLayout::NK, cuda::GemmAct::None, s0);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(rel_err(out.get(), ref), 1e-4) << "Gemm T=" << Tn << " K=" << K << " N=" << N;
  }
  Dev<float> o(8);
  Dev<T> x(8), w(8);
  try {
    cuda::detail::gemv_nk<T, float>(o.p(), x.p(), w.p(), nullptr, 1, 8, 1, cuda::GemmAct::None, s0, 3);
    ADD_FAILURE() << "a K split of 3 ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k_split 3"), std::string::npos) << e.what();
  }
}

// The sequential-order GEMV (gemv.h) against the CPU: fp32 out without epilogue, and T out with a bias (added before the
// rounding) or a bias and GeLU (after it); K past a 128-element stage.
TYPED_TEST(CudaOps, SequentialGemvMatchesTheCpu) {
  using T = TypeParam;
  Rng rng;
  SEED_TRACE(rng);
  for (int Tn = 1; Tn <= 8; ++Tn) {
    const int K = rng.pick({8, 264, 1600, 4096}), N = rng.pick({1, 17, 1001, 7000});
    SCOPED_TRACE("T=" + std::to_string(Tn) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
    auto in = rng.normal(static_cast<size_t>(Tn) * K), w = rng.normal(static_cast<size_t>(N) * K, 0.05f),
         b = rng.normal(static_cast<size_t>(N), 0.1f);
    round_all<T>(in), round_all<T>(w), round_all<T>(b);
    std::vector<float> ref(static_cast<size_t>(Tn) * N);
    cpu::lm_head_forward(ref.data(), in.data(), w.data(), Tn, K, N);  // in @ w^T, w [N, K]
    Dev<T> din(in), dw(w), db(b);
    ASSERT_TRUE(cuda::detail::gemv_seq_supported(Tn, K, N, din.p(), dw.p()));
    Dev<float> out32(int64_t(ref.size()));
    cuda::detail::gemv_seq<T, float>(out32.p(), din.p(), dw.p(), nullptr, Tn, K, N, cuda::GemmAct::None, s0);
    CUDA_CHECK(cudaDeviceSynchronize());
    // Per output, against the sum of its products' magnitudes: the fp32 sums differ from the
    // CPU's only in their order. (A relative error over the whole output failed once in 12
    // seeds at N = 1, where the one sum cancelled: 1.19e-5.)
    const std::vector<float> got32 = out32.get();
    double worst = 0;
    for (int t = 0; t < Tn; ++t)
      for (int n = 0; n < N; ++n) {
        double mag = 0;
        for (int k = 0; k < K; ++k)
          mag += std::fabs(double(in[size_t(t) * K + size_t(k)]) * double(w[size_t(n) * K + size_t(k)]));
        const size_t i = size_t(t) * size_t(N) + size_t(n);
        worst = std::max(worst, std::fabs(double(got32[i]) - double(ref[i])) / std::max(mag, 1e-30));
      }
    EXPECT_LT(worst, 1e-5) << "the largest error over its products' magnitude";
    std::vector<float> ref_b(ref);
    for (size_t i = 0; i < ref.size(); ++i) ref_b[i] += b[i % static_cast<size_t>(N)];
    // With an activation the product is rounded to T before the bias and GeLU (as Gemm's
    // cuBLASLt path): against the unrounded sum, a bias that cancels the product made a single
    // output's relative error 6% (bf16, K = 8, N = 1).
    std::vector<float> ref_g(ref);
    round_all<T>(ref_g);
    for (size_t i = 0; i < ref.size(); ++i) ref_g[i] += b[i % static_cast<size_t>(N)];
    cpu::gelu_forward(ref_g.data(), int64_t(ref_g.size()));
    Dev<T> out(int64_t(ref.size()));
    cuda::detail::gemv_seq<T, T>(out.p(), din.p(), dw.p(), db.p(), Tn, K, N, cuda::GemmAct::None, s0);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(rel_err(out.get(), ref_b), tol<T>(3e-3, 1.2e-2)) << "bias";
    cuda::detail::gemv_seq<T, T>(out.p(), din.p(), dw.p(), db.p(), Tn, K, N, cuda::GemmAct::GeluTanh, s0);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LT(rel_err(out.get(), ref_g), tol<T>(3e-3, 1.2e-2)) << "gelu";
  }
  Dev<float> o(1);
  Dev<T> x(9 * 16), w(16);
  EXPECT_FALSE(cuda::detail::gemv_seq_supported(9, 16, 1, x.p(), w.p()));
  EXPECT_THROW((cuda::detail::gemv_seq<T, float>(o.p(), x.p(), w.p(), nullptr, 9, 16, 1, cuda::GemmAct::None, s0)),
               Error);
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

// A Gemm refuses options its kernels cannot honour, naming the option and the value, before
// it touches a device (no GPU needed).
TEST(GemmOptions, OutOfRangeOptionsAreRefused) {
  auto message_of = [](GemmOptions o) -> std::string {
    try {
      cuda::Gemm gemm(o);
    } catch (const Error& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("another error: ") + e.what();
    }
    return "(no error)";
  };
  GemmOptions o;
  o.gemv_k_split = 3;
  EXPECT_EQ(message_of(o), "Gemm: gemv_k_split 3 (0: chosen by N, or 1, 2, 4)");
  o = {};
  o.int8_gemv_k_split = 16;
  EXPECT_EQ(message_of(o), "Gemm: int8_gemv_k_split 16 (0: chosen by shape, or 1, 2, 4, 8)");
  o = {};
  o.gemv_l2_prefetch_bytes = -1;
  EXPECT_EQ(message_of(o), "Gemm: gemv_l2_prefetch_bytes -1 (0 to 1048576)");
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

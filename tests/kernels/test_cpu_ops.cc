// The CPU ops against naive double-precision references on random inputs of odd sizes,
// and the batch-invariance guarantees (bit-exact) that the cluster tests rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"

namespace conveyor::cpu {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

TEST(CpuOps, EmbeddingAddsTokenAndPositionRows) {
  const int64_t V = 11, P = 7, C = 5, T = 4;
  auto wte = randn(size_t(V * C), 1), wpe = randn(size_t(P * C), 2);
  const int32_t ids[T] = {3, 10, 0, 3}, pos[T] = {0, 6, 2, 1};
  std::vector<float> out(size_t(T * C));
  embedding_forward(out.data(), ids, pos, T, wte.data(), wpe.data(), C);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(out[size_t(t * C + c)], wte[size_t(ids[t] * C + c)] + wpe[size_t(pos[t] * C + c)]);
}

// The pool's size is a start-up setting (KernelOptions::cpu_threads): it takes effect when the
// pool starts, at the first parallel op, and a different size after that is refused.
TEST(CpuOps, ThreadsAreSetBeforeThePoolStarts) {
  const Status negative = set_threads(-1);
  EXPECT_FALSE(negative.ok());
  EXPECT_NE(negative.message().find("threads -1"), std::string::npos) << negative.message();
  // ctest runs each test in a process of its own, where no op has run yet; a whole run of the
  // program may have started the pool in an earlier test.
  if (set_threads(3).ok()) {
    EXPECT_EQ(threads(), 3);
  }
  const int64_t T = 64, K = 32, N = 16;  // 8 row blocks: a parallel op, which starts the pool
  auto in = randn(size_t(T * K), 7), w = randn(size_t(K * N), 8);
  std::vector<float> out(size_t(T * N));
  matmul_forward(out.data(), in.data(), w.data(), nullptr, T, K, N);
  const int running = threads();
  EXPECT_GE(running, 1);
  EXPECT_TRUE(set_threads(running).ok()) << "the size it runs with is no change";
  const Status late = set_threads(running + 1);
  EXPECT_FALSE(late.ok());
  EXPECT_NE(late.message().find("the pool already runs " + std::to_string(running) + " threads"), std::string::npos)
      << late.message();
  EXPECT_EQ(threads(), running);
}

TEST(CpuOps, LayerNormMatchesDoubleReference) {
  const int64_t T = 5, C = 97;
  auto in = randn(size_t(T * C), 3, 2.0f), g = randn(size_t(C), 4), b = randn(size_t(C), 5);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) in[size_t(t * C + c)] += float(t) * 3.0f;  // non-zero means
  std::vector<float> out(size_t(T * C));
  layernorm_forward(out.data(), in.data(), g.data(), b.data(), T, C, 1e-5f);
  for (int64_t t = 0; t < T; ++t) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) mean += in[size_t(t * C + c)];
    mean /= double(C);
    for (int64_t c = 0; c < C; ++c) var += (in[size_t(t * C + c)] - mean) * (in[size_t(t * C + c)] - mean);
    var /= double(C);
    for (int64_t c = 0; c < C; ++c) {
      const double ref = (in[size_t(t * C + c)] - mean) / std::sqrt(var + 1e-5) * g[size_t(c)] + b[size_t(c)];
      EXPECT_NEAR(out[size_t(t * C + c)], ref, 1e-5 * (1.0 + std::abs(ref))) << "t=" << t << " c=" << c;
    }
  }
}

// |got - ref| <= 1e-5 * sum_k |a_k w_k| (+ |bias|): relative to the magnitude of the terms.
void expect_matmul_close(const std::vector<float>& got, const float* in, const float* w, const float* bias,
                         bool w_is_nk, int64_t T, int64_t K, int64_t N) {
  int bad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double ref = bias ? bias[n] : 0.0, mag = bias ? std::abs(bias[n]) : 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double wv = w_is_nk ? w[n * K + k] : w[k * N + n];
        ref += double(in[t * K + k]) * wv;
        mag += std::abs(double(in[t * K + k]) * wv);
      }
      if (std::abs(got[size_t(t * N + n)] - ref) > 1e-5 * mag + 1e-7 && bad++ < 5)
        ADD_FAILURE() << "t=" << t << " n=" << n << " got " << got[size_t(t * N + n)] << " want " << ref;
    }
  EXPECT_EQ(bad, 0);
}

TEST(CpuOps, MatmulMatchesDoubleReference) {
  for (int64_t T : {1, 3, 17, 40}) {
    const int64_t K = 37, N = 53;
    auto in = randn(size_t(T * K), 6), w = randn(size_t(K * N), 7, 0.1f), b = randn(size_t(N), 8);
    std::vector<float> out(size_t(T * N));
    matmul_forward(out.data(), in.data(), w.data(), b.data(), T, K, N);
    expect_matmul_close(out, in.data(), w.data(), b.data(), false, T, K, N);
    matmul_forward(out.data(), in.data(), w.data(), nullptr, T, K, N);
    expect_matmul_close(out, in.data(), w.data(), nullptr, false, T, K, N);
  }
}

TEST(CpuOps, LmHeadMatchesDoubleReference) {
  for (int64_t T : {1, 5, 19}) {
    const int64_t C = 45, V = 101;
    auto in = randn(size_t(T * C), 9), head = randn(size_t(V * C), 10, 0.1f);
    std::vector<float> out(size_t(T * V));
    lm_head_forward(out.data(), in.data(), head.data(), T, C, V);
    expect_matmul_close(out, in.data(), head.data(), nullptr, true, T, C, V);
  }
}

TEST(CpuOps, GeluMatchesDoubleReference) {
  std::vector<float> x;
  for (int i = -2000; i <= 2000; ++i) x.push_back(float(i) * 0.005f);  // [-10, 10]
  auto tanh_form = x, erf_form = x;
  gelu_forward(tanh_form.data(), int64_t(x.size()));
  gelu_erf_forward(erf_form.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double ref_tanh = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    const double ref_erf = 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
    EXPECT_NEAR(tanh_form[i], ref_tanh, 1e-6 + 1e-5 * std::abs(ref_tanh)) << "x=" << v;
    EXPECT_NEAR(erf_form[i], ref_erf, 1e-6 + 1e-5 * std::abs(ref_erf)) << "x=" << v;
  }
  // The two forms differ (by up to ~1e-3 around |x| ~ 2), so a mix-up is visible.
  float max_diff = 0;
  for (size_t i = 0; i < x.size(); ++i) max_diff = std::max(max_diff, std::abs(tanh_form[i] - erf_form[i]));
  EXPECT_GT(max_diff, 1e-4f);
}

TEST(CpuOps, ResidualAddsInPlace) {
  auto a = randn(33, 11), b = randn(33, 12);
  auto out = a;
  residual_forward(out.data(), out.data(), b.data(), 33);
  for (size_t i = 0; i < 33; ++i) EXPECT_EQ(out[i], a[i] + b[i]);
}

TEST(CpuOps, LogSoftmaxMatchesDoubleReference) {
  const int64_t rows = 3, n = 1001;
  auto x = randn(size_t(rows * n), 13, 5.0f);
  auto y = x;
  log_softmax_forward(y.data(), rows, n);
  for (int64_t r = 0; r < rows; ++r) {
    double m = -1e300, s = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, double(x[size_t(r * n + i)]));
    for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[size_t(r * n + i)]) - m);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = double(x[size_t(r * n + i)]) - m - std::log(s);
      EXPECT_NEAR(y[size_t(r * n + i)], ref, 1e-5 * (1.0 + std::abs(ref)));
    }
  }
}

// Double-precision causal attention of one sequence: out [q_len, H*D].
std::vector<double> attention_reference(const std::vector<float>& q, int64_t q_stride, const std::vector<float>& k,
                                        const std::vector<float>& v, int64_t kv_stride, int64_t q_len, int64_t kv_len,
                                        int64_t H, int64_t D) {
  std::vector<double> out(size_t(q_len * H * D), 0.0);
  for (int64_t i = 0; i < q_len; ++i) {
    const int64_t pos = kv_len - q_len + i;
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> s(size_t(pos + 1));
      double m = -1e300;
      for (int64_t j = 0; j <= pos; ++j) {
        double d = 0;
        for (int64_t e = 0; e < D; ++e) d += double(q[size_t(i * q_stride + h * D + e)]) * k[size_t(j * kv_stride + h * D + e)];
        s[size_t(j)] = d / std::sqrt(double(D));
        m = std::max(m, s[size_t(j)]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - m));
      for (int64_t j = 0; j <= pos; ++j)
        for (int64_t e = 0; e < D; ++e)
          out[size_t(i * H * D + h * D + e)] += s[size_t(j)] / sum * v[size_t(j * kv_stride + h * D + e)];
    }
  }
  return out;
}

TEST(CpuOps, AttentionMatchesDoubleReference) {
  const int64_t H = 3, D = 13, C = H * D, kv_len = 23, q_len = 9;
  const int64_t q_stride = 3 * C, kv_stride = 2 * C + 5;  // strided rows, as in the stage
  auto q = randn(size_t(q_len * q_stride), 14), k = randn(size_t(kv_len * kv_stride), 15),
       v = randn(size_t(kv_len * kv_stride), 16);
  std::vector<float> out(size_t(q_len * C));
  attention_context(out.data(), q.data(), q_stride, k.data(), v.data(), kv_stride, q_len, kv_len, H, D);
  const auto ref = attention_reference(q, q_stride, k, v, kv_stride, q_len, kv_len, H, D);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5 * (1.0 + std::abs(ref[i]))) << i;
}

// Chunked prefill == one pass == token by token, bit for bit; decode == context with q_len 1.
// The big case goes through the thread pool, the small one does not.
TEST(CpuOps, AttentionRowsDoNotDependOnChunking) {
  struct Case { int64_t H, D, len; };
  for (Case cs : {Case{3, 13, 29}, Case{12, 64, 300}}) {
    const int64_t C = cs.H * cs.D, kv_stride = 2 * C;
    auto q = randn(size_t(cs.len * C), 17), kv = randn(size_t(cs.len * kv_stride), 18);
    const float *k = kv.data(), *v = kv.data() + C;
    std::vector<float> whole(size_t(cs.len * C)), chunked(whole.size()), single(whole.size());
    attention_context(whole.data(), q.data(), C, k, v, kv_stride, cs.len, cs.len, cs.H, cs.D);
    for (int64_t start = 0; start < cs.len; start += 3) {
      const int64_t n = std::min<int64_t>(3, cs.len - start);
      attention_context(chunked.data() + start * C, q.data() + start * C, C, k, v, kv_stride, n, start + n, cs.H, cs.D);
    }
    for (int64_t t = 0; t < cs.len; ++t)
      attention_decode(single.data() + t * C, q.data() + t * C, k, v, kv_stride, t + 1, cs.H, cs.D);
    EXPECT_TRUE(same_bits(whole.data(), chunked.data(), whole.size())) << "H=" << cs.H;
    EXPECT_TRUE(same_bits(whole.data(), single.data(), whole.size())) << "H=" << cs.H;
  }
}

// The row of a product must not depend on how many rows share the call or where the row
// sits. OpenBLAS alone fails this (gemv for M = 1, edge kernels for M % unroll != 0);
// matmul_forward's fixed row blocks make it hold. Shapes of GPT-2 small/XL and odd ones.
TEST(CpuOps, MatmulRowsAreBatchInvariant) {
  struct Shape { int64_t K, N; };
  const int64_t M = 64;
  for (Shape s : {Shape{96, 288}, Shape{97, 389}, Shape{768, 2304}, Shape{3072, 768}, Shape{1600, 4800}}) {
    auto in = randn(size_t(M * s.K), 19), w = randn(size_t(s.K * s.N), 20, 0.02f), b = randn(size_t(s.N), 21);
    std::vector<float> full(size_t(M * s.N));
    matmul_forward(full.data(), in.data(), w.data(), b.data(), M, s.K, s.N);
    for (int64_t T : {1, 2, 3, 7, 15, 16, 17, 33}) {
      for (int64_t first : {int64_t(0), int64_t(5), M - T}) {
        std::vector<float> part(size_t(T * s.N));
        matmul_forward(part.data(), in.data() + first * s.K, w.data(), b.data(), T, s.K, s.N);
        for (int64_t r = 0; r < T; ++r)
          ASSERT_TRUE(same_bits(part.data() + r * s.N, full.data() + (first + r) * s.N, size_t(s.N)))
              << "K=" << s.K << " N=" << s.N << ": row " << first + r << " computed with T=" << T
              << " differs from the same row with T=" << M;
      }
    }
  }
}

TEST(CpuOps, LmHeadRowsAreBatchInvariant) {
  const int64_t M = 40, C = 768, V = 50257;
  auto in = randn(size_t(M * C), 22), head = randn(size_t(V * C), 23, 0.02f);
  std::vector<float> full(size_t(M * V));
  lm_head_forward(full.data(), in.data(), head.data(), M, C, V);
  for (int64_t T : {1, 3, 8, 17}) {
    for (int64_t first : {int64_t(0), M - T}) {
      std::vector<float> part(size_t(T * V));
      lm_head_forward(part.data(), in.data() + first * C, head.data(), T, C, V);
      for (int64_t r = 0; r < T; ++r)
        ASSERT_TRUE(same_bits(part.data() + r * V, full.data() + (first + r) * V, size_t(V)))
            << "row " << first + r << " computed with T=" << T << " differs from T=" << M;
    }
  }
}

}  // namespace
}  // namespace conveyor::cpu

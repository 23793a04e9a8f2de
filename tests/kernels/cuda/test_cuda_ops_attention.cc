// The CUDA attention kernels against the CPU reference (kernels/cpu, fp32) on fresh random
// inputs of odd sizes, in fp16 and bf16: context (prefill) and decode attention on contiguous
// K/V, prompts cut into chunks, and the paged K/V cache with the batched kernels the GPU
// stage uses (append, paged prefill, split decode, chunked prefill from the cache).
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

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/paged_kv.h"
#include "stage/cuda/kv_cache.h"  // the paged pool the attention tests read

#include "tests/kernels/cuda/cuda_ops_test_util.h"

namespace conveyor {
namespace {

using namespace cuda_ops_test;

TYPED_TEST_SUITE(CudaOps, ElemTypes);

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
    const int64_t max_len = *std::max_element(lens.begin(), lens.end());
    Dev<float> partial(cuda::decode_partial_floats(S, H, D, max_len));
    cuda::DeviceBuffer counters = cuda::device_alloc(static_cast<size_t>(S * H) * 4, "test", "counters");
    CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
    cuda::DecodeWorkspace ws{partial.p(), counters.as<int32_t>(), partial.n, S * H, max_len};
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

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

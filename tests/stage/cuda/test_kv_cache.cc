// The GPU stage's paged K/V cache (stage/cuda/kv_cache.h): pages per sequence, a reserve
// that fails changing nothing, and creation that fails naming who asked and the sizes.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(CudaKvCache, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#include "stage/cuda/kv_cache.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

TEST(CudaKvCache, PagesAndErrors) {
  REQUIRE_GPU();
  auto made = cuda::KvCache::create("test", 1, 2, 64, DType::F16, 4);
  ASSERT_TRUE(made.ok()) << made.error();
  cuda::KvCache& cache = **made;
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
  EXPECT_TRUE(cache.pages(8).empty());
  // Out of memory, and sizes that are not positive: errors naming the owner.
  auto huge = cuda::KvCache::create("stage-x", 1, 1 << 20, 1 << 10, DType::F16, int64_t(1) << 20);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().find("stage-x"), std::string::npos) << huge.error();
  EXPECT_NE(huge.error().find("bytes asked"), std::string::npos) << huge.error();
  EXPECT_NE(huge.error().find("bytes free"), std::string::npos) << huge.error();
  auto empty = cuda::KvCache::create("stage-y", 1, 2, 64, DType::F16, 0);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().find("stage-y: KV cache needs positive sizes"), std::string::npos) << empty.error();
}

// The bytes of page `page` of layer `layer` (K and V).
std::vector<uint16_t> page_bytes_of(const cuda::KvCache& cache, int64_t layer, int32_t page, int64_t page_elems) {
  const cuda::KvLayerView v = cache.layer(layer, nullptr, 0);
  std::vector<uint16_t> out(static_cast<size_t>(page_elems));
  CUDA_CHECK(cudaMemcpy(out.data(), static_cast<const uint16_t*>(v.k) + int64_t(page) * v.page_stride,
                        size_t(page_elems) * 2, cudaMemcpyDeviceToHost));
  return out;
}

// Forks share full pages by reference count and copy a partial last page (in every layer);
// a page is free again when its last holder releases it; a write into a shared page copies
// it first; bad forks change nothing.
// FP8 K/V: a page of a layer is its E4M3 bytes then their scales, so the views point inside
// the page and a fork's page copy carries the scales along.
TEST(CudaKvCache, Fp8PagesHoldBytesThenScales) {
  REQUIRE_GPU();
  const int64_t layers = 2, heads = 3, D = 64, pages_total = 4;
  const int64_t bytes_per_layer_page = 2 * heads * cuda::kPageTokens * D + 2 * heads * cuda::kPageTokens * 4;
  EXPECT_EQ(cuda::KvCache::page_bytes(layers, heads, D, DType::F16, /*fp8=*/true), layers * bytes_per_layer_page);
  EXPECT_EQ(cuda::KvCache::page_bytes(layers, heads, D, DType::F16), layers * 2 * heads * cuda::kPageTokens * D * 2);
  auto made = cuda::KvCache::create("test", layers, heads, D, DType::F16, pages_total, /*fp8=*/true);
  ASSERT_TRUE(made.ok()) << made.error();
  cuda::KvCache& cache = **made;
  EXPECT_EQ(cache.bytes(), pages_total * layers * bytes_per_layer_page);
  const cuda::KvLayerView v0 = cache.layer(0, nullptr, 0), v1 = cache.layer(1, nullptr, 0);
  ASSERT_TRUE(v0.fp8());
  auto* base = static_cast<char*>(v0.k);
  EXPECT_EQ(static_cast<char*>(v0.v) - base, heads * cuda::kPageTokens * D);
  EXPECT_EQ(reinterpret_cast<char*>(v0.k_scale) - base, 2 * heads * cuda::kPageTokens * D);
  EXPECT_EQ(v0.v_scale - v0.k_scale, heads * cuda::kPageTokens);
  EXPECT_EQ(v0.page_stride, bytes_per_layer_page);
  EXPECT_EQ(v0.scale_page_stride * 4, bytes_per_layer_page);
  EXPECT_EQ(static_cast<char*>(v1.k) - base, pages_total * bytes_per_layer_page);

  // Known contents, then a fork of a partial page: the copy holds the bytes and the scales.
  std::vector<uint8_t> fill(static_cast<size_t>(cache.bytes()));
  for (size_t i = 0; i < fill.size(); ++i) fill[i] = uint8_t(i * 13 + 5);
  CUDA_CHECK(cudaMemcpy(base, fill.data(), fill.size(), cudaMemcpyHostToDevice));
  ASSERT_TRUE(cache.reserve(1, 5).ok());
  ASSERT_TRUE(cache.fork(1, 2, 5, 5, nullptr).ok());
  CUDA_CHECK(cudaDeviceSynchronize());
  const int32_t from = cache.pages(1)[0], to = cache.pages(2)[0];
  ASSERT_NE(from, to);
  for (int64_t l = 0; l < layers; ++l) {
    std::vector<uint8_t> a(static_cast<size_t>(bytes_per_layer_page)), b(a.size());
    const char* layer = base + l * pages_total * bytes_per_layer_page;
    CUDA_CHECK(cudaMemcpy(a.data(), layer + from * bytes_per_layer_page, a.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), layer + to * bytes_per_layer_page, b.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(a, b) << "layer " << l;
  }
}

TEST(CudaKvCache, ForkSharesFullPagesAndCopiesThePartialOne) {
  REQUIRE_GPU();
  const int64_t layers = 2, heads = 2, D = 64, pages_total = 8;
  auto made = cuda::KvCache::create("test", layers, heads, D, DType::F16, pages_total);
  ASSERT_TRUE(made.ok()) << made.error();
  cuda::KvCache& cache = **made;
  const int64_t page_elems = 2 * heads * cuda::kPageTokens * D;
  // Known contents: every element of the pool its index (mod 2^16).
  {
    const cuda::KvLayerView v = cache.layer(0, nullptr, 0);
    std::vector<uint16_t> fill(size_t(layers * pages_total * page_elems));
    for (size_t i = 0; i < fill.size(); ++i) fill[i] = uint16_t(i * 7 + 3);
    CUDA_CHECK(cudaMemcpy(v.k, fill.data(), fill.size() * 2, cudaMemcpyHostToDevice));
  }
  ASSERT_TRUE(cache.reserve(1, 21).ok());  // pages: one full, one partial
  const std::vector<int32_t> parent(cache.pages(1).begin(), cache.pages(1).end());
  ASSERT_EQ(parent.size(), 2u);
  ASSERT_TRUE(cache.fork(1, 2, 21, 21, nullptr).ok());  // shares page 0, copies page 1
  ASSERT_TRUE(cache.fork(1, 3, 21, 16, nullptr).ok());  // shares page 0 only
  ASSERT_TRUE(cache.fork(1, 4, 21, 9, nullptr).ok());   // copies page 0
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(cache.free_pages(), pages_total - 4);
  EXPECT_EQ(cache.page_refs(parent[0]), 3);
  EXPECT_EQ(cache.page_refs(parent[1]), 1);
  ASSERT_EQ(cache.pages(2).size(), 2u);
  EXPECT_EQ(cache.pages(2)[0], parent[0]);
  EXPECT_NE(cache.pages(2)[1], parent[1]);
  ASSERT_EQ(cache.pages(3).size(), 1u);
  EXPECT_EQ(cache.pages(3)[0], parent[0]);
  ASSERT_EQ(cache.pages(4).size(), 1u);
  EXPECT_NE(cache.pages(4)[0], parent[0]);
  for (int64_t l = 0; l < layers; ++l) {  // the copies hold the parent's bytes in every layer
    EXPECT_EQ(page_bytes_of(cache, l, cache.pages(2)[1], page_elems), page_bytes_of(cache, l, parent[1], page_elems));
    EXPECT_EQ(page_bytes_of(cache, l, cache.pages(4)[0], page_elems), page_bytes_of(cache, l, parent[0], page_elems));
  }
  // Errors change nothing.
  EXPECT_NE(cache.fork(9, 5, 4, 4, nullptr).message().find("holds no K/V pages"), std::string::npos);
  EXPECT_NE(cache.fork(1, 2, 21, 4, nullptr).message().find("exists already"), std::string::npos);
  EXPECT_NE(cache.fork(1, 5, 21, 22, nullptr).message().find("22 tokens of sequence 1"), std::string::npos);
  EXPECT_NE(cache.fork(1, 5, 21, 0, nullptr).message().find("0 tokens"), std::string::npos);
  EXPECT_EQ(cache.free_pages(), pages_total - 4);
  // Copy-on-write: sequence 3 writing from position 10 (into shared page 0) gets its own copy.
  ASSERT_TRUE(cache.prepare_write(3, 10, nullptr).ok());
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_NE(cache.pages(3)[0], parent[0]);
  EXPECT_EQ(cache.page_refs(parent[0]), 2);
  EXPECT_EQ(page_bytes_of(cache, 1, cache.pages(3)[0], page_elems), page_bytes_of(cache, 1, parent[0], page_elems));
  // Writing past the shared pages copies nothing.
  const int64_t free_before = cache.free_pages();
  ASSERT_TRUE(cache.reserve(2, 40).ok());
  ASSERT_TRUE(cache.prepare_write(2, 21, nullptr).ok());
  EXPECT_EQ(cache.pages(2)[0], parent[0]);
  EXPECT_EQ(cache.free_pages(), free_before - 1);  // the reserve's new page only
  // Out of pages: a fork needing a copy fails, changing nothing.
  while (cache.free_pages() > 0) ASSERT_TRUE(cache.reserve(50 + uint64_t(cache.free_pages()), 1).ok());
  const Status full = cache.fork(1, 6, 21, 21, nullptr);
  EXPECT_NE(full.message().find("KV cache full"), std::string::npos) << full.message();
  EXPECT_FALSE(cache.contains(6));
  EXPECT_EQ(cache.page_refs(parent[0]), 2);
  ASSERT_TRUE(cache.fork(1, 6, 21, 16, nullptr).ok());  // whole pages need no free page
  EXPECT_EQ(cache.page_refs(parent[0]), 3);
  // Every holder released: every page free again.
  for (uint64_t id : {1, 2, 3, 4, 6}) cache.release(id);
  for (uint64_t id = 50; id < 60; ++id) cache.release(id);
  EXPECT_EQ(cache.free_pages(), pages_total);
  EXPECT_EQ(cache.page_refs(parent[0]), 0);
}

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

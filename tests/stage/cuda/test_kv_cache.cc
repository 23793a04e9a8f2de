// The GPU stage's paged K/V cache (stage/cuda/kv_cache.h): pages per sequence, a reserve
// that fails changing nothing, and creation that fails naming who asked and the sizes.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(CudaKvCache, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <string>

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

}  // namespace
}  // namespace conveyor

#endif  // CONVEYOR_HAVE_CUDA

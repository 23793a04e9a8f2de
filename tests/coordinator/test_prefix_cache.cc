#include "coordinator/prefix_cache.h"

#include <gtest/gtest.h>

#include <numeric>

namespace conveyor {
namespace {

std::vector<int32_t> tokens(int32_t first, size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(PrefixCache, RetainsWholeGranulesAndHitsTheLongestPrefix) {
  PrefixCache c(4);
  const auto system = tokens(100, 10);  // 2 whole granules + 2
  auto r = c.retain(system, 1000);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->entry_seq_id, 1000u);
  EXPECT_EQ(r->num_tokens, 8);
  EXPECT_EQ(c.cached_tokens(), 8);

  // A prompt sharing the first 9 tokens: the 8 cached ones are reused.
  auto prompt = concat(tokens(100, 9), tokens(7, 5));
  auto hit = c.lookup(prompt);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->entry_seq_id, 1000u);
  EXPECT_EQ(hit->num_tokens, 8);

  // Sharing 6 tokens: only the first granule matches.
  EXPECT_EQ(c.match_length(concat(tokens(100, 6), tokens(1, 6))), 4);
  // Sharing 3 tokens (less than a granule) or a different first token: no hit.
  EXPECT_FALSE(c.lookup(concat(tokens(100, 3), tokens(1, 9))));
  EXPECT_FALSE(c.lookup(tokens(101, 12)));
}

TEST(PrefixCache, LeavesTheLastPromptTokenToCompute) {
  PrefixCache c(4);
  ASSERT_TRUE(c.retain(tokens(0, 8), 7));
  // The very same 8-token prompt reuses one granule only: its last token must run to give
  // the logits of the first new token.
  auto hit = c.lookup(tokens(0, 8));
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->num_tokens, 4);
  EXPECT_EQ(c.lookup(tokens(0, 9))->num_tokens, 8);
  EXPECT_EQ(c.cached_length(tokens(0, 8)), 8);  // what it holds, without the rule
  EXPECT_EQ(c.match_length(tokens(0, 8)), 4);
  EXPECT_FALSE(c.lookup(tokens(0, 4)));
  EXPECT_FALSE(c.lookup({}));
}

TEST(PrefixCache, DoesNotRetainWhatItHoldsOrWhatIsShorterThanAGranule) {
  PrefixCache c(4);
  EXPECT_FALSE(c.retain(tokens(0, 3), 1));
  ASSERT_TRUE(c.retain(tokens(0, 9), 2));
  EXPECT_FALSE(c.retain(tokens(0, 8), 3));  // its 8 tokens are entry 2's first 8
  EXPECT_FALSE(c.retain(tokens(0, 4), 3));
  EXPECT_EQ(c.entries(), 1u);
  // A longer prompt with the same start makes a second, longer entry, and the longest wins.
  ASSERT_TRUE(c.retain(tokens(0, 12), 4));
  EXPECT_EQ(c.entries(), 2u);
  EXPECT_EQ(c.cached_tokens(), 8 + 12);
  auto hit = c.lookup(tokens(0, 13));
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->entry_seq_id, 4u);
  EXPECT_EQ(hit->num_tokens, 12);
}

TEST(PrefixCache, EvictsLeastRecentlyUsedFirst) {
  PrefixCache c(2);
  ASSERT_TRUE(c.retain(tokens(0, 4), 10));
  ASSERT_TRUE(c.retain(tokens(50, 4), 11));
  ASSERT_TRUE(c.retain(tokens(90, 6), 12));
  ASSERT_TRUE(c.lookup(tokens(0, 5)));  // entry 10 is now the most recent
  EXPECT_EQ(c.evict_lru(1), std::vector<uint64_t>{11});
  EXPECT_EQ(c.cached_tokens(), 10);
  EXPECT_FALSE(c.lookup(tokens(50, 5)));
  EXPECT_EQ(c.evict_lru(7), (std::vector<uint64_t>{12, 10}));
  EXPECT_EQ(c.entries(), 0u);
  EXPECT_EQ(c.cached_tokens(), 0);
  EXPECT_TRUE(c.evict_lru(5).empty());
  EXPECT_FALSE(c.lookup(tokens(0, 5)));
}

TEST(PrefixCache, ClearForgetsEverything) {
  PrefixCache c(2);
  ASSERT_TRUE(c.retain(tokens(0, 4), 1));
  c.clear();
  EXPECT_EQ(c.entries(), 0u);
  EXPECT_EQ(c.cached_tokens(), 0);
  EXPECT_FALSE(c.lookup(tokens(0, 5)));
  ASSERT_TRUE(c.retain(tokens(0, 4), 2));  // and can hold it again
  EXPECT_EQ(c.lookup(tokens(0, 5))->entry_seq_id, 2u);
}

TEST(PrefixCache, AHashMatchIsCheckedAgainstTheTokens) {
  // Many different prompts share no prefix: each lookup finds only its own.
  PrefixCache c(4);
  for (int32_t i = 0; i < 200; ++i) ASSERT_TRUE(c.retain(tokens(i * 1000, 8), uint64_t(i + 1)));
  for (int32_t i = 0; i < 200; ++i) {
    auto hit = c.lookup(tokens(i * 1000, 9));
    ASSERT_TRUE(hit);
    EXPECT_EQ(hit->entry_seq_id, uint64_t(i + 1));
  }
  auto other = tokens(0, 9);
  other[5] = -1;  // differs inside the second granule
  EXPECT_EQ(c.lookup(other)->num_tokens, 4);
}

TEST(PrefixCache, RefusesANonPositiveGranule) { EXPECT_THROW(PrefixCache(0), std::invalid_argument); }

}  // namespace
}  // namespace conveyor

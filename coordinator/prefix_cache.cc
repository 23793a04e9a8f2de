#include "coordinator/prefix_cache.h"

#include <algorithm>
#include <stdexcept>

namespace conveyor {

namespace {

// splitmix64's finaliser: every input bit reaches every output bit.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

PrefixCache::PrefixCache(int32_t granule_tokens) : granule_(granule_tokens) {
  if (granule_ <= 0) throw std::invalid_argument("prefix cache: granule_tokens must be positive");
}

std::vector<uint64_t> PrefixCache::prefix_keys(std::span<const int32_t> prompt, size_t max_granules) const {
  std::vector<uint64_t> keys;
  keys.reserve(max_granules);
  uint64_t h = 0;
  for (size_t g = 0; g < max_granules; ++g) {
    for (size_t i = g * size_t(granule_); i < (g + 1) * size_t(granule_); ++i) h = mix(h ^ uint32_t(prompt[i]));
    keys.push_back(h);
  }
  return keys;
}

std::pair<PrefixCache::Lru::iterator, size_t> PrefixCache::find(std::span<const int32_t> prompt,
                                                                 size_t max_granules) const {
  const std::vector<uint64_t> keys = prefix_keys(prompt, max_granules);
  for (size_t g = keys.size(); g > 0; --g) {
    auto hit = by_key_.find(keys[g - 1]);
    if (hit == by_key_.end()) continue;
    const size_t len = g * size_t(granule_);
    for (Lru::iterator it : hit->second)
      if (it->tokens.size() >= len && std::equal(prompt.begin(), prompt.begin() + len, it->tokens.begin()))
        return {it, g};
  }
  return {lru_.end(), 0};
}

int32_t PrefixCache::cached_length(std::span<const int32_t> tokens) const {
  return int32_t(find(tokens, tokens.size() / size_t(granule_)).second) * granule_;
}

int32_t PrefixCache::match_length(std::span<const int32_t> prompt) const {
  return prompt.empty() ? 0 : cached_length(prompt.first(prompt.size() - 1));
}

std::optional<PrefixCache::Hit> PrefixCache::lookup(std::span<const int32_t> prompt) {
  if (prompt.empty()) return std::nullopt;
  auto [it, granules] = find(prompt, (prompt.size() - 1) / size_t(granule_));
  if (granules == 0) return std::nullopt;
  lru_.splice(lru_.begin(), lru_, it);  // iterators stay valid
  return Hit{.entry_seq_id = it->seq_id, .num_tokens = int32_t(granules) * granule_};
}

std::optional<PrefixCache::Retain> PrefixCache::retain(std::span<const int32_t> prompt, uint64_t new_entry_seq_id) {
  const size_t granules = prompt.size() / size_t(granule_);
  if (granules == 0) return std::nullopt;
  auto [it, have] = find(prompt, granules);
  if (have == granules) {  // already cached: count the use
    lru_.splice(lru_.begin(), lru_, it);
    return std::nullopt;
  }
  const size_t len = granules * size_t(granule_);
  Entry e{.seq_id = new_entry_seq_id,
          .tokens = std::vector<int32_t>(prompt.begin(), prompt.begin() + len),
          .keys = prefix_keys(prompt, granules)};
  lru_.push_front(std::move(e));
  for (uint64_t k : lru_.front().keys) by_key_[k].push_back(lru_.begin());
  cached_tokens_ += int64_t(len);
  return Retain{.entry_seq_id = new_entry_seq_id, .num_tokens = int32_t(len)};
}

void PrefixCache::unindex(Lru::iterator it) {
  for (uint64_t k : it->keys) {
    auto bucket = by_key_.find(k);
    if (bucket == by_key_.end()) continue;
    std::erase(bucket->second, it);
    if (bucket->second.empty()) by_key_.erase(bucket);
  }
}

std::vector<uint64_t> PrefixCache::evict_lru(int64_t need) {
  std::vector<uint64_t> freed;
  int64_t released = 0;
  while (released < need && !lru_.empty()) {
    auto it = std::prev(lru_.end());
    released += int64_t(it->tokens.size());
    cached_tokens_ -= int64_t(it->tokens.size());
    freed.push_back(it->seq_id);
    unindex(it);
    lru_.erase(it);
  }
  return freed;
}

void PrefixCache::clear() {
  lru_.clear();
  by_key_.clear();
  cached_tokens_ = 0;
}

}  // namespace conveyor

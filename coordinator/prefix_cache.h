// Prefix K/V reuse: the coordinator's record of the prompt prefixes a pipeline's stages still
// hold, so that a new request whose prompt starts the same way is not computed again.
//
// The stages hold nothing of their own accord. A cached prefix is a sequence of its own on the
// stages (an entry's `seq_id`), made by forking the first tokens of a sequence whose prompt was
// computed, and removed by freeing that sequence: both ride on the pipeline's next
// micro-batch. A new sequence forks the longest cached prefix of its prompt and computes only
// the rest. So the coordinator always knows exactly what each pipeline holds, and this record
// is all of it: there is no eviction on a stage, and no miss to recover from.
//
//   retain(seq, prompt)  -> fork seq's first L tokens into a new entry (L: whole granules)
//   lookup(prompt)       -> the entry and length a new sequence forks (at most prompt - 1
//                           tokens: the last prompt token is always computed, for its logits)
//   evict_lru(need)      -> entries to free, least recently used first
//
// Prefixes are whole granules of `granule_tokens` tokens. Keys are hashes of the token
// prefix at each granule boundary; a hit is checked against the entry's tokens, so a hash
// collision costs a miss, never a wrong answer. Its bits: a forked prefix gives the same
// answer as a recomputed one because the stages' K/V does not depend on how a prompt was cut
// into chunks (the deterministic kernels, docs/ARCHITECTURE.md).
//
// Token accounting is conservative: an entry counts all its tokens against the pipeline's K/V
// budget, although the stages share the blocks it has in common with other entries and with
// the sequences forked from it. When a pipeline restarts (failover, re-plan) its stages drop
// every sequence: clear() forgets the record.
//
// Not thread-safe: the scheduler owns one per pipeline, under the coordinator's mutex.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace conveyor {

class PrefixCache {
 public:
  explicit PrefixCache(int32_t granule_tokens);  // the K/V page of the pipeline's stages
  // Its index holds iterators into its list: moved, never copied.
  PrefixCache(PrefixCache&&) noexcept = default;
  PrefixCache& operator=(PrefixCache&&) noexcept = default;
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  struct Hit {
    uint64_t entry_seq_id = 0;  // the stages' sequence that holds the prefix
    int32_t num_tokens = 0;     // how many of the prompt's first tokens it gives
  };
  // The longest cached prefix of `prompt` that a new sequence can fork (whole granules, at
  // most prompt.size() - 1 tokens). A hit counts as a use (LRU).
  std::optional<Hit> lookup(std::span<const int32_t> prompt);
  // How many tokens lookup() would give, without counting a use (routing between replicas).
  int32_t match_length(std::span<const int32_t> prompt) const;
  // The longest cached whole-granule prefix of `tokens` (all of them may count).
  int32_t cached_length(std::span<const int32_t> tokens) const;

  // A sequence whose `prompt` the stages have computed: the fork to send (its first
  // `num_tokens` tokens into a new entry `entry_seq_id`), or nothing when the prompt is shorter
  // than a granule or its whole-granule prefix is already cached (then that entry is used).
  struct Retain {
    uint64_t entry_seq_id = 0;
    int32_t num_tokens = 0;
  };
  std::optional<Retain> retain(std::span<const int32_t> prompt, uint64_t new_entry_seq_id);

  // Removes least recently used entries until `need` tokens are released or none is left;
  // returns the entries' sequence ids, which the caller frees on the stages.
  std::vector<uint64_t> evict_lru(int64_t need);
  // Forgets everything (the stages dropped their sequences).
  void clear();

  int64_t cached_tokens() const { return cached_tokens_; }
  size_t entries() const { return lru_.size(); }
  int32_t granule_tokens() const { return granule_; }

 private:
  struct Entry {
    uint64_t seq_id = 0;
    std::vector<int32_t> tokens;  // whole granules
    std::vector<uint64_t> keys;   // the prefix hash at each granule boundary
  };
  using Lru = std::list<Entry>;  // most recently used first

  // Hashes of prompt[0, (k+1)*granule) for k = 0 .. max_granules-1.
  std::vector<uint64_t> prefix_keys(std::span<const int32_t> prompt, size_t max_granules) const;
  // The entry and granule count of the longest cached prefix within `max_granules`.
  std::pair<Lru::iterator, size_t> find(std::span<const int32_t> prompt, size_t max_granules) const;
  void unindex(Lru::iterator it);

  int32_t granule_;
  mutable Lru lru_;
  std::unordered_map<uint64_t, std::vector<Lru::iterator>> by_key_;
  int64_t cached_tokens_ = 0;
};

}  // namespace conveyor

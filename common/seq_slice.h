// A micro-batch's rows, per sequence: every stage, kernel launcher and the wire format speak
// of a micro-batch as a list of SeqSlice whose tokens are concatenated in slice order, so a
// micro-batch's activations are [total_tokens, n_embd] row-major.
#pragma once

#include <cstdint>
#include <span>

namespace conveyor {

struct SeqSlice {
  uint64_t seq_id = 0;
  int32_t start_pos = 0;   // position of the slice's first token in its sequence
  int32_t num_tokens = 0;  // >= 1
  bool operator==(const SeqSlice&) const = default;
};

// Tokens of a micro-batch: the sum of its slices' num_tokens.
inline int64_t total_tokens(std::span<const SeqSlice> slices) {
  int64_t n = 0;
  for (const SeqSlice& s : slices) n += s.num_tokens;
  return n;
}

}  // namespace conveyor

// A one-stage micro-batch of a fresh 4-token prompt (greedy), for tests (and the stranger
// program of tests/transport/) that push micro-batches into a real worker by hand.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "protocol/microbatch.h"
#include "protocol/seq_state.h"

namespace conveyor::testing {

inline MicroBatch prompt_batch(uint64_t batch_id, uint32_t epoch) {
  const std::vector<int32_t> prompt = {464, 902, 531, 262};  // the demo model has 4096 tokens
  MicroBatch b;
  b.batch_id = batch_id;
  b.pipeline = 0;
  b.epoch = epoch;
  SeqStep w;
  w.slice = {.seq_id = 1, .start_pos = 0, .num_tokens = int32_t(prompt.size())};
  w.sample = true;
  w.prefill = true;
  b.seqs = {w};
  b.token_ids = prompt;
  b.free_seq_ids = {1};  // a fresh sequence each time (frees are applied before running)
  Admission a{.seq_id = 1, .state = {}};  // its state comes with it each time: greedy
  a.state.prompt_len = int32_t(prompt.size());
  a.state.sampling.temperature = 0;
  b.admissions = encode_admissions(std::span(&a, 1));
  return b;
}

}  // namespace conveyor::testing

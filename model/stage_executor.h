// StageExecutor: what a stage worker does with one MicroBatch on the CPU backend.
//
//   first stage:  embed the header's token ids, run the layers, hand on the activations
//   middle:       run the layers on the activations received, hand them on
//   last stage:   run the layers, then ln_f + LM head, sample (model/sampling.h) and
//                 report log-probs into a BatchResult for the coordinator
//
// The last stage keeps each sequence's token history (every token id that passed through
// in a header) for the repetition/presence penalties and min_tokens; it is dropped with
// the sequence's KV cache. The sampling step of a slice is the number of tokens generated
// so far (history length - prompt_len), so a replayed sequence draws the same tokens.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/cpu_stage.h"
#include "model/microbatch.h"

namespace conveyor {

class StageExecutor {
 public:
  explicit StageExecutor(StageWeights weights);

  bool is_first() const { return stage_.weights().has_embedding(); }
  bool is_last() const { return stage_.weights().has_head(); }
  const ModelConfig& config() const { return stage_.config(); }
  CpuStage& stage() { return stage_; }

  // Runs `batch`. `hidden` holds the incoming activations [T, C] (ignored on the first
  // stage) and, on return, the outgoing ones (non-last stages). On the last stage
  // `result` receives the sampled tokens and log-probs. Frees batch.free_seq_ids first.
  // On error no sequence's cache has changed (the batch can be replayed).
  Status run(const MicroBatch& batch, std::vector<float>& hidden, BatchResult* result);

  // Drops every sequence (failover, re-plan): KV caches and token histories.
  void drop_all();
  void free_sequence(uint64_t seq_id);

 private:
  Status sample_outputs(const MicroBatch& batch, const std::vector<float>& hidden, BatchResult& result);

  CpuStage stage_;
  std::unordered_map<uint64_t, std::vector<int32_t>> history_;  // last stage only
  std::vector<float> logits_;
  std::vector<float> scratch_;
};

}  // namespace conveyor

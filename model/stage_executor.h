// StageExecutor: what a stage worker does with one MicroBatch, on any StageBackend (the CPU
// stage, or a GPU stage).
//
//   first stage:  embed the header's token ids, run the layers, hand on the activations
//   middle:       run the layers on the activations received, hand them on
//   last stage:   run the layers, then ln_f + LM head, sample (model/sampling.h) and
//                 report log-probs into a BatchResult for the coordinator. A backend that
//                 samples in place (the GPU: the same algorithm and Philox counters)
//                 chooses the tokens where its logits are, unless a slice asks for top or
//                 prompt log-probs: those batches bring their logits to the host.
//
// The last stage keeps each sequence's token history (every token id that passed through
// in a header) for the repetition/presence penalties and min_tokens; it is dropped with
// the sequence's KV cache. The sampling step of a slice is the number of tokens generated
// so far (history length - prompt_len), so a replayed sequence draws the same tokens.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <memory>
#include <span>

#include "common/status.h"

#include "model/microbatch.h"
#include "model/stage_backend.h"

namespace conveyor {

class StageExecutor {
 public:
  explicit StageExecutor(StageWeights weights);  // on the CPU
  explicit StageExecutor(std::unique_ptr<StageBackend> backend);

  bool is_first() const { return backend_->has_embedding(); }
  bool is_last() const { return backend_->has_head(); }
  const ModelConfig& config() const { return backend_->config(); }
  StageBackend& backend() { return *backend_; }

  // Runs `batch`. The first stage embeds the header's token ids; the others take `in`, the
  // incoming activations [T, C] (batch.activation_dtype, host memory). A non-last stage then
  // holds its outgoing activations for read_activations; the last stage fills `result`
  // with the sampled tokens and log-probs. Frees batch.free_seq_ids first. On error no
  // sequence's cache has changed (the batch can be replayed).
  Status run(const MicroBatch& batch, std::span<const std::byte> in, BatchResult* result);
  // The outgoing activations of the batch just run: activation_bytes(batch) bytes of
  // activation_dtype() into `out`.
  DType activation_dtype() const { return backend_->activation_dtype(); }
  size_t activation_bytes(const MicroBatch& batch) const {
    return size_t(batch.total_tokens() * config().n_embd) * dtype_bytes(activation_dtype());
  }
  Status read_activations(const MicroBatch& batch, std::span<std::byte> out) {
    return backend_->read_activations(batch.total_tokens(), out);
  }

  // Drops every sequence (failover, re-plan): KV caches and token histories.
  void drop_all();
  void free_sequence(uint64_t seq_id);

 private:
  Status sample_outputs(const MicroBatch& batch, BatchResult& result);
  // The backend chooses the tokens where its logits are (StageBackend::samples_in_place).
  Status sample_in_place(const MicroBatch& batch, BatchResult& result);

  std::unique_ptr<StageBackend> backend_;
  std::unordered_map<uint64_t, std::vector<int32_t>> history_;  // last stage only
  std::vector<float> logits_;
  std::vector<float> scratch_;
};

}  // namespace conveyor

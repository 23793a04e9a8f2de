// StageExecutor: what a stage worker does with one MicroBatch, on any StageBackend (the CPU
// stage, or a GPU stage).
//
//   first stage:  the header's token ids through the layers, activations handed on
//   middle:       the activations received through the layers, handed on
//   last stage:   the layers, then ln_f + LM head and the choice of each sequence's next
//                 token (kernels/cpu/sampling.h), with log-probs, into a BatchResult for the
//                 coordinator. A backend that samples in place (the GPU: the same algorithm
//                 and Philox counters) chooses the tokens where its logits are, unless a
//                 slice asks for top or prompt log-probs: those batches bring their logits
//                 to the host and are chosen here.
//
// The last stage keeps, per sequence, what choosing its tokens needs beyond the step
// (LastStageSeq): its SeqState, which arrives once in a micro-batch's admissions
// (protocol/seq_state.h), and its token history (every token id that passed through in a
// header) for the repetition/presence penalties and min_tokens. A fork gives the child both;
// a free, or drop_all, drops them with the sequence's KV cache. The sampling step of a slice
// is the number of tokens generated so far (history length - prompt_len), so a replayed
// sequence draws the same tokens. A slice of a sequence the last stage holds no state for
// fails its batch, naming the sequence: it is never sampled with defaults.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "stage/stage_backend.h"

namespace conveyor {

class StageExecutor {
 public:
  explicit StageExecutor(std::unique_ptr<StageBackend> backend) : backend_(std::move(backend)) {}

  bool is_first() const { return backend_->has_embedding(); }
  bool is_last() const { return backend_->has_head(); }
  const ModelConfig& config() const { return backend_->config(); }
  StageBackend& backend() { return *backend_; }
  // The element type of the activations a non-last stage hands on.
  DType activation_dtype() const { return backend_->activation_dtype(); }

  // Runs `batch`. The first stage embeds the header's token ids; the others take `in`, the
  // incoming activations [T, C] (batch.activation_dtype, host memory). A non-last stage
  // writes its outgoing activations where `out` says (called once, also with 0 bytes for a
  // batch that only frees sequences, so the frees travel on); the last stage fills `result`
  // with the sampled tokens and log-probs. Applies batch.forks first (each child gets its
  // parent's first num_tokens K/V positions, and on the last stage its state and token
  // history), then frees batch.free_seq_ids, then (last stage) takes the admissions' states,
  // then runs the slices. An own-token slice (SeqStep::own_token: a pipeline of one stage
  // stepping ahead) runs on the token this stage sampled for its sequence at the position
  // before; only a stage that is first and last takes one. A batch refused
  // by the checks changes no sequence's cache; one whose rows find no room in `out` has
  // already run (either way the coordinator replays the pipeline from a new epoch).
  Status run(const MicroBatch& batch, std::span<const std::byte> in, const ActivationSink& out, BatchResult* result);

  // Seconds the last run() spent choosing tokens on the host (last stage; 0 when the backend
  // chose them in its own step, which then includes that time). For the worker's step trace.
  double last_sample_seconds() const { return sample_seconds_; }

  // Drops every sequence (failover, re-plan): KV caches, states and token histories.
  void drop_all();
  void free_sequence(uint64_t seq_id);

 private:
  // What the last stage keeps of a sequence between its steps (see the top of this file).
  struct LastStageSeq {
    SeqState state;
    std::vector<int32_t> history;  // prompt then generated tokens, as far as they were sent
    // The token its last sampling step chose, at position history.size() then (for a step
    // ahead); -1 when none or a fork made the record.
    int32_t sampled = -1;
    int64_t sampled_at = -1;
  };

  void apply_forks(const MicroBatch& batch, Status& forked);
  Status admit(const MicroBatch& batch);
  // The batch's sequences' records, in slice order; an error names a sequence without one.
  Expected<std::vector<LastStageSeq*>> records_of(const MicroBatch& batch);
  // The batch's token ids with every own-token slice's placeholder replaced by the token this
  // stage sampled (`own_tokens_`), or batch.token_ids itself when it has none.
  Expected<std::span<const int32_t>> tokens_of(const MicroBatch& batch);
  // `tokens`: the batch's token ids, own tokens in place (tokens_of).
  Status run_last(const MicroBatch& batch, std::span<const int32_t> tokens, StepInput& in, BatchResult& result);
  Status sample_in_place(const MicroBatch& batch, const std::vector<LastStageSeq*>& seqs, StepInput& step,
                         BatchResult& result);
  // Chooses tokens on the host from `logits` (one row per slice, or every row when all_rows).
  void sample_on_host(const MicroBatch& batch, std::span<const int32_t> tokens, const std::vector<LastStageSeq*>& seqs,
                      const std::vector<float>& logits, bool all_rows, BatchResult& result);
  // Notes each sampled token in its record, for a step ahead.
  static void note_sampled(LastStageSeq& rec, int32_t token);

  std::unique_ptr<StageBackend> backend_;
  std::unordered_map<uint64_t, LastStageSeq> seqs_;  // last stage only
  StepOutput step_out_;  // reused: its buffers keep their capacity
  std::vector<float> scratch_;
  std::vector<int32_t> own_tokens_;  // tokens_of's copy when the batch has own-token slices
  double sample_seconds_ = 0;
};

}  // namespace conveyor

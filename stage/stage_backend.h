// StageBackend: what a stage worker runs its micro-batches on (the CPU stage, stage/cpu/, or a
// GPU stage, stage/cuda/), behind one call per micro-batch:
//
//   step(in, out): the micro-batch's rows in (token ids on the first stage, the previous
//   stage's activations on the others), this stage's layers, then out: the activations for
//   the next stage, or on the last stage the chosen tokens or the logits to choose from.
//
// Activations cross between stages as host rows [tokens, n_embd] of F32 (a CPU stage) or the
// GPU stage's F16/BF16 (half the bytes); a backend takes any of the three and hands on its
// own activation_dtype(). A step refused by its checks changes no sequence's cache (the
// coordinator replays the micro-batch). Backends are made by stage/backend_factory.h.
//
// Not thread-safe: one caller at a time (the stage worker's compute thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/sampling_params.h"
#include "common/seq_slice.h"
#include "common/stage_description.h"
#include "common/status.h"

namespace conveyor {

// Activations as they travel between stages: [tokens, n_embd] elements of `dtype`
// (is_activation_dtype) in host memory.
struct ActivationsView {
  DType dtype = DType::F32;
  std::span<const std::byte> bytes;
};

// Where a step writes the activations it hands on: called once, after the layers have run
// (or, on a GPU, been queued), with the bytes it will write; returns host memory of at least
// that size, or an error (no room: the step fails). It may wait for a free send slot.
using ActivationSink = std::function<Expected<std::span<std::byte>>(size_t bytes)>;

// What the last stage's head produces.
enum class HeadOutput {
  None,        // not the last stage
  Tokens,      // choose each slice's next token where the logits are (needs samples_in_place())
  LastLogits,  // the logits of each slice's last row, [slices, V], for the caller to choose from
  AllLogits,   // the logits of every row, [tokens, V] (prompt log-probs)
};

struct StepInput {
  std::span<const SeqSlice> slices;  // the micro-batch: each continues its sequence's cache
  std::span<const int32_t> token_ids;  // first stage: every slice's tokens, concatenated
  ActivationsView activations;         // other stages: the previous stage's rows
  HeadOutput head = HeadOutput::None;  // last stage: what to produce
  // head == Tokens: one row per slice, what sample_next (kernels/cpu/sampling.h) would be
  // given for it; the backend draws the same tokens with the same algorithm and counters.
  std::span<const SampleRow> sample_rows;
};

struct StepOutput {
  ActivationSink activations;  // not the last stage: where the outgoing rows go
  // head == Tokens: per slice, the chosen token and its log-prob under the raw logits.
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  // head == LastLogits / AllLogits: [rows, vocab_size] fp32.
  std::vector<float> logits;
};

class StageBackend {
 public:
  virtual ~StageBackend() = default;

  virtual const ModelConfig& config() const = 0;
  virtual bool has_embedding() const = 0;  // the first stage
  virtual bool has_head() const = 0;       // the last stage
  // The element type of the activations this stage hands on.
  virtual DType activation_dtype() const = 0;
  // Whether the backend chooses tokens where its logits are (HeadOutput::Tokens): the GPU
  // does, so no logits cross to the host; the CPU hands its logits to the caller.
  virtual bool samples_in_place() const = 0;

  // Runs one micro-batch; see the top of this file. The backend checks what it is given
  // (slices against its caches, ids against the vocabulary, activation sizes) and names what
  // is wrong.
  virtual Status step(const StepInput& in, StepOutput& out) = 0;

  // Host memory for activations this backend reads and writes: page-locked for a GPU backend
  // (copies to and from the device run as DMA), the heap otherwise. Null when none is left.
  virtual std::shared_ptr<std::byte[]> allocate_host(size_t bytes) const = 0;

  // Gives `child` the first num_tokens positions of `parent`'s K/V (beam search, prefix
  // reuse). Fails, changing nothing, naming what is wrong: an unknown parent, a child that
  // exists, num_tokens outside 1..the parent's cached length, or no room for the child.
  // A paged cache shares the parent's full pages and copies only a partial last one.
  virtual Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) = 0;
  virtual void free_sequence(uint64_t seq_id) = 0;
  virtual void clear() = 0;  // every sequence (failover, re-plan)

  virtual int64_t num_sequences() const = 0;
  virtual int64_t kv_used_tokens() const = 0;
  virtual int64_t kv_capacity_tokens() const = 0;  // tokens its K/V cache may hold in all
  virtual int64_t kv_bytes_per_token() const = 0;
  // "cpu", "cuda:0 F16", ...: for logs and the cluster table.
  virtual std::string describe() const = 0;

  // Ok while the backend can run steps. Otherwise why no step will run again in this process
  // (a GPU's sticky fault, tensor-parallel ranks out of step): the worker then exits, so that
  // the coordinator fails its work over as it does for a dead worker (a step that fails on
  // its input alone leaves the backend healthy). The CPU backend is always healthy.
  virtual Status health() const { return ok_status(); }
};

// Checks `in` against a micro-batch of `tokens` tokens of width `width`: an activation dtype
// and exactly tokens x width elements. `stage` names the stage in the error.
Status check_activations(const ActivationsView& in, int64_t tokens, int64_t width, const std::string& stage);

// The common checks of a step's input against a stage: token ids on the first stage (as
// many as the slices' tokens), activations on the others, the head's output on the last
// stage only, and one sample row per slice when it chooses tokens.
Status check_step_input(const StepInput& in, const StageBackend& stage, const std::string& name);

}  // namespace conveyor

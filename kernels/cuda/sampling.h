// Choosing the next token on the GPU: the twin of model/sampling.h's sample_next, step for
// step (penalties, greedy, temperature, candidates sorted by (logit desc, id asc), top-k,
// softmax in double with running sums, top-p cut, one Philox4x32-10 draw keyed by (seed;
// step, sample_index) through model/philox.h). Same seed, same token wherever the two
// computed the same logits; the running sums are a block scan here and a left-to-right sum
// there, so they may differ in the last bits, which changes a token only when the draw
// lands within ~1e-16 of a boundary.
//
// Kernels per call: one prepare kernel (logit_bias, penalties; greedy rows take their argmax there;
// others are divided by the temperature), the candidates in order: rows with a top-k of at
// most 256 get just their first top-k from two select kernels (a block a slice of about 4,096
// logits finds the slice's first top-k by a radix select over the keys' bytes, dividing by the
// temperature as it reads; a block a row sorts the slices' candidates, bitonic in shared
// memory: a row of GPT-2's 50257 logits is not sorted whole), the others from one segmented
// radix sort (CUB; greedy and top-k rows get empty segments, and it is skipped when no row
// needs it), then one draw kernel (block scan of
// exp(l - max) in double, then binary searches for the top-p cut and the draw). The
// parameters and penalty lists travel in one host-to-device copy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>

#include "kernels/cuda/check.h"
#include "common/sampling_params.h"

namespace conveyor::cuda {

using conveyor::SampleRow;  // model/sampling.h

// tokens[r] = argmax of logits row r (the lowest id on ties): greedy without penalties.
void argmax_rows(int32_t* tokens, const float* logits, int64_t rows, int64_t V, cudaStream_t stream);

class GpuSampler {
 public:
  GpuSampler(const std::string& owner, int64_t max_rows, int64_t vocab_size);
  ~GpuSampler();
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // True when a row needs more than argmax_rows: a temperature > 0, a logit_bias or any penalty.
  static bool needs_sampler(const SamplingParams& p, size_t generated_len);

  // logits: device [rows.size(), V], mutated by the penalties as sample_next mutates its row,
  // and divided by the temperature where the row is sorted whole (a top-k row divides as it
  // reads). tokens: device [rows.size()]. Asynchronous; the host-side buffers it fills are
  // reused on the next call only after this call's copy has completed.
  void sample(float* logits, std::span<const SampleRow> rows, int32_t* tokens, cudaStream_t stream);

  // tokens[r] = argmax of logits row r (lowest id on ties), rows <= max_rows(): argmax_rows
  // spread over 16 blocks a row. Capturable in a CUDA graph; one stream at a time.
  void argmax(int32_t* tokens, const float* logits, int64_t rows, cudaStream_t stream);

  int64_t max_rows() const { return max_rows_; }
  int64_t device_bytes() const;

 private:
  void ensure_list_capacity(int64_t ints);

  std::string owner_;
  int64_t max_rows_, vocab_;
  size_t select_smem_ = 0;  // dynamic shared memory of the top-k select: a slice's keys, or 0
  size_t merge_smem_ = 0;   // and of its merge: the slices' candidates of a row
  DeviceBuffer sorted_keys_, sorted_ids_, iota_, cum_, offsets_, cub_temp_, params_dev_, lists_dev_;
  DeviceBuffer slice_candidates_;  // [rows][slices][kSelectMax] of the top-k select
  DeviceBuffer argmax_partial_, argmax_counters_;
  PinnedBuffer params_host_, lists_host_;
  int64_t list_capacity_ = 0;  // ints
  cudaEvent_t copied_ = nullptr;
};

}  // namespace conveyor::cuda

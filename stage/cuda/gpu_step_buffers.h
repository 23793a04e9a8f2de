// StepBuffers: every buffer a GpuStage's steps use besides the weights and the K/V cache,
// allocated once at creation (the one place that sizes them, from GpuStageShape) and freed
// with the stage:
//   activations   [max_rows, width] of the stage's dtype, reused by every layer and call;
//   workspaces    fp32 staging rows, int8 dequantisation, FP8, decode attention, the sampler;
//   the head's    logits, the chosen tokens and log-probs, device and pinned (the rank that
//                 holds the LM head only);
//   the step metadata (StepMetaStaging: the device block, two pinned slots, their events).
// The runner (gpu_step_runner.h) reads and writes them; between calls they hold nothing but
// the hidden state and the last logits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "stage/cuda/gpu_stage_shape.h"
#include "stage/cuda/gpu_step_meta.h"

namespace conveyor::cuda {

struct StepBuffers {
  // Everything above, for `shape`, in the order of the members below; the GEMM workspaces are
  // handed to `gemm`, and an FP8 stage's GEMM is checked (gemm.fp8_supported()). Activations
  // and decode counters start zeroed. Out of memory throws (device_alloc names the stage);
  // an FP8 check that fails comes back.
  static Expected<std::unique_ptr<StepBuffers>> create(const GpuStageShape& shape, Gemm& gemm, cudaStream_t stream);

  // Bytes of the activation rows and of the workspaces (the Gemm's own not counted).
  int64_t activation_bytes() const;
  int64_t workspace_bytes() const;

  // Activations, [max_rows, *] of dtype (C = n_embd, W = this rank's attention width, I = its MLP units).
  DeviceBuffer hidden;       // [rows, C] the residual stream: a call's input and output
  DeviceBuffer ln;           // [rows, C] LayerNorm output; while loading, weight rows to quantise
  DeviceBuffer qkv;          // [rows, 3W]
  DeviceBuffer attn;         // [rows, W]
  DeviceBuffer proj;         // [rows, C] the row-split products' (partial) sums
  DeviceBuffer fc;           // [rows, I]
  DeviceBuffer staging_f32;  // [rows, C] fp32: hidden-state transfers in another dtype, the weight upload
  DeviceBuffer dequant;      // int8 weights: the largest layer matrix in dtype, for prefill GEMMs
  DeviceBuffer fp8_act;      // FP8: the products' rows quantised (with their scales) and fp16 sums
  DeviceBuffer ln_q, ln_q_scales;  // FP8: `ln` quantised by its LayerNorm for QKV and FC1, [rows, C] E4M3 and [rows]

  // FP8 stages: where the LayerNorms put their rows quantised (ln_q, ln_q_scales); empty otherwise.
  Fp8Rows ln_rows_fp8() const { return {ln_q.as<uint8_t>(), ln_q_scales.as<float>()}; }

  // The head (rank holding the LM head): logits_rows = max_step_seqs rows.
  int64_t logits_rows = 0;
  DeviceBuffer head_in;      // [logits_rows, C] ln_f of the rows the head reads
  DeviceBuffer logits;       // [logits_rows, V] fp32
  DeviceBuffer tokens_dev;   // [max_step_seqs] the chosen ids
  PinnedBuffer tokens_host;
  // [logits_rows, head_rows(V)]: the LM head's product at its padded pitch (gpu_weights.h),
  // copied into `logits` at once; then sample()'s [rows, V] copy of the logits before the
  // sampler mutates them.
  DeviceBuffer raw_logits;
  DeviceBuffer logprobs_dev;  // [max_step_seqs] the chosen ids' log-probs
  PinnedBuffer logprobs_host;
  std::unique_ptr<GpuSampler> sampler;

  std::unique_ptr<StepMetaStaging> meta;
  // Decode attention: every piece of every row, up to the context length, and their counters.
  DeviceBuffer decode_partial, decode_counters;
};

}  // namespace conveyor::cuda

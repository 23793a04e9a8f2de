// StepBuffers (gpu_step_buffers.h): the one place that sizes a GpuStage's activations and
// workspaces.
#include "stage/cuda/gpu_step_buffers.h"

#include <algorithm>
#include <string>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tiles.h"
#include "stage/cuda/gpu_weights.h"

namespace conveyor::cuda {
Expected<std::unique_ptr<StepBuffers>> StepBuffers::create(const GpuStageShape& shape, Gemm& gemm,
                                                           cudaStream_t stream) {
  const GpuStageOptions& o = shape.options;
  const std::string& n = o.name;
  const int64_t C = shape.config.n_embd, W = shape.width, I = shape.inner, V = shape.config.vocab_size;
  const int64_t H = shape.heads, D = shape.config.head_dim();
  const int64_t max_step_seqs = shape.max_step_seqs;
  const size_t e = dtype_bytes(o.dtype);
  const size_t R = size_t(shape.max_rows);
  auto b = std::make_unique<StepBuffers>();
  b->hidden = device_alloc(R * C * e, n, "activations (hidden)");
  b->ln = device_alloc(R * C * e, n, "activations (layernorm)");
  b->qkv = device_alloc(R * 3 * W * e, n, "activations (qkv)");
  b->attn = device_alloc(R * W * e, n, "activations (attention)");
  b->proj = device_alloc(R * C * e, n, "activations (projection)");
  b->fc = device_alloc(R * I * e, n, "activations (mlp)");
  b->staging_f32 = device_alloc(R * C * sizeof(float), n, "fp32 staging");
  if (o.int8_weights && shape.num_layers() > 0) {  // the largest layer matrix, for prefill GEMMs
    b->dequant = device_alloc(size_t(std::max({3 * W * C, C * W, I * C})) * e, n, "int8 dequantisation workspace");
    gemm.set_dequant_workspace(b->dequant.get(), b->dequant.bytes());
  }
  if (o.fp8 && shape.num_layers() > 0) {  // every row of the largest product (or the MLP): E4M3 rows + fp16 sums
    b->fp8_act = device_alloc(std::max({Gemm::fp8_workspace_bytes(shape.max_rows, C, 3 * W),
                                        Gemm::fp8_workspace_bytes(shape.max_rows, W, C),
                                        Gemm::fp8_workspace_bytes(shape.max_rows, C, I),
                                        Gemm::fp8_workspace_bytes(shape.max_rows, I, C),
                                        Gemm::fp8_mlp_supported(I)
                                            ? Gemm::fp8_mlp_workspace_bytes(shape.max_rows, C, I, C)
                                            : size_t(0)}),
                              n, "FP8 workspace");
    gemm.set_fp8_workspace(b->fp8_act.get(), b->fp8_act.bytes());
    b->ln_q = device_alloc(R * C, n, "FP8 LayerNorm rows");
    b->ln_q_scales = device_alloc(R * sizeof(float), n, "FP8 LayerNorm row scales");
    if (Status s = gemm.fp8_supported(); !s) return Status::error(n + ": " + s.message());
  }
  for (DeviceBuffer* a : {&b->hidden, &b->ln, &b->qkv, &b->attn, &b->proj, &b->fc})
    CUDA_CHECK(cudaMemsetAsync(a->get(), 0, a->bytes(), stream));
  if (shape.holds_head()) {
    b->logits_rows = max_step_seqs;
    b->head_in = device_alloc(size_t(b->logits_rows * C) * e, n, "LM head input");
    b->logits = device_alloc(size_t(b->logits_rows * V) * sizeof(float), n, "logits");
    b->tokens_dev = device_alloc(size_t(max_step_seqs) * sizeof(int32_t), n, "sampled tokens");
    b->tokens_host = PinnedBuffer(size_t(max_step_seqs) * sizeof(int32_t), n + " sampled tokens");
    b->raw_logits = device_alloc(size_t(b->logits_rows * head_rows(V)) * sizeof(float), n, "raw logits");
    b->logprobs_dev = device_alloc(size_t(max_step_seqs) * sizeof(float), n, "sampled log-probs");
    b->logprobs_host = PinnedBuffer(size_t(max_step_seqs) * sizeof(float), n + " sampled log-probs");
    b->sampler = std::make_unique<GpuSampler>(n, max_step_seqs, V);
  }
  b->meta = std::make_unique<StepMetaStaging>(shape.max_rows, max_step_seqs, shape.max_pages, n);
  // Decode attention workspace: every piece of every row, up to the context length, for
  // either order (the tile order's pieces are shorter; it spreads only small batches).
  const int64_t P = shape.config.n_positions;
  const int64_t partial =
      std::max(decode_partial_floats(max_step_seqs, H, D, P),
               tile_partial_floats(std::min(max_step_seqs, tile_spread_rows(H, shape.num_sms)), H, D, P));
  b->decode_partial =
      device_alloc(size_t(std::max<int64_t>(partial, 1)) * sizeof(float), n, "decode attention workspace");
  b->decode_counters = device_alloc(size_t(max_step_seqs * H) * sizeof(int32_t), n, "decode attention counters");
  CUDA_CHECK(cudaMemsetAsync(b->decode_counters.get(), 0, b->decode_counters.bytes(), stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return b;
}

int64_t StepBuffers::activation_bytes() const {
  return int64_t(hidden.bytes() + ln.bytes() + qkv.bytes() + attn.bytes() + proj.bytes() + fc.bytes() +
                 head_in.bytes() + logits.bytes() + raw_logits.bytes() + staging_f32.bytes());
}

int64_t StepBuffers::workspace_bytes() const {
  return int64_t(decode_partial.bytes() + decode_counters.bytes() + meta->device_bytes() + dequant.bytes() +
                 fp8_act.bytes() + ln_q.bytes() + ln_q_scales.bytes()) +
         (sampler ? sampler->device_bytes() : 0);
}

}  // namespace conveyor::cuda

// StepRunner: the kernels of a GpuStage's steps, in order, over its weights (GpuWeights), its
// buffers (StepBuffers) and its K/V cache (KvCache): the embedding, the layers, the head
// (ln_f + LM head, the choice of tokens), the decode step and its CUDA graphs, and the
// planning of a step's matrix products. GpuStage checks a call's arguments, fills the step
// metadata and keeps the sequences' lengths; the runner only launches, on the stage's stream
// (CUDA faults throw: the stage's guard() turns them into a Status).
//
// One layer is
//   ln_1 -> QKV (bias fused) -> attention (K/V appended to the paged cache) -> proj ->
//   add-bias-residual + ln_2 (one kernel) -> FC (bias + GeLU fused) -> FC2 ->
//   add-bias-residual + next layer's ln_1 (one kernel)
// so the residual stream `hidden` is [tokens, C] of the stage's dtype throughout. Weights are
// read through the weight table (layer.at(LayerTensor::...)). Tensor parallel: the attention
// projection and FC2 produce partial sums that the options' all_reduce joins before their
// bias and the residual are added. FP8 on one rank: the projection's and FC2's epilogues run
// inside the add-bias-residual kernel after them, which reads their sums (Gemm::run_fp8's
// `defer`).
//
// Decode: the step (embedding on the first stage, every layer, ln_f + LM head + greedy argmax
// on the rank holding the head) is captured once per batch-size bucket (decode_bucket) and
// replayed. The graph's kernels read everything that changes between steps (token ids,
// positions, block tables, lengths) from the step metadata block at a fixed device address,
// so one capture serves every later step of its bucket; the rows past the batch are padding
// that no kernel attends for.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <utility>

#include "common/status.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "stage/cuda/gpu_stage_shape.h"
#include "stage/cuda/gpu_step_buffers.h"
#include "stage/cuda/gpu_step_meta.h"
#include "stage/cuda/gpu_weights.h"
#include "stage/cuda/kv_cache.h"

namespace conveyor::cuda {

class StepRunner {
 public:
  // Views of the stage's parts, which outlive the runner.
  StepRunner(const GpuStageShape& shape, const GpuWeights& weights, StepBuffers& buffers, Gemm& gemm,
             cudaStream_t stream);
  ~StepRunner();  // the decode graphs
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  // ---- the layers ----
  // hidden[t] = wte[ids[t]] + wpe[pos[t]] for the step's first num_tokens rows (first stage).
  void embed_rows(const StepMeta& m, int64_t num_tokens);
  // The layers over a step's rows, K/V appended to `kv` (null only without layers). The first
  // decode_seqs sequences have one row each and attend through the decode kernel (which
  // appends their K/V); the rest, chunks of prompts, through the context kernel.
  // fuse_final_ln: the last layer's residual kernel also applies ln_f into `ln` (the decode
  // step's head input). A failed all-reduce comes back naming the stage.
  Status run_layers(const StepMeta& m, const KvCache* kv, int64_t num_tokens, int64_t num_seqs, int64_t max_q_len,
                    int64_t decode_seqs, bool fuse_final_ln);

  // ---- the head (the rank that holds it) ----
  // ln_f + LM head of every row of hidden [num_tokens, C] into host out [num_tokens, V], in
  // chunks of the logits buffer's rows. Synchronous.
  void all_logits(int64_t num_tokens, float* out);
  // ln_f + LM head of the rows m.last_row[0, num_seqs) into the logits buffer; out (host,
  // optional) gets a copy [num_seqs, V], synchronously.
  void last_logits(const StepMeta& m, int64_t num_seqs, float* out);
  // The tokens of the first rows.size() rows of the logits buffer into host `tokens`, and
  // their log-probs under the raw logits into host `logprobs` (optional): the sampler when
  // `full`, else the argmax (already in tokens_dev when `have_argmax`: a decode step leaves it).
  // Synchronous.
  void choose_tokens(std::span<const SampleRow> rows, bool full, bool have_argmax, int32_t* tokens, float* logprobs);

  // ---- decode ----
  // The rows a decode step of `seqs` sequences runs: its graph's bucket when graphs are on.
  int64_t decode_rows(int64_t seqs) const;
  // The step of `rows` rows from bucket `rows`'s graph (captured on first use), or eagerly.
  Status run_decode_step(const StepMeta& m, const KvCache* kv, int64_t rows, bool graph);
  size_t captured_graphs() const { return graphs_.size(); }
  bool has_graph(int64_t rows) const { return graphs_.count(rows) > 0; }

  // ---- planning (GpuStage::plan_products) ----
  // The four layer products (and, with_head, the LM head) for `rows` rows, run once on the
  // step buffers, which hold nothing between calls; the stream is synchronised.
  void plan_products(int64_t rows, bool with_head);
  bool products_planned(int64_t rows, bool with_head) const { return planned_rows_.count({rows, with_head}) > 0; }

 private:
  // One decode step of `rows` rows: embedding (first stage), every layer, ln_f + LM head +
  // greedy argmax into tokens_dev (rank 0 of the last stage). Capturable.
  Status decode_step(const StepMeta& m, const KvCache* kv, int64_t rows);
  int decode_splits(int64_t rows) const;
  // logits [rows, V] (fp32) = in_rows [rows, C] (dtype) @ head^T.
  void lm_head(const void* in_rows, int64_t rows, float* logits);
  template <class T> void embed_impl(const StepMeta& m, int64_t num_tokens);
  template <class T> Status layers_impl(const StepMeta& m, const KvCache* kv, int64_t num_tokens, int64_t num_seqs,
                                        int64_t max_q_len, int64_t decode_seqs, bool fuse_final_ln);
  // ln_q: where ln_out's rows also go quantised (FP8 stages, before QKV and FC1), or empty.
  // x_sums: x as an FP8 product's deferred epilogue (one rank only), or empty.
  template <class T> Status reduce_residual_layernorm(T* hidden, T* ln_out, T* x, const T* bias, const T* gamma,
                                                      const T* beta, int64_t num_tokens, Fp8Rows ln_q = {},
                                                      Fp8Sums x_sums = {});
  // out[T, N] = act(in[T, K] @ w^T + bias) for a layer matrix w [N, K] (scales: int8 or FP8
  // weights; in_q: FP8 only, in's rows quantised already by their LayerNorm; defer: FP8 only,
  // Gemm::run_fp8's deferred epilogue, set empty for every other product).
  template <class T> void matmul(T* out, const T* in, const void* w, const float* scales, const void* bias,
                                 int64_t num_tokens, int64_t K, int64_t N, GemmAct act, Fp8Rows in_q = {},
                                 Fp8Sums* defer = nullptr);
  template <class T> void plan_products_impl(int64_t rows, bool with_head);

  const GpuStageShape& shape_;
  const ModelConfig& config_;       // shape_.config
  const GpuStageOptions& options_;  // shape_.options
  const int64_t heads_, width_, inner_, max_pages_;  // shape_'s
  const GpuWeights& weights_;
  StepBuffers& buffers_;
  Gemm& gemm_;
  cudaStream_t stream_;

  std::map<int64_t, cudaGraphExec_t> graphs_;        // decode step per bucket
  std::set<std::pair<int64_t, bool>> planned_rows_;  // plan_products' (rows, head) done
};

}  // namespace conveyor::cuda

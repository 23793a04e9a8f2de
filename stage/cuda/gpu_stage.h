// GpuStage: one pipeline stage (a contiguous layer range of a GPT-2-family model) on one
// GPU, in fp16 or bf16: the GPU twin of stage/cpu/cpu_stage.h's CpuStage, call for call
// (embed / forward / logits over the same SeqSlice micro-batches), plus a decode fast path
// that replays the whole step from a CUDA graph.
//
// A GpuStage is the owner of four parts, each a class of its own, made once in create() in
// this order:
//   GpuWeights   (gpu_weights.h)       the weights: layout, upload or synthesis, byte counts;
//   StepBuffers  (gpu_step_buffers.h)  activations (one set, reused by every layer and call),
//                                      workspaces, the head's buffers, the step metadata;
//   KvCache      (kv_cache.h)          the paged K/V cache, from a fraction of what is left;
//   StepRunner   (gpu_step_runner.h)   the kernels of a step over the three: the layers, the
//                                      head, the decode step and its CUDA graphs.
// All are sized from one GpuStageShape (gpu_stage_shape.h: the model, the layer range, the
// options, this rank's shard, the device). GpuStage itself checks each call's arguments,
// fills the step's metadata, reserves K/V pages and keeps the sequences' cached lengths. An
// allocation that fails names the stage, the bytes asked and the bytes free.
//
// Errors: every public call returns Status or Expected (guard.h: a CUDA fault comes back as a
// failed Status naming the stage); nothing here throws.
//
// Weights are kept in the [out, in] ("NK") layout: the decode GEMV reads each row with
// 16-byte loads and the prefill GEMMs are cuBLASLt's TN case. The residual stream `hidden` is
// [tokens, C] of the stage's dtype throughout (the layer's kernels: gpu_step_runner.h).
//
// decode(): every slice is one new token. The step (embedding on the first stage, every
// layer, ln_f + LM head + greedy argmax on the last) is captured once per batch-size bucket
// (1, 2, 4, ..., 128, 192, 256, ... 512; rows past the batch are padding that no kernel
// attends for), on its first use or ahead of it (capture_decode_graph), and replayed; the host
// copies one block of step metadata in and, on the last stage, reads the sampled ids back: the
// only synchronisation of a step. Rows that need more than argmax
// (temperature, penalties) go through GpuSampler after the replay.
//
// Tensor parallel: a GpuStage may be rank r of a stage split over several GPUs (tp_stage.h
// builds and drives them): it then holds its TpShard of every layer (its heads' Q, K, V
// columns and projection rows, its MLP units), its heads' K/V, and the whole residual
// stream; the attention projection and FC2 produce partial sums that `all_reduce` joins
// before their bias and the residual are added. Rank 0 alone holds ln_f and the LM head.
//
// Not thread-safe: one caller at a time (the stage worker's engine thread for this GPU).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/seq_slice.h"
#include "common/status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "model/tp_shard.h"
#include "model/weights.h"
#include "stage/cuda/gpu_stage_options.h"
#include "stage/cuda/gpu_stage_shape.h"
#include "stage/cuda/gpu_step_buffers.h"
#include "stage/cuda/gpu_step_meta.h"
#include "stage/cuda/gpu_step_runner.h"
#include "stage/cuda/gpu_weights.h"
#include "stage/cuda/kv_cache.h"
#include "stage/cuda/tp_all_reduce.h"

namespace conveyor::cuda {

class GpuStage {
 public:
  // On the current device. Fails on bad shapes, bad options, weights of the wrong size, out
  // of memory (the message names the stage, the bytes asked and the bytes free).
  static Expected<std::unique_ptr<GpuStage>> create(const StageWeights& weights, const GpuStageOptions& options);
  // The same stage loaded straight from the checkpoint's bytes (GpuWeights::load: this rank's
  // part, no fp32 host copy), before the step buffers and the K/V cache are sized, so the
  // load's scratch leaves them the memory they would have had. `progress`: this rank's bytes.
  static Expected<std::unique_ptr<GpuStage>> create(const StageCheckpoint& checkpoint, const GpuStageOptions& options,
                                                    const DirectLoadOptions& load = {},
                                                    const LoadProgress& progress = {});
  // Weights drawn on the GPU (synthetic.h): N(0, 0.02) matrices, biases and LN shifts, LN
  // gains 1, deterministic in `seed`. For benchmarks of any shape.
  static Expected<std::unique_ptr<GpuStage>> create_synthetic(const ModelConfig& config, int64_t layer_begin,
                                                              int64_t layer_end, uint64_t seed,
                                                              const GpuStageOptions& options);
  ~GpuStage();
  GpuStage(const GpuStage&) = delete;
  // Activation rows a stage built with `options` holds: the most tokens one call may carry
  // (and so the largest all-reduce of a tensor-parallel stage: rows x n_embd elements).
  static int64_t activation_rows(const GpuStageOptions& options);
  GpuStage& operator=(const GpuStage&) = delete;

  const ModelConfig& config() const { return config_; }
  DType dtype() const { return options_.dtype; }
  bool int8_weights() const { return options_.int8_weights; }
  bool fp8() const { return options_.fp8; }
  bool kv_fp8() const { return options_.kv_fp8; }
  const std::string& name() const { return options_.name; }
  int64_t layer_begin() const { return shape_.layer_begin; }
  int64_t layer_end() const { return shape_.layer_end; }
  bool has_embedding() const { return shape_.has_embedding(); }
  bool has_head() const { return shape_.has_head(); }
  // The LM head is this stage's and this rank holds it (rank 0 of a tensor-parallel stage).
  bool holds_head() const { return shape_.holds_head(); }
  const TpShard& shard() const { return shape_.shard; }
  int64_t hidden_size() const { return config_.n_embd; }
  int64_t max_tokens() const { return options_.max_tokens; }
  int64_t max_seqs() const { return options_.max_seqs; }
  bool cuda_graphs() const { return options_.cuda_graphs; }
  int device() const { return shape_.device; }
  cudaStream_t stream() const { return stream_; }

  // ---- CpuStage twins. The hidden state lives on the device (hidden_device()). ----

  // First stage only: hidden[t] = wte[token_ids[t]] + wpe[position]; ids and positions checked.
  // token_ids is host memory.
  Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids);
  // This stage's layers, in place on hidden [total_tokens, C], appending K/V. Same checks as
  // CpuStage::forward; on error nothing has changed.
  Status forward(std::span<const SeqSlice> slices);
  // Last stage, rank 0 only: ln_f + LM head. out (host) is [total_tokens, V] when all_positions, else
  // [slices.size(), V] (each slice's last token). out may be null when !all_positions: the
  // logits then stay on the device for sample().
  Status logits(std::span<const SeqSlice> slices, bool all_positions, float* out);
  // Chooses a token for each row of the last logits(..., all_positions = false) call; tokens
  // is host memory of rows.size() entries. Mutates those device logits (penalties).
  // logprobs (host, optional): each chosen token's log-prob under the raw logits.
  Status sample(std::span<const SampleRow> rows, int32_t* tokens, float* logprobs = nullptr);

  // Decode fast path: each slice is one token (start_pos = cached length). First stage:
  // token_ids (host, one per slice). Other stages: the input rows are already in
  // hidden_device(). Last stage: sampling (one row per slice) and tokens (host) get the
  // chosen ids, and logprobs (host, optional) their log-probs under the raw logits, as
  // sample() gives; other stages leave the output in hidden_device() and do not synchronise.
  Status decode(std::span<const SeqSlice> slices, const int32_t* token_ids,
                std::span<const SampleRow> sampling, int32_t* tokens, float* logprobs = nullptr);
  // decode()'s checks of its arguments alone, before anything runs (TpStage checks rank 0's,
  // the one with the sampling rows, before any rank starts the step).
  Status check_decode(std::span<const SeqSlice> slices, const int32_t* token_ids, std::span<const SampleRow> sampling,
                      const int32_t* tokens) const;

  // The checks forward() and decode() make of a micro-batch before they change anything:
  // sizes, positions, no sequence twice, and (need_cached_match) each slice continuing its
  // sequence's cached tokens.
  Status check_slices(std::span<const SeqSlice> slices, bool need_cached_match) const;

  // Hidden-state transfers of num_tokens rows, converted on the device from or to `dtype`
  // (F32, F16 or BF16; the stage's own dtype is a plain copy). `src`/`dst` may be host
  // memory (page-locked: a DMA copy) or device memory. Synchronous.
  Status upload_hidden(const void* src, DType dtype, int64_t num_tokens);
  Status download_hidden(void* dst, DType dtype, int64_t num_tokens);
  Status upload_hidden(const float* host, int64_t num_tokens) { return upload_hidden(host, DType::F32, num_tokens); }
  Status download_hidden(float* host, int64_t num_tokens) { return download_hidden(host, DType::F32, num_tokens); }
  void* hidden_device() const { return buffers_->hidden.get(); }  // [max rows, C] of dtype()

  // KvCache::fork for this stage's sequences (the parent's cached length bounds num_tokens).
  Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens);
  void free_sequence(uint64_t seq_id);
  void clear();
  int64_t cached_tokens(uint64_t seq_id) const;  // -1 when absent
  const KvCache& kv_cache() const { return *kv_; }
  int64_t num_sequences() const { return int64_t(lengths_.size()); }

  // Memory figures.
  const GpuWeights& weights() const { return weights_; }
  int64_t weight_bytes() const { return weights_.bytes(); }                // resident weights
  int64_t decode_weight_bytes() const { return weights_.decode_bytes(); }  // read by one decode step
  int64_t kv_bytes() const { return kv_->bytes(); }
  int64_t kv_bytes_per_token() const;
  int64_t kv_capacity_tokens() const { return kv_->num_pages() * kPageTokens; }
  int64_t kv_free_tokens() const { return kv_->free_pages() * kPageTokens; }
  // Rebuilds the K/V cache with `pages` pages (at most as many as now; no sequence may be
  // cached): a tensor-parallel stage gives every rank the smallest rank's capacity.
  Status shrink_kv_cache(int64_t pages);
  std::string memory_report() const;
  Gemm& gemm() { return *gemm_; }
  // The rows a decode step of `seqs` sequences runs: its graph's bucket when graphs are on.
  int64_t decode_rows(int64_t seqs) const;
  // Plans a step's matrix products for `rows` rows, once per rows: the four layer products
  // (and, with_head on the rank holding the head, the LM head) run once on the step's scratch
  // buffers, which hold nothing between calls, and the stream is synchronised. Planning may
  // load cuBLASLt kernels, and a load can wait for every GPU of the process to go idle (so
  // it does under CUDA_MODULE_LOADING=EAGER): a tensor-parallel rank that planned mid-step
  // while a peer's all-reduce waited for it would never return. TpStage plans every rank
  // before a step whose rows are new. Rows outside the buffers plan nothing (the step refuses them).
  Status plan_products(int64_t rows, bool with_head);
  bool products_planned(int64_t rows, bool with_head) const {
    return runner_->products_planned(rows, with_head && holds_head());
  }
  size_t captured_graphs() const { return runner_->captured_graphs(); }
  // Captures the decode graph a step of `seqs` sequences replays (bucket decode_rows(seqs)),
  // unless it is captured already or graphs are off: a step of padding rows only, which reads
  // and writes no sequence's K/V, run eagerly (planning its products) and then captured. Its
  // tokens go nowhere. Like decode(), every rank of a tensor-parallel stage runs it at once.
  Status capture_decode_graph(int64_t seqs);

  Status synchronize();

 private:
  // The checks of shapes and options create() makes before it touches the device
  // (GpuStageShape's, then GpuWeights' FP8 ones).
  static Status validate(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                         const GpuStageOptions& options);
  // After validate(): the shape, the stream and the GEMM; CUDA faults throw (create guards).
  GpuStage(const ModelConfig& config, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& options);

  // After the weights' allocation: the step buffers, the K/V cache from a fraction of the
  // memory left, and the runner over them.
  Status allocate_runtime();
  // What loading the weights borrows from the step buffers (free until the first step).
  WeightLoadScratch load_scratch() const { return {buffers_->staging_f32, buffers_->ln}; }
  StepMetaStaging& meta() { return *buffers_->meta; }
  // K/V pages for every slice's positions; on failure nothing has changed.
  Status reserve(std::span<const SeqSlice> slices);

  GpuStageShape shape_;
  const ModelConfig& config_ = shape_.config;        // shape_'s, for short
  const GpuStageOptions& options_ = shape_.options;  // shape_'s, for short
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Gemm> gemm_;

  GpuWeights weights_;
  std::unique_ptr<StepBuffers> buffers_;
  std::unique_ptr<KvCache> kv_;         // null without layers; shrink_kv_cache replaces it
  std::unique_ptr<StepRunner> runner_;  // over weights_ and *buffers_; kv_ is passed per call

  std::unordered_map<uint64_t, int32_t> lengths_;  // cached tokens per sequence
  int64_t last_logit_rows_ = -1;                   // rows of the last logits(..., false) still on the device
};

}  // namespace conveyor::cuda

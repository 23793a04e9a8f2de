// GpuStage: one pipeline stage (a contiguous layer range of a GPT-2-family model) on one
// GPU, in fp16 or bf16: the GPU twin of model/cpu_stage.h's CpuStage, call for call
// (embed / forward / logits over the same SeqSlice micro-batches), plus a decode fast path
// that replays the whole step from a CUDA graph.
//
// Everything is allocated once, in create(), in this order: weights, one activation buffer
// set (reused by every layer and call), workspaces (GEMM, decode attention, sampler), then
// the K/V cache from a fraction of what is left. An allocation that fails names the stage,
// the bytes asked and the bytes free.
//
// Errors: every public call returns Status or Expected (guard.h: a CUDA fault comes back as a
// failed Status naming the stage); nothing here throws.
//
// The class is defined over several files, one idea each: gpu_stage.cu (creation and the
// per-call entries), gpu_weights.cu (layout, upload, synthetic weights), gpu_buffers.cc
// (activations, workspaces, the K/V cache), gpu_step_meta.cc (step metadata, slice checks,
// page reservation), gpu_forward.cu (the layers), gpu_head.cu (logits and sampling),
// gpu_decode.cu (the decode step and its CUDA graphs).
//
// Weights are kept in the [out, in] ("NK") layout: the decode GEMV reads each row with
// 16-byte loads and the prefill GEMMs are cuBLASLt's TN case. One layer is
//   ln_1 -> QKV (bias fused) -> attention (K/V appended to the paged cache) -> proj ->
//   add-bias-residual + ln_2 (one kernel) -> FC (bias + GeLU fused) -> FC2 ->
//   add-bias-residual + next layer's ln_1 (one kernel)
// so the residual stream `hidden` is [tokens, C] of the stage's dtype throughout.
//
// decode(): every slice is one new token. The step (embedding on the first stage, every
// layer, ln_f + LM head + greedy argmax on the last) is captured once per batch-size bucket
// (1, 2, 4, ..., 128, 192, 256, ... 512; rows past the batch are padding that no kernel attends for) and
// replayed; the host copies one block of step metadata in and, on the last stage, reads
// the sampled ids back: the only synchronisation of a step. Rows that need more than argmax
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
#include "stage/cuda/gpu_step_meta.h"
#include "stage/cuda/gpu_weights.h"
#include "stage/cuda/kv_cache.h"
#include "stage/cuda/tp_all_reduce.h"

namespace conveyor::cuda {

struct GpuStageOptions {
  DType dtype = DType::F16;         // F16 or BF16
  std::string name = "stage";       // names the stage in errors and reports
  int64_t max_tokens = 4096;        // tokens of one forward (prefill chunk): activation rows
  int64_t max_seqs = 128;           // sequences of one micro-batch
  double kv_cache_fraction = 0.90;  // of the device memory free after everything else
  int64_t kv_cache_max_bytes = 0;   // cap on the K/V cache (0: none)
  bool cuda_graphs = true;          // decode() replays graphs (false: runs the same kernels eagerly)
  // Int8 weight-only (quant.h): the four matrices of every layer stored as int8 with one fp32
  // scale per output channel, quantised at load; activations, embeddings and the LM head
  // stay in `dtype`.
  bool int8_weights = false;
  // FP8 (E4M3, fp8.h), compute capability 9.0: the four matrices of every layer stored as E4M3
  // with one fp32 scale per output channel, quantised at load, and their products' activations
  // quantised per row (per token) at every call; cuBLASLt's FP8 products apply both scales,
  // the bias and the GeLU. LayerNorm, attention, K/V, embeddings and the LM head stay in
  // `dtype`. Not with int8_weights.
  bool fp8 = false;
  // Tensor parallel: this stage is rank tp_rank of tp_ranks (1 <= tp_ranks <= n_head, n_inner),
  // and all_reduce (rank tp_rank's GPU must be this stage's) joins the ranks' partial sums.
  int tp_rank = 0, tp_ranks = 1;
  TpAllReduce* all_reduce = nullptr;
  // Tensor parallel: decode steps join their partial sums with the bias, the residual and
  // the next LayerNorm in one kernel (CustomAllReduce::all_reduce_residual_layernorm).
  // Off until it is measured on several GPUs: so far it ran on ranks sharing one GPU only.
  bool fused_all_reduce = false;
  // Deterministic (the default): every product takes the fixed-order tiles (fixed_gemm.h) and
  // prompts the fixed-order attention (attention.h), so a sequence's logits and K/V are the
  // same bits alone or in any batch, chunked any way, and rebuilt after a failover. Off
  // (CONVEYOR_DETERMINISTIC=0 in the worker's environment also turns it off): the fastest
  // kernels of each shape, whose summation order follows the batch.
  bool deterministic = true;
};

class GpuStage {
 public:
  // On the current device. Fails on bad shapes, bad options, weights of the wrong size, out
  // of memory (the message names the stage, the bytes asked and the bytes free).
  static Expected<std::unique_ptr<GpuStage>> create(const StageWeights& weights, const GpuStageOptions& options);
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
  const std::string& name() const { return options_.name; }
  int64_t layer_begin() const { return layer_begin_; }
  int64_t layer_end() const { return layer_end_; }
  bool has_embedding() const { return layer_begin_ == 0; }
  bool has_head() const { return layer_end_ == config_.n_layer; }
  // The LM head is this stage's and this rank holds it (rank 0 of a tensor-parallel stage).
  bool holds_head() const { return has_head() && options_.tp_rank == 0; }
  const TpShard& shard() const { return shard_; }
  int64_t hidden_size() const { return config_.n_embd; }
  int64_t max_tokens() const { return options_.max_tokens; }
  int64_t max_seqs() const { return options_.max_seqs; }
  int device() const { return device_; }
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
  void* hidden_device() const { return hidden_.get(); }  // [max rows, C] of dtype()

  // KvCache::fork for this stage's sequences (the parent's cached length bounds num_tokens).
  Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens);
  void free_sequence(uint64_t seq_id);
  void clear();
  int64_t cached_tokens(uint64_t seq_id) const;  // -1 when absent
  const KvCache& kv_cache() const { return *kv_; }
  int64_t num_sequences() const { return int64_t(lengths_.size()); }

  // Memory figures.
  int64_t weight_bytes() const { return weight_bytes_; }              // resident weights
  int64_t decode_weight_bytes() const { return decode_weight_bytes_; } // read by one decode step
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
    return planned_rows_.count({rows, with_head && holds_head()}) > 0;
  }
  size_t captured_graphs() const { return graphs_.size(); }

  Status synchronize();

 private:
  static constexpr int64_t kMaxGraphRows = 512;  // largest decode bucket

  // The checks of shapes and options create() makes before it touches the device.
  static Status validate(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                         const GpuStageOptions& options);
  // After validate(): the device, its stream and the GEMM; CUDA faults throw (create guards).
  GpuStage(const ModelConfig& config, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& options);

  // ---- gpu_weights.cu ----
  // validate()'s FP8 part: not with int8, every layer matrix of this rank K, N % 16 == 0, a
  // GPU of compute capability 8.9 or newer (the current device).
  static Status validate_fp8(const ModelConfig& config, const GpuStageOptions& options);
  void allocate_weights();
  Status upload(const StageWeights& w);  // fails naming a tensor of the wrong size
  // Rows [n0, n0 + num_rows) of a byte matrix (int8 or FP8, per the options) and their scales
  // from `rows` [num_rows, K] of T.
  template <class T> void quantize_matrix_rows(void* dst, float* scales, int64_t n0, const T* rows, int64_t num_rows,
                                               int64_t K);
  void synthesize(uint64_t seed);

  // ---- gpu_buffers.cc ----
  Status allocate_runtime();  // activations, workspaces, then the K/V cache from what is left
  int decode_splits(int64_t rows) const;

  // ---- gpu_step_meta.cc ----
  int32_t* begin_meta();                     // waits until the staging slot is free, returns it
  void send_meta(const StepMeta& host_view);  // one copy host -> device
  StepMeta device_meta(int64_t tokens, int64_t seqs) const;
  Status reserve(std::span<const SeqSlice> slices);

  // ---- gpu_forward.cu: the kernels of a step, in the stage's dtype ----
  void embed_rows(const StepMeta& m, int64_t num_tokens);
  // The layers over a step's rows. The first decode_seqs sequences have one row each and
  // attend through the decode kernel (which appends their K/V); the rest, chunks of prompts,
  // through the context kernel. fuse_final_ln: the last layer's residual kernel also applies
  // ln_f into ln_ (the decode step's head input).
  Status run_layers(const StepMeta& m, int64_t num_tokens, int64_t num_seqs, int64_t max_q_len, int64_t decode_seqs,
                    bool fuse_final_ln);
  // One decode step of `rows` rows: embedding (first stage), every layer, ln_f + LM head +
  // greedy argmax into tokens_dev_ (rank 0 of the last stage). Capturable.
  Status decode_step(const StepMeta& m, int64_t rows);
  template <class T> void embed_impl(const StepMeta& m, int64_t num_tokens);
  template <class T> Status layers_impl(const StepMeta& m, int64_t num_tokens, int64_t num_seqs, int64_t max_q_len,
                                        int64_t decode_seqs, bool fuse_final_ln);
  template <class T> Status reduce_residual_layernorm(T* hidden, T* ln_out, T* x, const T* bias, const T* gamma,
                                                      const T* beta, int64_t num_tokens);
  // out[T, N] = act(in[T, K] @ w^T + bias) for a layer matrix w [N, K] (scales: int8 or FP8 weights).
  template <class T> void matmul(T* out, const T* in, const void* w, const float* scales, const void* bias,
                                 int64_t num_tokens, int64_t K, int64_t N, GemmAct act);
  template <class T> void plan_products_impl(int64_t rows, bool with_head);

  // ---- gpu_head.cu ----
  // logits [rows, V] (fp32) = in_rows [rows, C] (dtype) @ head^T.
  void lm_head(const void* in_rows, int64_t rows, float* logits);
  // The tokens of the first rows.size() rows of logits_ into host `tokens`, and their
  // log-probs under the raw logits into host `logprobs` (optional): the sampler when `full`,
  // else the argmax (already in tokens_dev_ when `have_argmax`: a decode step leaves it).
  void choose_tokens(std::span<const SampleRow> rows, bool full, bool have_argmax, int32_t* tokens, float* logprobs);

  // ---- gpu_decode.cu ----
  static int64_t bucket_for(int64_t rows);
  // The step from bucket `rows`'s graph (captured on first use), or eagerly.
  Status run_decode_step(const StepMeta& m, int64_t rows, bool graph);

  ModelConfig config_;
  int64_t layer_begin_, layer_end_;
  GpuStageOptions options_;
  TpShard shard_;          // this rank's heads and MLP units (all of them when tp_ranks == 1)
  int64_t heads_ = 0;      // shard_.heads()
  int64_t width_ = 0;      // heads_ x head_dim: this rank's share of the attention width
  int64_t inner_ = 0;      // shard_.inner()
  int device_ = 0;
  int num_sms_ = 0;
  int64_t max_pages_ = 0;   // block-table entries per sequence: ceil(n_positions / kPageTokens)
  int64_t max_rows_ = 0;    // activation rows: max(max_tokens, largest graph bucket)
  int64_t max_step_seqs_ = 0;  // sequence slots in the metadata: max(max_seqs, largest bucket)
  cudaStream_t stream_ = nullptr;

  std::unique_ptr<Gemm> gemm_;
  GpuWeights weights_;
  int64_t weight_bytes_ = 0, decode_weight_bytes_ = 0;

  DeviceBuffer hidden_, ln_, qkv_, attn_, proj_, fc_, head_in_, logits_, staging_f32_, tokens_dev_;
  DeviceBuffer raw_logits_, logprobs_dev_;  // sample(): the logits before the sampler mutates them, the chosen log-probs
  DeviceBuffer meta_dev_, decode_partial_, decode_counters_, dequant_;
  DeviceBuffer fp8_act_;  // FP8: the products' rows quantised (with their scales) and fp32 sums
  PinnedBuffer meta_host_[2], tokens_host_, logprobs_host_;
  cudaEvent_t meta_sent_[2] = {nullptr, nullptr};
  int meta_slot_ = 0;
  int64_t logits_rows_ = 0;       // rows logits_ holds
  int64_t last_logit_rows_ = -1;  // rows of the last logits(..., false) still on the device

  std::unique_ptr<GpuSampler> sampler_;
  std::unique_ptr<KvCache> kv_;
  std::unordered_map<uint64_t, int32_t> lengths_;  // cached tokens per sequence
  std::map<int64_t, cudaGraphExec_t> graphs_;      // decode step per bucket
  std::set<std::pair<int64_t, bool>> planned_rows_;  // plan_products' (rows, head) done
};

}  // namespace conveyor::cuda

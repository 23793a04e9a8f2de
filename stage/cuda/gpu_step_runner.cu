// StepRunner (gpu_step_runner.h): the kernels of a GpuStage's steps, in order. The layers:
// per layer
//   ln_1 -> QKV (bias fused) -> attention (K/V appended to the paged cache) -> proj ->
//   add-bias-residual + ln_2 (one kernel) -> FC (bias + GeLU fused) -> FC2 ->
//   add-bias-residual + next layer's ln_1 (one kernel)
// then the head (ln_f + LM head into fp32 logits, and the choice of tokens from them: greedy
// argmax, or GpuSampler: the CPU's steps and Philox counters, with their log-probs under the
// raw logits), the decode step and its CUDA graph per batch-size bucket, and the planning of a
// step's products. Activations are [rows, width] of the stage's dtype.
#include "stage/cuda/gpu_step_runner.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/ops.h"
#include "stage/cuda/dtype_dispatch.h"
#include "stage/cuda/tp_all_reduce.h"

namespace conveyor::cuda {
namespace {

// Ends a capture left unfinished (the step failed: a Status, or a CUDA fault unwinding to
// GpuStage::decode()'s guard) and drops what it recorded, so the stream is usable again.
struct UnfinishedCapture {
  cudaStream_t stream;
  ~UnfinishedCapture() {
    if (!stream) return;
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial) cudaGraphDestroy(partial);
  }
};

}  // namespace

StepRunner::StepRunner(const GpuStageShape& shape, const GpuWeights& weights, StepBuffers& buffers, Gemm& gemm,
                       cudaStream_t stream)
    : shape_(shape),
      config_(shape.config),
      options_(shape.options),
      heads_(shape.heads),
      width_(shape.width),
      inner_(shape.inner),
      max_pages_(shape.max_pages),
      weights_(weights),
      buffers_(buffers),
      gemm_(gemm),
      stream_(stream) {}

StepRunner::~StepRunner() {
  for (auto& [rows, exec] : graphs_) cudaGraphExecDestroy(exec);
}

// ---- the layers ----

template <class T>
void StepRunner::embed_impl(const StepMeta& m, int64_t num_tokens) {
  embedding_forward<T>(buffers_.hidden.as<T>(), m.ids, m.pos, num_tokens, weights_.as<T>(StageTensor::Wte),
                       weights_.as<T>(StageTensor::Wpe), config_.n_embd, stream_);
}

void StepRunner::embed_rows(const StepMeta& m, int64_t num_tokens) {
  with_dtype(options_.dtype, [&](auto tag) { embed_impl<decltype(tag)>(m, num_tokens); });
}

template <class T>
Status StepRunner::layers_impl(const StepMeta& m, const KvCache* cache, int64_t num_tokens, int64_t num_seqs,
                               int64_t max_q_len, int64_t decode_seqs, bool fuse_final_ln) {
  using LT = LayerTensor;
  const int64_t C = config_.n_embd, W = width_, I = inner_, H = heads_, D = config_.head_dim();
  const float eps = config_.layer_norm_epsilon;
  const GemmAct act = gemm_act(config_.activation);
  T* hidden = buffers_.hidden.as<T>();
  T* ln = buffers_.ln.as<T>();
  T* qkv = buffers_.qkv.as<T>();
  T* attn = buffers_.attn.as<T>();
  T* proj = buffers_.proj.as<T>();
  T* fc = buffers_.fc.as<T>();
  const T* lnf_g = weights_.as<T>(StageTensor::LnfGain);
  const T* lnf_b = weights_.as<T>(StageTensor::LnfBias);
  const int64_t L = weights_.num_layers();
  if (L == 0) {
    if (fuse_final_ln && shape_.holds_head())
      layernorm_forward<T>(ln, hidden, lnf_g, lnf_b, num_tokens, C, eps, stream_);
    return ok_status();
  }
  DecodeWorkspace ws;
  ws.partial = buffers_.decode_partial.as<float>();
  ws.counters = buffers_.decode_counters.as<int32_t>();
  ws.partial_floats = int64_t(buffers_.decode_partial.bytes() / sizeof(float));
  ws.counter_entries = int64_t(buffers_.decode_counters.bytes() / sizeof(int32_t));
  ws.max_kv_len = config_.n_positions;
  const int splits = decode_seqs > 0 ? decode_splits(decode_seqs) : 1;
  // The prompt chunks: their rows start after the decode sequences' one row each, and their
  // block-table rows after those sequences' rows.
  const int64_t first_chunk_row = decode_seqs;
  const SeqArrays chunks{m.q_begin + decode_seqs, m.q_len + decode_seqs, m.kv_len + decode_seqs,
                         num_seqs - decode_seqs};

  // FP8: each LayerNorm before QKV and FC1 writes its rows quantised, which the product reads,
  // and not as T, which nothing would read; (one rank) the projection's and FC2's epilogues are
  // left to the residual's LayerNorm, which reads their sums (Fp8Sums) instead of a T row the
  // epilogue wrote; and QKV's, in a decode step over FP8 K/V, to the decode attention.
  const Fp8Rows ln_q = buffers_.ln_rows_fp8();
  T* const ln_t = ln_q ? nullptr : ln;  // the LayerNorms' T rows, where a product reads them (FP8: none)
  const bool defer = options_.fp8 && options_.tp_ranks <= 1 && Gemm::fp8_defer_pays(num_tokens);
  for (int64_t l = 0; l < L; ++l) {
    const GpuLayer w = weights_.layer(l);
    if (l == 0)
      layernorm_forward<T>(ln_t, hidden, w.as<T>(LT::Ln1Gain), w.as<T>(LT::Ln1Bias), num_tokens, C, eps, stream_, ln_q);
    const KvLayerView kv = cache->layer(l, m.tables, int32_t(max_pages_));
    // FP8 weights and K/V, QKV's epilogue deferred: the decode rows' attention reads the sums
    // itself, and the prompt chunks' rows take theirs from an epilogue over their rows alone,
    // which (head_dim 16-128) also puts their K and V in the cache, in place of the append.
    // The same functions on the same sums, so the same bits.
    const bool fp8_sums = options_.fp8 && Gemm::fp8_defer_pays(num_tokens) && attention_decode_reads_sums(kv, D);
    const bool fuse_append = fp8_sums && chunks.num_seqs > 0 && fp8_scale_epilogue_kv_supported(kv, D);
    const bool defer_qkv = fp8_sums && (decode_seqs > 0 || fuse_append);
    Fp8Sums qkv_sums;
    matmul<T>(qkv, ln_t, w.at(LT::QkvWeight), w.scales(LT::QkvWeight), w.at(LT::QkvBias), num_tokens, C, 3 * W,
              GemmAct::None, ln_q, defer_qkv ? &qkv_sums : nullptr);
    if (defer_qkv && chunks.num_seqs > 0) {
      const int64_t N = 3 * W, r0 = first_chunk_row;
      const T* bias = static_cast<const T*>(qkv_sums.bias);
      if (fuse_append)
        fp8_scale_epilogue_kv<T>(qkv + r0 * N, qkv_sums.sums + r0 * N, fp8_sum_exponent(C), qkv_sums.row_scales + r0,
                                 qkv_sums.col_scales, bias, num_tokens - r0, H, D, kv, m.token_row + r0, m.pos + r0,
                                 stream_);
      else
        fp8_scale_epilogue<T>(qkv + r0 * N, qkv_sums.sums + r0 * N, fp8_sum_exponent(C), qkv_sums.row_scales + r0,
                              qkv_sums.col_scales, bias, num_tokens - r0, N, int(GemmAct::None), stream_);
    }
    if (decode_seqs > 0)
      attention_decode_paged<T>(attn, qkv, kv, m.kv_len, decode_seqs, H, D, splits, ws, stream_, qkv_sums);
    if (chunks.num_seqs > 0) {
      if (!fuse_append)
        kv_cache_append<T>(kv, qkv + first_chunk_row * 3 * W, 3 * W, m.token_row + first_chunk_row,
                           m.pos + first_chunk_row, num_tokens - first_chunk_row, H, D, stream_);
      KvLayerView chunk_kv = kv;
      chunk_kv.block_tables += decode_seqs * max_pages_;
      if (options_.deterministic)
        attention_context_fixed_paged<T>(attn, qkv, chunk_kv, chunks, max_q_len, H, D, stream_);
      else
        attention_context_paged<T>(attn, qkv, chunk_kv, chunks, max_q_len, H, D, stream_);
    }
    Fp8Sums sums;
    matmul<T>(proj, attn, w.at(LT::ProjWeight), w.scales(LT::ProjWeight), nullptr, num_tokens, W, C, GemmAct::None, {},
              defer ? &sums : nullptr);
    if (Status s = reduce_residual_layernorm<T>(hidden, ln_t, proj, w.as<T>(LT::ProjBias), w.as<T>(LT::Ln2Gain),
                                                w.as<T>(LT::Ln2Bias), num_tokens, ln_q, sums);
        !s)
      return s;
    if (options_.fp8 && Gemm::fp8_mlp_pays(num_tokens, I)) {  // FC1's rows go to FC2 quantised, never as T
      gemm_.run_fp8_mlp<T>(proj, ln_t, static_cast<const uint8_t*>(w.at(LT::FcWeight)), w.scales(LT::FcWeight),
                           static_cast<const T*>(w.at(LT::FcBias)), act,
                           static_cast<const uint8_t*>(w.at(LT::Fc2Weight)), w.scales(LT::Fc2Weight), num_tokens, C,
                           I, C, stream_, ln_q, defer ? &sums : nullptr);
    } else {
      matmul<T>(fc, ln_t, w.at(LT::FcWeight), w.scales(LT::FcWeight), w.at(LT::FcBias), num_tokens, C, I, act, ln_q);
      matmul<T>(proj, fc, w.at(LT::Fc2Weight), w.scales(LT::Fc2Weight), nullptr, num_tokens, I, C, GemmAct::None, {},
                defer ? &sums : nullptr);
    }
    // The next LayerNorm fused into this residual: the next layer's ln_1, or ln_f after the last.
    const T* g = nullptr;
    const T* b = nullptr;
    if (l + 1 < L) g = weights_.layer(l + 1).as<T>(LT::Ln1Gain), b = weights_.layer(l + 1).as<T>(LT::Ln1Bias);
    else if (fuse_final_ln && shape_.holds_head()) g = lnf_g, b = lnf_b;
    // (After the last layer, ln_f's rows are T, for the head, and not quantised.)
    T* const next_ln = g == nullptr ? nullptr : l + 1 < L ? ln_t : ln;
    if (Status s = reduce_residual_layernorm<T>(hidden, next_ln, proj, w.as<T>(LT::Fc2Bias), g, b, num_tokens,
                                                l + 1 < L ? ln_q : Fp8Rows{}, sums);
        !s)
      return s;
  }
  return ok_status();
}

Status StepRunner::run_layers(const StepMeta& m, const KvCache* kv, int64_t num_tokens, int64_t num_seqs,
                              int64_t max_q_len, int64_t decode_seqs, bool fuse_final_ln) {
  Status s;
  with_dtype(options_.dtype, [&](auto tag) {
    s = layers_impl<decltype(tag)>(m, kv, num_tokens, num_seqs, max_q_len, decode_seqs, fuse_final_ln);
  });
  return s;
}

template <class T>
void StepRunner::matmul(T* out, const T* in, const void* w, const float* scales, const void* bias, int64_t num_tokens,
                        int64_t K, int64_t N, GemmAct act, Fp8Rows in_q, Fp8Sums* defer) {
  const T* b = static_cast<const T*>(bias);
  if (defer) *defer = {};
  if (options_.int8_weights)
    gemm_.run_int8<T, T>(out, in, static_cast<const int8_t*>(w), scales, b, num_tokens, K, N, act, stream_);
  else if (options_.fp8)
    gemm_.run_fp8<T>(out, in, static_cast<const uint8_t*>(w), scales, b, num_tokens, K, N, act, stream_, in_q, defer);
  else
    gemm_.run<T, T>(out, in, static_cast<const T*>(w), b, num_tokens, K, N, WeightLayout::NK, act, stream_);
}

// hidden = hidden + x + bias (x: this rank's partial sums of a row-split projection,
// [num_tokens, C], joined over the ranks first; or, one rank, x_sums: the FP8 product's
// deferred epilogue standing for x), then ln_out = LayerNorm(hidden) with gamma, beta (ln_out
// null: none). Tensor parallel: the all-reduce, then the LayerNorm kernel. A failed all-reduce
// comes back naming the stage; nothing after it is launched.
template <class T>
Status StepRunner::reduce_residual_layernorm(T* hidden, T* ln_out, T* x, const T* bias, const T* gamma, const T* beta,
                                             int64_t num_tokens, Fp8Rows ln_q, Fp8Sums x_sums) {
  const int64_t C = config_.n_embd;
  const float eps = config_.layer_norm_epsilon;
  TpAllReduce* ar = options_.tp_ranks > 1 ? options_.all_reduce : nullptr;
  if (ar && x_sums) return Status::error(options_.name + ": FP8 sums cannot be all-reduced before their epilogue");
  Status s;
  if (ar) s = ar->all_reduce(options_.tp_rank, x, size_t(num_tokens * C), stream_);
  if (s)
    add_bias_residual_layernorm<T>(hidden, ln_out, x, bias, gamma, beta, num_tokens, C, eps, stream_, ln_q, x_sums);
  if (!s) return Status::error(options_.name + ": " + s.message());
  return ok_status();
}

// ---- the head ----

// The product over the head's padded rows (gpu_weights.h, head_rows) into raw_logits, then
// its first V columns into `logits` [rows, V]: one strided copy.
void StepRunner::lm_head(const void* in_rows, int64_t rows, float* logits) {
  const int64_t V = config_.vocab_size, Vp = head_rows(V);
  float* padded = buffers_.raw_logits.as<float>();
  with_dtype(options_.dtype, [&](auto tag) {
    using T = decltype(tag);
    gemm_.run<T, float>(padded, static_cast<const T*>(in_rows), weights_.as<T>(StageTensor::LmHead), nullptr, rows,
                         config_.n_embd, Vp, WeightLayout::NK, GemmAct::None, stream_);
  });
  CUDA_CHECK(cudaMemcpy2DAsync(logits, size_t(V) * sizeof(float), padded, size_t(Vp) * sizeof(float),
                               size_t(V) * sizeof(float), size_t(rows), cudaMemcpyDeviceToDevice, stream_));
}

void StepRunner::all_logits(int64_t num_tokens, float* out) {
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const float eps = config_.layer_norm_epsilon;
  with_dtype(options_.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    T_* head_in = buffers_.head_in.as<T_>();
    const T_* g = weights_.as<T_>(StageTensor::LnfGain);
    const T_* b = weights_.as<T_>(StageTensor::LnfBias);
    float* logits = buffers_.logits.as<float>();
    const int64_t T = num_tokens, rows = buffers_.logits_rows;
    for (int64_t r0 = 0; r0 < T; r0 += rows) {  // in chunks of the logits buffer's rows, each to the host
      const int64_t n = std::min(rows, T - r0);
      layernorm_forward<T_>(head_in, buffers_.hidden.as<T_>() + r0 * C, g, b, n, C, eps, stream_);
      lm_head(head_in, n, logits);
      CUDA_CHECK(cudaMemcpyAsync(out + r0 * V, logits, size_t(n * V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  });
}

void StepRunner::last_logits(const StepMeta& m, int64_t num_seqs, float* out) {
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const float eps = config_.layer_norm_epsilon;
  const int64_t S = num_seqs;
  with_dtype(options_.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    T_* head_in = buffers_.head_in.as<T_>();
    const T_* g = weights_.as<T_>(StageTensor::LnfGain);
    const T_* b = weights_.as<T_>(StageTensor::LnfBias);
    float* logits = buffers_.logits.as<float>();
    gather_rows<T_>(head_in, buffers_.hidden.as<T_>(), m.last_row, S, C, stream_);
    layernorm_forward<T_>(head_in, head_in, g, b, S, C, eps, stream_);
    lm_head(head_in, S, logits);
    if (out) {
      CUDA_CHECK(cudaMemcpyAsync(out, logits, size_t(S * V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  });
}

void StepRunner::choose_tokens(std::span<const SampleRow> rows, bool full, bool have_argmax, int32_t* tokens,
                               float* logprobs) {
  const int64_t n = int64_t(rows.size());
  const int64_t V = config_.vocab_size;
  // The sampler mutates its rows (penalties, temperature): log-probs come from a copy.
  const float* raw = buffers_.logits.as<float>();
  if (full && logprobs) {
    CUDA_CHECK(cudaMemcpyAsync(buffers_.raw_logits.get(), buffers_.logits.get(), size_t(n * V) * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream_));
    raw = buffers_.raw_logits.as<float>();
  }
  if (full) buffers_.sampler->sample(buffers_.logits.as<float>(), rows, buffers_.tokens_dev.as<int32_t>(), stream_);
  else if (!have_argmax)
    buffers_.sampler->argmax(buffers_.tokens_dev.as<int32_t>(), buffers_.logits.as<float>(), n, stream_);
  CUDA_CHECK(cudaMemcpyAsync(buffers_.tokens_host.get(), buffers_.tokens_dev.get(), size_t(n) * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream_));
  if (logprobs) {
    token_logprob(buffers_.logprobs_dev.as<float>(), raw, buffers_.tokens_dev.as<int32_t>(), n, V, stream_);
    CUDA_CHECK(cudaMemcpyAsync(buffers_.logprobs_host.get(), buffers_.logprobs_dev.get(), size_t(n) * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(tokens, buffers_.tokens_host.get(), size_t(n) * sizeof(int32_t));
  if (logprobs) std::memcpy(logprobs, buffers_.logprobs_host.get(), size_t(n) * sizeof(float));
}

// ---- decode ----

int64_t StepRunner::decode_rows(int64_t seqs) const {
  return options_.cuda_graphs && seqs <= kMaxGraphRows ? decode_bucket(seqs) : seqs;
}

int StepRunner::decode_splits(int64_t rows) const {
  return decode_splits_for(rows, heads_, config_.n_positions, shape_.num_sms);
}

Status StepRunner::decode_step(const StepMeta& m, const KvCache* kv, int64_t rows) {
  if (shape_.has_embedding()) embed_rows(m, rows);
  if (Status s = run_layers(m, kv, rows, rows, 1, /*decode_seqs=*/rows, /*fuse_final_ln=*/shape_.has_head()); !s)
    return s;
  if (shape_.holds_head()) {
    lm_head(buffers_.ln.get(), rows, buffers_.logits.as<float>());
    buffers_.sampler->argmax(buffers_.tokens_dev.as<int32_t>(), buffers_.logits.as<float>(), rows, stream_);
  }
  return ok_status();
}

Status StepRunner::run_decode_step(const StepMeta& m, const KvCache* kv, int64_t rows, bool graph) {
  if (!graph) return decode_step(m, kv, rows);
  if (auto it = graphs_.find(rows); it != graphs_.end()) {
    CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
    return ok_status();
  }
  // First use of this bucket: run the step eagerly (which also plans every GEMM shape outside
  // capture), then capture the same step and keep its executable graph.
  if (Status s = decode_step(m, kv, rows); !s) return s;
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  UnfinishedCapture unfinished{stream_};
  if (Status s = decode_step(m, kv, rows); !s) return s;
  unfinished.stream = nullptr;
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  CUDA_CHECK(e);
  graphs_[rows] = exec;
  return ok_status();
}

// ---- planning ----

// The products of layers_impl on the buffers it uses (layer 0's weights: every layer has the
// same shapes), then the decode step's LM head.
template <class T>
void StepRunner::plan_products_impl(int64_t rows, bool with_head) {
  using LT = LayerTensor;
  const int64_t C = config_.n_embd, W = width_, I = inner_;
  if (weights_.num_layers() > 0) {
    const GpuLayer w = weights_.layer(0);
    matmul<T>(buffers_.qkv.as<T>(), buffers_.ln.as<T>(), w.at(LT::QkvWeight), w.scales(LT::QkvWeight),
              w.at(LT::QkvBias), rows, C, 3 * W, GemmAct::None);
    matmul<T>(buffers_.proj.as<T>(), buffers_.attn.as<T>(), w.at(LT::ProjWeight), w.scales(LT::ProjWeight), nullptr,
              rows, W, C, GemmAct::None);
    matmul<T>(buffers_.fc.as<T>(), buffers_.ln.as<T>(), w.at(LT::FcWeight), w.scales(LT::FcWeight), w.at(LT::FcBias),
              rows, C, I, gemm_act(config_.activation));
    matmul<T>(buffers_.proj.as<T>(), buffers_.fc.as<T>(), w.at(LT::Fc2Weight), w.scales(LT::Fc2Weight), nullptr, rows,
              I, C, GemmAct::None);
  }
  if (with_head) lm_head(buffers_.ln.get(), rows, buffers_.logits.as<float>());
}

void StepRunner::plan_products(int64_t rows, bool with_head) {
  with_dtype(options_.dtype, [&](auto tag) { plan_products_impl<decltype(tag)>(rows, with_head); });
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  planned_rows_.insert({rows, with_head});
}

}  // namespace conveyor::cuda

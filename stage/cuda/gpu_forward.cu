// The kernels of a GpuStage step, in order: the embedding, then per layer
//   ln_1 -> QKV (bias fused) -> attention (K/V appended to the paged cache) -> proj ->
//   add-bias-residual + ln_2 (one kernel) -> FC (bias + GeLU fused) -> FC2 ->
//   add-bias-residual + next layer's ln_1 (one kernel)
// and the decode step that a CUDA graph captures. Weights are read through the weight table
// (layer.at(LayerTensor::...)); activations are [rows, width] of the stage's dtype.
#include <algorithm>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/ops.h"
#include "stage/cuda/dtype_dispatch.h"
#include "stage/cuda/gpu_stage.h"
#include "stage/cuda/guard.h"

namespace conveyor::cuda {

template <class T>
void GpuStage::embed_impl(const StepMeta& m, int64_t num_tokens) {
  embedding_forward<T>(hidden_.as<T>(), m.ids, m.pos, num_tokens, weights_.as<T>(StageTensor::Wte),
                       weights_.as<T>(StageTensor::Wpe), config_.n_embd, stream_);
}

void GpuStage::embed_rows(const StepMeta& m, int64_t num_tokens) {
  with_dtype(options_.dtype, [&](auto tag) { embed_impl<decltype(tag)>(m, num_tokens); });
}

template <class T>
Status GpuStage::layers_impl(const StepMeta& m, int64_t num_tokens, int64_t num_seqs, int64_t max_q_len,
                             int64_t decode_seqs, bool fuse_final_ln) {
  using LT = LayerTensor;
  const int64_t C = config_.n_embd, W = width_, I = inner_, H = heads_, D = config_.head_dim();
  const float eps = config_.layer_norm_epsilon;
  const GemmAct act = gemm_act(config_.activation);
  T* hidden = hidden_.as<T>();
  T* ln = ln_.as<T>();
  T* qkv = qkv_.as<T>();
  T* attn = attn_.as<T>();
  T* proj = proj_.as<T>();
  T* fc = fc_.as<T>();
  const T* lnf_g = weights_.as<T>(StageTensor::LnfGain);
  const T* lnf_b = weights_.as<T>(StageTensor::LnfBias);
  const int64_t L = weights_.num_layers();
  if (L == 0) {
    if (fuse_final_ln && holds_head()) layernorm_forward<T>(ln, hidden, lnf_g, lnf_b, num_tokens, C, eps, stream_);
    return ok_status();
  }
  DecodeWorkspace ws;
  ws.partial = decode_partial_.as<float>();
  ws.counters = decode_counters_.as<int32_t>();
  ws.partial_floats = int64_t(decode_partial_.bytes() / sizeof(float));
  ws.counter_entries = int64_t(decode_counters_.bytes() / sizeof(int32_t));
  ws.max_kv_len = config_.n_positions;
  const int splits = decode_seqs > 0 ? decode_splits(decode_seqs) : 1;
  // The prompt chunks: their rows start after the decode sequences' one row each, and their
  // block-table rows after those sequences' rows.
  const int64_t first_chunk_row = decode_seqs;
  const SeqArrays chunks{m.q_begin + decode_seqs, m.q_len + decode_seqs, m.kv_len + decode_seqs, num_seqs - decode_seqs};

  for (int64_t l = 0; l < L; ++l) {
    const GpuLayer w = weights_.layer(l);
    if (l == 0) layernorm_forward<T>(ln, hidden, w.as<T>(LT::Ln1Gain), w.as<T>(LT::Ln1Bias), num_tokens, C, eps, stream_);
    matmul<T>(qkv, ln, w.at(LT::QkvWeight), w.scales(LT::QkvWeight), w.at(LT::QkvBias), num_tokens, C, 3 * W,
              GemmAct::None);
    const KvLayerView kv = kv_->layer(l, m.tables, int32_t(max_pages_));
    if (decode_seqs > 0) attention_decode_paged<T>(attn, qkv, kv, m.kv_len, decode_seqs, H, D, splits, ws, stream_);
    if (chunks.num_seqs > 0) {
      kv_cache_append<T>(kv, qkv + first_chunk_row * 3 * W, 3 * W, m.token_row + first_chunk_row,
                         m.pos + first_chunk_row, num_tokens - first_chunk_row, H, D, stream_);
      KvLayerView chunk_kv = kv;
      chunk_kv.block_tables += decode_seqs * max_pages_;
      if (options_.deterministic)
        attention_context_fixed_paged<T>(attn, qkv, chunk_kv, chunks, max_q_len, H, D, stream_);
      else
        attention_context_paged<T>(attn, qkv, chunk_kv, chunks, max_q_len, H, D, stream_);
    }
    matmul<T>(proj, attn, w.at(LT::ProjWeight), w.scales(LT::ProjWeight), nullptr, num_tokens, W, C, GemmAct::None);
    if (Status s = reduce_residual_layernorm<T>(hidden, ln, proj, w.as<T>(LT::ProjBias), w.as<T>(LT::Ln2Gain),
                                                w.as<T>(LT::Ln2Bias), num_tokens);
        !s)
      return s;
    matmul<T>(fc, ln, w.at(LT::FcWeight), w.scales(LT::FcWeight), w.at(LT::FcBias), num_tokens, C, I, act);
    matmul<T>(proj, fc, w.at(LT::Fc2Weight), w.scales(LT::Fc2Weight), nullptr, num_tokens, I, C, GemmAct::None);
    // The next LayerNorm fused into this residual: the next layer's ln_1, or ln_f after the last.
    const T* g = nullptr;
    const T* b = nullptr;
    if (l + 1 < L) g = weights_.layer(l + 1).as<T>(LT::Ln1Gain), b = weights_.layer(l + 1).as<T>(LT::Ln1Bias);
    else if (fuse_final_ln && holds_head()) g = lnf_g, b = lnf_b;
    if (Status s = reduce_residual_layernorm<T>(hidden, g ? ln : nullptr, proj, w.as<T>(LT::Fc2Bias), g, b, num_tokens);
        !s)
      return s;
  }
  return ok_status();
}

Status GpuStage::run_layers(const StepMeta& m, int64_t num_tokens, int64_t num_seqs, int64_t max_q_len,
                            int64_t decode_seqs, bool fuse_final_ln) {
  Status s;
  with_dtype(options_.dtype, [&](auto tag) {
    s = layers_impl<decltype(tag)>(m, num_tokens, num_seqs, max_q_len, decode_seqs, fuse_final_ln);
  });
  return s;
}

template <class T>
void GpuStage::matmul(T* out, const T* in, const void* w, const float* scales, const void* bias, int64_t num_tokens,
                      int64_t K, int64_t N, GemmAct act) {
  const T* b = static_cast<const T*>(bias);
  if (options_.int8_weights)
    gemm_->run_int8<T, T>(out, in, static_cast<const int8_t*>(w), scales, b, num_tokens, K, N, act, stream_);
  else if (options_.fp8)
    gemm_->run_fp8<T>(out, in, static_cast<const uint8_t*>(w), scales, b, num_tokens, K, N, act, stream_);
  else
    gemm_->run<T, T>(out, in, static_cast<const T*>(w), b, num_tokens, K, N, WeightLayout::NK, act, stream_);
}

// The products of layers_impl on the buffers it uses (layer 0's weights: every layer has the
// same shapes), then the decode step's LM head.
template <class T>
void GpuStage::plan_products_impl(int64_t rows, bool with_head) {
  using LT = LayerTensor;
  const int64_t C = config_.n_embd, W = width_, I = inner_;
  if (weights_.num_layers() > 0) {
    const GpuLayer w = weights_.layer(0);
    matmul<T>(qkv_.as<T>(), ln_.as<T>(), w.at(LT::QkvWeight), w.scales(LT::QkvWeight), w.at(LT::QkvBias), rows, C,
              3 * W, GemmAct::None);
    matmul<T>(proj_.as<T>(), attn_.as<T>(), w.at(LT::ProjWeight), w.scales(LT::ProjWeight), nullptr, rows, W, C,
              GemmAct::None);
    matmul<T>(fc_.as<T>(), ln_.as<T>(), w.at(LT::FcWeight), w.scales(LT::FcWeight), w.at(LT::FcBias), rows, C, I,
              gemm_act(config_.activation));
    matmul<T>(proj_.as<T>(), fc_.as<T>(), w.at(LT::Fc2Weight), w.scales(LT::Fc2Weight), nullptr, rows, I, C,
              GemmAct::None);
  }
  if (with_head) lm_head(ln_.get(), rows, logits_.as<float>());
}

Status GpuStage::plan_products(int64_t rows, bool with_head) {
  return guard(options_.name, [&]() -> Status {
    with_head = with_head && holds_head();
    if (rows <= 0 || rows > max_rows_ || (with_head && rows > logits_rows_) || products_planned(rows, with_head))
      return ok_status();
    DeviceGuard on(device_);
    with_dtype(options_.dtype, [&](auto tag) { plan_products_impl<decltype(tag)>(rows, with_head); });
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    planned_rows_.insert({rows, with_head});
    last_logit_rows_ = -1;  // the head's run left scratch in logits_
    return ok_status();
  });
}

// hidden = hidden + x + bias (x: this rank's partial sums of a row-split projection,
// [num_tokens, C], joined over the ranks first), then ln_out = LayerNorm(hidden) with gamma,
// beta (ln_out null: none). Tensor parallel: one fused kernel when the rows fit its buffers
// (the decode steps), else the all-reduce and then the LayerNorm kernel. A failed all-reduce
// comes back naming the stage; nothing after it is launched.
template <class T>
Status GpuStage::reduce_residual_layernorm(T* hidden, T* ln_out, T* x, const T* bias, const T* gamma, const T* beta,
                                           int64_t num_tokens) {
  const int64_t C = config_.n_embd;
  const float eps = config_.layer_norm_epsilon;
  TpAllReduce* ar = options_.tp_ranks > 1 ? options_.all_reduce : nullptr;
  Status s;
  if (ar && num_tokens * C <= ar->fused_max_elems()) {
    s = ar->all_reduce_residual_layernorm(options_.tp_rank, x, hidden, bias, ln_out ? gamma : nullptr,
                                          ln_out ? beta : nullptr, ln_out, num_tokens, C, eps, stream_);
  } else {
    if (ar) s = ar->all_reduce(options_.tp_rank, x, size_t(num_tokens * C), stream_);
    if (s) add_bias_residual_layernorm<T>(hidden, ln_out, x, bias, gamma, beta, num_tokens, C, eps, stream_);
  }
  if (!s) return Status::error(options_.name + ": " + s.message());
  return ok_status();
}

Status GpuStage::decode_step(const StepMeta& m, int64_t rows) {
  if (has_embedding()) embed_rows(m, rows);
  if (Status s = run_layers(m, rows, rows, 1, /*decode_seqs=*/rows, /*fuse_final_ln=*/has_head()); !s) return s;
  if (holds_head()) {
    lm_head(ln_.get(), rows, logits_.as<float>());
    sampler_->argmax(tokens_dev_.as<int32_t>(), logits_.as<float>(), rows, stream_);
  }
  return ok_status();
}

}  // namespace conveyor::cuda

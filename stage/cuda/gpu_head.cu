// The last stage's head (rank 0 of a tensor-parallel stage): ln_f + the LM head into fp32
// logits, and the choice of tokens from them (greedy argmax, or GpuSampler: the CPU's steps
// and Philox counters) with their log-probs under the raw logits.
#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cuda/ops.h"
#include "stage/cuda/dtype_dispatch.h"
#include "stage/cuda/gpu_stage.h"
#include "stage/cuda/guard.h"

namespace conveyor::cuda {

void GpuStage::lm_head(const void* in_rows, int64_t rows, float* logits) {
  with_dtype(options_.dtype, [&](auto tag) {
    using T = decltype(tag);
    gemm_->run<T, float>(logits, static_cast<const T*>(in_rows), weights_.as<T>(StageTensor::LmHead), nullptr, rows,
                         config_.n_embd, config_.vocab_size, WeightLayout::NK, GemmAct::None, stream_);
  });
}

Status GpuStage::logits(std::span<const SeqSlice> slices, bool all_positions, float* out) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (!holds_head())
      return Status::error(options_.name + ": logits called on a stage without the LM head (layers " +
                           std::to_string(layer_begin_) + ".." + std::to_string(layer_end_) + ")");
    if (all_positions && out == nullptr) return Status::error(options_.name + ": logits over all positions need `out`");
    int64_t T = 0;
    for (const SeqSlice& s : slices) {
      if (s.num_tokens <= 0)
        return Status::error(seq_name(s.seq_id) + ": slice has " + std::to_string(s.num_tokens) + " tokens");
      T += s.num_tokens;
    }
    const int64_t S = int64_t(slices.size());
    if (T > max_rows_ || S > max_step_seqs_)
      return Status::error(options_.name + ": micro-batch larger than the stage's buffers");
    const int64_t C = config_.n_embd, V = config_.vocab_size;
    const float eps = config_.layer_norm_epsilon;
    with_dtype(options_.dtype, [&](auto tag) {
      using T_ = decltype(tag);
      T_* head_in = head_in_.as<T_>();
      const T_* g = weights_.as<T_>(StageTensor::LnfGain);
      const T_* b = weights_.as<T_>(StageTensor::LnfBias);
      float* logits = logits_.as<float>();
      if (all_positions) {  // in chunks of the logits buffer's rows, each to the host
        for (int64_t r0 = 0; r0 < T; r0 += logits_rows_) {
          const int64_t n = std::min(logits_rows_, T - r0);
          layernorm_forward<T_>(head_in, hidden_.as<T_>() + r0 * C, g, b, n, C, eps, stream_);
          lm_head(head_in, n, logits);
          CUDA_CHECK(cudaMemcpyAsync(out + r0 * V, logits, size_t(n * V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
          CUDA_CHECK(cudaStreamSynchronize(stream_));
        }
        last_logit_rows_ = -1;
        return;
      }
      int32_t* host = begin_meta();
      const StepMeta h = step_meta_layout(host, T, S, max_pages_);
      int64_t row = -1;
      for (int64_t i = 0; i < S; ++i) h.last_row[i] = int32_t(row += slices[size_t(i)].num_tokens);
      send_meta(h);
      const StepMeta m = device_meta(T, S);
      gather_rows<T_>(head_in, hidden_.as<T_>(), m.last_row, S, C, stream_);
      layernorm_forward<T_>(head_in, head_in, g, b, S, C, eps, stream_);
      lm_head(head_in, S, logits);
      if (out) {
        CUDA_CHECK(cudaMemcpyAsync(out, logits, size_t(S * V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
      }
      last_logit_rows_ = S;
    });
    return ok_status();
  });
}

Status GpuStage::sample(std::span<const SampleRow> rows, int32_t* tokens, float* logprobs) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (!holds_head()) return Status::error(options_.name + ": sample called on a stage without the LM head");
    if (int64_t(rows.size()) != last_logit_rows_)
      return Status::error(options_.name + ": sample needs the logits of the last logits(..., all_positions=false) call (" +
                           std::to_string(rows.size()) + " rows asked, " +
                           std::to_string(std::max<int64_t>(last_logit_rows_, 0)) + " held)");
    bool full = false;
    for (const SampleRow& r : rows) {
      if (r.params == nullptr) return Status::error(options_.name + ": a sample row has no parameters");
      full = full || GpuSampler::needs_sampler(*r.params, r.generated.size());
    }
    choose_tokens(rows, full, false, tokens, logprobs);
    return ok_status();
  });
}

void GpuStage::choose_tokens(std::span<const SampleRow> rows, bool full, bool have_argmax, int32_t* tokens,
                             float* logprobs) {
  const int64_t n = int64_t(rows.size());
  const int64_t V = config_.vocab_size;
  // The sampler mutates its rows (penalties, temperature): log-probs come from a copy.
  const float* raw = logits_.as<float>();
  if (full && logprobs) {
    CUDA_CHECK(cudaMemcpyAsync(raw_logits_.get(), logits_.get(), size_t(n * V) * sizeof(float), cudaMemcpyDeviceToDevice,
                               stream_));
    raw = raw_logits_.as<float>();
  }
  if (full) sampler_->sample(logits_.as<float>(), rows, tokens_dev_.as<int32_t>(), stream_);
  else if (!have_argmax) sampler_->argmax(tokens_dev_.as<int32_t>(), logits_.as<float>(), n, stream_);
  CUDA_CHECK(cudaMemcpyAsync(tokens_host_.get(), tokens_dev_.get(), size_t(n) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                             stream_));
  if (logprobs) {
    token_logprob(logprobs_dev_.as<float>(), raw, tokens_dev_.as<int32_t>(), n, V, stream_);
    CUDA_CHECK(cudaMemcpyAsync(logprobs_host_.get(), logprobs_dev_.get(), size_t(n) * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(tokens, tokens_host_.get(), size_t(n) * sizeof(int32_t));
  if (logprobs) std::memcpy(logprobs, logprobs_host_.get(), size_t(n) * sizeof(float));
  last_logit_rows_ = -1;
}

}  // namespace conveyor::cuda

// Everything of a GpuStage besides its weights, allocated once at creation (the one place
// that sizes them): the activation rows every layer and call reuses, the workspaces (GEMM
// dequantisation, decode attention, the sampler, the step metadata), and last the K/V cache
// from a fraction of the memory still free. Also the stage's memory figures.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "kernels/cuda/attention.h"
#include "stage/cuda/gpu_stage.h"
#include "stage/cuda/guard.h"

namespace conveyor::cuda {
namespace {

std::string gib(int64_t bytes) {
  std::ostringstream os;
  os.precision(3);
  os << double(bytes) / double(int64_t(1) << 30) << " GiB";
  return os.str();
}

}  // namespace

int64_t GpuStage::activation_rows(const GpuStageOptions& o) {
  const int64_t largest_bucket = o.max_seqs <= kMaxGraphRows ? bucket_for(o.max_seqs) : 0;
  return std::max({o.max_tokens, o.max_seqs, largest_bucket});
}

Status GpuStage::allocate_runtime() {
  const std::string& n = options_.name;
  const int64_t C = config_.n_embd, W = width_, I = inner_, V = config_.vocab_size, H = heads_;
  const int64_t D = config_.head_dim();
  const size_t e = dtype_bytes(options_.dtype);
  const size_t R = size_t(max_rows_);
  hidden_ = device_alloc(R * C * e, n, "activations (hidden)");
  ln_ = device_alloc(R * C * e, n, "activations (layernorm)");
  qkv_ = device_alloc(R * 3 * W * e, n, "activations (qkv)");
  attn_ = device_alloc(R * W * e, n, "activations (attention)");
  proj_ = device_alloc(R * C * e, n, "activations (projection)");
  fc_ = device_alloc(R * I * e, n, "activations (mlp)");
  staging_f32_ = device_alloc(R * C * sizeof(float), n, "fp32 staging");
  if (options_.int8_weights && layer_end_ > layer_begin_) {  // the largest layer matrix, for prefill GEMMs
    dequant_ = device_alloc(size_t(std::max({3 * W * C, C * W, I * C})) * e, n, "int8 dequantisation workspace");
    gemm_->set_dequant_workspace(dequant_.get(), dequant_.bytes());
  }
  if (options_.fp8 && layer_end_ > layer_begin_) {  // every row of the largest product: E4M3 input + fp32 sums
    fp8_act_ = device_alloc(std::max({Gemm::fp8_workspace_bytes(max_rows_, C, 3 * W),
                                      Gemm::fp8_workspace_bytes(max_rows_, W, C),
                                      Gemm::fp8_workspace_bytes(max_rows_, C, I),
                                      Gemm::fp8_workspace_bytes(max_rows_, I, C)}),
                            n, "FP8 workspace");
    gemm_->set_fp8_workspace(fp8_act_.get(), fp8_act_.bytes());
    if (Status s = gemm_->fp8_supported(); !s) return Status::error(n + ": " + s.message());
  }
  for (DeviceBuffer* b : {&hidden_, &ln_, &qkv_, &attn_, &proj_, &fc_})
    CUDA_CHECK(cudaMemsetAsync(b->get(), 0, b->bytes(), stream_));
  if (holds_head()) {
    logits_rows_ = max_step_seqs_;
    head_in_ = device_alloc(size_t(logits_rows_ * C) * e, n, "LM head input");
    logits_ = device_alloc(size_t(logits_rows_ * V) * sizeof(float), n, "logits");
    tokens_dev_ = device_alloc(size_t(max_step_seqs_) * sizeof(int32_t), n, "sampled tokens");
    tokens_host_ = PinnedBuffer(size_t(max_step_seqs_) * sizeof(int32_t), n + " sampled tokens");
    raw_logits_ = device_alloc(size_t(logits_rows_ * V) * sizeof(float), n, "raw logits");
    logprobs_dev_ = device_alloc(size_t(max_step_seqs_) * sizeof(float), n, "sampled log-probs");
    logprobs_host_ = PinnedBuffer(size_t(max_step_seqs_) * sizeof(float), n + " sampled log-probs");
    sampler_ = std::make_unique<GpuSampler>(n, max_step_seqs_, V);
  }
  const int64_t meta_ints = step_meta_capacity(max_rows_, max_step_seqs_, max_pages_);
  meta_dev_ = device_alloc(size_t(meta_ints) * sizeof(int32_t), n, "step metadata");
  for (int i = 0; i < 2; ++i) {
    meta_host_[i] = PinnedBuffer(size_t(meta_ints) * sizeof(int32_t), n + " step metadata");
    std::memset(meta_host_[i].get(), 0, meta_host_[i].bytes());
    CUDA_CHECK(cudaEventCreateWithFlags(&meta_sent_[i], cudaEventDisableTiming));
  }
  // Decode attention workspace: every piece of every row, up to the context length.
  const int64_t partial = decode_partial_floats(max_step_seqs_, H, D, config_.n_positions);
  decode_partial_ = device_alloc(size_t(std::max<int64_t>(partial, 1)) * sizeof(float), n, "decode attention workspace");
  decode_counters_ = device_alloc(size_t(max_step_seqs_ * H) * sizeof(int32_t), n, "decode attention counters");
  CUDA_CHECK(cudaMemsetAsync(decode_counters_.get(), 0, decode_counters_.bytes(), stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));

  // The K/V cache takes its fraction of what is left.
  const int64_t L = layer_end_ - layer_begin_;
  if (L == 0) return ok_status();
  const auto [free_bytes, total_bytes] = device_memory_info();
  const int64_t page = KvCache::page_bytes(L, H, D, options_.dtype);
  int64_t budget = int64_t(double(free_bytes) * options_.kv_cache_fraction);
  if (options_.kv_cache_max_bytes > 0) budget = std::min(budget, options_.kv_cache_max_bytes);
  const int64_t pages = budget / page;
  if (pages < 1)
    return Status::error(n + ": no room for the K/V cache: one page (" + std::to_string(kPageTokens) + " positions) is " +
                         std::to_string(page) + " bytes, " + std::to_string(budget) + " bytes allowed, " +
                         std::to_string(free_bytes) + " bytes free of " + std::to_string(total_bytes));
  auto kv = KvCache::create(n, L, H, D, options_.dtype, pages);
  if (!kv) return kv.status();
  kv_ = std::move(kv).value();
  return ok_status();
}

int GpuStage::decode_splits(int64_t rows) const {
  return decode_splits_for(rows, heads_, config_.n_positions, num_sms_);
}

int64_t GpuStage::kv_bytes_per_token() const {
  return (layer_end_ - layer_begin_) * 2 * width_ * int64_t(dtype_bytes(options_.dtype));
}

Status GpuStage::shrink_kv_cache(int64_t pages) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (!kv_ || pages == kv_->num_pages()) return ok_status();
    if (pages < 1 || pages > kv_->num_pages() || kv_->num_sequences() > 0)
      return Status::error(options_.name + ": cannot shrink a K/V cache of " + std::to_string(kv_->num_pages()) +
                           " pages to " + std::to_string(pages));
    kv_.reset();
    auto kv = KvCache::create(options_.name, layer_end_ - layer_begin_, heads_, config_.head_dim(), options_.dtype, pages);
    if (!kv) return kv.status();
    kv_ = std::move(kv).value();
    return ok_status();
  });
}

std::string GpuStage::memory_report() const {
  std::ostringstream os;
  const int64_t act = int64_t(hidden_.bytes() + ln_.bytes() + qkv_.bytes() + attn_.bytes() + proj_.bytes() + fc_.bytes() +
                              head_in_.bytes() + logits_.bytes() + raw_logits_.bytes() + staging_f32_.bytes());
  const int64_t ws = int64_t(Gemm::kWorkspaceBytes + decode_partial_.bytes() + decode_counters_.bytes() + meta_dev_.bytes() +
                             dequant_.bytes() + fp8_act_.bytes()) +
                     (sampler_ ? sampler_->device_bytes() : 0);
  os << options_.name << " on device " << device_;
  if (options_.tp_ranks > 1) os << " (tensor-parallel rank " << options_.tp_rank << " of " << options_.tp_ranks << ")";
  const char* quantised = options_.int8_weights ? " (int8 weights)" : options_.fp8 ? " (fp8 weights and activations)" : "";
  os << ": layers [" << layer_begin_ << ", " << layer_end_ << ") " << dtype_name(options_.dtype)
     << quantised << "; weights " << gib(weight_bytes_) << " (a decode step reads "
     << gib(decode_weight_bytes_) << "), activations " << gib(act) << " for " << max_rows_ << " rows, workspaces "
     << gib(ws) << ", K/V cache " << gib(kv_ ? kv_->bytes() : 0) << " = " << (kv_ ? kv_capacity_tokens() : 0)
     << " positions";
  return os.str();
}

}  // namespace conveyor::cuda

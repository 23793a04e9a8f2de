// GpuStage (gpu_stage.h): creation (options checked, then weights, buffers and the K/V cache
// allocated and filled), and the per-call entries other than the head's and decode's: embed,
// forward, the hidden-state transfers and the sequence bookkeeping. Every public entry runs
// through guard() once (guard.h).
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda/ops.h"
#include "stage/cuda/dtype_dispatch.h"
#include "stage/cuda/guard.h"

#include "stage/cuda/gpu_stage.h"

namespace conveyor::cuda {

Status GpuStage::validate(const ModelConfig& c, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& o) {
  const std::string& n = o.name;
  if (c.n_embd <= 0 || c.n_head <= 0 || c.n_embd % c.n_head != 0 || c.n_inner <= 0 || c.vocab_size <= 0 ||
      c.n_positions <= 0)
    return Status::error(n + ": invalid model shape");
  if (layer_begin < 0 || layer_end > c.n_layer || layer_begin > layer_end)
    return Status::error(n + ": layer range [" + std::to_string(layer_begin) + ", " + std::to_string(layer_end) +
                         ") outside a " + std::to_string(c.n_layer) + "-layer model");
  if (o.dtype != DType::F16 && o.dtype != DType::BF16)
    return Status::error(n + ": dtype must be F16 or BF16, got " + std::string(dtype_name(o.dtype)));
  if (o.max_tokens <= 0 || o.max_seqs <= 0) return Status::error(n + ": max_tokens and max_seqs must be positive");
  if (!(o.kv_cache_fraction > 0.0 && o.kv_cache_fraction <= 1.0))
    return Status::error(n + ": kv_cache_fraction must be in (0, 1]");
  if (c.n_embd % 8 != 0)
    return Status::error(n + ": n_embd must be a multiple of 8 on the GPU (got " + std::to_string(c.n_embd) + ")");
  const int R = o.tp_ranks;
  if (R < 1 || R > c.n_head || R > c.n_inner || o.tp_rank < 0 || o.tp_rank >= R)
    return Status::error(n + ": tensor-parallel rank " + std::to_string(o.tp_rank) + " of " + std::to_string(R) +
                         " (ranks must be from 1 to the model's " + std::to_string(c.n_head) + " heads)");
  if (R > 1 && (o.all_reduce == nullptr || o.all_reduce->ranks() != R))
    return Status::error(n + ": a tensor-parallel stage needs an all-reduce over its " + std::to_string(R) + " ranks");
  return validate_fp8(c, o);
}

GpuStage::GpuStage(const ModelConfig& config, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& options)
    : config_(config), layer_begin_(layer_begin), layer_end_(layer_end), options_(options) {
  shard_ = TpShard::of(config_, options_.tp_rank, options_.tp_ranks);
  heads_ = shard_.heads();
  width_ = heads_ * config_.head_dim();
  inner_ = shard_.inner();

  CUDA_CHECK(cudaGetDevice(&device_));
  CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<Gemm>();
  // The Gemm starts in the mode the environment asks for (CONVEYOR_DETERMINISTIC=0: off).
  options_.deterministic = options_.deterministic && gemm_->deterministic();
  gemm_->set_deterministic(options_.deterministic);

  const int64_t largest_bucket = options_.max_seqs <= kMaxGraphRows ? bucket_for(options_.max_seqs) : 0;
  max_pages_ = (config_.n_positions + kPageTokens - 1) / kPageTokens;
  max_rows_ = activation_rows(options_);
  max_step_seqs_ = std::max(options_.max_seqs, largest_bucket);
}

GpuStage::~GpuStage() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (auto& [rows, exec] : graphs_) cudaGraphExecDestroy(exec);
  for (cudaEvent_t e : meta_sent_)
    if (e) cudaEventDestroy(e);
  sampler_.reset();
  gemm_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

// Creation's faults come back unprefixed: device_alloc's name the stage already.
Expected<std::unique_ptr<GpuStage>> GpuStage::create(const StageWeights& weights, const GpuStageOptions& options) {
  return guard("", [&]() -> Expected<std::unique_ptr<GpuStage>> {
    if (Status s = validate(weights.config, weights.layer_begin, weights.layer_end, options); !s) return s;
    std::unique_ptr<GpuStage> s(new GpuStage(weights.config, weights.layer_begin, weights.layer_end, options));
    if (int64_t(weights.layers.size()) != weights.layer_end - weights.layer_begin)
      return Status::error(options.name + ": weights hold " + std::to_string(weights.layers.size()) +
                           " layers for range [" + std::to_string(weights.layer_begin) + ", " +
                           std::to_string(weights.layer_end) + ")");
    s->allocate_weights();
    if (Status st = s->allocate_runtime(); !st) return st;
    if (Status st = s->upload(weights); !st) return st;
    return std::move(s);  // nvcc: no implicit move into Expected
  });
}

Expected<std::unique_ptr<GpuStage>> GpuStage::create_synthetic(const ModelConfig& config, int64_t layer_begin,
                                                               int64_t layer_end, uint64_t seed,
                                                               const GpuStageOptions& options) {
  return guard("", [&]() -> Expected<std::unique_ptr<GpuStage>> {
    if (Status s = validate(config, layer_begin, layer_end, options); !s) return s;
    std::unique_ptr<GpuStage> s(new GpuStage(config, layer_begin, layer_end, options));
    s->allocate_weights();
    if (Status st = s->allocate_runtime(); !st) return st;
    s->synthesize(seed);
    return std::move(s);  // nvcc: no implicit move into Expected
  });
}

Status GpuStage::embed(std::span<const SeqSlice> slices, const int32_t* token_ids) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (!has_embedding())
      return Status::error(options_.name + ": embed called on a stage without the embedding (layers " +
                           std::to_string(layer_begin_) + ".." + std::to_string(layer_end_) + ")");
    if (Status s = check_slices(slices, false); !s) return s;
    int64_t T = 0;
    for (const SeqSlice& s : slices) {
      for (int32_t i = 0; i < s.num_tokens; ++i, ++T)
        if (token_ids[T] < 0 || token_ids[T] >= config_.vocab_size)
          return Status::error(seq_name(s.seq_id) + ": token id " + std::to_string(token_ids[T]) +
                               " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
    }
    const int64_t S = int64_t(slices.size());
    int32_t* host = begin_meta();
    const StepMeta h = step_meta_layout(host, T, S, max_pages_);
    fill_seq_meta(h, slices, S, kv_.get(), max_pages_);
    std::memcpy(h.ids, token_ids, size_t(T) * sizeof(int32_t));
    send_meta(h);
    embed_rows(device_meta(T, S), T);
    last_logit_rows_ = -1;
    return ok_status();
  });
}

Status GpuStage::forward(std::span<const SeqSlice> slices) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (Status s = check_slices(slices, true); !s) return s;
    if (Status s = reserve(slices); !s) return s;
    const int64_t S = int64_t(slices.size());
    int64_t T = 0, max_q = 0;
    for (const SeqSlice& s : slices) T += s.num_tokens, max_q = std::max<int64_t>(max_q, s.num_tokens);
    int32_t* host = begin_meta();
    const StepMeta h = step_meta_layout(host, T, S, max_pages_);
    fill_seq_meta(h, slices, S, kv_.get(), max_pages_);
    send_meta(h);
    // Sequences decoding one token (the coordinator puts them first) take the decode kernel.
    int64_t decode_seqs = 0;
    while (decode_seqs < S && slices[size_t(decode_seqs)].num_tokens == 1) ++decode_seqs;
    if (Status s = run_layers(device_meta(T, S), T, S, max_q, decode_seqs, /*fuse_final_ln=*/false); !s) return s;
    for (const SeqSlice& s : slices) lengths_[s.seq_id] = s.start_pos + s.num_tokens;
    last_logit_rows_ = -1;
    return ok_status();
  });
}

Status GpuStage::upload_hidden(const void* src, DType dtype, int64_t num_tokens) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (num_tokens < 0 || num_tokens > max_rows_) return Status::error(options_.name + ": upload_hidden of too many rows");
    const int64_t n = num_tokens * config_.n_embd;
    const size_t bytes = size_t(n) * dtype_bytes(dtype);
    if (dtype == options_.dtype) {
      CUDA_CHECK(cudaMemcpyAsync(hidden_.get(), src, bytes, cudaMemcpyDefault, stream_));
    } else {  // through the fp32 staging rows, which hold n elements of any activation dtype
      if (dtype != DType::F32 && dtype != (options_.dtype == DType::F16 ? DType::BF16 : DType::F16))
        return Status::error(options_.name + ": activations of " + std::string(dtype_name(dtype)) +
                             " cannot be uploaded");
      CUDA_CHECK(cudaMemcpyAsync(staging_f32_.get(), src, bytes, cudaMemcpyDefault, stream_));
      with_dtype(options_.dtype, [&](auto tag) {
        using T = decltype(tag);
        using Other = std::conditional_t<std::is_same_v<T, half>, bf16, half>;  // the other half type
        if (dtype == DType::F32) convert_from_float<T>(hidden_.as<T>(), staging_f32_.as<float>(), n, stream_);
        else convert<T, Other>(hidden_.as<T>(), staging_f32_.as<Other>(), n, stream_);
      });
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    last_logit_rows_ = -1;
    return ok_status();
  });
}

Status GpuStage::download_hidden(void* dst, DType dtype, int64_t num_tokens) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (num_tokens < 0 || num_tokens > max_rows_)
      return Status::error(options_.name + ": download_hidden of too many rows");
    if (dtype != DType::F32 && dtype != options_.dtype)
      return Status::error(options_.name + ": activations download as F32 or the stage's " +
                           std::string(dtype_name(options_.dtype)) + ", not " + std::string(dtype_name(dtype)));
    const int64_t n = num_tokens * config_.n_embd;
    const void* from = hidden_.get();
    if (dtype == DType::F32) {
      with_dtype(options_.dtype, [&](auto tag) {
        convert_to_float<decltype(tag)>(staging_f32_.as<float>(), hidden_.as<decltype(tag)>(), n, stream_);
      });
      from = staging_f32_.get();
    }
    CUDA_CHECK(cudaMemcpyAsync(dst, from, size_t(n) * dtype_bytes(dtype), cudaMemcpyDefault, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return ok_status();
  });
}

Status GpuStage::fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    auto it = lengths_.find(parent);
    if (it == lengths_.end())
      return Status::error(options_.name + ": fork: " + seq_name(parent) + " is not cached on this stage");
    if (lengths_.count(child)) return Status::error(options_.name + ": fork: " + seq_name(child) + " exists already");
    if (!kv_) return Status::error(options_.name + ": fork: this stage has no K/V cache");
    if (Status s = kv_->fork(parent, child, it->second, num_tokens, stream_); !s)
      return Status::error(options_.name + ": " + s.message());
    lengths_[child] = int32_t(num_tokens);
    return ok_status();
  });
}

void GpuStage::free_sequence(uint64_t seq_id) {
  if (kv_) kv_->release(seq_id);
  lengths_.erase(seq_id);
}

void GpuStage::clear() {
  if (kv_) kv_->clear();
  lengths_.clear();
}

int64_t GpuStage::cached_tokens(uint64_t seq_id) const {
  auto it = lengths_.find(seq_id);
  return it == lengths_.end() ? -1 : it->second;
}

Status GpuStage::synchronize() {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return ok_status();
  });
}

}  // namespace conveyor::cuda

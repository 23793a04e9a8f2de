// GpuStage (gpu_stage.h): creation (options checked, then the weights, the step buffers and
// the K/V cache allocated and the weights filled), and every public entry: the checks a call's
// arguments pass before anything changes, the step metadata, the K/V pages and the sequences'
// lengths, around the runner's kernels. Every public entry runs through guard() once (guard.h).
#include "stage/cuda/gpu_stage.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kernels/cuda/ops.h"
#include "stage/cuda/dtype_dispatch.h"
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

Status GpuStage::validate(const ModelConfig& c, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& o) {
  if (Status s = GpuStageShape::validate(c, layer_begin, layer_end, o); !s) return s;
  return GpuWeights::validate_fp8(c, o);
}

GpuStage::GpuStage(const ModelConfig& config, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& options)
    : shape_(GpuStageShape::of(config, layer_begin, layer_end, options)) {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<Gemm>(options_.gemm);
  // Deterministic only when the Gemm's options are too (CONVEYOR_DETERMINISTIC=0: off).
  shape_.options.deterministic = shape_.options.deterministic && gemm_->deterministic();
  gemm_->set_deterministic(options_.deterministic);
}

GpuStage::~GpuStage() {
  if (stream_) cudaStreamSynchronize(stream_);
  runner_.reset();   // the decode graphs
  buffers_.reset();  // the step metadata's events, the sampler
  gemm_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

int64_t GpuStage::activation_rows(const GpuStageOptions& options) { return GpuStageShape::activation_rows(options); }

// Creation's faults come back unprefixed: device_alloc's name the stage already.
Expected<std::unique_ptr<GpuStage>> GpuStage::create(const StageWeights& weights, const GpuStageOptions& options) {
  return guard("", [&]() -> Expected<std::unique_ptr<GpuStage>> {
    if (Status s = validate(weights.config, weights.layer_begin, weights.layer_end, options); !s) return s;
    std::unique_ptr<GpuStage> s(new GpuStage(weights.config, weights.layer_begin, weights.layer_end, options));
    if (int64_t(weights.layers.size()) != weights.layer_end - weights.layer_begin)
      return Status::error(options.name + ": weights hold " + std::to_string(weights.layers.size()) +
                           " layers for range [" + std::to_string(weights.layer_begin) + ", " +
                           std::to_string(weights.layer_end) + ")");
    s->weights_ = GpuWeights::allocate(s->shape_);
    if (Status st = s->allocate_runtime(); !st) return st;
    if (Status st = s->weights_.upload(weights, s->shape_, s->load_scratch(), s->stream_); !st) return st;
    return std::move(s);  // nvcc: no implicit move into Expected
  });
}

Expected<std::unique_ptr<GpuStage>> GpuStage::create(const StageCheckpoint& checkpoint, const GpuStageOptions& options,
                                                     const DirectLoadOptions& load, const LoadProgress& progress) {
  return guard("", [&]() -> Expected<std::unique_ptr<GpuStage>> {
    const ModelConfig& c = checkpoint.config;
    if (Status s = validate(c, checkpoint.layer_begin, checkpoint.layer_end, options); !s) return s;
    std::unique_ptr<GpuStage> s(new GpuStage(c, checkpoint.layer_begin, checkpoint.layer_end, options));
    s->weights_ = GpuWeights::allocate(s->shape_);
    if (Status st = s->weights_.load(checkpoint, s->shape_, load, s->stream_, progress); !st) return st;
    if (Status st = s->allocate_runtime(); !st) return st;
    return std::move(s);  // nvcc: no implicit move into Expected
  });
}

Expected<std::unique_ptr<GpuStage>> GpuStage::create_synthetic(const ModelConfig& config, int64_t layer_begin,
                                                               int64_t layer_end, uint64_t seed,
                                                               const GpuStageOptions& options) {
  return guard("", [&]() -> Expected<std::unique_ptr<GpuStage>> {
    if (Status s = validate(config, layer_begin, layer_end, options); !s) return s;
    std::unique_ptr<GpuStage> s(new GpuStage(config, layer_begin, layer_end, options));
    s->weights_ = GpuWeights::allocate(s->shape_);
    if (Status st = s->allocate_runtime(); !st) return st;
    s->weights_.synthesize(seed, s->shape_, s->load_scratch(), s->stream_);
    return std::move(s);  // nvcc: no implicit move into Expected
  });
}

Status GpuStage::allocate_runtime() {
  const std::string& n = options_.name;
  auto buffers = StepBuffers::create(shape_, *gemm_, stream_);
  if (!buffers) return buffers.status();
  buffers_ = std::move(buffers).value();
  runner_ = std::make_unique<StepRunner>(shape_, weights_, *buffers_, *gemm_, stream_);

  // The K/V cache takes its fraction of what is left.
  const int64_t L = shape_.num_layers();
  const int64_t H = shape_.heads, D = config_.head_dim();
  if (L == 0) return ok_status();
  const auto [free_bytes, total_bytes] = device_memory_info();
  const int64_t page = KvCache::page_bytes(L, H, D, options_.dtype, options_.kv_fp8);
  int64_t budget = int64_t(double(free_bytes) * options_.kv_cache_fraction);
  if (options_.kv_cache_max_bytes > 0) budget = std::min(budget, options_.kv_cache_max_bytes);
  const int64_t pages = budget / page;
  if (pages < 1)
    return Status::error(n + ": no room for the K/V cache: one page (" + std::to_string(kPageTokens) + " positions) is " +
                         std::to_string(page) + " bytes, " + std::to_string(budget) + " bytes allowed, " +
                         std::to_string(free_bytes) + " bytes free of " + std::to_string(total_bytes));
  auto kv = KvCache::create(n, L, H, D, options_.dtype, pages, options_.kv_fp8);
  if (!kv) return kv.status();
  kv_ = std::move(kv).value();
  return ok_status();
}

Status GpuStage::embed(std::span<const SeqSlice> slices, const int32_t* token_ids) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (!has_embedding())
      return Status::error(options_.name + ": embed called on a stage without the embedding (layers " +
                           std::to_string(shape_.layer_begin) + ".." + std::to_string(shape_.layer_end) + ")");
    if (Status s = check_slices(slices, false); !s) return s;
    int64_t T = 0;
    for (const SeqSlice& s : slices) {
      for (int32_t i = 0; i < s.num_tokens; ++i, ++T)
        if (token_ids[T] < 0 || token_ids[T] >= config_.vocab_size)
          return Status::error(seq_name(s.seq_id) + ": token id " + std::to_string(token_ids[T]) +
                               " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
    }
    const int64_t S = int64_t(slices.size());
    int32_t* host = meta().begin();
    const StepMeta h = step_meta_layout(host, T, S, shape_.max_pages);
    fill_seq_meta(h, slices, S, kv_.get(), shape_.max_pages);
    std::memcpy(h.ids, token_ids, size_t(T) * sizeof(int32_t));
    meta().send(h, stream_);
    runner_->embed_rows(meta().device(T, S), T);
    last_logit_rows_ = -1;
    return ok_status();
  });
}

Status GpuStage::forward(std::span<const SeqSlice> slices) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (Status s = check_slices(slices, true); !s) return s;
    if (Status s = reserve(slices); !s) return s;
    const int64_t S = int64_t(slices.size());
    int64_t T = 0, max_q = 0;
    for (const SeqSlice& s : slices) T += s.num_tokens, max_q = std::max<int64_t>(max_q, s.num_tokens);
    int32_t* host = meta().begin();
    const StepMeta h = step_meta_layout(host, T, S, shape_.max_pages);
    fill_seq_meta(h, slices, S, kv_.get(), shape_.max_pages);
    meta().send(h, stream_);
    // Sequences decoding one token (the coordinator puts them first) take the decode kernel.
    int64_t decode_seqs = 0;
    while (decode_seqs < S && slices[size_t(decode_seqs)].num_tokens == 1) ++decode_seqs;
    if (Status s = runner_->run_layers(meta().device(T, S), kv_.get(), T, S, max_q, decode_seqs,
                                       /*fuse_final_ln=*/false);
        !s)
      return s;
    for (const SeqSlice& s : slices) lengths_[s.seq_id] = s.start_pos + s.num_tokens;
    last_logit_rows_ = -1;
    return ok_status();
  });
}

Status GpuStage::logits(std::span<const SeqSlice> slices, bool all_positions, float* out) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (!holds_head())
      return Status::error(options_.name + ": logits called on a stage without the LM head (layers " +
                           std::to_string(shape_.layer_begin) + ".." + std::to_string(shape_.layer_end) + ")");
    if (all_positions && out == nullptr) return Status::error(options_.name + ": logits over all positions need `out`");
    int64_t T = 0;
    for (const SeqSlice& s : slices) {
      if (s.num_tokens <= 0)
        return Status::error(seq_name(s.seq_id) + ": slice has " + std::to_string(s.num_tokens) + " tokens");
      T += s.num_tokens;
    }
    const int64_t S = int64_t(slices.size());
    if (T > shape_.max_rows || S > shape_.max_step_seqs)
      return Status::error(options_.name + ": micro-batch larger than the stage's buffers");
    if (all_positions) {
      runner_->all_logits(T, out);
      last_logit_rows_ = -1;
      return ok_status();
    }
    int32_t* host = meta().begin();
    const StepMeta h = step_meta_layout(host, T, S, shape_.max_pages);
    int64_t row = -1;
    for (int64_t i = 0; i < S; ++i) h.last_row[i] = int32_t(row += slices[size_t(i)].num_tokens);
    meta().send(h, stream_);
    runner_->last_logits(meta().device(T, S), S, out);
    last_logit_rows_ = S;
    return ok_status();
  });
}

Status GpuStage::sample(std::span<const SampleRow> rows, int32_t* tokens, float* logprobs) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
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
    runner_->choose_tokens(rows, full, false, tokens, logprobs);
    last_logit_rows_ = -1;  // the sampler changed the logits: a second sample needs new ones
    return ok_status();
  });
}

int64_t GpuStage::decode_rows(int64_t seqs) const {
  return runner_->decode_rows(seqs);
}

Status GpuStage::decode(std::span<const SeqSlice> slices, const int32_t* token_ids, std::span<const SampleRow> sampling,
                        int32_t* tokens, float* logprobs) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (Status s = check_decode(slices, token_ids, sampling, tokens); !s) return s;
    const int64_t S = int64_t(slices.size());
    bool full = false;
    if (holds_head())
      for (const SampleRow& r : sampling) full = full || GpuSampler::needs_sampler(*r.params, r.generated.size());
    if (Status s = reserve(slices); !s) return s;

    const bool graph = options_.cuda_graphs && S <= kMaxGraphRows;
    const int64_t rows = decode_rows(S);
    int32_t* host = meta().begin();
    const StepMeta h = step_meta_layout(host, rows, rows, shape_.max_pages);
    fill_seq_meta(h, slices, rows, kv_.get(), shape_.max_pages);
    if (has_embedding()) std::memcpy(h.ids, token_ids, size_t(S) * sizeof(int32_t));
    meta().send(h, stream_);
    if (Status s = runner_->run_decode_step(meta().device(rows, rows), kv_.get(), rows, graph); !s) return s;
    for (const SeqSlice& s : slices) lengths_[s.seq_id] = s.start_pos + 1;
    last_logit_rows_ = -1;

    if (holds_head()) runner_->choose_tokens(sampling, full, true, tokens, logprobs);  // the step left the argmax
    return ok_status();
  });
}

Status GpuStage::check_decode(std::span<const SeqSlice> slices, const int32_t* token_ids,
                              std::span<const SampleRow> sampling, const int32_t* tokens) const {
  if (Status s = check_slices(slices, true); !s) return s;
  const int64_t S = int64_t(slices.size());
  for (const SeqSlice& s : slices)
    if (s.num_tokens != 1)
      return Status::error(seq_name(s.seq_id) + ": decode takes one token per sequence, got " +
                           std::to_string(s.num_tokens));
  if (has_embedding()) {
    if (token_ids == nullptr) return Status::error(options_.name + ": decode on the first stage needs token ids");
    for (int64_t i = 0; i < S; ++i)
      if (token_ids[i] < 0 || token_ids[i] >= config_.vocab_size)
        return Status::error(seq_name(slices[size_t(i)].seq_id) + ": token id " + std::to_string(token_ids[i]) +
                             " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
  }
  if (holds_head()) {
    if (int64_t(sampling.size()) != S || tokens == nullptr)
      return Status::error(options_.name + ": decode on the last stage needs one sampling row per sequence and `tokens`");
    for (const SampleRow& r : sampling)
      if (r.params == nullptr) return Status::error(options_.name + ": a sample row has no parameters");
  }
  return ok_status();
}

Status GpuStage::capture_decode_graph(int64_t seqs) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (!options_.cuda_graphs || seqs < 1 || seqs > kMaxGraphRows) return ok_status();
    const int64_t rows = decode_rows(seqs);
    if (runner_->has_graph(rows)) return ok_status();
    int32_t* host = meta().begin();
    const StepMeta h = step_meta_layout(host, rows, rows, shape_.max_pages);
    fill_seq_meta(h, {}, rows, kv_.get(), shape_.max_pages);  // every sequence slot padding
    meta().send(h, stream_);
    if (Status s = runner_->run_decode_step(meta().device(rows, rows), kv_.get(), rows, /*graph=*/true); !s) return s;
    last_logit_rows_ = -1;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return ok_status();
  });
}

Status GpuStage::plan_products(int64_t rows, bool with_head) {
  return guard(options_.name, [&]() -> Status {
    with_head = with_head && holds_head();
    if (rows <= 0 || rows > shape_.max_rows || (with_head && rows > buffers_->logits_rows) ||
        products_planned(rows, with_head))
      return ok_status();
    DeviceGuard on(shape_.device);
    runner_->plan_products(rows, with_head);
    last_logit_rows_ = -1;  // the head's run left scratch in the logits
    return ok_status();
  });
}

Status GpuStage::upload_hidden(const void* src, DType dtype, int64_t num_tokens) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (num_tokens < 0 || num_tokens > shape_.max_rows)
      return Status::error(options_.name + ": upload_hidden of too many rows");
    const int64_t n = num_tokens * config_.n_embd;
    const size_t bytes = size_t(n) * dtype_bytes(dtype);
    const DeviceBuffer& hidden = buffers_->hidden;
    const DeviceBuffer& staging = buffers_->staging_f32;
    if (dtype == options_.dtype) {
      CUDA_CHECK(cudaMemcpyAsync(hidden.get(), src, bytes, cudaMemcpyDefault, stream_));
    } else {  // through the fp32 staging rows, which hold n elements of any activation dtype
      if (dtype != DType::F32 && dtype != (options_.dtype == DType::F16 ? DType::BF16 : DType::F16))
        return Status::error(options_.name + ": activations of " + std::string(dtype_name(dtype)) +
                             " cannot be uploaded");
      CUDA_CHECK(cudaMemcpyAsync(staging.get(), src, bytes, cudaMemcpyDefault, stream_));
      with_dtype(options_.dtype, [&](auto tag) {
        using T = decltype(tag);
        using Other = std::conditional_t<std::is_same_v<T, half>, bf16, half>;  // the other half type
        if (dtype == DType::F32) convert_from_float<T>(hidden.as<T>(), staging.as<float>(), n, stream_);
        else convert<T, Other>(hidden.as<T>(), staging.as<Other>(), n, stream_);
      });
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    last_logit_rows_ = -1;
    return ok_status();
  });
}

Status GpuStage::download_hidden(void* dst, DType dtype, int64_t num_tokens) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (num_tokens < 0 || num_tokens > shape_.max_rows)
      return Status::error(options_.name + ": download_hidden of too many rows");
    if (dtype != DType::F32 && dtype != options_.dtype)
      return Status::error(options_.name + ": activations download as F32 or the stage's " +
                           std::string(dtype_name(options_.dtype)) + ", not " + std::string(dtype_name(dtype)));
    const int64_t n = num_tokens * config_.n_embd;
    const DeviceBuffer& hidden = buffers_->hidden;
    const DeviceBuffer& staging = buffers_->staging_f32;
    const void* from = hidden.get();
    if (dtype == DType::F32) {
      with_dtype(options_.dtype, [&](auto tag) {
        convert_to_float<decltype(tag)>(staging.as<float>(), hidden.as<decltype(tag)>(), n, stream_);
      });
      from = staging.get();
    }
    CUDA_CHECK(cudaMemcpyAsync(dst, from, size_t(n) * dtype_bytes(dtype), cudaMemcpyDefault, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return ok_status();
  });
}

Status GpuStage::fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
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
    DeviceGuard on(shape_.device);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return ok_status();
  });
}

Status GpuStage::check_slices(std::span<const SeqSlice> slices, bool need_cached_match) const {
  const int64_t P = config_.n_positions;
  if (slices.empty()) return Status::error(options_.name + ": empty micro-batch");
  if (int64_t(slices.size()) > shape_.max_step_seqs)
    return Status::error(options_.name + ": " + std::to_string(slices.size()) + " sequences in one micro-batch, at most " +
                         std::to_string(shape_.max_step_seqs));
  std::unordered_set<uint64_t> seen;
  int64_t total = 0;
  for (const SeqSlice& s : slices) {
    if (s.num_tokens <= 0)
      return Status::error(seq_name(s.seq_id) + ": slice has " + std::to_string(s.num_tokens) + " tokens");
    if (s.start_pos < 0 || int64_t(s.start_pos) + s.num_tokens > P)
      return Status::error(seq_name(s.seq_id) + ": positions " + std::to_string(s.start_pos) + ".." +
                           std::to_string(int64_t(s.start_pos) + s.num_tokens - 1) + " exceed the model's context of " +
                           std::to_string(P) + " positions");
    if (!seen.insert(s.seq_id).second) return Status::error(seq_name(s.seq_id) + " appears twice in one micro-batch");
    if (need_cached_match) {
      const int64_t cached = cached_tokens(s.seq_id);
      if (s.start_pos != std::max<int64_t>(cached, 0))
        return Status::error(seq_name(s.seq_id) + ": slice starts at position " + std::to_string(s.start_pos) +
                             " but the stage has " + std::to_string(std::max<int64_t>(cached, 0)) + " tokens cached for it");
    }
    total += s.num_tokens;
  }
  if (total > shape_.max_rows)
    return Status::error(options_.name + ": " + std::to_string(total) + " tokens in one micro-batch, at most " +
                         std::to_string(shape_.max_rows));
  return ok_status();
}

// Pages for every slice's positions; on failure the sequences this call added are released,
// so nothing changed for the caller.
Status GpuStage::reserve(std::span<const SeqSlice> slices) {
  if (!kv_) return ok_status();
  std::vector<uint64_t> fresh;
  for (const SeqSlice& s : slices) {
    const bool is_new = !kv_->contains(s.seq_id);
    Status st = kv_->reserve(s.seq_id, int64_t(s.start_pos) + s.num_tokens);
    if (st.ok()) st = kv_->prepare_write(s.seq_id, s.start_pos, stream_);  // copy-on-write
    if (!st.ok()) {
      for (uint64_t id : fresh) kv_->release(id);
      return Status::error(options_.name + ": " + st.message());
    }
    if (is_new) fresh.push_back(s.seq_id);
  }
  return ok_status();
}

int64_t GpuStage::kv_bytes_per_token() const {
  return KvCache::page_bytes(shape_.num_layers(), shape_.heads, config_.head_dim(), options_.dtype, options_.kv_fp8) /
         kPageTokens;
}

Status GpuStage::shrink_kv_cache(int64_t pages) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(shape_.device);
    if (!kv_ || pages == kv_->num_pages()) return ok_status();
    if (pages < 1 || pages > kv_->num_pages() || kv_->num_sequences() > 0)
      return Status::error(options_.name + ": cannot shrink a K/V cache of " + std::to_string(kv_->num_pages()) +
                           " pages to " + std::to_string(pages));
    kv_.reset();
    auto kv = KvCache::create(options_.name, shape_.num_layers(), shape_.heads, config_.head_dim(), options_.dtype,
                              pages, options_.kv_fp8);
    if (!kv) return kv.status();
    kv_ = std::move(kv).value();
    return ok_status();
  });
}

std::string GpuStage::memory_report() const {
  std::ostringstream os;
  const int64_t act = buffers_->activation_bytes();
  const int64_t ws = int64_t(Gemm::kWorkspaceBytes) + buffers_->workspace_bytes();
  os << options_.name << " on device " << shape_.device;
  if (options_.tp_ranks > 1) os << " (tensor-parallel rank " << options_.tp_rank << " of " << options_.tp_ranks << ")";
  const char* quantised = options_.int8_weights ? " (int8 weights)" : options_.fp8 ? " (fp8 weights and activations)" : "";
  os << ": layers [" << shape_.layer_begin << ", " << shape_.layer_end << ") " << dtype_name(options_.dtype)
     << quantised << "; weights " << gib(weight_bytes()) << " (a decode step reads "
     << gib(decode_weight_bytes()) << "), activations " << gib(act) << " for " << shape_.max_rows
     << " rows, workspaces " << gib(ws) << ", K/V cache " << gib(kv_ ? kv_->bytes() : 0) << " = " << (kv_ ? kv_capacity_tokens() : 0)
     << " positions";
  return os.str();
}

}  // namespace conveyor::cuda

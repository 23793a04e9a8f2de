#include "kernels/cuda/gpu_stage.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <unordered_set>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/synthetic.h"

namespace conveyor::cuda {
namespace {

constexpr int64_t kAlign = 256;       // bytes: every weight tensor starts on this boundary
constexpr int64_t kMaxGraphRows = 128;  // largest decode bucket

template <class F>
void with_dtype(DType d, F&& f) {
  if (d == DType::F16) f(half{});
  else f(bf16{});
}

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

std::string gib(int64_t bytes) {
  std::ostringstream os;
  os.precision(3);
  os << double(bytes) / double(int64_t(1) << 30) << " GiB";
  return os.str();
}

std::string seq_name(uint64_t id) { return "sequence " + std::to_string(id); }

}  // namespace

int64_t GpuStage::bucket_for(int64_t rows) {
  int64_t b = 1;
  while (b < rows) b *= 2;
  return b;
}

GpuStage::GpuStage(const ModelConfig& config, int64_t layer_begin, int64_t layer_end, const GpuStageOptions& options)
    : config_(config), layer_begin_(layer_begin), layer_end_(layer_end), options_(options) {
  const std::string& n = options_.name;
  if (config_.n_embd <= 0 || config_.n_head <= 0 || config_.n_embd % config_.n_head != 0 || config_.n_inner <= 0 ||
      config_.vocab_size <= 0 || config_.n_positions <= 0)
    throw Error(n + ": invalid model shape");
  if (layer_begin < 0 || layer_end > config_.n_layer || layer_begin > layer_end)
    throw Error(n + ": layer range [" + std::to_string(layer_begin) + ", " + std::to_string(layer_end) +
                ") outside a " + std::to_string(config_.n_layer) + "-layer model");
  if (options_.dtype != DType::F16 && options_.dtype != DType::BF16)
    throw Error(n + ": dtype must be F16 or BF16, got " + std::string(dtype_name(options_.dtype)));
  if (options_.max_tokens <= 0 || options_.max_seqs <= 0)
    throw Error(n + ": max_tokens and max_seqs must be positive");
  if (!(options_.kv_cache_fraction > 0.0 && options_.kv_cache_fraction <= 1.0))
    throw Error(n + ": kv_cache_fraction must be in (0, 1]");
  if (config_.n_embd % 8 != 0)
    throw Error(n + ": n_embd must be a multiple of 8 on the GPU (got " + std::to_string(config_.n_embd) + ")");
  const int R = options_.tp_ranks;
  if (R < 1 || R > config_.n_head || R > config_.n_inner || options_.tp_rank < 0 || options_.tp_rank >= R)
    throw Error(n + ": tensor-parallel rank " + std::to_string(options_.tp_rank) + " of " + std::to_string(R) +
                " (ranks must be from 1 to the model's " + std::to_string(config_.n_head) + " heads)");
  if (R > 1 && (options_.all_reduce == nullptr || options_.all_reduce->ranks() != R))
    throw Error(n + ": a tensor-parallel stage needs an all-reduce over its " + std::to_string(R) + " ranks");
  shard_ = TpShard::of(config_, options_.tp_rank, R);
  heads_ = shard_.heads();
  width_ = heads_ * config_.head_dim();
  inner_ = shard_.inner();

  CUDA_CHECK(cudaGetDevice(&device_));
  CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<Gemm>();

  const int64_t largest_bucket = options_.max_seqs <= kMaxGraphRows ? bucket_for(options_.max_seqs) : 0;
  max_pages_ = (config_.n_positions + kPageTokens - 1) / kPageTokens;
  max_rows_ = activation_rows(options_);
  max_step_seqs_ = std::max(options_.max_seqs, largest_bucket);
}

int64_t GpuStage::activation_rows(const GpuStageOptions& o) {
  const int64_t largest_bucket = o.max_seqs <= kMaxGraphRows ? bucket_for(o.max_seqs) : 0;
  return std::max({o.max_tokens, o.max_seqs, largest_bucket});
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

std::unique_ptr<GpuStage> GpuStage::create(const StageWeights& weights, const GpuStageOptions& options) {
  std::unique_ptr<GpuStage> s(new GpuStage(weights.config, weights.layer_begin, weights.layer_end, options));
  if (int64_t(weights.layers.size()) != weights.layer_end - weights.layer_begin)
    throw Error(options.name + ": weights hold " + std::to_string(weights.layers.size()) + " layers for range [" +
                std::to_string(weights.layer_begin) + ", " + std::to_string(weights.layer_end) + ")");
  s->allocate_weights();
  s->allocate_runtime();
  s->upload(weights);
  return s;
}

std::unique_ptr<GpuStage> GpuStage::create_synthetic(const ModelConfig& config, int64_t layer_begin, int64_t layer_end,
                                                     uint64_t seed, const GpuStageOptions& options) {
  std::unique_ptr<GpuStage> s(new GpuStage(config, layer_begin, layer_end, options));
  s->allocate_weights();
  s->allocate_runtime();
  s->synthesize(seed);
  return s;
}

// ---- memory ----

void GpuStage::allocate_weights() {
  const int64_t C = config_.n_embd, W = width_, I = inner_, V = config_.vocab_size, P = config_.n_positions;
  const int64_t e = int64_t(dtype_bytes(options_.dtype));
  const int64_t L = layer_end_ - layer_begin_;
  const bool int8 = options_.int8_weights;
  // Offsets first (elements -> bytes, each aligned), then one allocation.
  int64_t bytes = 0;
  auto take = [&](int64_t elems, int64_t elem_bytes) {
    const int64_t off = bytes;
    bytes = align_up(bytes + elems * elem_bytes, kAlign);
    return off;
  };
  struct Offsets {
    int64_t v[12], s[4];
  };
  std::vector<Offsets> lo(static_cast<size_t>(L));
  int64_t layer_bytes = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t before = bytes;
    const int64_t sizes[12] = {C, C, 3 * W * C, 3 * W, C * W, C, C, C, I * C, I, C * I, C};
    const bool matrix[12] = {false, false, true, false, true, false, false, false, true, false, true, false};
    for (int i = 0; i < 12; ++i) lo[size_t(l)].v[i] = take(sizes[i], matrix[i] && int8 ? 1 : e);
    const int64_t rows[4] = {3 * W, C, I, C};  // output channels of qkv, proj, fc, fc2
    for (int i = 0; i < 4 && int8; ++i) lo[size_t(l)].s[i] = take(rows[i], int64_t(sizeof(float)));
    layer_bytes += bytes - before;
  }
  auto take_e = [&](int64_t elems) { return take(elems, e); };
  int64_t wte = -1, wpe = -1, lnf_g = -1, lnf_b = -1, head = -1;
  if (has_embedding()) {
    wte = take_e(V * C);
    wpe = take_e(P * C);
  }
  if (holds_head()) {
    lnf_g = take_e(C);
    lnf_b = take_e(C);
    if (!(has_embedding() && config_.tie_word_embeddings)) head = take_e(V * C);
  }
  weights_buf_ = device_alloc(size_t(bytes), options_.name,
                              "weights (" + std::to_string(L) + " layers, " + std::string(dtype_name(options_.dtype)) +
                                  (int8 ? ", int8 matrices" : "") + ")");
  char* base = weights_buf_.as<char>();
  layers_.resize(size_t(L));
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* o = lo[size_t(l)].v;
    LayerPtrs& p = layers_[size_t(l)];
    p = LayerPtrs{base + o[0], base + o[1], base + o[2], base + o[3], base + o[4],  base + o[5],
                  base + o[6], base + o[7], base + o[8], base + o[9], base + o[10], base + o[11]};
    if (int8) {
      const int64_t* s = lo[size_t(l)].s;
      auto f = [&](int64_t off) { return reinterpret_cast<float*>(base + off); };
      p.qkv_s = f(s[0]), p.proj_s = f(s[1]), p.fc_s = f(s[2]), p.fc2_s = f(s[3]);
    }
  }
  if (wte >= 0) wte_ = base + wte, wpe_ = base + wpe;
  if (lnf_g >= 0) lnf_g_ = base + lnf_g, lnf_b_ = base + lnf_b;
  if (holds_head()) head_ = head >= 0 ? base + head : wte_;
  weight_bytes_ = bytes;
  decode_weight_bytes_ = layer_bytes + (holds_head() ? (V * C + 2 * C) * e : 0);
}

void GpuStage::allocate_runtime() {
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
  const int64_t meta_ints = 3 * max_rows_ + 4 * max_step_seqs_ + max_step_seqs_ * max_pages_;
  meta_dev_ = device_alloc(size_t(meta_ints) * sizeof(int32_t), n, "step metadata");
  for (int i = 0; i < 2; ++i) {
    meta_host_[i] = PinnedBuffer(size_t(meta_ints) * sizeof(int32_t), n + " step metadata");
    std::memset(meta_host_[i].get(), 0, meta_host_[i].bytes());
    CUDA_CHECK(cudaEventCreateWithFlags(&meta_sent_[i], cudaEventDisableTiming));
  }
  // Decode attention workspace: the most any row count up to max_step_seqs_ uses.
  int64_t partial = 0;
  for (int64_t r = 1; r <= max_step_seqs_; ++r) {
    const int sp = decode_splits(r);
    max_splits_ = std::max(max_splits_, sp);
    partial = std::max(partial, decode_partial_floats(r, H, D, sp));
  }
  decode_partial_ = device_alloc(size_t(std::max<int64_t>(partial, 1)) * sizeof(float), n, "decode attention workspace");
  decode_counters_ = device_alloc(size_t(max_step_seqs_ * H) * sizeof(int32_t), n, "decode attention counters");
  CUDA_CHECK(cudaMemsetAsync(decode_counters_.get(), 0, decode_counters_.bytes(), stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));

  // The K/V cache takes its fraction of what is left.
  const int64_t L = layer_end_ - layer_begin_;
  if (L > 0) {
    const auto [free_bytes, total_bytes] = device_memory_info();
    const int64_t page = KvCache::page_bytes(L, H, D, options_.dtype);
    int64_t budget = int64_t(double(free_bytes) * options_.kv_cache_fraction);
    if (options_.kv_cache_max_bytes > 0) budget = std::min(budget, options_.kv_cache_max_bytes);
    const int64_t pages = budget / page;
    if (pages < 1)
      throw Error(n + ": no room for the K/V cache: one page (" + std::to_string(kPageTokens) + " positions) is " +
                  std::to_string(page) + " bytes, " + std::to_string(budget) + " bytes allowed, " +
                  std::to_string(free_bytes) + " bytes free of " + std::to_string(total_bytes));
    kv_ = std::make_unique<KvCache>(n, L, H, D, options_.dtype, pages);
  }
}

int GpuStage::decode_splits(int64_t rows) const {
  return decode_splits_for(rows, heads_, config_.n_positions, num_sms_);
}

int64_t GpuStage::kv_bytes_per_token() const {
  return (layer_end_ - layer_begin_) * 2 * width_ * int64_t(dtype_bytes(options_.dtype));
}

void GpuStage::shrink_kv_cache(int64_t pages) {
  DeviceGuard guard(device_);
  if (!kv_ || pages == kv_->num_pages()) return;
  if (pages < 1 || pages > kv_->num_pages() || kv_->num_sequences() > 0)
    throw Error(options_.name + ": cannot shrink a K/V cache of " + std::to_string(kv_->num_pages()) + " pages to " +
                std::to_string(pages));
  kv_.reset();
  kv_ = std::make_unique<KvCache>(options_.name, layer_end_ - layer_begin_, heads_, config_.head_dim(), options_.dtype,
                                  pages);
}

std::string GpuStage::memory_report() const {
  std::ostringstream os;
  const int64_t act = int64_t(hidden_.bytes() + ln_.bytes() + qkv_.bytes() + attn_.bytes() + proj_.bytes() + fc_.bytes() +
                              head_in_.bytes() + logits_.bytes() + raw_logits_.bytes() + staging_f32_.bytes());
  const int64_t ws = int64_t(Gemm::kWorkspaceBytes + decode_partial_.bytes() + decode_counters_.bytes() + meta_dev_.bytes() +
                             dequant_.bytes()) +
                     (sampler_ ? sampler_->device_bytes() : 0);
  os << options_.name << " on device " << device_;
  if (options_.tp_ranks > 1) os << " (tensor-parallel rank " << options_.tp_rank << " of " << options_.tp_ranks << ")";
  os << ": layers [" << layer_begin_ << ", " << layer_end_ << ") "
     << dtype_name(options_.dtype) << (options_.int8_weights ? " (int8 weights)" : "") << "; weights " << gib(weight_bytes_) << " (a decode step reads "
     << gib(decode_weight_bytes_) << "), activations " << gib(act) << " for " << max_rows_ << " rows, workspaces "
     << gib(ws) << ", K/V cache " << gib(kv_ ? kv_->bytes() : 0) << " = " << (kv_ ? kv_capacity_tokens() : 0)
     << " positions";
  return os.str();
}

// ---- weights ----

void GpuStage::upload(const StageWeights& w) {
  DeviceGuard guard(device_);
  const int64_t C = config_.n_embd, W = width_, I = inner_, V = config_.vocab_size, P = config_.n_positions;
  const int64_t staging_elems = int64_t(staging_f32_.bytes() / sizeof(float));
  float* staging = staging_f32_.as<float>();
  auto check = [&](const std::vector<float>& v, int64_t expected, const std::string& name) {
    if (int64_t(v.size()) != expected)
      throw Error(options_.name + ": weight " + name + " has " + std::to_string(v.size()) + " floats, expected " +
                  std::to_string(expected));
  };
  with_dtype(options_.dtype, [&](auto tag) {
    using T = decltype(tag);
    // Same layout, converted in chunks through the fp32 staging buffer.
    auto put = [&](void* dst, const std::vector<float>& src, int64_t elems, const std::string& name) {
      check(src, elems, name);
      for (int64_t i = 0; i < elems; i += staging_elems) {
        const int64_t n = std::min(staging_elems, elems - i);
        CUDA_CHECK(cudaMemcpyAsync(staging, src.data() + i, size_t(n) * sizeof(float), cudaMemcpyHostToDevice, stream_));
        convert_from_float<T>(static_cast<T*>(dst) + i, staging, n, stream_);
      }
    };
    // A layer matrix, [K, N] on the host -> [N, K] on the device. In dtype: chunks of K rows.
    // Int8: chunks of output channels (host columns) through the staging buffer, transposed
    // to dtype in the LayerNorm activation buffer (free while loading), then quantised.
    auto put_t = [&](void* dst, float* scales, const std::vector<float>& src, int64_t K, int64_t N,
                     const std::string& name) {
      check(src, K * N, name);
      if (!options_.int8_weights) {
        const int64_t rows = std::max<int64_t>(1, staging_elems / N);
        for (int64_t k0 = 0; k0 < K; k0 += rows) {
          const int64_t kc = std::min(rows, K - k0);
          CUDA_CHECK(cudaMemcpyAsync(staging, src.data() + k0 * N, size_t(kc * N) * sizeof(float),
                                     cudaMemcpyHostToDevice, stream_));
          convert_transpose_from_float<T>(static_cast<T*>(dst) + k0, staging, kc, N, K, stream_);
        }
        return;
      }
      if (K > staging_elems) throw Error(options_.name + ": " + name + " is too wide for the load buffers");
      const int64_t cols = staging_elems / K;
      for (int64_t n0 = 0; n0 < N; n0 += cols) {
        const int64_t nc = std::min(cols, N - n0);
        CUDA_CHECK(cudaMemcpy2DAsync(staging, size_t(nc) * sizeof(float), src.data() + n0, size_t(N) * sizeof(float),
                                     size_t(nc) * sizeof(float), size_t(K), cudaMemcpyHostToDevice, stream_));
        convert_transpose_from_float<T>(ln_.as<T>(), staging, K, nc, K, stream_);
        quantize_rows_int8<T>(static_cast<int8_t*>(dst) + n0 * K, scales + n0, ln_.as<T>(), nc, K, stream_);
      }
    };
    const bool split = options_.tp_ranks > 1;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& lw = w.layers[l];
      const LayerPtrs& d = layers_[l];
      const std::string h = "h." + std::to_string(layer_begin_ + int64_t(l)) + ".";
      if (split) {  // the full matrices' sizes first, so a short tensor is named as such
        check(lw.attn_qkv_w, C * 3 * C, h + "attn.c_attn.weight");
        check(lw.attn_qkv_b, 3 * C, h + "attn.c_attn.bias");
        check(lw.attn_proj_w, C * C, h + "attn.c_proj.weight");
        check(lw.mlp_fc_w, C * config_.n_inner, h + "mlp.c_fc.weight");
        check(lw.mlp_fc_b, config_.n_inner, h + "mlp.c_fc.bias");
        check(lw.mlp_proj_w, config_.n_inner * C, h + "mlp.c_proj.weight");
      }
      const LayerWeights sliced = split ? shard_layer(lw, config_, shard_) : LayerWeights{};
      const LayerWeights& m = split ? sliced : lw;  // this rank's matrices
      put(d.ln1_g, lw.ln_1_g, C, h + "ln_1.weight");
      put(d.ln1_b, lw.ln_1_b, C, h + "ln_1.bias");
      put_t(d.qkv_w, d.qkv_s, m.attn_qkv_w, C, 3 * W, h + "attn.c_attn.weight");
      put(d.qkv_b, m.attn_qkv_b, 3 * W, h + "attn.c_attn.bias");
      put_t(d.proj_w, d.proj_s, m.attn_proj_w, W, C, h + "attn.c_proj.weight");
      put(d.proj_b, lw.attn_proj_b, C, h + "attn.c_proj.bias");
      put(d.ln2_g, lw.ln_2_g, C, h + "ln_2.weight");
      put(d.ln2_b, lw.ln_2_b, C, h + "ln_2.bias");
      put_t(d.fc_w, d.fc_s, m.mlp_fc_w, C, I, h + "mlp.c_fc.weight");
      put(d.fc_b, m.mlp_fc_b, I, h + "mlp.c_fc.bias");
      put_t(d.fc2_w, d.fc2_s, m.mlp_proj_w, I, C, h + "mlp.c_proj.weight");
      put(d.fc2_b, lw.mlp_proj_b, C, h + "mlp.c_proj.bias");
    }
    if (has_embedding()) {
      put(wte_, w.wte, V * C, "wte");
      put(wpe_, w.wpe, P * C, "wpe");
    }
    if (holds_head()) {
      put(lnf_g_, w.ln_f_g, C, "ln_f.weight");
      put(lnf_b_, w.ln_f_b, C, "ln_f.bias");
      if (head_ != wte_) put(head_, w.head_matrix(), V * C, "lm_head");
    }
  });
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuStage::synthesize(uint64_t seed) {
  DeviceGuard guard(device_);
  const int64_t C = config_.n_embd, W = width_, I = inner_, V = config_.vocab_size, P = config_.n_positions;
  uint64_t tensor = 0;
  with_dtype(options_.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto normal = [&](void* p, int64_t n) { fill_normal<T>(static_cast<T*>(p), n, 0.f, 0.02f, seed, tensor++, stream_); };
    auto ones = [&](void* p, int64_t n) { fill_constant<T>(static_cast<T*>(p), n, 1.f, stream_); };
    // A layer matrix [N, K]; int8: drawn in chunks of rows into the LayerNorm activation
    // buffer (free while loading), then quantised.
    const int64_t tmp_elems = int64_t(ln_.bytes() / sizeof(T));
    auto matrix = [&](void* p, float* scales, int64_t N, int64_t K) {
      if (!options_.int8_weights) return normal(p, N * K);
      const uint64_t id = tensor++;
      const int64_t rows = std::max<int64_t>(1, tmp_elems / K);
      for (int64_t n0 = 0; n0 < N; n0 += rows) {
        const int64_t nc = std::min(rows, N - n0);
        fill_normal<T>(ln_.as<T>(), nc * K, 0.f, 0.02f, seed, (id << 20) + uint64_t(n0 / rows), stream_);
        quantize_rows_int8<T>(static_cast<int8_t*>(p) + n0 * K, scales + n0, ln_.as<T>(), nc, K, stream_);
      }
    };
    for (auto& d : layers_) {
      tensor = (tensor / 64 + 1) * 64;  // each layer its own range of tensor ids
      ones(d.ln1_g, C), normal(d.ln1_b, C);
      matrix(d.qkv_w, d.qkv_s, 3 * W, C), normal(d.qkv_b, 3 * W);
      matrix(d.proj_w, d.proj_s, C, W), normal(d.proj_b, C);
      ones(d.ln2_g, C), normal(d.ln2_b, C);
      matrix(d.fc_w, d.fc_s, I, C), normal(d.fc_b, I);
      matrix(d.fc2_w, d.fc2_s, C, I), normal(d.fc2_b, C);
    }
    tensor = 1 << 20;
    if (has_embedding()) normal(wte_, V * C), normal(wpe_, P * C);
    if (holds_head()) {
      ones(lnf_g_, C), normal(lnf_b_, C);
      if (head_ != wte_) normal(head_, V * C);
    }
  });
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---- step metadata ----

GpuStage::Meta GpuStage::meta_layout(int32_t* base, int64_t T, int64_t S) const {
  Meta m;
  m.ids = base;
  m.pos = m.ids + T;
  m.token_row = m.pos + T;
  m.q_begin = m.token_row + T;
  m.q_len = m.q_begin + S;
  m.kv_len = m.q_len + S;
  m.last_row = m.kv_len + S;
  m.tables = m.last_row + S;
  m.ints = 3 * T + 4 * S + S * max_pages_;
  return m;
}

int32_t* GpuStage::begin_meta() {
  meta_slot_ ^= 1;
  CUDA_CHECK(cudaEventSynchronize(meta_sent_[meta_slot_]));  // its last copy has left the buffer
  return meta_host_[meta_slot_].as<int32_t>();
}

void GpuStage::send_meta(const Meta& host_view) {
  CUDA_CHECK(cudaMemcpyAsync(meta_dev_.get(), host_view.ids, size_t(host_view.ints) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(meta_sent_[meta_slot_], stream_));
}

// Per-sequence and per-token entries; sequences [slices.size(), padded_seqs) are padding.
void GpuStage::fill_seq_meta(int32_t* /*host*/, const Meta& h, std::span<const SeqSlice> slices, int64_t padded_seqs) {
  int64_t row = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const SeqSlice& s = slices[i];
    h.q_begin[i] = int32_t(row);
    h.q_len[i] = s.num_tokens;
    h.kv_len[i] = s.start_pos + s.num_tokens;
    h.last_row[i] = int32_t(row + s.num_tokens - 1);
    for (int32_t j = 0; j < s.num_tokens; ++j, ++row) {
      h.pos[row] = s.start_pos + j;
      h.token_row[row] = int32_t(i);
    }
    if (kv_ && kv_->contains(s.seq_id)) {  // embed() runs before the pages are reserved
      const auto& pages = kv_->pages(s.seq_id);
      std::memcpy(h.tables + int64_t(i) * max_pages_, pages.data(), std::min<size_t>(pages.size(), size_t(max_pages_)) * sizeof(int32_t));
    }
  }
  for (int64_t i = int64_t(slices.size()); i < padded_seqs; ++i) {
    h.q_begin[i] = int32_t(i);
    h.q_len[i] = 0;
    h.kv_len[i] = 0;
    h.last_row[i] = int32_t(i);
    h.pos[i] = 0;  // decode padding: one token row per sequence slot
    h.token_row[i] = -1;
    h.ids[i] = 0;
  }
}

Status GpuStage::check_slices(std::span<const SeqSlice> slices, bool need_cached_match) const {
  const int64_t P = config_.n_positions;
  if (slices.empty()) return Status::error(options_.name + ": empty micro-batch");
  if (int64_t(slices.size()) > max_step_seqs_)
    return Status::error(options_.name + ": " + std::to_string(slices.size()) + " sequences in one micro-batch, at most " +
                         std::to_string(max_step_seqs_));
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
  if (total > max_rows_)
    return Status::error(options_.name + ": " + std::to_string(total) + " tokens in one micro-batch, at most " +
                         std::to_string(max_rows_));
  return ok_status();
}

Status GpuStage::reserve(std::span<const SeqSlice> slices) {
  if (!kv_) return ok_status();
  std::vector<uint64_t> fresh;
  for (const SeqSlice& s : slices) {
    const bool is_new = !kv_->contains(s.seq_id);
    Status st = kv_->reserve(s.seq_id, int64_t(s.start_pos) + s.num_tokens);
    if (!st.ok()) {
      for (uint64_t id : fresh) kv_->release(id);  // nothing changed for the caller
      return Status::error(options_.name + ": " + st.message());
    }
    if (is_new) fresh.push_back(s.seq_id);
  }
  return ok_status();
}

// ---- the forward pass ----

template <class T>
void GpuStage::embed_impl(const Meta& m, int64_t num_tokens) {
  embedding_forward<T>(hidden_.as<T>(), m.ids, m.pos, num_tokens, static_cast<const T*>(wte_),
                       static_cast<const T*>(wpe_), config_.n_embd, stream_);
}

template <class T>
void GpuStage::layers_impl(const Meta& m, int64_t num_tokens, int64_t num_seqs, int64_t max_q_len,
                           int64_t decode_seqs, bool fuse_final_ln) {
  const int64_t C = config_.n_embd, W = width_, I = inner_, H = heads_, D = config_.head_dim();
  const float eps = config_.layer_norm_epsilon;
  const GemmAct act = gemm_act(config_.activation);
  T* hidden = hidden_.as<T>();
  T* ln = ln_.as<T>();
  T* qkv = qkv_.as<T>();
  T* attn = attn_.as<T>();
  T* proj = proj_.as<T>();
  T* fc = fc_.as<T>();
  const auto c = [](void* p) { return static_cast<const T*>(p); };
  const int64_t L = int64_t(layers_.size());
  if (L == 0) {
    if (fuse_final_ln && holds_head()) layernorm_forward<T>(ln, hidden, c(lnf_g_), c(lnf_b_), num_tokens, C, eps, stream_);
    return;
  }
  DecodeWorkspace ws;
  ws.partial = decode_partial_.as<float>();
  ws.counters = decode_counters_.as<int32_t>();
  ws.partial_floats = int64_t(decode_partial_.bytes() / sizeof(float));
  ws.counter_entries = int64_t(decode_counters_.bytes() / sizeof(int32_t));
  const int splits = decode_seqs > 0 ? decode_splits(decode_seqs) : 1;
  // The prompt chunks: their rows start after the decode sequences' one row each, and their
  // block-table rows after those sequences' rows.
  const int64_t first_chunk_row = decode_seqs;
  const SeqArrays chunks{m.q_begin + decode_seqs, m.q_len + decode_seqs, m.kv_len + decode_seqs, num_seqs - decode_seqs};

  for (int64_t l = 0; l < L; ++l) {
    const LayerPtrs& w = layers_[size_t(l)];
    if (l == 0) layernorm_forward<T>(ln, hidden, c(w.ln1_g), c(w.ln1_b), num_tokens, C, eps, stream_);
    matmul<T>(qkv, ln, w.qkv_w, w.qkv_s, w.qkv_b, num_tokens, C, 3 * W, GemmAct::None);
    const KvLayerView kv = kv_->layer(l, m.tables, int32_t(max_pages_));
    if (decode_seqs > 0) attention_decode_paged<T>(attn, qkv, kv, m.kv_len, decode_seqs, H, D, splits, ws, stream_);
    if (chunks.num_seqs > 0) {
      kv_cache_append<T>(kv, qkv + first_chunk_row * 3 * W, 3 * W, m.token_row + first_chunk_row,
                         m.pos + first_chunk_row, num_tokens - first_chunk_row, H, D, stream_);
      KvLayerView chunk_kv = kv;
      chunk_kv.block_tables += decode_seqs * max_pages_;
      attention_context_paged<T>(attn, qkv, chunk_kv, chunks, max_q_len, H, D, stream_);
    }
    matmul<T>(proj, attn, w.proj_w, w.proj_s, nullptr, num_tokens, W, C, GemmAct::None);
    reduce_residual_layernorm<T>(hidden, ln, proj, c(w.proj_b), c(w.ln2_g), c(w.ln2_b), num_tokens);
    matmul<T>(fc, ln, w.fc_w, w.fc_s, w.fc_b, num_tokens, C, I, act);
    matmul<T>(proj, fc, w.fc2_w, w.fc2_s, nullptr, num_tokens, I, C, GemmAct::None);
    const T* g = nullptr;
    const T* b = nullptr;
    if (l + 1 < L) g = c(layers_[size_t(l + 1)].ln1_g), b = c(layers_[size_t(l + 1)].ln1_b);
    else if (fuse_final_ln && holds_head()) g = c(lnf_g_), b = c(lnf_b_);
    reduce_residual_layernorm<T>(hidden, g ? ln : nullptr, proj, c(w.fc2_b), g, b, num_tokens);
  }
}

template <class T>
void GpuStage::matmul(T* out, const T* in, const void* w, const float* scales, const void* bias, int64_t num_tokens,
                      int64_t K, int64_t N, GemmAct act) {
  const T* b = static_cast<const T*>(bias);
  if (options_.int8_weights)
    gemm_->run_int8<T, T>(out, in, static_cast<const int8_t*>(w), scales, b, num_tokens, K, N, act, stream_);
  else
    gemm_->run<T, T>(out, in, static_cast<const T*>(w), b, num_tokens, K, N, WeightLayout::NK, act, stream_);
}

// hidden = hidden + x + bias (x: this rank's partial sums of a row-split projection,
// [num_tokens, C], joined over the ranks first), then ln_out = LayerNorm(hidden) with gamma,
// beta (ln_out null: none). Tensor parallel: one fused kernel when the rows fit its buffers
// (the decode steps), else the all-reduce and then the LayerNorm kernel.
template <class T>
void GpuStage::reduce_residual_layernorm(T* hidden, T* ln_out, T* x, const T* bias, const T* gamma, const T* beta,
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
  if (!s) throw Error(options_.name + ": " + s.message());
}

template <class T>
void GpuStage::head_impl(const T* in_rows, int64_t rows, float* logits) {
  gemm_->run<T, float>(logits, in_rows, static_cast<const T*>(head_), nullptr, rows, config_.n_embd, config_.vocab_size,
                       WeightLayout::NK, GemmAct::None, stream_);
}

template <class T>
void GpuStage::decode_step_impl(const Meta& m, int64_t rows) {
  if (has_embedding()) embed_impl<T>(m, rows);
  layers_impl<T>(m, rows, rows, 1, /*decode_seqs=*/rows, /*fuse_final_ln=*/has_head());
  if (holds_head()) {
    head_impl<T>(ln_.as<T>(), rows, logits_.as<float>());
    sampler_->argmax(tokens_dev_.as<int32_t>(), logits_.as<float>(), rows, stream_);
  }
}

void GpuStage::decode_step(const Meta& m, int64_t rows) {
  with_dtype(options_.dtype, [&](auto tag) { decode_step_impl<decltype(tag)>(m, rows); });
}

// ---- public calls ----

Status GpuStage::embed(std::span<const SeqSlice> slices, const int32_t* token_ids) {
  DeviceGuard guard(device_);
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
  const Meta h = meta_layout(host, T, S);
  fill_seq_meta(host, h, slices, S);
  std::memcpy(h.ids, token_ids, size_t(T) * sizeof(int32_t));
  send_meta(h);
  const Meta m = meta_layout(meta_dev_.as<int32_t>(), T, S);
  with_dtype(options_.dtype, [&](auto tag) { embed_impl<decltype(tag)>(m, T); });
  last_logit_rows_ = -1;
  return ok_status();
}

Status GpuStage::forward(std::span<const SeqSlice> slices) {
  DeviceGuard guard(device_);
  if (Status s = check_slices(slices, true); !s) return s;
  if (Status s = reserve(slices); !s) return s;
  const int64_t S = int64_t(slices.size());
  int64_t T = 0, max_q = 0;
  for (const SeqSlice& s : slices) T += s.num_tokens, max_q = std::max<int64_t>(max_q, s.num_tokens);
  int32_t* host = begin_meta();
  const Meta h = meta_layout(host, T, S);
  fill_seq_meta(host, h, slices, S);
  send_meta(h);
  const Meta m = meta_layout(meta_dev_.as<int32_t>(), T, S);
  // Sequences decoding one token (the coordinator puts them first) take the decode kernel.
  int64_t decode_seqs = 0;
  while (decode_seqs < S && slices[size_t(decode_seqs)].num_tokens == 1) ++decode_seqs;
  with_dtype(options_.dtype, [&](auto tag) {
    layers_impl<decltype(tag)>(m, T, S, max_q, decode_seqs, /*fuse_final_ln=*/false);
  });
  for (const SeqSlice& s : slices) lengths_[s.seq_id] = s.start_pos + s.num_tokens;
  last_logit_rows_ = -1;
  return ok_status();
}

Status GpuStage::logits(std::span<const SeqSlice> slices, bool all_positions, float* out) {
  DeviceGuard guard(device_);
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
  if (T > max_rows_ || S > max_step_seqs_) return Status::error(options_.name + ": micro-batch larger than the stage's buffers");
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const float eps = config_.layer_norm_epsilon;
  with_dtype(options_.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    T_* head_in = head_in_.as<T_>();
    const T_* g = static_cast<const T_*>(lnf_g_);
    const T_* b = static_cast<const T_*>(lnf_b_);
    float* logits = logits_.as<float>();
    if (all_positions) {
      for (int64_t r0 = 0; r0 < T; r0 += logits_rows_) {
        const int64_t n = std::min(logits_rows_, T - r0);
        layernorm_forward<T_>(head_in, hidden_.as<T_>() + r0 * C, g, b, n, C, eps, stream_);
        head_impl<T_>(head_in, n, logits);
        CUDA_CHECK(cudaMemcpyAsync(out + r0 * V, logits, size_t(n * V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
      }
      last_logit_rows_ = -1;
      return;
    }
    int32_t* host = begin_meta();
    const Meta h = meta_layout(host, T, S);
    int64_t row = -1;
    for (int64_t i = 0; i < S; ++i) h.last_row[i] = int32_t(row += slices[size_t(i)].num_tokens);
    send_meta(h);
    const Meta m = meta_layout(meta_dev_.as<int32_t>(), T, S);
    gather_rows<T_>(head_in, hidden_.as<T_>(), m.last_row, S, C, stream_);
    layernorm_forward<T_>(head_in, head_in, g, b, S, C, eps, stream_);
    head_impl<T_>(head_in, S, logits);
    if (out) {
      CUDA_CHECK(cudaMemcpyAsync(out, logits, size_t(S * V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    last_logit_rows_ = S;
  });
  return ok_status();
}

Status GpuStage::sample(std::span<const SampleRow> rows, int32_t* tokens, float* logprobs) {
  DeviceGuard guard(device_);
  if (!holds_head()) return Status::error(options_.name + ": sample called on a stage without the LM head");
  if (int64_t(rows.size()) != last_logit_rows_)
    return Status::error(options_.name + ": sample needs the logits of the last logits(..., all_positions=false) call (" +
                         std::to_string(rows.size()) + " rows asked, " + std::to_string(std::max<int64_t>(last_logit_rows_, 0)) +
                         " held)");
  bool full = false;
  for (const SampleRow& r : rows) {
    if (r.params == nullptr) return Status::error(options_.name + ": a sample row has no parameters");
    full = full || GpuSampler::needs_sampler(*r.params, r.generated.size());
  }
  choose_tokens(rows, full, false, tokens, logprobs);
  return ok_status();
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

Status GpuStage::decode(std::span<const SeqSlice> slices, const int32_t* token_ids, std::span<const SampleRow> sampling,
                        int32_t* tokens, float* logprobs) {
  DeviceGuard guard(device_);
  if (Status s = check_slices(slices, true); !s) return s;
  const int64_t S = int64_t(slices.size());
  for (const SeqSlice& s : slices)
    if (s.num_tokens != 1)
      return Status::error(seq_name(s.seq_id) + ": decode takes one token per sequence, got " + std::to_string(s.num_tokens));
  if (has_embedding()) {
    if (token_ids == nullptr) return Status::error(options_.name + ": decode on the first stage needs token ids");
    for (int64_t i = 0; i < S; ++i)
      if (token_ids[i] < 0 || token_ids[i] >= config_.vocab_size)
        return Status::error(seq_name(slices[size_t(i)].seq_id) + ": token id " + std::to_string(token_ids[i]) +
                             " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
  }
  bool full = false;
  if (holds_head()) {
    if (int64_t(sampling.size()) != S || tokens == nullptr)
      return Status::error(options_.name + ": decode on the last stage needs one sampling row per sequence and `tokens`");
    for (const SampleRow& r : sampling) {
      if (r.params == nullptr) return Status::error(options_.name + ": a sample row has no parameters");
      full = full || GpuSampler::needs_sampler(*r.params, r.generated.size());
    }
  }
  if (Status s = reserve(slices); !s) return s;

  const bool graph = options_.cuda_graphs && S <= kMaxGraphRows;
  const int64_t rows = graph ? bucket_for(S) : S;
  int32_t* host = begin_meta();
  const Meta h = meta_layout(host, rows, rows);
  fill_seq_meta(host, h, slices, rows);
  if (has_embedding()) std::memcpy(h.ids, token_ids, size_t(S) * sizeof(int32_t));
  send_meta(h);
  const Meta m = meta_layout(meta_dev_.as<int32_t>(), rows, rows);

  if (graph) {
    auto it = graphs_.find(rows);
    if (it != graphs_.end()) {
      CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
    } else {
      decode_step(m, rows);  // runs this step and plans every GEMM shape outside capture
      cudaGraph_t g = nullptr;
      CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      try {
        decode_step(m, rows);
      } catch (...) {
        cudaGraph_t partial = nullptr;
        cudaStreamEndCapture(stream_, &partial);
        if (partial) cudaGraphDestroy(partial);
        throw;
      }
      CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
      cudaGraphDestroy(g);
      CUDA_CHECK(e);
      graphs_[rows] = exec;
    }
  } else {
    decode_step(m, rows);
  }
  for (const SeqSlice& s : slices) lengths_[s.seq_id] = s.start_pos + 1;
  last_logit_rows_ = -1;

  if (holds_head()) choose_tokens(sampling, full, true, tokens, logprobs);  // the step left the argmax
  return ok_status();
}

void GpuStage::upload_hidden(const void* src, DType dtype, int64_t num_tokens) {
  DeviceGuard guard(device_);
  if (num_tokens < 0 || num_tokens > max_rows_) throw Error(options_.name + ": upload_hidden of too many rows");
  const int64_t n = num_tokens * config_.n_embd;
  const size_t bytes = size_t(n) * dtype_bytes(dtype);
  if (dtype == options_.dtype) {
    CUDA_CHECK(cudaMemcpyAsync(hidden_.get(), src, bytes, cudaMemcpyDefault, stream_));
  } else {  // through the fp32 staging rows, which hold n elements of any activation dtype
    CUDA_CHECK(cudaMemcpyAsync(staging_f32_.get(), src, bytes, cudaMemcpyDefault, stream_));
    with_dtype(options_.dtype, [&](auto tag) {
      using T = decltype(tag);
      using Other = std::conditional_t<std::is_same_v<T, half>, bf16, half>;  // the other half type
      const DType other = std::is_same_v<T, half> ? DType::BF16 : DType::F16;
      if (dtype == DType::F32) convert_from_float<T>(hidden_.as<T>(), staging_f32_.as<float>(), n, stream_);
      else if (dtype == other) convert<T, Other>(hidden_.as<T>(), staging_f32_.as<Other>(), n, stream_);
      else throw Error(options_.name + ": activations of " + std::string(dtype_name(dtype)) + " cannot be uploaded");
    });
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  last_logit_rows_ = -1;
}

void GpuStage::download_hidden(void* dst, DType dtype, int64_t num_tokens) {
  DeviceGuard guard(device_);
  if (num_tokens < 0 || num_tokens > max_rows_) throw Error(options_.name + ": download_hidden of too many rows");
  const int64_t n = num_tokens * config_.n_embd;
  const void* from = hidden_.get();
  if (dtype == DType::F32) {
    with_dtype(options_.dtype, [&](auto tag) {
      convert_to_float<decltype(tag)>(staging_f32_.as<float>(), hidden_.as<decltype(tag)>(), n, stream_);
    });
    from = staging_f32_.get();
  } else if (dtype != options_.dtype) {
    throw Error(options_.name + ": activations download as F32 or the stage's " +
                std::string(dtype_name(options_.dtype)) + ", not " + std::string(dtype_name(dtype)));
  }
  CUDA_CHECK(cudaMemcpyAsync(dst, from, size_t(n) * dtype_bytes(dtype), cudaMemcpyDefault, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
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

void GpuStage::synchronize() {
  DeviceGuard guard(device_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace conveyor::cuda

#include "stage/cpu/cpu_stage.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_set>

#include "kernels/cpu/ops.h"

namespace conveyor {
namespace {

std::string seq_name(uint64_t seq_id) { return "sequence " + std::to_string(seq_id); }

}  // namespace

Expected<std::unique_ptr<CpuStage>> CpuStage::create(StageWeights weights, int tp) {
  const ModelConfig& c = weights.config;
  if (c.n_embd <= 0 || c.n_head <= 0 || c.n_embd % c.n_head != 0 || c.n_inner <= 0)
    return Status::error("cpu stage: invalid model shape");
  if (Status s = check_weight_shapes(weights); !s) return Status::error("cpu stage: " + s.message());
  if (tp < 1 || tp > c.n_inner)
    return Status::error("cpu stage: tensor parallel " + std::to_string(tp) + " must be from 1 to the MLP width " +
                         std::to_string(c.n_inner));
  return std::unique_ptr<CpuStage>(new CpuStage(std::move(weights), tp));
}

CpuStage::CpuStage(StageWeights weights, int tp) : weights_(std::move(weights)), tp_(tp) { make_shards(tp); }

void CpuStage::make_shards(int tp) {
  const ModelConfig& c = config();
  const int64_t D = c.head_dim();
  shards_.resize(size_t(tp));
  partials_.assign(size_t(tp), nullptr);
  for (int r = 0; r < tp; ++r) {
    Shard& sh = shards_[size_t(r)];
    const TpShard part = TpShard::of(c, r, tp);
    sh.heads = part.heads(), sh.width = sh.heads * D, sh.inner = part.inner();
    sh.layers.resize(weights_.layers.size());
    for (size_t l = 0; l < weights_.layers.size(); ++l) {
      const LayerWeights& lw = weights_.layers[l];
      ShardLayer& s = sh.layers[l];
      const LayerWeights& m = tp == 1 ? lw : (s.owned = shard_layer(lw, c, part));
      s.qkv_w = m.attn_qkv_w.data(), s.qkv_b = m.attn_qkv_b.data(), s.proj_w = m.attn_proj_w.data();
      s.fc_w = m.mlp_fc_w.data(), s.fc_b = m.mlp_fc_b.data(), s.fc2_w = m.mlp_proj_w.data();
    }
  }
  if (tp > 1)  // the ranks hold the matrices now; the output biases stay for the all-reduce
    for (LayerWeights& lw : weights_.layers)
      for (std::vector<float>* m : {&lw.attn_qkv_w, &lw.attn_qkv_b, &lw.attn_proj_w, &lw.mlp_fc_w, &lw.mlp_fc_b, &lw.mlp_proj_w})
        std::vector<float>().swap(*m);
}

void CpuStage::ensure_activations(int64_t T) {
  if (T <= act_tokens_) return;
  const int64_t C = config().n_embd;
  act_.ln.resize(size_t(T * C));
  act_.pos.resize(size_t(T));
  for (Shard& sh : shards_) {
    sh.qkv.resize(size_t(T * 3 * sh.width));
    sh.atty.resize(size_t(T * sh.width));
    sh.fch.resize(size_t(T * sh.inner));
    sh.partial.resize(size_t(T * C));
  }
  act_tokens_ = T;
}

Status CpuStage::check_slices(std::span<const SeqSlice> slices) const {
  const int64_t P = config().n_positions;
  std::unordered_set<uint64_t> seen;
  for (const SeqSlice& s : slices) {
    if (s.num_tokens <= 0)
      return Status::error(seq_name(s.seq_id) + ": slice has " + std::to_string(s.num_tokens) + " tokens");
    if (s.start_pos < 0 || int64_t(s.start_pos) + s.num_tokens > P)
      return Status::error(seq_name(s.seq_id) + ": positions " + std::to_string(s.start_pos) + ".." +
                           std::to_string(int64_t(s.start_pos) + s.num_tokens - 1) +
                           " exceed the model's context of " + std::to_string(P) + " positions");
    if (!seen.insert(s.seq_id).second)
      return Status::error(seq_name(s.seq_id) + " appears twice in one micro-batch");
  }
  return ok_status();
}

Status CpuStage::embed(std::span<const SeqSlice> slices, const int32_t* token_ids, float* hidden) {
  if (!weights_.has_embedding())
    return Status::error("embed called on a stage without the embedding (layers " +
                         std::to_string(weights_.layer_begin) + ".." + std::to_string(weights_.layer_end) + ")");
  if (Status s = check_slices(slices); !s) return s;
  const int64_t T = total_tokens(slices), V = config().vocab_size;
  ensure_activations(T);
  int64_t t = 0;
  for (const SeqSlice& s : slices) {
    for (int32_t i = 0; i < s.num_tokens; ++i, ++t) {
      if (token_ids[t] < 0 || token_ids[t] >= V)
        return Status::error(seq_name(s.seq_id) + ": token id " + std::to_string(token_ids[t]) +
                             " is outside the vocabulary [0, " + std::to_string(V) + ")");
      act_.pos[size_t(t)] = s.start_pos + i;
    }
  }
  cpu::embedding_forward(hidden, token_ids, act_.pos.data(), T, weights_.wte.data(), weights_.wpe.data(),
                         config().n_embd);
  return ok_status();
}

Status CpuStage::forward(std::span<const SeqSlice> slices, float* hidden) {
  if (Status s = check_slices(slices); !s) return s;
  for (const SeqSlice& s : slices) {
    auto it = cache_.find(s.seq_id);
    const int32_t cached = it == cache_.end() ? 0 : it->second.length;
    if (s.start_pos != cached)
      return Status::error(seq_name(s.seq_id) + ": slice starts at position " + std::to_string(s.start_pos) +
                           " but the stage has " + std::to_string(cached) + " tokens cached for it");
  }
  // All checks passed: from here on nothing fails.
  const int64_t T = total_tokens(slices);
  const size_t n_layers = weights_.layers.size(), tp = shards_.size();
  ensure_activations(T);
  slice_caches_.clear();
  for (const SeqSlice& s : slices) {
    SequenceCache& sc = cache_[s.seq_id];
    sc.kv.resize(n_layers * tp);
    for (size_t i = 0; i < sc.kv.size(); ++i)
      sc.kv[i].resize(size_t((int64_t(s.start_pos) + s.num_tokens) * 2 * shards_[i % tp].width));
    slice_caches_.push_back(&sc);
  }
  for (size_t l = 0; l < n_layers; ++l) layer_forward(int64_t(l), slices, slice_caches_, hidden, T);
  for (size_t i = 0; i < slices.size(); ++i) slice_caches_[i]->length += slices[i].num_tokens;
  return ok_status();
}

// One transformer block (pre-LayerNorm GPT-2), in place on hidden [T, C]: each rank its
// heads and FC1 units, each projection's partial sums joined by an all-reduce that also
// adds the bias and the residual.
void CpuStage::layer_forward(int64_t layer, std::span<const SeqSlice> slices,
                             std::span<SequenceCache* const> caches, float* hidden, int64_t T) {
  const ModelConfig& c = config();
  const int64_t C = c.n_embd, D = c.head_dim();
  const float eps = c.layer_norm_epsilon;
  const LayerWeights& w = weights_.layers[size_t(layer)];
  const int tp = tp_.ranks();
  float* ln = act_.ln.data();
  auto all_reduce = [&](const std::vector<float>& bias, bool attention) {
    for (size_t r = 0; r < shards_.size(); ++r)
      partials_[r] = (attention ? shards_[r].width : shards_[r].inner) > 0 ? shards_[r].partial.data() : nullptr;
    tp_.run([&](int r) { TpGroup::all_reduce_add(hidden, partials_, bias.data(), T * C, C, r, tp); });
  };

  // Attention.
  cpu::layernorm_forward(ln, hidden, w.ln_1_g.data(), w.ln_1_b.data(), T, C, eps);
  tp_.run([&](int r) {
    Shard& sh = shards_[size_t(r)];
    const ShardLayer& sw = sh.layers[size_t(layer)];
    const int64_t W = sh.width;
    if (W == 0) return;
    float *qkv = sh.qkv.data(), *atty = sh.atty.data();
    cpu::matmul_forward(qkv, ln, sw.qkv_w, sw.qkv_b, T, C, 3 * W);
    int64_t row = 0;
    for (size_t i = 0; i < slices.size(); ++i) {
      const SeqSlice& s = slices[i];
      float* kv = caches[i]->kv[size_t(layer * tp + r)].data();
      for (int32_t j = 0; j < s.num_tokens; ++j)  // append K and V of the new tokens
        std::memcpy(kv + (int64_t(s.start_pos) + j) * 2 * W, qkv + (row + j) * 3 * W + W, sizeof(float) * size_t(2 * W));
      const int64_t kv_len = int64_t(s.start_pos) + s.num_tokens;
      cpu::attention_context(atty + row * W, qkv + row * 3 * W, 3 * W, kv, kv + W, 2 * W, s.num_tokens, kv_len,
                             sh.heads, D);
      row += s.num_tokens;
    }
    cpu::matmul_forward(sh.partial.data(), atty, sw.proj_w, nullptr, T, W, C);
  });
  all_reduce(w.attn_proj_b, true);

  // MLP.
  cpu::layernorm_forward(ln, hidden, w.ln_2_g.data(), w.ln_2_b.data(), T, C, eps);
  tp_.run([&](int r) {
    Shard& sh = shards_[size_t(r)];
    const ShardLayer& sw = sh.layers[size_t(layer)];
    const int64_t N = sh.inner;
    if (N == 0) return;
    float* fch = sh.fch.data();
    cpu::matmul_forward(fch, ln, sw.fc_w, sw.fc_b, T, C, N);
    if (c.activation == Activation::GeluNew)
      cpu::gelu_forward(fch, T * N);
    else
      cpu::gelu_erf_forward(fch, T * N);
    cpu::matmul_forward(sh.partial.data(), fch, sw.fc2_w, nullptr, T, N, C);
  });
  all_reduce(w.mlp_proj_b, false);
}

Status CpuStage::logits(std::span<const SeqSlice> slices, const float* hidden, bool all_positions,
                        float* out) {
  if (!weights_.has_head())
    return Status::error("logits called on a stage without the LM head (layers " +
                         std::to_string(weights_.layer_begin) + ".." + std::to_string(weights_.layer_end) + ")");
  for (const SeqSlice& s : slices)
    if (s.num_tokens <= 0)
      return Status::error(seq_name(s.seq_id) + ": slice has " + std::to_string(s.num_tokens) + " tokens");
  const ModelConfig& c = config();
  const int64_t C = c.n_embd, T = total_tokens(slices);
  ensure_activations(T);
  float* ln = act_.ln.data();
  int64_t rows = 0;
  if (all_positions) {
    cpu::layernorm_forward(ln, hidden, weights_.ln_f_g.data(), weights_.ln_f_b.data(), T, C, c.layer_norm_epsilon);
    rows = T;
  } else {
    int64_t last = -1;
    for (const SeqSlice& s : slices) {
      last += s.num_tokens;
      cpu::layernorm_forward(ln + rows * C, hidden + last * C, weights_.ln_f_g.data(), weights_.ln_f_b.data(), 1,
                             C, c.layer_norm_epsilon);
      ++rows;
    }
  }
  cpu::lm_head_forward(out, ln, weights_.head_matrix().data(), rows, C, c.vocab_size);
  return ok_status();
}

Status CpuStage::fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) {
  auto it = cache_.find(parent);
  if (it == cache_.end())
    return Status::error("fork: " + seq_name(parent) + " is not cached on this stage (forking into " +
                         std::to_string(child) + ")");
  if (cache_.count(child)) return Status::error("fork: " + seq_name(child) + " exists already (forking " + seq_name(parent) + ")");
  if (num_tokens < 1 || num_tokens > it->second.length)
    return Status::error("fork: " + std::to_string(num_tokens) + " tokens of " + seq_name(parent) + ", which has " +
                         std::to_string(it->second.length) + " cached (1.." + std::to_string(it->second.length) + " allowed)");
  const SequenceCache& from = it->second;
  SequenceCache to;
  to.length = int32_t(num_tokens);
  to.kv.resize(from.kv.size());
  const size_t tp = shards_.size();
  for (size_t i = 0; i < from.kv.size(); ++i) {
    const size_t n = size_t(num_tokens * 2 * shards_[i % tp].width);
    to.kv[i].assign(from.kv[i].begin(), from.kv[i].begin() + int64_t(n));
  }
  cache_.emplace(child, std::move(to));
  return ok_status();
}

void CpuStage::free_sequence(uint64_t seq_id) { cache_.erase(seq_id); }

void CpuStage::clear() { cache_.clear(); }

int64_t CpuStage::cached_tokens(uint64_t seq_id) const {
  auto it = cache_.find(seq_id);
  return it == cache_.end() ? -1 : it->second.length;
}

int64_t CpuStage::kv_bytes_per_token() const {
  return int64_t(weights_.layers.size()) * 2 * config().n_embd * int64_t(sizeof(float));
}

int64_t CpuStage::kv_bytes_used() const {
  int64_t tokens = 0;
  for (const auto& [id, sc] : cache_) tokens += sc.length;
  return tokens * kv_bytes_per_token();
}

}  // namespace conveyor

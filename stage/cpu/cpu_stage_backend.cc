#include "stage/cpu/cpu_stage_backend.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "model/safetensors.h"  // convert_to_f32
#include "model/tp_shard.h"

namespace conveyor {

Expected<std::unique_ptr<CpuStageBackend>> CpuStageBackend::create(StageWeights weights, int tp,
                                                                   int64_t kv_cache_bytes) {
  auto stage = CpuStage::create(std::move(weights), tp);
  if (!stage) return stage.status();
  return std::unique_ptr<CpuStageBackend>(new CpuStageBackend(std::move(stage).value(), kv_cache_bytes));
}

StageCapabilities CpuStageBackend::capabilities(int64_t memory_bytes, int64_t kv_cache_bytes) {
  StageCapabilities c;
  c.dtype = DType::F32;
  c.weight_format = "f32";
  c.weight_memory_bytes = memory_bytes > 0 ? std::max<int64_t>(1, memory_bytes - kv_cache_bytes) : 0;
  // Each sequence's K/V rows are contiguous and a fork copies them, so any position would do;
  // prefixes are offered in granules of 16 positions all the same, which keeps the prefix
  // cache's keys few and counts reuse as a GPU stage (16-position pages) does.
  c.kv_page_tokens = 16;
  c.max_rows_per_step = 0;  // no buffer bounds a step's rows
  // A CPU step's time grows with its rows. Prompt rows per step are held to a decode step's
  // rows, so a step that takes in new prompts is at most about twice as long as one that does
  // not and the inter-token latency of running sequences stays even (docs/OPERATIONS.md).
  c.max_sequences_per_step = 64;
  c.max_prompt_rows_per_step = 64;
  // A pipeline of several CPU stages keeps one micro-batch more than stages in flight, so a
  // stage finds its next input waiting while another travels the hops and the coordinator's
  // turn (docs/PERFORMANCE.md, issue 16: two stages 91-95% -> 96-97% busy, three +11%
  // tokens/s). A single CPU stage loses more to the smaller micro-batches (its step costs
  // less a row at more rows: -19% tokens/s) than the coordinator's turn costs it; the
  // coordinator gives a single stage no extra.
  c.extra_in_flight = 1;
  return c;
}

Expected<StageFootprint> CpuStageBackend::footprint(const ModelConfig& c, int tp) {
  if (c.n_embd <= 0 || c.n_head <= 0 || c.n_embd % c.n_head != 0 || c.n_inner <= 0 || c.vocab_size <= 0 ||
      c.n_positions <= 0)
    return Status::error("cpu stage: the model's shapes are not a GPT's (n_embd " + std::to_string(c.n_embd) +
                         ", n_head " + std::to_string(c.n_head) + ", n_inner " + std::to_string(c.n_inner) + ")");
  if (tp < 1 || tp > c.n_inner)
    return Status::error("cpu stage: tp " + std::to_string(tp) + " must be from 1 to the MLP width " +
                         std::to_string(c.n_inner));
  constexpr int64_t f32 = sizeof(float);
  StageFootprint f;
  for (const LayerTensorSpec& spec : kLayerTensors) {
    f.layer_bytes += layer_tensor_shape(spec, c).elements() * f32;
    if (tp > 1 && spec.split != TpSplit::Whole)  // make_shards' owned copies of the split tensors
      for (int r = 0; r < tp; ++r) {
        const TpShard shard = TpShard::of(c, r, tp);
        f.layer_bytes += layer_tensor_shape(spec, c, &shard).elements() * f32;
      }
  }
  auto tensor = [&](StageTensor t) {
    const StageTensorSpec& spec = kStageTensors[size_t(t)];
    return dim_size(spec.rows, c) * dim_size(spec.cols, c) * f32;
  };
  // StageWeights: wte on the first stage, and on the last as its head when tied; lm_head
  // only when not tied. A stage that is both keeps a tied wte once.
  f.embedding_bytes = tensor(StageTensor::Wte) + tensor(StageTensor::Wpe);
  f.head_bytes = tensor(StageTensor::LnfGain) + tensor(StageTensor::LnfBias) + tensor(StageTensor::LmHead);
  f.embedding_and_head_bytes =
      f.embedding_bytes + f.head_bytes - (c.tie_word_embeddings ? tensor(StageTensor::LmHead) : 0);
  f.kv_bytes_per_token_per_layer = 2 * c.n_embd * f32;  // CpuStage::kv_bytes_per_token for one layer
  return f;
}

Status CpuStageBackend::step(const StepInput& in, StepOutput& out) {
  if (Status s = check_step_input(in, *this, "cpu stage"); !s) return s;
  const int64_t T = total_tokens(in.slices), C = config().n_embd;
  hidden_.resize(size_t(T * C));
  if (has_embedding()) {
    if (Status s = stage_->embed(in.slices, in.token_ids.data(), hidden_.data()); !s) return s;
  } else if (Status s = convert_to_f32(in.activations.dtype, in.activations.bytes.data(), hidden_.size(), hidden_.data());
             !s) {
    return s;
  }
  if (Status s = stage_->forward(in.slices, hidden_.data()); !s) return s;
  if (!has_head()) {
    const size_t bytes = hidden_.size() * sizeof(float);
    auto to = out.activations(bytes);
    if (!to) return to.status();
    std::memcpy(to->data(), hidden_.data(), bytes);
    return ok_status();
  }
  const bool all = in.head == HeadOutput::AllLogits;
  out.logits.resize(size_t((all ? T : int64_t(in.slices.size())) * config().vocab_size));
  return stage_->logits(in.slices, hidden_.data(), all, out.logits.data());
}

Status CpuStageBackend::fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) {
  // The budget the worker was given bounds the copies a fork makes (its prefix's rows).
  if (stage_->kv_bytes_used() + num_tokens * stage_->kv_bytes_per_token() > kv_cache_bytes_)
    return Status::error("cpu stage: no K/V room to fork sequence " + std::to_string(parent) + " into " +
                         std::to_string(child) + " (" + std::to_string(num_tokens) + " tokens; " +
                         std::to_string(kv_used_tokens()) + " of " + std::to_string(kv_capacity_tokens()) + " used)");
  return stage_->fork_sequence(parent, child, num_tokens);
}

std::shared_ptr<std::byte[]> CpuStageBackend::allocate_host(size_t bytes) const {
  return std::shared_ptr<std::byte[]>(new (std::nothrow) std::byte[bytes]);
}

int64_t CpuStageBackend::kv_used_tokens() const {
  return stage_->kv_bytes_used() / std::max<int64_t>(1, stage_->kv_bytes_per_token());
}

int64_t CpuStageBackend::kv_capacity_tokens() const {
  return kv_cache_bytes_ / std::max<int64_t>(1, stage_->kv_bytes_per_token());
}

std::string CpuStageBackend::describe() const {
  return stage_->tensor_parallel() > 1 ? "cpu tp=" + std::to_string(stage_->tensor_parallel()) : "cpu";
}

}  // namespace conveyor

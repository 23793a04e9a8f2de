#include "model/stage_executor.h"

#include <span>

namespace conveyor {

StageExecutor::StageExecutor(StageWeights weights)
    : backend_(std::make_unique<CpuStageBackend>(std::move(weights))) {}

StageExecutor::StageExecutor(std::unique_ptr<StageBackend> backend) : backend_(std::move(backend)) {}

void StageExecutor::free_sequence(uint64_t seq_id) {
  backend_->free_sequence(seq_id);
  history_.erase(seq_id);
}

void StageExecutor::drop_all() {
  backend_->clear();
  history_.clear();
}

Status StageExecutor::run(const MicroBatch& batch, std::span<const std::byte> in, BatchResult* result) {
  for (uint64_t id : batch.free_seq_ids) free_sequence(id);
  if (Status s = validate(batch, config()); !s.ok()) return s;
  const std::vector<SeqSlice> slices = batch.slices();
  const int64_t T = batch.total_tokens();
  if (T > 0) {
    if (is_first()) {
      if (Status s = backend_->embed(slices, batch.token_ids.data()); !s.ok()) return s;
      if (Status s = backend_->forward(slices, nullptr); !s.ok()) return s;
    } else {
      const ActivationsView view{batch.activation_dtype, in};
      if (Status s = backend_->forward(slices, &view); !s.ok())
        return Status::error("micro-batch " + std::to_string(batch.batch_id) + ": " + s.message());
    }
  }
  if (!is_last()) return ok_status();
  if (result == nullptr) return Status::error("last stage ran without a result to fill");
  // Record the tokens for penalties only once the forward pass has succeeded.
  size_t offset = 0;
  for (const SeqWork& w : batch.seqs) {
    auto& h = history_[w.slice.seq_id];
    if (int64_t(h.size()) != w.slice.start_pos) h.resize(size_t(w.slice.start_pos));  // replayed slice
    h.insert(h.end(), batch.token_ids.begin() + int64_t(offset),
             batch.token_ids.begin() + int64_t(offset) + w.slice.num_tokens);
    offset += size_t(w.slice.num_tokens);
  }
  result->batch_id = batch.batch_id;
  result->pipeline = batch.pipeline;
  result->epoch = batch.epoch;
  return sample_outputs(batch, *result);
}

Status StageExecutor::sample_in_place(const MicroBatch& batch, BatchResult& result) {
  static const SamplingParams kGreedy = [] {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }();
  const std::vector<SeqSlice> slices = batch.slices();
  std::vector<SampleRow> rows(slices.size());
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqWork& w = batch.seqs[i];
    rows[i].params = &kGreedy;  // a slice that does not sample: its choice is dropped
    if (!w.sample) continue;
    const std::vector<int32_t>& h = history_[w.slice.seq_id];
    const size_t plen = std::min(h.size(), size_t(std::max(0, w.prompt_len)));
    rows[i] = SampleRow{&w.sampling, {h.data(), plen}, {h.data() + plen, h.size() - plen}, w.sample_index};
  }
  std::vector<int32_t> tokens(slices.size());
  std::vector<float> logprobs(slices.size());
  if (Status s = backend_->sample_last(slices, rows, tokens.data(), logprobs.data()); !s.ok()) return s;
  result.seqs.clear();
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    SeqResult out;
    out.seq_id = batch.seqs[i].slice.seq_id;
    if (batch.seqs[i].sample) out.token = tokens[i], out.logprob = logprobs[i];
    result.seqs.push_back(std::move(out));
  }
  return ok_status();
}

Status StageExecutor::sample_outputs(const MicroBatch& batch, BatchResult& result) {
  const int64_t V = config().vocab_size;
  bool all_rows = false, host_only = false;  // host_only: a slice asks for log-probs beyond the chosen token's
  for (const SeqWork& w : batch.seqs) {
    all_rows = all_rows || w.prompt_logprobs;
    host_only = host_only || w.prompt_logprobs || w.top_logprobs > 0;
  }
  if (backend_->samples_in_place() && !host_only) return sample_in_place(batch, result);
  const std::vector<SeqSlice> slices = batch.slices();
  const int64_t rows = all_rows ? batch.total_tokens() : int64_t(slices.size());
  logits_.resize(size_t(rows * V));
  if (rows > 0)
    if (Status s = backend_->logits(slices, all_rows, logits_.data()); !s.ok()) return s;

  result.seqs.clear();
  int64_t first_row = 0;  // this slice's first row in logits_ when all_rows
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqWork& w = batch.seqs[i];
    const int64_t k = w.slice.num_tokens;
    const int64_t last_row = all_rows ? first_row + k - 1 : int64_t(i);
    SeqResult out;
    out.seq_id = w.slice.seq_id;
    if (w.prompt_logprobs) {
      const int32_t* tokens = batch.token_ids.data() + first_row;
      for (int64_t r = 0; r < k; ++r) {
        const int32_t next = r + 1 < k ? tokens[r + 1] : w.lookahead_token;
        if (next < 0) break;
        const TokenLogprobs lp = token_logprobs(
            std::span<const float>(logits_.data() + (first_row + r) * V, size_t(V)), next, w.top_logprobs);
        out.prompt_logprobs.push_back(lp.logprob);
        if (w.top_logprobs > 0) out.prompt_top.push_back(lp.top);
      }
    }
    if (w.sample) {
      const std::vector<int32_t>& h = history_[w.slice.seq_id];
      const size_t plen = std::min(h.size(), size_t(std::max(0, w.prompt_len)));
      const float* row = logits_.data() + last_row * V;
      scratch_.assign(row, row + V);
      const std::span<const int32_t> prompt(h.data(), plen);
      const std::span<const int32_t> generated(h.data() + plen, h.size() - plen);
      out.token = sample_next(scratch_, w.sampling, prompt, generated, w.sample_index);
      const TokenLogprobs lp = token_logprobs(std::span<const float>(row, size_t(V)), out.token, w.top_logprobs);
      out.logprob = lp.logprob;
      out.top = lp.top;
    }
    result.seqs.push_back(std::move(out));
    first_row += k;
  }
  return ok_status();
}

}  // namespace conveyor

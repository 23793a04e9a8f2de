#include "stage/stage_executor.h"

#include <algorithm>
#include <chrono>
#include <span>
#include <string>

#include "kernels/cpu/sampling.h"

namespace conveyor {

void StageExecutor::free_sequence(uint64_t seq_id) {
  backend_->free_sequence(seq_id);
  history_.erase(seq_id);
}

void StageExecutor::drop_all() {
  backend_->clear();
  history_.clear();
}

Status StageExecutor::run(const MicroBatch& batch, std::span<const std::byte> in, const ActivationSink& out,
                          BatchResult* result) {
  sample_seconds_ = 0;
  // Forks before frees: a parent freed by this batch can still be forked from. A fork that
  // fails fails the batch (the coordinator replays the pipeline from a new epoch, which drops
  // every cache); the frees still run, so nothing the coordinator released stays held.
  Status forked = ok_status();
  for (const SeqFork& f : batch.forks) {
    forked = backend_->fork_sequence(f.parent, f.child, f.num_tokens);
    if (!forked.ok()) break;
    if (auto h = history_.find(f.parent); h != history_.end()) {
      const int64_t n = std::min<int64_t>(f.num_tokens, int64_t(h->second.size()));
      std::vector<int32_t> prefix(h->second.begin(), h->second.begin() + n);  // before history_ may rehash
      history_[f.child] = std::move(prefix);
    }
  }
  for (uint64_t id : batch.free_seq_ids) free_sequence(id);
  if (!forked.ok())
    return is_first() ? forked : Status::error("micro-batch " + std::to_string(batch.batch_id) + ": " + forked.message());
  if (Status s = validate(batch, config()); !s.ok()) return s;
  const std::vector<SeqSlice> slices = batch.slices();
  StepInput step;
  step.slices = slices;
  if (is_first()) step.token_ids = batch.token_ids;
  else step.activations = {batch.activation_dtype, in};
  Status s;
  if (is_last()) {
    if (result == nullptr) return Status::error("last stage ran without a result to fill");
    result->batch_id = batch.batch_id;
    result->pipeline = batch.pipeline;
    result->epoch = batch.epoch;
    result->seqs.clear();
    if (!slices.empty()) s = run_last(batch, step, *result);
  } else if (slices.empty()) {  // only frees: an empty payload carries them on
    auto to = out(0);
    s = to ? ok_status() : to.status();
  } else {
    step_out_.activations = out;
    s = backend_->step(step, step_out_);
    step_out_.activations = nullptr;
  }
  // A stage that received activations names the micro-batch they came with.
  if (!s.ok() && !is_first()) return Status::error("micro-batch " + std::to_string(batch.batch_id) + ": " + s.message());
  return s;
}

Status StageExecutor::run_last(const MicroBatch& batch, StepInput& step, BatchResult& result) {
  // Each sequence's history gains this batch's tokens (a replayed slice restarts it at its
  // start position). A step that fails leaves the stage's cache as it was and the pipeline
  // is replayed from a fresh epoch, which drops these histories too.
  size_t offset = 0;
  for (const SeqWork& w : batch.seqs) {
    auto& h = history_[w.slice.seq_id];
    if (int64_t(h.size()) != w.slice.start_pos) h.resize(size_t(w.slice.start_pos));
    h.insert(h.end(), batch.token_ids.begin() + int64_t(offset),
             batch.token_ids.begin() + int64_t(offset) + w.slice.num_tokens);
    offset += size_t(w.slice.num_tokens);
  }
  bool all_rows = false, host_only = false;  // host_only: a slice asks for log-probs beyond the chosen token's
  for (const SeqWork& w : batch.seqs) {
    all_rows = all_rows || w.prompt_logprobs;
    host_only = host_only || w.prompt_logprobs || w.top_logprobs > 0;
  }
  if (!backend_->samples_in_place() || host_only) {
    step.head = all_rows ? HeadOutput::AllLogits : HeadOutput::LastLogits;
    if (Status s = backend_->step(step, step_out_); !s.ok()) return s;
    const auto t0 = std::chrono::steady_clock::now();
    sample_on_host(batch, step_out_.logits, all_rows, result);
    sample_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return ok_status();
  }
  static const SamplingParams kGreedy = [] {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }();
  std::vector<SampleRow> rows(batch.seqs.size());
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqWork& w = batch.seqs[i];
    rows[i].params = &kGreedy;  // a slice that does not sample: its choice is dropped
    if (!w.sample) continue;
    const std::vector<int32_t>& h = history_[w.slice.seq_id];
    const size_t plen = std::min(h.size(), size_t(std::max(0, w.prompt_len)));
    rows[i] = SampleRow{&w.sampling, {h.data(), plen}, {h.data() + plen, h.size() - plen}, w.sample_index};
  }
  step.head = HeadOutput::Tokens;
  step.sample_rows = rows;
  if (Status s = backend_->step(step, step_out_); !s.ok()) return s;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    SeqResult out;
    out.seq_id = batch.seqs[i].slice.seq_id;
    if (batch.seqs[i].sample) out.token = step_out_.tokens[i], out.logprob = step_out_.logprobs[i];
    result.seqs.push_back(std::move(out));
  }
  return ok_status();
}

void StageExecutor::sample_on_host(const MicroBatch& batch, const std::vector<float>& logits, bool all_rows,
                                   BatchResult& result) {
  const int64_t V = config().vocab_size;
  int64_t first_row = 0;  // this slice's first row in logits when all_rows
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
        const TokenLogprobs lp =
            token_logprobs(std::span<const float>(logits.data() + (first_row + r) * V, size_t(V)), next, w.top_logprobs);
        out.prompt_logprobs.push_back(lp.logprob);
        if (w.top_logprobs > 0) out.prompt_top.push_back(lp.top);
      }
    }
    if (w.sample) {
      const std::vector<int32_t>& h = history_[w.slice.seq_id];
      const size_t plen = std::min(h.size(), size_t(std::max(0, w.prompt_len)));
      const float* row = logits.data() + last_row * V;
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
}

}  // namespace conveyor

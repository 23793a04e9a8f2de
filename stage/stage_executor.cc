#include "stage/stage_executor.h"

#include <algorithm>
#include <chrono>
#include <span>
#include <string>

#include "kernels/cpu/sampling.h"

namespace conveyor {

void StageExecutor::free_sequence(uint64_t seq_id) {
  backend_->free_sequence(seq_id);
  seqs_.erase(seq_id);
}

void StageExecutor::drop_all() {
  backend_->clear();
  seqs_.clear();
}

Status StageExecutor::run(const MicroBatch& batch, std::span<const std::byte> in, const ActivationSink& out,
                          BatchResult* result) {
  sample_seconds_ = 0;
  // Forks before frees: a parent freed by this batch can still be forked from. A fork that
  // fails fails the batch (the coordinator replays the pipeline from a new epoch, which drops
  // every cache); the frees still run, so nothing the coordinator released stays held.
  Status forked = ok_status();
  apply_forks(batch, forked);
  for (uint64_t id : batch.free_seq_ids) free_sequence(id);
  if (!forked.ok())
    return is_first() ? forked : Status::error("micro-batch " + std::to_string(batch.batch_id) + ": " + forked.message());
  if (Status s = validate(batch, config()); !s.ok()) return s;
  auto tokens = tokens_of(batch);
  if (!tokens) return tokens.status();
  const std::vector<SeqSlice> slices = batch.slices();
  StepInput step;
  step.slices = slices;
  if (is_first()) step.token_ids = *tokens;
  else step.activations = {batch.activation_dtype, in};
  Status s;
  if (is_last()) {
    if (result == nullptr) return Status::error("last stage ran without a result to fill");
    result->batch_id = batch.batch_id;
    result->pipeline = batch.pipeline;
    result->epoch = batch.epoch;
    result->seqs.clear();
    s = admit(batch);
    if (s.ok() && !slices.empty()) s = run_last(batch, *tokens, step, *result);
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

// Every stage forks the K/V; the last stage also gives the child its parent's state and the
// first num_tokens tokens of its history.
void StageExecutor::apply_forks(const MicroBatch& batch, Status& forked) {
  for (const SeqFork& f : batch.forks) {
    forked = backend_->fork_sequence(f.parent, f.child, f.num_tokens);
    if (!forked.ok()) return;
    auto parent = seqs_.find(f.parent);
    if (parent == seqs_.end()) continue;  // not the last stage: it keeps no records
    LastStageSeq child;
    child.state = parent->second.state;
    const auto& h = parent->second.history;
    child.history.assign(h.begin(), h.begin() + std::min<int64_t>(f.num_tokens, int64_t(h.size())));
    seqs_[f.child] = std::move(child);  // after the copy: inserting may rehash
  }
}

Expected<std::span<const int32_t>> StageExecutor::tokens_of(const MicroBatch& batch) {
  const bool any = std::any_of(batch.seqs.begin(), batch.seqs.end(), [](const SeqStep& w) { return w.own_token; });
  if (!any) return std::span<const int32_t>(batch.token_ids);
  if (!is_first() || !is_last())
    return Status::error("micro-batch " + std::to_string(batch.batch_id) +
                         " steps ahead on this stage's own tokens, but only the stage of a one-stage pipeline samples "
                         "and embeds");
  own_tokens_ = batch.token_ids;
  size_t offset = 0;
  for (const SeqStep& w : batch.seqs) {
    if (w.own_token) {
      auto it = seqs_.find(w.slice.seq_id);
      if (it == seqs_.end() || it->second.sampled < 0 || it->second.sampled_at != w.slice.start_pos)
        return Status::error("sequence " + std::to_string(w.slice.seq_id) + " steps ahead at position " +
                             std::to_string(w.slice.start_pos) + " on the token this stage sampled there, and it " +
                             (it == seqs_.end() || it->second.sampled < 0
                                  ? std::string("sampled none")
                                  : "sampled one for position " + std::to_string(it->second.sampled_at)));
      own_tokens_[offset] = it->second.sampled;
    }
    offset += size_t(w.slice.num_tokens);
  }
  return std::span<const int32_t>(own_tokens_);
}

void StageExecutor::note_sampled(LastStageSeq& rec, int32_t token) {
  rec.sampled = token;
  rec.sampled_at = int64_t(rec.history.size());
}

// The last stage takes the states of the batch's admissions, all checked before any is kept.
// A sequence that already has a record (a fork brought it: a prefix-cache hit) keeps its
// history and takes its own state.
Status StageExecutor::admit(const MicroBatch& batch) {
  if (batch.admissions.empty()) return ok_status();
  auto admitted = decode_admissions(batch.admissions);
  if (!admitted) return admitted.status();
  for (const Admission& a : *admitted)
    if (Status s = validate(a.state, config()); !s.ok())
      return Status::error("the admission of sequence " + std::to_string(a.seq_id) + ": " + s.message());
  for (Admission& a : *admitted) seqs_[a.seq_id].state = std::move(a.state);
  return ok_status();
}

Expected<std::vector<StageExecutor::LastStageSeq*>> StageExecutor::records_of(const MicroBatch& batch) {
  std::vector<LastStageSeq*> out;
  out.reserve(batch.seqs.size());
  for (const SeqStep& w : batch.seqs) {
    auto it = seqs_.find(w.slice.seq_id);
    if (it == seqs_.end())
      return Status::error("sequence " + std::to_string(w.slice.seq_id) +
                           " has no request state on the last stage: no admission (or fork) brought it here");
    out.push_back(&it->second);  // stable: the map's nodes do not move
  }
  return out;
}

Status StageExecutor::run_last(const MicroBatch& batch, std::span<const int32_t> tokens, StepInput& step,
                               BatchResult& result) {
  auto records = records_of(batch);
  if (!records) return records.status();
  const std::vector<LastStageSeq*>& seqs = *records;
  // Each sequence's history gains this batch's tokens (a replayed slice restarts it at its
  // start position). A step that fails leaves the stage's cache as it was and the pipeline
  // is replayed from a fresh epoch, which drops these histories too.
  size_t offset = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqSlice& slice = batch.seqs[i].slice;
    std::vector<int32_t>& h = seqs[i]->history;
    if (int64_t(h.size()) != slice.start_pos) h.resize(size_t(slice.start_pos));
    h.insert(h.end(), tokens.begin() + int64_t(offset), tokens.begin() + int64_t(offset) + slice.num_tokens);
    offset += size_t(slice.num_tokens);
  }
  bool all_rows = false, host_only = false;  // host_only: a slice asks for log-probs beyond the chosen token's
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    all_rows = all_rows || batch.seqs[i].prompt_logprobs;
    host_only = host_only || batch.seqs[i].prompt_logprobs || seqs[i]->state.top_logprobs > 0;
  }
  if (backend_->samples_in_place() && !host_only) return sample_in_place(batch, seqs, step, result);
  step.head = all_rows ? HeadOutput::AllLogits : HeadOutput::LastLogits;
  if (Status s = backend_->step(step, step_out_); !s.ok()) return s;
  const auto t0 = std::chrono::steady_clock::now();
  sample_on_host(batch, tokens, seqs, step_out_.logits, all_rows, result);
  sample_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ok_status();
}

// The backend chooses the tokens where its logits are, from the same rows sample_next takes.
Status StageExecutor::sample_in_place(const MicroBatch& batch, const std::vector<LastStageSeq*>& seqs,
                                      StepInput& step, BatchResult& result) {
  static const SamplingParams kGreedy = [] {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }();
  std::vector<SampleRow> rows(batch.seqs.size());
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    rows[i].params = &kGreedy;  // a slice that does not sample: its choice is dropped
    if (!batch.seqs[i].sample) continue;
    const SeqState& st = seqs[i]->state;
    const std::vector<int32_t>& h = seqs[i]->history;
    const size_t plen = std::min(h.size(), size_t(std::max(0, st.prompt_len)));
    rows[i] = SampleRow{&st.sampling, {h.data(), plen}, {h.data() + plen, h.size() - plen}, st.sample_index};
  }
  step.head = HeadOutput::Tokens;
  step.sample_rows = rows;
  if (Status s = backend_->step(step, step_out_); !s.ok()) return s;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    SeqResult out;
    out.seq_id = batch.seqs[i].slice.seq_id;
    if (batch.seqs[i].sample) {
      out.token = step_out_.tokens[i], out.logprob = step_out_.logprobs[i];
      note_sampled(*seqs[i], out.token);
    }
    result.seqs.push_back(std::move(out));
  }
  return ok_status();
}

void StageExecutor::sample_on_host(const MicroBatch& batch, std::span<const int32_t> tokens,
                                   const std::vector<LastStageSeq*>& seqs,
                                   const std::vector<float>& logits, bool all_rows, BatchResult& result) {
  const int64_t V = config().vocab_size;
  int64_t first_row = 0;  // this slice's first row in logits when all_rows
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqStep& w = batch.seqs[i];
    const SeqState& st = seqs[i]->state;
    const int64_t k = w.slice.num_tokens;
    const int64_t last_row = all_rows ? first_row + k - 1 : int64_t(i);
    SeqResult out;
    out.seq_id = w.slice.seq_id;
    if (w.prompt_logprobs) {
      const int32_t* slice_tokens = tokens.data() + first_row;
      for (int64_t r = 0; r < k; ++r) {
        const int32_t next = r + 1 < k ? slice_tokens[r + 1] : w.lookahead_token;
        if (next < 0) break;
        const TokenLogprobs lp = token_logprobs(std::span<const float>(logits.data() + (first_row + r) * V, size_t(V)),
                                                next, st.top_logprobs);
        out.prompt_logprobs.push_back(lp.logprob);
        if (st.top_logprobs > 0) out.prompt_top.push_back(lp.top);
      }
    }
    if (w.sample) {
      const std::vector<int32_t>& h = seqs[i]->history;
      const size_t plen = std::min(h.size(), size_t(std::max(0, st.prompt_len)));
      const float* row = logits.data() + last_row * V;
      scratch_.assign(row, row + V);
      const std::span<const int32_t> prompt(h.data(), plen);
      const std::span<const int32_t> generated(h.data() + plen, h.size() - plen);
      out.token = sample_next(scratch_, st.sampling, prompt, generated, st.sample_index);
      const TokenLogprobs lp = token_logprobs(std::span<const float>(row, size_t(V)), out.token, st.top_logprobs);
      out.logprob = lp.logprob;
      out.top = lp.top;
      note_sampled(*seqs[i], out.token);
    }
    result.seqs.push_back(std::move(out));
    first_row += k;
  }
}

}  // namespace conveyor

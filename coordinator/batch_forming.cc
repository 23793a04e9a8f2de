// The scheduler's second half: planning a pipeline's next step from its running
// sequences (decode steps first, beam groups together, then prompt chunks), and the request
// state that goes with a sequence once. A sequence's SeqState (protocol/seq_state.h) rides
// in the admissions of the first micro-batch that carries it on a pipeline in an epoch: its
// first step, or its first after a replay or re-plan (every epoch change drops the stages'
// states with their caches). A beam forked from its parent needs none: the fork brings the
// parent's state to the child on the last stage.
#include <algorithm>

#include "coordinator/scheduler.h"

namespace conveyor {

using Clock = std::chrono::steady_clock;

SamplingParams Scheduler::sampling_for(const CompletionRequest& r) const {
  SamplingParams p = r.sampling;
  if (!r.ignore_eos && cfg_.model.eos_token_id >= 0 &&
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), int32_t(cfg_.model.eos_token_id)) ==
          p.stop_token_ids.end())
    p.stop_token_ids.push_back(int32_t(cfg_.model.eos_token_id));
  return p;
}

SeqState Scheduler::state_of(const Sequence& s) const {
  const CompletionRequest& r = *s.request->req;
  SeqState st;
  st.prompt_len = int32_t(s.prompt_len);
  st.top_logprobs = std::max(0, r.logprobs);
  st.sample_index = s.choice % r.slots_per_prompt();  // the sample's Philox stream
  st.sampling = sampling_for(r);
  if (s.group >= 0) {  // a beam reports its group's candidates and draws from stream 0
    st.top_logprobs = s.request->groups[size_t(s.group)].search->alternatives_needed();
    st.sample_index = 0;
  }
  return st;
}

int64_t Scheduler::ready_sequences(const PipelineRun& p, std::vector<Sequence*>& decode, std::vector<Sequence*>& prefill,
                                   std::vector<Sequence*>* ahead) {
  int64_t active = 0;
  for (auto& [_, s] : seqs_) {
    if (s.pipeline != p.index || s.finished) continue;
    ++active;
    if (s.in_flight && ahead && can_step_ahead(s)) ahead->push_back(&s);
    if (s.in_flight || s.fed >= s.all.size()) continue;
    (s.all.size() - s.fed == 1 ? decode : prefill).push_back(&s);
  }
  auto by_id = [](const Sequence* a, const Sequence* b) { return a->id < b->id; };
  std::sort(decode.begin(), decode.end(), by_id);
  std::sort(prefill.begin(), prefill.end(), by_id);
  if (ahead) std::sort(ahead->begin(), ahead->end(), by_id);
  return active;
}

bool Scheduler::can_step_ahead(const Sequence& s) const {
  return !s.ahead && s.group < 0 && s.fed == s.all.size() &&
         int64_t(s.generated()) + 2 <= max_tokens_of(*s.request->req, s.prompt_len);
}

std::optional<StepPlan> Scheduler::next_step(PipelineRun& p, int depth) {
  std::vector<Sequence*> decode, prefill, ahead;
  const int64_t active = ready_sequences(p, decode, prefill, p.view.step_ahead ? &ahead : nullptr);
  std::vector<SeqFork>& retains = retain_forks(p.index);
  if (p.view.step_ahead && p.in_flight >= depth && ahead.empty()) return std::nullopt;  // the extra slot: steps ahead
  if (decode.empty() && prefill.empty() && ahead.empty() && p.pending_frees.empty() && retains.empty())
    return std::nullopt;
  Draft d;
  // Spread the live sequences over the in-flight slots so every stage has work.
  d.cap_seqs = std::min<int64_t>(p.limits.max_sequences, std::max<int64_t>(1, (active + depth - 1) / depth));
  StepPlan& b = d.plan;
  b.batch_id = next_batch_id_++;
  b.pipeline = p.index;
  b.epoch = p.epoch;
  b.frees = std::move(p.pending_frees);
  p.pending_frees.clear();
  b.forks = std::move(retains);  // new cache entries before any fork from them
  retains.clear();
  b.record = {p.epoch, {}, Clock::now()};
  add_decode_steps(p, d, decode);
  add_ahead_steps(p, d, ahead);
  add_prefill_steps(p, d, prefill);
  return std::move(d.plan);
}

// A beam group's decode steps go together (all its ready beams, or none unless the batch is
// empty: a group wider than the limits still runs).
void Scheduler::add_decode_steps(PipelineRun& p, Draft& d, std::vector<Sequence*>& decode) {
  const StepPlan& b = d.plan;
  for (size_t i = 0; i < decode.size(); ++i) {
    Sequence* s = decode[i];
    if (s == nullptr) continue;
    if (s->group < 0) {
      if (int64_t(b.steps.size()) >= d.cap_seqs || d.tokens + 1 > p.limits.max_rows) break;
      add_step(p, d, *s, 1);
      continue;
    }
    std::vector<Sequence*> unit;
    for (size_t j = i; j < decode.size(); ++j)
      if (decode[j] && decode[j]->request == s->request && decode[j]->group == s->group) unit.push_back(decode[j]);
    const int64_t n = int64_t(unit.size());
    const bool fits = int64_t(b.steps.size()) + n <= std::max(d.cap_seqs, n) &&
                      d.tokens + n <= std::max(p.limits.max_rows, n);
    if (!fits && !b.steps.empty()) continue;
    for (Sequence* u : unit) {
      add_step(p, d, *u, 1);
      *std::find(decode.begin() + int64_t(i), decode.end(), u) = nullptr;
    }
  }
}

// Steps ahead, after the ready decode steps (a sequence waiting for its step goes first). The
// stage holds each one's state: its step in flight is of this epoch.
void Scheduler::add_ahead_steps(const PipelineRun& p, Draft& d, const std::vector<Sequence*>& ahead) {
  StepPlan& b = d.plan;
  for (Sequence* s : ahead) {
    if (int64_t(b.steps.size()) >= d.cap_seqs || d.tokens + 1 > p.limits.max_rows) break;
    SeqStep w;
    w.slice = {s->id, int32_t(s->fed), 1};
    w.sample = true;
    w.own_token = true;
    b.token_ids.push_back(kOwnTokenPlaceholder);
    b.steps.push_back(w);
    s->ahead = true;
    b.record.seq_ids.push_back(s->id);
    d.tokens += 1;
  }
}

// Prompt chunks, within the micro-batch's prompt rows (BatchLimits::prefill_tokens).
void Scheduler::add_prefill_steps(PipelineRun& p, Draft& d, const std::vector<Sequence*>& prefill) {
  const BatchLimits& lim = p.limits;
  StepPlan& b = d.plan;
  int64_t prompt_budget = lim.prefill_tokens;  // prompt rows left in this micro-batch
  for (Sequence* s : prefill) {
    if (int64_t(b.steps.size()) >= d.cap_seqs || d.tokens >= lim.max_rows || prompt_budget <= 0) break;
    if (s->fed == 0 && !s->prefix_done) reuse_prefix(p, *s, b);
    const int64_t n = std::min<int64_t>(
        {lim.prefill_chunk, int64_t(s->all.size() - s->fed), lim.max_rows - d.tokens, prompt_budget});
    add_step(p, d, *s, n);
    prompt_budget -= n;
  }
}

// The next n tokens of `s` as one slice of the batch, with its state when the pipeline's last
// stage does not hold it in this epoch.
void Scheduler::add_step(PipelineRun& p, Draft& d, Sequence& s, int64_t n) {
  StepPlan& b = d.plan;
  SeqStep w;
  w.slice = {s.id, int32_t(s.fed), int32_t(n)};
  // max_tokens 0 (the scoring idiom): the prompt's log-probs, nothing sampled.
  w.sample = s.fed + size_t(n) == s.all.size() && max_tokens_of(*s.request->req, s.prompt_len) > 0;
  w.prompt_logprobs = !s.prompt_lp.empty() && s.prompt_lp.size() < s.prompt_len && s.fed < s.prompt_len;
  w.prefill = s.fed < s.prompt_len;
  if (w.prompt_logprobs && s.fed + size_t(n) < s.all.size()) w.lookahead_token = s.all[s.fed + size_t(n)];
  if (s.state_pipeline != p.index || s.state_epoch != p.epoch) {
    b.admissions.push_back({s.id, state_of(s)});
    s.state_pipeline = p.index;
    s.state_epoch = p.epoch;
  }
  if (s.group >= 0) {
    BeamGroup& g = s.request->groups[size_t(s.group)];
    // The group's forks before its beams' slices; the beams they drop freed after them.
    b.forks.insert(b.forks.end(), g.forks.begin(), g.forks.end());
    b.frees.insert(b.frees.end(), g.frees.begin(), g.frees.end());
    g.forks.clear(), g.frees.clear();
  }
  b.token_ids.insert(b.token_ids.end(), s.all.begin() + int64_t(s.fed), s.all.begin() + int64_t(s.fed) + n);
  b.steps.push_back(w);
  s.fed += size_t(n);
  s.in_flight = true;
  b.record.seq_ids.push_back(s.id);
  d.tokens += n;
}

void Scheduler::sent(PipelineRun& p, StepPlan plan) {
  p.batches.emplace(plan.batch_id, std::move(plan.record));
  ++p.in_flight;
}

}  // namespace conveyor

#include "coordinator/scheduler.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include <spdlog/spdlog.h>

namespace conveyor {

using Clock = std::chrono::steady_clock;

const char* queue_wait_name(QueueWait w) {
  switch (w) {
    case QueueWait::None: return "none";
    case QueueWait::NoPipeline: return "no_pipeline";
    case QueueWait::KvCache: return "kv_cache";
    case QueueWait::RunningLimit: return "running_limit";
  }
  return "?";
}

BatchLimits Scheduler::batch_limits(const ClusterConfig& cfg, const StageFigures& f, int stages, int depth) {
  auto pick = [](int64_t configured, int64_t automatic) { return configured > 0 ? configured : automatic; };
  BatchLimits l;
  l.max_sequences = pick(cfg.max_sequences_per_batch, f.sequences);
  l.prefill_chunk = pick(cfg.prefill_chunk, f.prompt_rows);
  // A sequence waits a whole round of the ring between its tokens: `depth` micro-batches
  // pass each stage in that time. The prompt rows of a round are held to `stages` micro-
  // batches' worth, so one more micro-batch in flight than stages adds no prompt work a round.
  l.prefill_tokens = pick(cfg.prefill_tokens_per_batch,
                          std::max<int64_t>(16, f.prompt_rows * std::max(1, stages) / std::max(1, depth)));
  const int64_t rows = l.max_sequences + l.prefill_tokens;
  l.max_rows = pick(cfg.max_batch_tokens, f.max_rows > 0 ? std::min(rows, f.max_rows) : rows);
  l.max_running = pick(cfg.max_running, int64_t(std::max(1, depth)) * l.max_sequences);
  return l;
}

Scheduler::Scheduler(const ClusterConfig& cfg, std::shared_ptr<const Tokenizer> tokenizer,
                     std::vector<PipelineRun>& pipelines)
    : cfg_(cfg), tokenizer_(std::move(tokenizer)), pipelines_(pipelines) {}

int64_t Scheduler::max_tokens_of(const CompletionRequest& r, size_t prompt_len) const {
  return std::min<int64_t>(r.max_tokens, cfg_.model.n_positions - int64_t(prompt_len));
}

int64_t Scheduler::kv_tokens_needed(const CompletionRequest& r, int64_t n_positions) {
  // Beam search holds up to twice its beams while a step's children are forked from their
  // parents (the forks come before the frees), each up to the whole context.
  const int64_t per_prompt = r.use_beam_search ? 2 * int64_t(r.best_of) : int64_t(r.slots_per_prompt());
  int64_t need = 0;
  for (const auto& pr : r.prompts)
    need += per_prompt * (int64_t(pr.size()) + std::min<int64_t>(r.max_tokens, n_positions - int64_t(pr.size())));
  return need;
}

namespace {

// Why a request cannot run on any pipeline, with the numbers, and the field to lower.
CoreStatus too_large(const CompletionRequest& r, int64_t need, int64_t capacity) {
  const int64_t per_prompt = r.use_beam_search ? 2 * int64_t(r.best_of) : int64_t(r.slots_per_prompt());
  const char* field = r.use_beam_search || r.ranks_samples() ? "best_of" : per_prompt > 1 ? "n" : "max_tokens";
  return CoreStatus::refuse(
      CoreError::Invalid,
      "the request needs " + std::to_string(need) + " K/V-cache tokens (" + std::to_string(per_prompt) +
          " sequence(s) for each of " + std::to_string(r.prompts.size()) + " prompt(s), each its prompt + max_tokens " +
          std::to_string(r.max_tokens) + "), more than a pipeline holds (" + std::to_string(capacity) +
          " tokens); lower n, best_of or max_tokens",
      field);
}

}  // namespace

CoreStatus Scheduler::submit(std::shared_ptr<const CompletionRequest> req, CompletionSink sink, int64_t kv_capacity) {
  if (int64_t(queue_.size()) >= cfg_.max_queue)
    return CoreStatus::retry_later(CoreError::QueueFull,
                                   "the queue is full (" + std::to_string(cfg_.max_queue) + " requests waiting)",
                                   kRetryQueueFullSeconds);
  const int64_t need = kv_tokens_needed(*req, cfg_.model.n_positions);
  if (kv_capacity > 0 && need > kv_capacity) return too_large(*req, need, kv_capacity);
  auto r = std::make_unique<Request>();
  r->req = std::move(req);
  r->sink = std::move(sink);
  r->queued_at = Clock::now();
  r->kv_need = need;
  queue_.push_back(std::move(r));
  return {};
}

void Scheduler::refuse_unserved(bool serviceable) {
  if (serviceable) {
    unserviceable_since_.reset();
    return;
  }
  const Clock::time_point now = Clock::now();
  if (!unserviceable_since_) unserviceable_since_ = now;
  const auto wait = std::chrono::milliseconds(cfg_.pipeline_wait_ms);
  // A request's wait starts at the later of its arrival and `since`: once `since` is a wait
  // ago, those that arrived a wait ago are due.
  if (queue_.empty() || *unserviceable_since_ + wait > now) return;
  refuse_queued(now - wait, CoreStatus::retry_later(CoreError::Unavailable,
                                                    "no pipeline could serve the request within scheduler.pipeline_wait_ms (" +
                                                        std::to_string(cfg_.pipeline_wait_ms) + " ms)",
                                                    kRetryUnavailableSeconds));
}

std::optional<Clock::time_point> Scheduler::refuse_deadline() const {
  if (!unserviceable_since_ || queue_.empty()) return std::nullopt;
  return std::max(queue_.front()->queued_at, *unserviceable_since_) + std::chrono::milliseconds(cfg_.pipeline_wait_ms);
}

int64_t Scheduler::running_sequences() const {
  int64_t n = 0;
  for (const auto& [_, s] : seqs_) n += !s.finished;
  return n;
}

int64_t Scheduler::running_on(int index) const {
  int64_t n = 0;
  for (const auto& [_, s] : seqs_) n += !s.finished && s.pipeline == index;
  return n;
}

void Scheduler::admit(const std::function<bool(const PipelineRun&)>& open,
                      const std::function<int64_t(const PipelineRun&)>& kv_capacity) {
  queue_wait_ = QueueWait::None;
  if (queue_.empty()) return;
  std::vector<int64_t> running(pipelines_.size(), 0);  // sequences per pipeline, kept as we admit
  for (const auto& [_, s] : seqs_)
    if (!s.finished && s.pipeline >= 0 && size_t(s.pipeline) < running.size()) ++running[size_t(s.pipeline)];
  while (!queue_.empty()) {
    const Choice c = choose_pipeline(*queue_.front(), running, open, kv_capacity);
    if (!c.fits_somewhere) {
      std::unique_ptr<Request> owned = std::move(queue_.front());
      queue_.pop_front();
      const CoreStatus why = too_large(*owned->req, owned->kv_need, c.max_cap);
      end_request(std::move(owned), {RequestOutcome::Invalid, why.message, why});
      continue;
    }
    if (!c.best) return;  // queue_wait_ says why
    running[size_t(c.best->index)] += int64_t(queue_.front()->req->num_sequences());
    std::unique_ptr<Request> owned = std::move(queue_.front());
    queue_.pop_front();
    start_request(std::move(owned), *c.best);
  }
}

// Among the open pipelines whose K/V budget and admission limit take `r`: the replica holding
// the longest prefix of its prompts, then the least reserved.
Scheduler::Choice Scheduler::choose_pipeline(const Request& r, const std::vector<int64_t>& running,
                                             const std::function<bool(const PipelineRun&)>& open,
                                             const std::function<int64_t(const PipelineRun&)>& kv_capacity) {
  const int64_t choices = int64_t(r.req->num_sequences());
  Choice c;
  int64_t best_match = 0;
  bool any_open = false, kv_room = false;
  for (PipelineRun& p : pipelines_) {
    if (!open(p)) continue;
    any_open = true;
    const int64_t cap = kv_capacity(p);
    c.max_cap = std::max(c.max_cap, cap);
    budget(p.index) = cap;
    if (p.kv_reserved + r.kv_need > cap) continue;
    kv_room = true;
    if (running[size_t(p.index)] + choices > std::max(p.limits.max_running, choices)) continue;
    const int64_t match = cfg_.prefix_cache && pipelines_.size() > 1 ? prefix_match(p, *r.req) : 0;
    if (!c.best || match > best_match || (match == best_match && p.kv_reserved < c.best->kv_reserved)) {
      c.best = &p;
      best_match = match;
    }
  }
  c.fits_somewhere = !(c.max_cap > 0 && r.kv_need > c.max_cap && !kv_room);
  if (!c.best)
    queue_wait_ = !any_open ? QueueWait::NoPipeline : !kv_room ? QueueWait::KvCache : QueueWait::RunningLimit;
  return c;
}

void Scheduler::start_request(std::unique_ptr<Request> owned, PipelineRun& p) {
  Request* rp = owned.get();
  rp->pipeline = p.index;
  p.kv_reserved += rp->kv_need;
  (void)make_room(p, 0);  // cache entries give way to running requests
  ++p.admitted;
  const CompletionRequest& cr = *rp->req;
  rp->cached_tokens.assign(cr.prompts.size(), 0);
  // Beam groups deliver their choices; samples end one by one (ranked ones too, emit()).
  rp->unfinished = cr.use_beam_search ? cr.num_choices() : cr.num_sequences();
  if (cr.use_beam_search) {
    start_beam_groups(*rp, p);
  } else {
    if (cr.ranks_samples()) rp->samples.resize(cr.num_sequences());
    for (size_t c = 0; c < cr.num_sequences(); ++c) {
      const std::vector<int32_t>& prompt = cr.prompts[c / cr.slots_per_prompt()];
      Sequence& s = add_sequence(*rp, c, p.index, prompt, prompt.size());
      s.text = std::make_unique<TextStream>(*tokenizer_, cr.stop);
      if (cr.echo && cr.logprobs >= 0) s.prompt_lp.push_back({s.all[0], std::numeric_limits<float>::quiet_NaN(), {}});
    }
  }
  running_.emplace(rp, std::move(owned));
}

// Beam search: one sequence a prompt to begin with (the prompt's prefill), in its group.
void Scheduler::start_beam_groups(Request& r, PipelineRun& p) {
  const CompletionRequest& cr = *r.req;
  for (size_t pi = 0; pi < cr.prompts.size(); ++pi) {
    BeamGroup& g = r.groups.emplace_back();
    BeamSearchOptions o;
    o.beam_width = cr.best_of;
    o.max_new_tokens = int(max_tokens_of(cr, cr.prompts[pi].size()));
    o.length_penalty = cr.length_penalty;
    o.early_stopping = cr.early_stopping;
    if (!cr.ignore_eos && cfg_.model.eos_token_id >= 0) o.stop_ids = {int32_t(cfg_.model.eos_token_id)};
    g.search = std::make_unique<BeamSearch>(std::move(o));
    g.prompt = pi;
    Sequence& s = add_sequence(r, pi * size_t(cr.n), p.index, cr.prompts[pi], cr.prompts[pi].size());
    s.group = int(pi);
    g.live = {s.id};
    g.alts.assign(1, {});
    g.reported.assign(1, false);
    g.waiting = 1;
  }
}

PipelineRun* Scheduler::on_result(const BatchResult& res) {
  if (res.pipeline >= pipelines_.size()) return nullptr;
  PipelineRun& p = pipelines_[res.pipeline];
  auto bit = p.batches.find(res.batch_id);
  if (res.epoch != p.epoch || bit == p.batches.end()) return nullptr;  // from before a restart
  const InFlightBatch rec = std::move(bit->second);
  p.batches.erase(bit);
  --p.in_flight;
  if (!res.error.empty()) {
    // A stage could not run or hand on the batch (most often: its neighbour went away).
    // The pipeline restarts in a new epoch and replays every sequence; a sequence whose
    // batches keep failing (an error that a replay cannot cure) is failed with the message.
    spdlog::warn("coordinator: pipeline {} batch {} failed: {}", p.index, res.batch_id, res.error);
    bool replay = false;
    for (uint64_t id : rec.seq_ids) {
      auto it = seqs_.find(id);
      if (it == seqs_.end() || it->second.finished || it->second.request->failed) continue;
      if (++it->second.failed_batches <= kMaxFailedBatches) {
        replay = true;
        continue;
      }
      Request& r = *it->second.request;
      r.failed = true;
      finish_request(r, "the pipeline failed this request " + std::to_string(kMaxFailedBatches + 1) +
                            " times: " + res.error);
    }
    return replay ? &p : nullptr;
  }
  for (const SeqResult& sr : res.seqs) {
    auto it = seqs_.find(sr.seq_id);
    if (it == seqs_.end() || it->second.finished) {
      discarded_tokens_ += sr.token >= 0;
      continue;
    }
    if (it->second.group >= 0) take_beam_report(it->second, sr);  // may end its request
    else take_token(it->second, sr);
  }
  return nullptr;
}

void Scheduler::take_beam_report(Sequence& s, const SeqResult& sr) {
  s.in_flight = false;
  if (sr.token < 0) return;  // a prefill chunk that did not end the beam's known tokens
  Request& r = *s.request;
  BeamGroup& g = r.groups[size_t(s.group)];
  if (g.done || s.beam >= g.live.size() || g.live[s.beam] != s.id || g.reported[s.beam]) return;
  ++r.generated;
  if (!r.first_token_at) r.first_token_at = Clock::now();
  if (!s.prefix_offered) retain_prefix(s);  // it reported: its prompt's K/V is complete
  g.alts[s.beam] = sr.top;
  g.reported[s.beam] = true;
  if (--g.waiting == 0) advance_group(r, g);
}

void Scheduler::advance_group(Request& r, BeamGroup& g) {
  Expected<std::vector<BeamSearch::Continuation>> next = g.search->step(g.alts);
  PipelineRun* p = r.pipeline >= 0 ? &pipelines_[size_t(r.pipeline)] : nullptr;
  if (!next) {
    r.failed = true;
    finish_request(r, next.error());
    return;
  }
  // The parents' tokens before this step (a parent's first child appends to it in place).
  std::vector<std::vector<int32_t>> before;
  for (uint64_t id : g.live) before.push_back(seqs_.at(id).all);
  const std::vector<uint64_t> parents = g.live;
  auto forget = [&](uint64_t id) {  // the stages still hold it until the frees go out
    seqs_.erase(id);
    r.seq_ids.erase(std::remove(r.seq_ids.begin(), r.seq_ids.end(), id), r.seq_ids.end());
  };
  if (g.search->done()) {
    g.done = true;
    for (uint64_t id : parents) forget(id);
    g.live.clear();
    if (p) {
      p->pending_frees.insert(p->pending_frees.end(), g.frees.begin(), g.frees.end());
      p->pending_frees.insert(p->pending_frees.end(), parents.begin(), parents.end());
    }
    g.forks.clear(), g.frees.clear();
    group_deliveries_.push_back({&r, size_t(&g - r.groups.data())});
    return;
  }
  std::vector<bool> continued(parents.size(), false);
  std::vector<uint64_t> live;
  for (size_t k = 0; k < next->size(); ++k) {
    const auto [parent, token] = (*next)[k];
    const uint64_t pid = parents[parent];
    if (!continued[parent]) {  // the first child continues as its parent's sequence
      continued[parent] = true;
      Sequence& s = seqs_.at(pid);
      s.all.push_back(token);
      s.beam = k;
      live.push_back(pid);
      continue;
    }
    const Sequence& from = seqs_.at(pid);  // element references survive the insertion
    std::vector<int32_t> tokens = before[parent];
    tokens.push_back(token);
    Sequence& c = add_sequence(r, from.choice, from.pipeline, std::move(tokens), from.prompt_len);
    c.group = from.group;
    c.beam = k;
    // A parent that was fed all its tokens hands its K/V on; one being fed again (a replay)
    // has none yet, and the child is fed from its first token too.
    // The fork also gives the child the parent's state on the last stage.
    if (from.fed == before[parent].size()) {
      c.fed = from.fed;
      c.state_pipeline = from.state_pipeline;
      c.state_epoch = from.state_epoch;
      g.forks.push_back({pid, c.id, int32_t(from.fed)});
    }
    live.push_back(c.id);
  }
  for (size_t i = 0; i < parents.size(); ++i)
    if (!continued[i]) {
      g.frees.push_back(parents[i]);
      forget(parents[i]);
    }
  g.live = std::move(live);
  g.alts.assign(g.live.size(), {});
  g.reported.assign(g.live.size(), false);
  g.waiting = g.live.size();
}

void Scheduler::reset_groups(Request& r) {
  for (BeamGroup& g : r.groups) {
    g.forks.clear(), g.frees.clear();
    g.alts.assign(g.live.size(), {});
    g.reported.assign(g.live.size(), false);
    g.waiting = g.live.size();
  }
}

// The group's n best hypotheses as its choices, one update each; the last choice of the
// request finishes it.
void Scheduler::deliver_group(Request& r, BeamGroup& g) {
  const CompletionRequest& cr = *r.req;
  const auto best = g.search->best(size_t(cr.n));
  for (size_t j = 0; j < size_t(cr.n); ++j) {
    ChoiceUpdate u;
    u.choice = g.prompt * size_t(cr.n) + j;
    TextStream text(*tokenizer_, {});
    if (j < best.size()) {
      const BeamSearch::Hypothesis& h = best[j];
      for (size_t t = 0; t < h.tokens.size(); ++t) {
        u.tokens.push_back({h.tokens[t], h.logprobs[t], {}});
        if (!(h.stopped && t + 1 == h.tokens.size())) u.text += text.push(h.tokens[t]);  // the stop token adds no text
      }
      u.finish_reason = h.stopped ? "stop" : "length";
    } else {
      u.finish_reason = "length";  // fewer hypotheses finished than asked (cannot happen with one stop id)
    }
    u.text += text.flush();
    u.cached_prompt_tokens = r.cached_tokens[g.prompt];
    r.sink.on_update(std::move(u));
    if (--r.unfinished == 0) {
      finish_request(r, "");  // destroys r
      return;
    }
  }
}

void Scheduler::take_token(Sequence& s, SeqResult sr) {
  const bool ahead = std::exchange(s.ahead, false);  // its step ahead is in flight still, on this token
  s.in_flight = ahead;
  const CompletionRequest& r = *s.request->req;
  // Prompt log-probs: entry j predicts the token at position start + 1 + j.
  if (!s.prompt_lp.empty()) {
    size_t pos = s.prompt_lp.size();
    for (size_t j = 0; j < sr.prompt_logprobs.size() && pos < s.prompt_len; ++j, ++pos)
      s.prompt_lp.push_back({s.all[pos], sr.prompt_logprobs[j],
                             j < sr.prompt_top.size() ? std::move(sr.prompt_top[j]) : std::vector<std::pair<int32_t, float>>{}});
  }
  if (sr.token < 0) {
    // max_tokens 0 (the scoring idiom): done once its prompt's last chunk has come back.
    if (max_tokens_of(r, s.prompt_len) == 0 && s.fed == s.all.size()) {
      s.finished = true;
      deliveries_.push_back({s.id, {}, "length", false});
    }
    return;
  }
  ++s.request->generated;
  if (!s.request->first_token_at) s.request->first_token_at = Clock::now();
  if (!s.prefix_offered) retain_prefix(s);  // it sampled: its prompt's K/V is complete on every stage
  s.all.push_back(sr.token);
  if (ahead) ++s.fed;
  Delivery d{s.id, {sr.token, sr.logprob, std::move(sr.top)}, nullptr, false};
  const int32_t eos = int32_t(cfg_.model.eos_token_id);
  const auto& stops = r.sampling.stop_token_ids;
  d.is_stop_token = int(s.generated()) > r.sampling.min_tokens - 1 &&
                    ((!r.ignore_eos && eos >= 0 && sr.token == eos) ||
                     std::find(stops.begin(), stops.end(), sr.token) != stops.end());
  if (d.is_stop_token) d.finish = "stop";
  else if (int64_t(s.generated()) >= max_tokens_of(r, s.prompt_len) || int64_t(s.all.size()) >= cfg_.model.n_positions)
    d.finish = "length";
  // Ended here: not stepped again (finish_sequence, in deliver, sends the frees).
  if (d.finish) s.finished = true;
  deliveries_.push_back(std::move(d));
}

void Scheduler::deliver() {
  std::vector<GroupDelivery> gs = std::move(group_deliveries_);
  group_deliveries_.clear();
  for (const GroupDelivery& gd : gs) {
    auto it = running_.find(gd.request);  // it may have failed meanwhile
    if (it == running_.end() || it->second->failed) continue;
    deliver_group(*gd.request, gd.request->groups[gd.group]);
  }
  std::vector<Delivery> ds = std::move(deliveries_);
  deliveries_.clear();
  for (Delivery& d : ds) {
    auto it = seqs_.find(d.seq_id);  // its request may have ended meanwhile (failed, or all choices done)
    if (it == seqs_.end() || it->second.request->failed) continue;
    if (it->second.finished && !d.finish) continue;  // ended meanwhile
    deliver_one(it->second, std::move(d));
  }
}

void Scheduler::deliver_one(Sequence& s, Delivery d) {
  ChoiceUpdate u;
  u.choice = s.choice;
  if (!s.prompt_lp.empty() && !s.prompt_lp_sent) {
    u.prompt_tokens = s.prompt_lp;
    s.prompt_lp_sent = true;
  }
  const int32_t token = d.token.id;
  if (token >= 0) u.tokens.push_back(std::move(d.token));  // none: the scoring idiom's only update
  if (token >= 0 && !d.is_stop_token) u.text = s.text->push(token);
  if (d.is_stop_token || s.text->stopped()) {
    finish_sequence(s, "stop", std::move(u));  // may destroy s and its request
  } else if (d.finish) {
    finish_sequence(s, d.finish, std::move(u));
  } else {
    emit(s, std::move(u));
  }
}

// Sends the choice's last update, then releases the sequence; the last choice of a request
// finishes the request (which destroys it and its sequences).
void Scheduler::finish_sequence(Sequence& s, const char* reason, ChoiceUpdate update) {
  s.finished = true;
  s.in_flight = s.ahead = false;
  update.text += s.text->flush();
  update.finish_reason = reason;
  Request& r = *s.request;
  update.cached_prompt_tokens = r.cached_tokens[s.choice / r.req->slots_per_prompt()];
  emit(s, std::move(update));
  if (s.pipeline >= 0) pipelines_[size_t(s.pipeline)].pending_frees.push_back(s.id);
  if (--r.unfinished == 0) finish_request(r, "");
}

std::optional<Clock::time_point> Scheduler::expiry_deadline() const {
  if (cfg_.request_timeout_ms <= 0 || (queue_.empty() && running_.empty())) return std::nullopt;
  Clock::time_point first = queue_.empty() ? Clock::time_point::max() : queue_.front()->queued_at;
  for (const auto& [rp, _] : running_) first = std::min(first, rp->queued_at);
  return first + std::chrono::milliseconds(cfg_.request_timeout_ms);
}

void Scheduler::restart(int index) {
  // Its stages drop every sequence, cache entries included.
  prefix_cache(index).clear();
  retain_forks(index).clear();
  std::unordered_set<Request*> replayed;  // requests with K/V on its stages: fed again (the request log)
  for (auto& [_, s] : seqs_)
    if (s.pipeline == index) {
      if (s.fed > 0) replayed.insert(s.request);
      s.fed = 0;
      s.in_flight = s.ahead = false;
      s.prefix_done = s.prefix_offered = false;
    }
  for (auto& [rp, _] : running_)
    if (rp->pipeline == index) reset_groups(*rp);
  for (Request* r : replayed) ++r->replays;
}

void Scheduler::redistribute() {
  for (PipelineRun& p : pipelines_) {
    p.kv_reserved = 0;
    prefix_cache(p.index).clear();
    retain_forks(p.index).clear();
  }
  for (auto& [rp, _] : running_) {
    PipelineRun& p = *std::min_element(pipelines_.begin(), pipelines_.end(),
                                    [](const PipelineRun& a, const PipelineRun& b) { return a.kv_reserved < b.kv_reserved; });
    rp->pipeline = p.index;
    p.kv_reserved += rp->kv_need;
    ++rp->replays;
    reset_groups(*rp);
    for (uint64_t id : rp->seq_ids)
      if (auto it = seqs_.find(id); it != seqs_.end()) {
        it->second.pipeline = p.index;
        it->second.fed = 0;
        it->second.in_flight = it->second.ahead = false;
        it->second.prefix_done = it->second.prefix_offered = false;
      }
  }
}

Scheduler::Sequence& Scheduler::add_sequence(Request& r, size_t choice, int pipeline, std::vector<int32_t> tokens,
                                             size_t prompt_len) {
  Sequence s;
  s.id = next_seq_id_++;
  s.request = &r;
  s.choice = choice;
  s.pipeline = pipeline;
  s.all = std::move(tokens);
  s.prompt_len = prompt_len;
  r.seq_ids.push_back(s.id);
  return seqs_.emplace(s.id, std::move(s)).first->second;
}

PrefixCache& Scheduler::prefix_cache(int pipeline) {
  PipelineRun& p = pipelines_[size_t(pipeline)];
  const auto granule = int32_t(std::clamp<int64_t>(p.figures.kv_page_tokens, 1, 1 << 20));
  while (prefix_.size() <= size_t(pipeline)) prefix_.emplace_back(granule);
  PrefixCache& cache = prefix_[size_t(pipeline)];
  if (cache.granule_tokens() != granule) {  // other workers: entries of the old granule go
    for (uint64_t id : cache.evict_lru(cache.cached_tokens())) p.pending_frees.push_back(id);
    cache = PrefixCache(granule);
  }
  return cache;
}

std::vector<SeqFork>& Scheduler::retain_forks(int pipeline) {
  if (retain_forks_.size() <= size_t(pipeline)) retain_forks_.resize(size_t(pipeline) + 1);
  return retain_forks_[size_t(pipeline)];
}

int64_t& Scheduler::budget(int pipeline) {
  if (kv_budget_.size() <= size_t(pipeline)) kv_budget_.resize(size_t(pipeline) + 1, 0);
  return kv_budget_[size_t(pipeline)];
}

int64_t Scheduler::prefix_match(PipelineRun& p, const CompletionRequest& r) {
  if (r.echo && r.logprobs >= 0) return 0;
  int64_t n = 0;
  for (const auto& prompt : r.prompts) n += prefix_cache(p.index).match_length(prompt);
  return n;
}

bool Scheduler::make_room(PipelineRun& p, int64_t tokens) {
  PrefixCache& cache = prefix_cache(p.index);
  const int64_t over = p.kv_reserved + cache.cached_tokens() + tokens - budget(p.index);
  if (over <= 0) return true;
  if (over > cache.cached_tokens()) return false;
  for (uint64_t id : cache.evict_lru(over)) p.pending_frees.push_back(id);
  return true;
}

// A sequence's first prefill: fork the longest cached prefix of its prompt (sent ahead of its
// slice in the same micro-batch) and compute only the rest.
void Scheduler::reuse_prefix(PipelineRun& p, Sequence& s, StepPlan& b) {
  s.prefix_done = true;
  const CompletionRequest& r = *s.request->req;
  if (!cfg_.prefix_cache || !s.prompt_lp.empty()) return;
  const std::span<const int32_t> prompt(s.all.data(), s.prompt_len);
  ++prefix_stats_.lookups;
  const auto hit = prefix_cache(p.index).lookup(prompt);
  const int64_t reused = hit ? hit->num_tokens : 0;
  if (s.choice % r.slots_per_prompt() == 0) s.request->cached_tokens[s.choice / r.slots_per_prompt()] = reused;
  prefix_stats_.reused_tokens += reused;
  prefix_stats_.computed_tokens += int64_t(s.prompt_len) - reused;
  if (!hit) return;
  ++prefix_stats_.hits;
  b.forks.push_back({hit->entry_seq_id, s.id, hit->num_tokens});
  s.fed = size_t(hit->num_tokens);
}

// A sequence whose prompt the stages have computed offers its whole granules to the cache,
// as a new entry forked from it on the pipeline's next micro-batch, in room that running
// requests leave.
void Scheduler::retain_prefix(Sequence& s) {
  s.prefix_offered = true;
  if (!cfg_.prefix_cache || s.pipeline < 0 || !s.prompt_lp.empty()) return;
  PipelineRun& p = pipelines_[size_t(s.pipeline)];
  PrefixCache& cache = prefix_cache(p.index);
  const std::span<const int32_t> prompt(s.all.data(), s.prompt_len);
  const int64_t whole = int64_t(s.prompt_len) / cache.granule_tokens() * cache.granule_tokens();
  if (whole == 0) return;
  if (cache.cached_length(prompt) < whole && !make_room(p, whole)) return;
  if (auto kept = cache.retain(prompt, next_seq_id_))
    retain_forks(p.index).push_back({s.id, next_seq_id_++, kept->num_tokens});
}

Scheduler::PrefixStats Scheduler::prefix_stats() const {
  PrefixStats st = prefix_stats_;
  for (const PrefixCache& c : prefix_) {
    st.entries += int64_t(c.entries());
    st.cached_tokens += c.cached_tokens();
  }
  return st;
}

bool Scheduler::busy(int index) const {
  return std::any_of(seqs_.begin(), seqs_.end(),
                     [&](const auto& e) { return !e.second.finished && e.second.pipeline == index; });
}

void Scheduler::wait_idle(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout) {
  idle_cv_.wait_for(lock, timeout, [&] { return outstanding() == 0; });
}

}  // namespace conveyor

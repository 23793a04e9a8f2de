#include "coordinator/beam_search.h"

#include <algorithm>
#include <cmath>

namespace conveyor {

const char* early_stopping_name(EarlyStopping e) {
  switch (e) {
    case EarlyStopping::Heuristic: return "false";
    case EarlyStopping::Stop: return "true";
    case EarlyStopping::Never: return "never";
  }
  return "?";
}

BeamSearch::BeamSearch(BeamSearchOptions options) : options_(std::move(options)) { live_.emplace_back(); }

bool BeamSearch::is_stop(int32_t token) const {
  return std::find(options_.stop_ids.begin(), options_.stop_ids.end(), token) != options_.stop_ids.end();
}

std::vector<BeamSearch::Hypothesis> BeamSearch::best(size_t n) const {
  return {finished_.begin(), finished_.begin() + int64_t(std::min(n, finished_.size()))};
}

Expected<std::vector<BeamSearch::Candidate>> BeamSearch::best_candidates(
    std::span<const std::vector<std::pair<int32_t, float>>> alternatives) const {
  const size_t K = 2 * size_t(options_.beam_width);
  std::vector<Candidate> cands;
  for (size_t b = 0; b < live_.size(); ++b) {
    const auto& alts = alternatives[b];
    if (alts.empty()) return Status::error("beam search: beam " + std::to_string(b) + " reported no alternatives");
    for (size_t i = 0; i < std::min(K, alts.size()); ++i)
      cands.push_back({live_[b].score + double(alts[i].second), b, alts[i].first, alts[i].second});
  }
  std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.beam != b.beam) return a.beam < b.beam;
    return a.token < b.token;
  });
  if (cands.size() > K) cands.resize(K);
  return cands;
}

void BeamSearch::keep_finished(const Beam& parent, const Candidate& c, int g1) {
  Hypothesis h;
  h.tokens = parent.tokens;
  h.tokens.push_back(c.token);
  h.logprobs = parent.logprobs;
  h.logprobs.push_back(c.logprob);
  h.score = c.score / std::pow(double(g1), double(options_.length_penalty));
  h.stopped = is_stop(c.token);
  // After the hypotheses already kept with an equal score (they came first in HF's merge).
  auto at = std::upper_bound(finished_.begin(), finished_.end(), h.score,
                             [](double s, const Hypothesis& x) { return s > x.score; });
  finished_.insert(at, std::move(h));
  if (finished_.size() > size_t(options_.beam_width)) finished_.pop_back();
}

Expected<std::vector<BeamSearch::Continuation>> BeamSearch::step(
    std::span<const std::vector<std::pair<int32_t, float>>> alternatives) {
  if (done_) return Status::error("beam search: step after the search is done");
  if (alternatives.size() != live_.size())
    return Status::error("beam search: " + std::to_string(alternatives.size()) + " beams reported alternatives, " +
                         std::to_string(live_.size()) + " are live");
  const size_t B = size_t(options_.beam_width);
  const double lp_exp = double(options_.length_penalty);

  // 1. The K best candidates over all beams.
  auto best = best_candidates(alternatives);
  if (!best) return best.status();
  const std::vector<Candidate>& cands = *best;

  // 2-4. Running beams and finished hypotheses.
  const int g1 = generated_ + 1;  // the candidates' generated length
  const bool at_length = g1 >= options_.max_new_tokens;
  const bool was_full = finished_.size() >= B;
  std::vector<Continuation> next;
  std::vector<Beam> next_live;
  bool all_stop = true;
  for (size_t r = 0; r < cands.size(); ++r) {
    const Candidate& c = cands[r];
    const bool stops = at_length || is_stop(c.token);
    all_stop = all_stop && stops;
    const Beam& parent = live_[c.beam];
    if (!stops) {
      if (next_live.size() < B) {
        Beam nb = parent;
        nb.tokens.push_back(c.token);
        nb.logprobs.push_back(c.logprob);
        nb.score = c.score;
        next_live.push_back(std::move(nb));
        next.push_back({c.beam, c.token});
      }
      continue;
    }
    if (r >= B || (options_.early_stopping == EarlyStopping::Stop && was_full)) continue;
    keep_finished(parent, c, g1);
  }
  live_ = std::move(next_live);
  generated_ = g1;

  // 5. Done?
  const bool full = finished_.size() >= B;
  if (all_stop || live_.empty() || (options_.early_stopping == EarlyStopping::Stop && full)) done_ = true;
  if (!done_ && full) {
    const int L = options_.early_stopping == EarlyStopping::Never && lp_exp > 0 ? options_.max_new_tokens : generated_;
    const double best_possible = live_.front().score / std::pow(double(L), lp_exp);
    if (!(best_possible > finished_.back().score)) improving_ = false;
  }
  if (!improving_) done_ = true;
  return next;
}

}  // namespace conveyor

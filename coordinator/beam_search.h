// Beam search bookkeeping for one prompt: which beams live on, which hypotheses are finished,
// and when the search is done, as HuggingFace transformers' beam search decides it
// (GenerationMixin._beam_search, transformers >= 4.50; see docs/API.md "Beam search").
// Pure logic, no pipeline: the scheduler feeds it each step's alternatives and turns its
// decisions into sequences, K/V forks and frees.
//
// One step, with B beams, g tokens generated so far by every live beam, K = 2B candidates
// (HF keeps max(2, 1 + number of EOS ids) x B; one EOS id or none gives 2B):
//  1. Every live beam b (score s_b = the sum of its tokens' log-probs) reports its top-K
//     tokens t with log-probs lp (the raw distribution, kernels/cpu/sampling.h); candidate
//     (b, t) scores s_b + lp. The K best candidates over all beams are kept, best first (ties:
//     lower beam, then lower token id). A beam's top K suffice: no candidate outside them can
//     be among the K best.
//  2. A candidate "stops" when t is a stop id or it reaches max_new_tokens (g + 1).
//  3. Running beams: the B best candidates that do not stop. (HF's running beams that stop
//     are pushed below -1e9; with at most one stop id there are always B others.)
//  4. Finished hypotheses: each stopping candidate among the first B of the K (rank < B)
//     scores (s_b + lp) / (g + 1)^length_penalty: the generated length, the stop token
//     included, the prompt not. They join the finished list (at most B, best first) unless
//     early_stopping is true and the list was already full, or the search had already
//     stopped improving.
//  5. Done when, after the step: early_stopping is true and the finished list is full; or every
//     candidate stopped; or the finished list is full and no running beam can beat its
//     worst: best running score / L^length_penalty <= worst finished score, where L = g + 1,
//     except early_stopping "never" with length_penalty > 0 takes L = max_new_tokens.
// The answer: the first n finished hypotheses, best first.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace conveyor {

// HuggingFace's early_stopping: false (the heuristic of step 5), true, or "never".
enum class EarlyStopping { Heuristic, Stop, Never };

struct BeamSearchOptions {
  int beam_width = 1;              // B, 1..kMaxBeamWidth
  int max_new_tokens = 16;         // >= 1
  float length_penalty = 1.0f;
  EarlyStopping early_stopping = EarlyStopping::Heuristic;
  std::vector<int32_t> stop_ids;   // the end-of-text id (empty with ignore_eos); at most one
};

// 2B alternatives a beam must report; the last stage reports at most 20.
constexpr int kMaxBeamWidth = 10;

class BeamSearch {
 public:
  struct Beam {
    std::vector<int32_t> tokens;   // generated so far
    std::vector<float> logprobs;   // each token's raw log-prob
    double score = 0;              // sum of logprobs
  };
  struct Hypothesis {
    std::vector<int32_t> tokens;   // generated, the stop token included when it ended on one
    std::vector<float> logprobs;
    double score = 0;              // sum of logprobs / len^length_penalty
    bool stopped = false;          // ended on a stop id (else: max_new_tokens)
  };
  // Where a new live beam came from: the index of its parent among the previous live beams,
  // and its new token.
  struct Continuation {
    size_t parent = 0;
    int32_t token = -1;
  };

  // Starts with one live beam: the prompt, nothing generated.
  explicit BeamSearch(BeamSearchOptions options);

  // Alternatives a live beam must report per step: 2B.
  int alternatives_needed() const { return 2 * options_.beam_width; }

  // One step: alternatives[b] = live beam b's top tokens with their log-probs, best first (at
  // least min(2B, vocabulary) of them). Returns the new live beams' origins, in the new beams'
  // order (best first), or an error naming what is wrong with the input. After done(), the
  // live beams are of no further use.
  Expected<std::vector<Continuation>> step(std::span<const std::vector<std::pair<int32_t, float>>> alternatives);

  bool done() const { return done_; }
  const std::vector<Beam>& live() const { return live_; }
  const std::vector<Hypothesis>& finished() const { return finished_; }
  int generated() const { return generated_; }  // g: tokens every live beam holds
  // The first n finished hypotheses, best first (fewer only when fewer finished).
  std::vector<Hypothesis> best(size_t n) const;
  const BeamSearchOptions& options() const { return options_; }

 private:
  // A continuation of a live beam, scored as the beam's score plus its token's log-prob.
  struct Candidate {
    double score;
    size_t beam;
    int32_t token;
    float logprob;
  };
  bool is_stop(int32_t token) const;
  // The 2B best candidates over all beams, best first (ties: lower beam, then lower token).
  Expected<std::vector<Candidate>> best_candidates(std::span<const std::vector<std::pair<int32_t, float>>> alternatives) const;
  // Keeps `c` (which stops, at generated length g1) among the B best finished hypotheses.
  void keep_finished(const Beam& parent, const Candidate& c, int g1);

  BeamSearchOptions options_;
  std::vector<Beam> live_;
  std::vector<Hypothesis> finished_;  // best first, at most B
  int generated_ = 0;
  bool improving_ = true;  // HF's is_early_stop_heuristic_unsatisfied
  bool done_ = false;
};

// "false", "true" or "never", for messages.
const char* early_stopping_name(EarlyStopping e);

}  // namespace conveyor

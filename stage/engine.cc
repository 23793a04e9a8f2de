#include "stage/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/sampling.h"

namespace conveyor {
namespace {

constexpr int64_t kLogitRowsPerCall = 64;  // bounds the all-positions logits buffer (rows x V)

// One request in flight.
struct Sequence {
  size_t request = 0;
  uint64_t seq_id = 0;
  int32_t prompt_fed = 0;  // prompt tokens already run through the stage
  std::vector<int32_t> generated;
  SamplingParams sampling;  // the request's, with eos added to the stop ids
  bool done = false;
};

// Frees the engine's sequences from the stage however generate() returns.
struct SequenceReleaser {
  CpuStage& stage;
  std::vector<Sequence>& seqs;
  ~SequenceReleaser() {
    for (const Sequence& s : seqs) stage.free_sequence(s.seq_id);
  }
};

}  // namespace

Expected<std::unique_ptr<Engine>> Engine::create(StageWeights weights, EngineOptions options) {
  if (weights.layer_begin != 0 || weights.layer_end != weights.config.n_layer)
    return Status::error("the engine needs the whole model, got layers [" + std::to_string(weights.layer_begin) +
                         ", " + std::to_string(weights.layer_end) + ") of " + std::to_string(weights.config.n_layer));
  if (options.max_batch_tokens < 1) return Status::error("EngineOptions.max_batch_tokens must be >= 1");
  auto stage = CpuStage::create(std::move(weights));
  if (!stage) return stage.status();
  return std::unique_ptr<Engine>(new Engine(std::move(stage).value(), options));
}

Status Engine::validate(const GenerationRequest& r) const {
  const ModelConfig& c = config();
  if (r.prompt.empty()) return Status::error("prompt is empty: at least one token is needed");
  for (int32_t id : r.prompt)
    if (id < 0 || id >= c.vocab_size)
      return Status::error("prompt holds token id " + std::to_string(id) + ", outside the vocabulary [0, " +
                           std::to_string(c.vocab_size) + ")");
  if (r.max_new_tokens < 0) return Status::error("max_new_tokens must be >= 0");
  const int64_t P = int64_t(r.prompt.size());
  if (P > c.n_positions || (r.max_new_tokens > 0 && P >= c.n_positions))
    return Status::error("prompt of " + std::to_string(P) + " tokens leaves no room to generate in the model's " +
                         std::to_string(c.n_positions) + "-token context");
  if (r.logprobs < 0 || r.logprobs > c.vocab_size)
    return Status::error("logprobs must be in [0, vocab_size]");
  return validate_sampling_params(r.sampling, c.vocab_size);
}

// One generate() call: its requests, their results and sequences.
struct Engine::Run {
  Engine& e;
  const std::vector<GenerationRequest>& requests;
  const TokenCallback& on_token;
  const int64_t C, V;
  std::vector<GenerationResult> results;
  std::vector<Sequence> seqs;
  SequenceReleaser releaser{*e.stage_, seqs};
  // The micro-batch being built.
  std::vector<SeqSlice> slices;
  std::vector<int32_t> ids;
  std::vector<Sequence*> slice_seqs;

  Run(Engine& engine, const std::vector<GenerationRequest>& r, const TokenCallback& cb)
      : e(engine), requests(r), on_token(cb), C(e.config().n_embd), V(e.config().vocab_size), results(r.size()) {}

  void admit();
  void take_token(Sequence& s, const float* row);
  Status echo_logprobs(const Sequence& s, const float* hidden_rows, int32_t first, int32_t n);
  Expected<bool> prefill_step();  // false when every prompt is in
  Expected<bool> decode_step();   // false when every sequence is done
};

// A sequence per request that computes anything, with eos joined to its stop ids.
void Engine::Run::admit() {
  const ModelConfig& c = e.config();
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    results[i].finish_reason = "length";
    if (r.max_new_tokens == 0 && !r.echo_logprobs) continue;  // nothing to compute
    Sequence& s = seqs.emplace_back();
    s.request = i;
    s.seq_id = e.next_seq_id_++;
    s.sampling = r.sampling;
    if (!r.ignore_eos && c.eos_token_id >= 0 && c.eos_token_id < V &&
        std::find(s.sampling.stop_token_ids.begin(), s.sampling.stop_token_ids.end(), c.eos_token_id) ==
            s.sampling.stop_token_ids.end())
      s.sampling.stop_token_ids.push_back(int32_t(c.eos_token_id));
    if (r.max_new_tokens == 0) s.done = true;  // echo only: prefill, no sampling
  }
}

// Samples the next token of `s` from its raw logits row; records it and decides stopping.
void Engine::Run::take_token(Sequence& s, const float* row) {
  const GenerationRequest& r = requests[s.request];
  GenerationResult& res = results[s.request];
  e.scratch_.assign(row, row + V);
  const int32_t token = sample_next(e.scratch_, s.sampling, r.prompt, s.generated, r.sample_index);
  const TokenLogprobs lp = token_logprobs(std::span<const float>(row, size_t(V)), token, r.logprobs);
  s.generated.push_back(token);
  res.tokens.push_back(token);
  res.token_logprobs.push_back(lp.logprob);
  if (r.logprobs > 0) res.top_logprobs.push_back(lp.top);
  if (on_token) on_token(s.request, token, lp.logprob);
  const auto& stops = s.sampling.stop_token_ids;
  const bool is_stop = std::find(stops.begin(), stops.end(), token) != stops.end() &&
                       int64_t(s.generated.size()) > int64_t(s.sampling.min_tokens);
  if (is_stop) {
    res.finish_reason = "stop";
    s.done = true;
  } else if (int64_t(s.generated.size()) >= r.max_new_tokens ||
             int64_t(r.prompt.size() + s.generated.size()) >= e.config().n_positions) {
    res.finish_reason = "length";
    s.done = true;
  }
}

// Echo: log-probs of prompt tokens p+1 from the rows of positions p in [first, first+n).
Status Engine::Run::echo_logprobs(const Sequence& s, const float* hidden_rows, int32_t first, int32_t n) {
  const GenerationRequest& r = requests[s.request];
  GenerationResult& res = results[s.request];
  const int32_t P = int32_t(r.prompt.size());
  if (first == 0) {
    res.prompt_logprobs.assign(1, std::numeric_limits<float>::quiet_NaN());
    if (r.logprobs > 0) res.prompt_top_logprobs.assign(1, {});
  }
  for (int32_t off = 0; off < n; off += int32_t(kLogitRowsPerCall)) {
    const int32_t rows = std::min<int32_t>(int32_t(kLogitRowsPerCall), n - off);
    const SeqSlice chunk{s.seq_id, first + off, rows};
    e.logits_.resize(size_t(rows * V));
    if (Status st = e.stage_->logits({&chunk, 1}, hidden_rows + int64_t(off) * C, true, e.logits_.data()); !st)
      return st;
    for (int32_t i = 0; i < rows; ++i) {
      const int32_t next = first + off + i + 1;
      if (next >= P) break;
      const TokenLogprobs lp = token_logprobs(std::span<const float>(e.logits_.data() + int64_t(i) * V, size_t(V)),
                                              r.prompt[size_t(next)], r.logprobs);
      res.prompt_logprobs.push_back(lp.logprob);
      if (r.logprobs > 0) res.prompt_top_logprobs.push_back(lp.top);
    }
  }
  return ok_status();
}

// One prefill micro-batch: prompts in chunks, at most max_batch_tokens tokens. Sequences
// whose prompt ends in it sample their first token from its last row; those rows are
// gathered so one LM-head call serves them all.
Expected<bool> Engine::Run::prefill_step() {
  slices.clear(), ids.clear(), slice_seqs.clear();
  int64_t budget = e.options_.max_batch_tokens;
  for (Sequence& s : seqs) {
    const auto& prompt = requests[s.request].prompt;
    const int64_t remaining = int64_t(prompt.size()) - s.prompt_fed;
    if (remaining <= 0 || budget <= 0) continue;
    const int32_t n = int32_t(std::min(remaining, budget));
    slices.push_back({s.seq_id, s.prompt_fed, n});
    ids.insert(ids.end(), prompt.begin() + s.prompt_fed, prompt.begin() + s.prompt_fed + n);
    slice_seqs.push_back(&s);
    budget -= n;
  }
  if (slices.empty()) return false;
  std::vector<float>& hidden = e.hidden_;
  hidden.resize(ids.size() * size_t(C));
  if (Status st = e.stage_->embed(slices, ids.data(), hidden.data()); !st) return st;
  if (Status st = e.stage_->forward(slices, hidden.data()); !st) return st;

  std::vector<SeqSlice> last_rows;
  std::vector<Sequence*> last_seqs;
  std::vector<float> gathered;
  int64_t row = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    Sequence& s = *slice_seqs[i];
    const SeqSlice& sl = slices[i];
    if (requests[s.request].echo_logprobs)
      if (Status st = echo_logprobs(s, hidden.data() + row * C, sl.start_pos, sl.num_tokens); !st) return st;
    s.prompt_fed += sl.num_tokens;
    row += sl.num_tokens;
    if (s.prompt_fed == int32_t(requests[s.request].prompt.size()) && !s.done) {
      last_rows.push_back({s.seq_id, s.prompt_fed - 1, 1});
      last_seqs.push_back(&s);
      gathered.insert(gathered.end(), hidden.data() + (row - 1) * C, hidden.data() + row * C);
    }
  }
  if (last_rows.empty()) return true;
  e.logits_.resize(last_rows.size() * size_t(V));
  if (Status st = e.stage_->logits(last_rows, gathered.data(), false, e.logits_.data()); !st) return st;
  for (size_t i = 0; i < last_seqs.size(); ++i) take_token(*last_seqs[i], e.logits_.data() + i * size_t(V));
  return true;
}

// One decode micro-batch: every live sequence's newest token.
Expected<bool> Engine::Run::decode_step() {
  slices.clear(), ids.clear(), slice_seqs.clear();
  for (Sequence& s : seqs) {
    if (s.done) continue;
    const int32_t pos = int32_t(requests[s.request].prompt.size() + s.generated.size()) - 1;
    slices.push_back({s.seq_id, pos, 1});
    ids.push_back(s.generated.back());
    slice_seqs.push_back(&s);
  }
  if (slices.empty()) return false;
  const int64_t T = int64_t(slices.size());
  e.hidden_.resize(size_t(T * C));
  if (Status st = e.stage_->embed(slices, ids.data(), e.hidden_.data()); !st) return st;
  if (Status st = e.stage_->forward(slices, e.hidden_.data()); !st) return st;
  e.logits_.resize(size_t(T * V));
  if (Status st = e.stage_->logits(slices, e.hidden_.data(), false, e.logits_.data()); !st) return st;
  for (size_t i = 0; i < slice_seqs.size(); ++i) {
    Sequence& s = *slice_seqs[i];
    take_token(s, e.logits_.data() + i * size_t(V));
    if (s.done) e.stage_->free_sequence(s.seq_id);
  }
  return true;
}

Expected<std::vector<GenerationResult>> Engine::generate(const std::vector<GenerationRequest>& requests,
                                                         const TokenCallback& on_token) {
  for (size_t i = 0; i < requests.size(); ++i)
    if (Status s = validate(requests[i]); !s) return Status::error("request " + std::to_string(i) + ": " + s.message());
  Run run(*this, requests, on_token);
  run.admit();
  for (;;) {
    Expected<bool> more = run.prefill_step();
    if (!more) return more.status();
    if (!more.value()) break;
  }
  for (Sequence& s : run.seqs)
    if (s.done) stage_->free_sequence(s.seq_id);
  for (;;) {
    Expected<bool> more = run.decode_step();
    if (!more) return more.status();
    if (!more.value()) break;
  }
  return std::move(run.results);
}

Expected<double> Engine::mean_nll(std::span<const int32_t> tokens) {
  const ModelConfig& c = config();
  const int64_t C = c.n_embd, V = c.vocab_size, P = c.n_positions;
  if (tokens.size() < 2) return Status::error("perplexity needs at least two tokens");
  for (int32_t id : tokens)
    if (id < 0 || id >= V)
      return Status::error("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                           std::to_string(V) + ")");
  double nll = 0.0;
  int64_t scored = 0;
  for (int64_t w0 = 0; w0 < int64_t(tokens.size()); w0 += P) {
    const int64_t wlen = std::min<int64_t>(P, int64_t(tokens.size()) - w0);
    if (wlen < 2) break;  // a lone last token has no context in its window
    const uint64_t seq = next_seq_id_++;
    struct Free {
      CpuStage& st;
      uint64_t id;
      ~Free() { st.free_sequence(id); }
    } release{*stage_, seq};
    for (int64_t c0 = 0; c0 < wlen; c0 += options_.max_batch_tokens) {
      const int32_t n = int32_t(std::min(options_.max_batch_tokens, wlen - c0));
      const SeqSlice slice{seq, int32_t(c0), n};
      hidden_.resize(size_t(n * C));
      if (Status st = stage_->embed({&slice, 1}, tokens.data() + w0 + c0, hidden_.data()); !st) return st;
      if (Status st = stage_->forward({&slice, 1}, hidden_.data()); !st) return st;
      for (int32_t off = 0; off < n; off += int32_t(kLogitRowsPerCall)) {
        const int32_t rows = std::min<int32_t>(int32_t(kLogitRowsPerCall), n - off);
        const SeqSlice part{seq, int32_t(c0) + off, rows};
        logits_.resize(size_t(rows * V));
        if (Status st = stage_->logits({&part, 1}, hidden_.data() + int64_t(off) * C, true, logits_.data()); !st)
          return st;
        for (int32_t i = 0; i < rows; ++i) {
          const int64_t next = c0 + off + i + 1;  // index within the window
          if (next >= wlen) break;
          const std::span<const float> row(logits_.data() + int64_t(i) * V, size_t(V));
          nll += log_sum_exp(row) - double(row[size_t(tokens[size_t(w0 + next)])]);
          ++scored;
        }
      }
    }
  }
  if (scored == 0) return Status::error("perplexity: no token could be scored");
  return nll / double(scored);
}

Expected<double> Engine::perplexity(std::span<const int32_t> tokens) {
  Expected<double> nll = mean_nll(tokens);
  if (!nll) return nll.status();
  return std::exp(*nll);
}

}  // namespace conveyor

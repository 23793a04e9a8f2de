// Engine: single-process text generation on one CpuStage that holds the whole model.
// It is the reference for what the distributed pipeline must produce (same tokens for
// the same requests and seeds), and what CPU tests and benchmarks drive.
//
// generate() runs continuous batching in its simplest form: all prompts are prefilled
// (in chunks of at most max_batch_tokens tokens per micro-batch), then every decode step
// runs each live sequence's newest token in one micro-batch. Because the stage is
// batch-invariant, a request's tokens are the same whether it runs alone or with others.
//
// Stopping: a sequence stops with "stop" when it draws one of its stop ids (the request's
// stop_token_ids, plus the model's eos_token_id unless ignore_eos) once at least
// min_tokens tokens were generated; the stop token is the last entry of `tokens`. It stops
// with "length" at max_new_tokens or when prompt + generated tokens fill n_positions.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "stage/cpu/cpu_stage.h"
#include "common/sampling_params.h"
#include "model/weights.h"

namespace conveyor {

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids, at least one
  int max_new_tokens = 16;
  SamplingParams sampling;
  int logprobs = 0;             // report the top-N log-probs of each generated token (0: none)
  bool echo_logprobs = false;   // also report the prompt tokens' log-probs
  bool ignore_eos = false;      // do not stop at the model's eos_token_id
  uint64_t sample_index = 0;    // which of a request's n choices (Philox counter word)
};

// Log-probs are under the raw model distribution (see kernels/cpu/sampling.h).
struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids (the stop id included when finish_reason is "stop")
  std::vector<float> token_logprobs;  // one per generated token
  std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;  // per token, when logprobs > 0
  std::string finish_reason;          // "stop" or "length"
  // echo_logprobs only, one per prompt token: entry 0 is NaN (no context, OpenAI's null).
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> prompt_top_logprobs;  // when logprobs > 0
};

// Called once per generated token, in step order: request index, token id, its log-prob.
using TokenCallback = std::function<void(size_t request, int32_t token, float logprob)>;

struct EngineOptions {
  int64_t max_batch_tokens = 512;  // prefill tokens per micro-batch (decode steps are smaller)
};

class Engine {
 public:
  // `weights` must hold the whole model (layers 0..n_layer, embedding and head); the error
  // says what is wrong otherwise.
  static Expected<std::unique_ptr<Engine>> create(StageWeights weights, EngineOptions options = {});

  const ModelConfig& config() const { return stage_->config(); }
  CpuStage& stage() { return *stage_; }

  Expected<std::vector<GenerationResult>> generate(const std::vector<GenerationRequest>& requests,
                                                   const TokenCallback& on_token = {});

  // Mean negative log-likelihood (nats per token) of tokens[1..] given their prefixes.
  // Sequences longer than n_positions are cut into consecutive disjoint windows of
  // n_positions tokens, each scored independently: every token but each window's first
  // is predicted from the tokens before it in its window.
  Expected<double> mean_nll(std::span<const int32_t> tokens);
  // exp(mean_nll(tokens)).
  Expected<double> perplexity(std::span<const int32_t> tokens);

 private:
  Engine(std::unique_ptr<CpuStage> stage, EngineOptions options) : stage_(std::move(stage)), options_(options) {}
  Status validate(const GenerationRequest& r) const;
  struct Run;  // one generate() call (engine.cc)

  std::unique_ptr<CpuStage> stage_;
  EngineOptions options_;
  uint64_t next_seq_id_ = 1;
  std::vector<float> hidden_, logits_, scratch_;
};

}  // namespace conveyor

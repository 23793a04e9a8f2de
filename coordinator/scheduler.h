// The scheduler: requests from admission to their last token. It keeps the queue of
// accepted requests, moves them onto pipelines while their K/V budget allows (admit), forms
// each pipeline's next micro-batch (continuous batching: decode steps of one token plus
// prefill chunks of at most prefill_chunk prompt tokens, up to max_batch_tokens, the live
// sequences spread over the micro-batches in flight so every stage has work), and turns the
// last stage's results into tokens, text (stop strings) and finished choices.
//
// No threads or sockets of its own: the coordinator calls it from its engine loop and its
// REST threads, always under the coordinator's mutex, and sends what it forms. Sinks are
// called with that mutex held, so they must only hand work elsewhere.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "coordinator/cluster_config.h"
#include "coordinator/completion.h"
#include "coordinator/pipeline.h"
#include "coordinator/text_stream.h"
#include "model/microbatch.h"
#include "model/tokenizer.h"

namespace conveyor {

class Scheduler {
 public:
  // `cfg` (the model and the scheduler's limits) and `pipelines` (the coordinator's, which
  // it re-plans in place) must outlive the scheduler.
  Scheduler(const ClusterConfig& cfg, std::shared_ptr<const Tokenizer> tokenizer, std::vector<Pipeline>& pipelines);

  // What a refusal tells the client about trying again (HTTP Retry-After), in seconds.
  static constexpr int kRetryUnavailableSeconds = 5;  // no pipeline, or shutting down
  static constexpr int kRetryQueueFullSeconds = 1;

  // Queues the request, or refuses it when the queue is full. Accepted requests always end
  // in sink.on_done, or in sink.on_refused when they waited too long for a pipeline.
  CoreStatus submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink);

  // The queue's wait for a pipeline. `serviceable`: some pipeline serves or is being
  // repaired (its missing stages are loading or have spares). While none is, a queued
  // request is refused (Unavailable, Retry-After) once it has waited pipeline_wait_ms
  // counted from the later of its arrival in the queue and the moment the last pipeline
  // stopped being serviceable: time spent behind a busy but working pipeline does not count.
  void refuse_unserved(bool serviceable);

  // Moves queued requests (FIFO) onto the pipelines `open` accepts while their K/V budget
  // (`kv_capacity`, tokens) allows; the least reserved pipeline first. A request larger
  // than any pipeline's budget is failed.
  void admit(const std::function<bool(const Pipeline&)>& open, const std::function<int64_t(const Pipeline&)>& kv_capacity);

  // The next micro-batch for `p`, with `depth` micro-batches allowed in flight; nothing when
  // it has no work. The caller sends it and then records it with sent().
  struct Formed {
    MicroBatch batch;
    InFlightBatch record;
  };
  std::optional<Formed> next_batch(Pipeline& p, int depth);
  static void sent(Pipeline& p, Formed formed);

  // A result from a pipeline's last stage. Returns the pipeline when it must replay (a stage
  // could not run or hand on the batch): the caller restarts it in a new epoch.
  Pipeline* on_result(const BatchResult& result);

  // Every sequence on pipeline `index` is fed again from its first token (a new epoch).
  void restart(int index);
  // After a re-plan: every running request moves to the least reserved pipeline
  // (reservations start from zero) and is fed again from its first token.
  void redistribute();

  // Whether a sequence still runs on pipeline `index`.
  bool busy(int index) const;
  // Requests accepted and not finished.
  size_t outstanding() const { return queue_.size() + running_.size(); }
  size_t queue_size() const { return queue_.size(); }
  int64_t running_sequences() const;
  // Waits (releasing `lock`, the coordinator's mutex) until nothing is outstanding or
  // `timeout` passes.
  void wait_idle(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout);
  // Fails every accepted request with `why` (refuses, Unavailable, those still queued).
  void fail_all(const std::string& why);

 private:
  // Times a sequence's micro-batches may fail on a stage (each failure replays its
  // pipeline) before the request is failed.
  static constexpr int kMaxFailedBatches = 3;

  struct Request {
    std::shared_ptr<const CompletionRequest> req;
    CompletionSink sink;
    std::vector<uint64_t> seq_ids;
    size_t unfinished = 0;
    int64_t kv_need = 0;  // tokens reserved on its pipeline
    int pipeline = -1;
    bool failed = false;
    std::chrono::steady_clock::time_point queued_at;
  };

  struct Sequence {
    uint64_t id = 0;
    Request* request = nullptr;
    size_t choice = 0;
    int pipeline = -1;
    std::vector<int32_t> all;  // prompt then generated tokens
    size_t prompt_len = 0;
    size_t fed = 0;            // tokens of `all` sent to the pipeline in its current epoch
    bool in_flight = false;
    bool finished = false;
    std::unique_ptr<TextStream> text;
    std::vector<TokenOut> prompt_lp;  // echo + logprobs: entry 0 is the first prompt token (NaN)
    bool prompt_lp_sent = false;
    int failed_batches = 0;    // micro-batches of it that a stage could not run or hand on

    size_t generated() const { return all.size() - prompt_len; }
  };

  int64_t max_tokens_of(const CompletionRequest& r, size_t prompt_len) const;
  SamplingParams sampling_for(const CompletionRequest& r) const;
  void take_token(Sequence& s, const SeqResult& result);
  void finish_sequence(Sequence& s, const char* reason, ChoiceUpdate update);
  void finish_request(Request& r, const std::string& error);

  const ClusterConfig& cfg_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::deque<std::unique_ptr<Request>> queue_;  // accepted, not yet admitted
  std::unordered_map<Request*, std::unique_ptr<Request>> running_;
  std::unordered_map<uint64_t, Sequence> seqs_;
  std::vector<Pipeline>& pipelines_;
  uint64_t next_seq_id_ = 1, next_batch_id_ = 1;
  std::condition_variable idle_cv_;  // a request finished
  // Since when no pipeline has been serviceable (refuse_unserved); unset while one is.
  std::optional<std::chrono::steady_clock::time_point> unserviceable_since_;
};

}  // namespace conveyor

// The scheduler: requests from admission to their last token. It keeps the queue of
// accepted requests, moves them onto pipelines while their K/V budget allows (admit), forms
// each pipeline's next micro-batch (continuous batching: decode steps of one token plus
// prefill chunks of at most prefill_chunk prompt tokens, at most prefill_tokens_per_batch
// prompt tokens in all, so a step with new prompts is not much longer than one without and
// running sequences see an even inter-token latency; up to max_batch_tokens, the live
// sequences spread over the micro-batches in flight so every stage has work), and turns the
// last stage's results into tokens, text (stop strings) and finished choices.
//
// Admission: a request runs once its K/V reservation (prompt + max_tokens per choice) fits
// the pipeline's budget (the smallest K/V capacity its stages report) and the pipeline runs
// fewer than its admission limit of sequences (BatchLimits::max_running: by default the
// in-flight depth times max_sequences_per_batch, every sequence it can step at once). Past
// either it waits in the queue, and queue_wait() says why (GET /v1/cluster, /metrics).
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

  // The limits of a pipeline's micro-batches: the cluster file's values, and for those it
  // leaves at 0 (auto) the defaults of the backend (`gpu`: a stage runs on a GPU), for a
  // pipeline of `stages` stages with `depth` micro-batches in flight. CPU: 64 sequences,
  // 64-token chunks, 64 x stages / depth prompt tokens a micro-batch (at least 16), rows: the
  // sequences + the prompt tokens. GPU: 256 sequences, 512-token chunks, 512 x stages / depth
  // prompt tokens. Admission limit: depth x sequences.
  static BatchLimits batch_limits(const ClusterConfig& cfg, bool gpu, int stages, int depth);

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
  //
  // In two halves, so the next micro-batch leaves before the result's text is made:
  // on_result appends each sequence's token and ends those that a stop token, max_tokens or
  // the context ends (they are not stepped again); deliver() then turns the tokens into text
  // (stop strings), updates and finished choices. Call deliver() after sending what the
  // result made possible, before anything else of the scheduler. A choice that a stop string
  // ends has had one more step sent; its result is dropped and the frees follow it.
  Pipeline* on_result(const BatchResult& result);
  void deliver();

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
  // Sequences running on pipeline `index` (against its admission limit).
  int64_t running_on(int index) const;
  // Why the queue's head waited at the last admit (None: the queue was empty or all admitted).
  QueueWait queue_wait() const { return queue_.empty() ? QueueWait::None : queue_wait_; }
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
  // A token taken by on_result, for deliver().
  struct Delivery {
    uint64_t seq_id = 0;
    TokenOut token;
    const char* finish = nullptr;  // "stop" (a stop token), "length", or null
    bool is_stop_token = false;
  };
  void take_token(Sequence& s, SeqResult result);
  void deliver_one(Sequence& s, Delivery d);
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
  QueueWait queue_wait_ = QueueWait::None;
  std::vector<Delivery> deliveries_;  // taken by on_result, not yet delivered
};

}  // namespace conveyor

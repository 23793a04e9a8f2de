// The scheduler: requests from admission to their last token. It keeps the queue of
// accepted requests, moves them onto pipelines while their K/V budget allows (admit), forms
// each pipeline's next micro-batch (continuous batching: decode steps of one token plus
// prefill chunks of at most prefill_chunk prompt tokens, at most prefill_tokens_per_batch
// prompt tokens in all, so a step with new prompts is not much longer than one without and
// running sequences see an even inter-token latency; up to max_batch_tokens, the live
// sequences spread over the micro-batches in flight so every stage has work), and turns the
// last stage's results into tokens, text (stop strings) and finished choices.
//
// Beam search (CompletionRequest::use_beam_search): each prompt is a beam group of up to best_of
// sequences, driven by coordinator/beam_search.h. Its beams travel in one micro-batch where the
// limits allow; each reports its top 2 x best_of tokens (the last stage's top log-probs), and
// once all have reported, the group picks the next beams: the first child of a beam continues
// as the same sequence, every other child is a new sequence forked from it (MicroBatch::forks,
// sent with the group's next slices, the dropped beams freed in the same micro-batch after the
// forks). A replay feeds every beam again from its first token, like any sequence. When the
// search is done, the group's n best hypotheses go out as its choices, one update each.
//
// Samples: a prompt's n choices are n sequences, sample k on the seed's Philox stream k; with
// best_of > n it runs best_of and returns the n of highest cumulative log-probability
// (sample_ranking.cc). max_tokens 0 (echo: the scoring idiom) computes the prompt's log-probs
// and samples nothing: the sequence ends when its last prompt chunk comes back.
//
// Endings (request_endings.cc): a request finishes, fails, times out, is refused while queued
// or is cancelled by its client (cancel(): the REST layer saw the connection close) through
// one path, end_request, which returns its K/V reservation, frees its sequences on the
// pipeline's next micro-batch, tells its sink and writes its line in the request log.
//
// Prefix reuse (scheduler.prefix_cache, on by default; coordinator/prefix_cache.h): once a
// sequence's prompt has been computed, its whole K/V pages (the granule its stages describe,
// PipelineRun::figures) are kept on the stages as
// a cache entry (a fork of the sequence, sent on the pipeline's next micro-batch), and a new
// sequence whose prompt starts the same way forks the longest such prefix instead of computing
// it. Entries use the K/V room the running requests leave: the least recently used go when a
// request or a newer entry needs it. A pipeline that restarts forgets its entries (its stages
// dropped them). A request goes to the replica holding the longest prefix of its prompt among
// those it fits, before the least reserved one. Not for echo with logprobs (the prompt's
// log-probs need its rows computed). Usage reports the reused tokens per prompt.
//
// Admission: a request runs once its K/V reservation (prompt + max_tokens per choice) fits
// the pipeline's budget (the smallest K/V capacity its stages report) and the pipeline runs
// fewer than its admission limit of sequences (BatchLimits::max_running: by default the
// in-flight depth times max_sequences_per_batch, every sequence it can step at once). Past
// either it waits in the queue, and queue_wait() says why (GET /v1/cluster, /metrics).
//
// No threads or sockets of its own: the engine (engine.h) calls it from its loop and from
// the REST threads' submit, always under the engine's mutex, and sends the plans it returns
// (step_plan.h). It runs over the engine's PipelineRuns (pipeline_run.h), never the cluster's
// state. Sinks are called with that mutex held, so they must only hand work elsewhere.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "coordinator/cluster_config.h"
#include "coordinator/completion.h"
#include "coordinator/membership.h"
#include "coordinator/pipeline_run.h"
#include "coordinator/prefix_cache.h"
#include "coordinator/request_log.h"
#include "coordinator/step_plan.h"
#include "coordinator/text_stream.h"
#include "model/tokenizer.h"
#include "protocol/batch_result.h"
#include "protocol/seq_state.h"

namespace conveyor {

class Scheduler {
 public:
  // `cfg` (the model and the scheduler's limits) and `pipelines` (the engine's runtimes, which
  // it replaces on a re-plan) must outlive the scheduler.
  Scheduler(const ClusterConfig& cfg, std::shared_ptr<const Tokenizer> tokenizer, std::vector<PipelineRun>& pipelines);

  // What a refusal tells the client about trying again (HTTP Retry-After), in seconds.
  static constexpr int kRetryUnavailableSeconds = 5;  // no pipeline, or shutting down
  static constexpr int kRetryQueueFullSeconds = 1;

  // The limits of a pipeline's micro-batches: the cluster file's values, and for those it
  // leaves at 0 (auto) what its workers say of their steps (`figures`), for a pipeline of
  // `stages` stages with `depth` micro-batches in flight: their sequences a step, chunks of
  // their prompt rows, their prompt rows x stages / depth prompt tokens a micro-batch (at
  // least 16), rows: the sequences + the prompt tokens, within their row limit. Admission
  // limit: depth x sequences.
  static BatchLimits batch_limits(const ClusterConfig& cfg, const StageFigures& figures, int stages, int depth);
  // What the workers of a pipeline's stages say of their steps, together (StageFigures);
  // null entries (stages nobody serves) are skipped. The cluster manager's stage_figures_of.
  static StageFigures figures_of(std::span<const WorkerInfo* const> stages) { return stage_figures_of(stages); }

  // Queues the request, or refuses it when the queue is full, or (Invalid, naming the
  // numbers) when its K/V reservation is larger than `kv_capacity`, the largest pipeline's
  // budget (0: not known yet; admit() refuses it then). Accepted requests always end in
  // sink.on_done, or in sink.on_refused when they waited too long for a pipeline.
  CoreStatus submit(std::shared_ptr<const CompletionRequest> request, CompletionSink sink, int64_t kv_capacity = 0);
  // The K/V tokens a request reserves on its pipeline: prompt + max_tokens per sequence (beam
  // search: twice its beams, see submit), each within the model's context.
  static int64_t kv_tokens_needed(const CompletionRequest& request, int64_t n_positions);
  // The client went away: `request` (as submitted) ends as cancelled, queued or running, the
  // way any request ends (end_request): its K/V reservation returned, its sequences freed on
  // every stage by the pipeline's next micro-batch, its sink's on_done called. False when it
  // is not outstanding (it ended already).
  bool cancel(const CompletionRequest* request);
  // Tokens the last stage generated for sequences that had ended (a stop string's step in
  // flight, a cancelled or failed request's), since the last call.
  int64_t take_discarded_tokens() { return std::exchange(discarded_tokens_, 0); }

  // The queue's wait for a pipeline. `serviceable`: some pipeline serves or is being
  // repaired (its missing stages are loading or have spares). While none is, a queued
  // request is refused (Unavailable, Retry-After) once it has waited pipeline_wait_ms
  // counted from the later of its arrival in the queue and the moment the last pipeline
  // stopped being serviceable: time spent behind a busy but working pipeline does not count.
  void refuse_unserved(bool serviceable);
  // When refuse_unserved will next refuse the queue's head (the engine's wait ends there);
  // none while some pipeline is serviceable or the queue is empty.
  std::optional<std::chrono::steady_clock::time_point> refuse_deadline() const;
  // Ends every request, queued or running, that arrived scheduler.request_timeout_ms ago or
  // more: refused with CoreError::Timeout (504; a stream's last event), its sequences freed
  // and its K/V reservation returned. expiry_deadline(): when the next one is due.
  void expire_requests();
  std::optional<std::chrono::steady_clock::time_point> expiry_deadline() const;

  // Moves queued requests (FIFO) onto the pipelines `open` accepts while their K/V budget
  // (`kv_capacity`, tokens) allows; the least reserved pipeline first. A request larger
  // than any pipeline's budget is failed.
  void admit(const std::function<bool(const PipelineRun&)>& open,
             const std::function<int64_t(const PipelineRun&)>& kv_capacity);

  // The plan of `p`'s next step, with `depth` micro-batches allowed in flight; nothing when
  // it has no work. The caller sends it and then records it with sent(). Its admissions
  // carry the state of each sequence the pipeline's last stage does not hold in this epoch
  // (coordinator/batch_forming.cc).
  //
  // Steps ahead (p.view.step_ahead: a pipeline of one stage): a sequence whose step in flight
  // samples its next token gets its following step now, on that token, which the stage puts
  // in itself (SeqStep::own_token); so the stage finds its next input waiting, and the
  // round trip through the coordinator leaves the critical path. The caller allows one
  // micro-batch beyond `depth` for them: with p.in_flight >= depth a plan goes only when some
  // sequence can step ahead (ready sequences join it), and it forms the plan after deliver()
  // so that stop strings are known. A sequence that its token in flight ends (a stop token or
  // string) had one step too many: its result is dropped (discarded tokens) and its free
  // follows it. The answers do not change: the stage's token is the one
  // the coordinator would have sent.
  std::optional<StepPlan> next_step(PipelineRun& p, int depth);
  static void sent(PipelineRun& p, StepPlan plan);

  // A result from a pipeline's last stage. Returns the pipeline when it must replay (a stage
  // could not run or hand on the batch): the caller has it restarted in a new epoch.
  //
  // In two halves, so the next micro-batch leaves before the result's text is made:
  // on_result appends each sequence's token and ends those that a stop token, max_tokens or
  // the context ends (they are not stepped again); deliver() then turns the tokens into text
  // (stop strings), updates and finished choices. Call deliver() after sending what the
  // result made possible, before anything else of the scheduler. A choice that a stop string
  // ends has had one more step sent; its result is dropped and the frees follow it.
  PipelineRun* on_result(const BatchResult& result);
  void deliver();

  // Every sequence on pipeline `index` is fed again from its first token (a new epoch).
  void restart(int index);
  // After a re-plan: every running request moves to the least reserved pipeline
  // (reservations start from zero) and is fed again from its first token.
  void redistribute();

  // Whether a sequence still runs on pipeline `index`.
  bool busy(int index) const;
  // Prefix reuse, for /metrics: prompts that could use a cached prefix (their sequence's
  // first prefill), those that did, and the prompt tokens those reused and computed; and what
  // the pipelines' caches hold now.
  struct PrefixStats {
    int64_t lookups = 0, hits = 0, reused_tokens = 0, computed_tokens = 0;
    int64_t entries = 0, cached_tokens = 0;
  };
  PrefixStats prefix_stats() const;

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

  // One prompt of a beam-search request (see the top of this file).
  struct BeamGroup {
    std::unique_ptr<BeamSearch> search;
    size_t prompt = 0;              // index in the request's prompts
    std::vector<uint64_t> live;     // the live beams' sequence ids, in search->live() order
    std::vector<std::vector<std::pair<int32_t, float>>> alts;  // this step's reports, per live beam
    std::vector<bool> reported;
    size_t waiting = 0;             // live beams yet to report this step
    std::vector<SeqFork> forks;     // go with the live beams' next slices
    std::vector<uint64_t> frees;    // dropped beams, freed after the forks
    bool done = false;
  };

  struct Request {
    std::shared_ptr<const CompletionRequest> req;
    CompletionSink sink;
    std::vector<uint64_t> seq_ids;
    std::vector<BeamGroup> groups;  // beam search: one per prompt
    size_t unfinished = 0;
    int64_t kv_need = 0;  // tokens reserved on its pipeline
    int pipeline = -1;
    bool failed = false;
    std::chrono::steady_clock::time_point queued_at;
    std::vector<int64_t> cached_tokens;  // per prompt: tokens its first sequence forked from a cache entry
    // For the request log: tokens the pipeline generated for it, when the first came, and how
    // many times its sequences were fed again from their first token.
    int64_t generated = 0;
    std::optional<std::chrono::steady_clock::time_point> first_token_at;
    int replays = 0;
    // best_of > n (CompletionRequest::ranks_samples): each sample's updates folded into one,
    // by slot, kept until every sample of its prompt is done (sample_ranking.cc).
    struct Sample {
      ChoiceUpdate update;
      double logprob = 0;  // the sum of its tokens' log-probs
      bool done = false;
    };
    std::vector<Sample> samples;
  };
  // How a request ends (end_request): the sink's on_done for Ok (no message), Failed and
  // Cancelled (`error`); refuse_accepted with `refusal` for the others.
  struct Ending {
    RequestOutcome outcome = RequestOutcome::Ok;
    std::string error;
    CoreStatus refusal;
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
    // A step ahead is in flight too: sent on the token its step in flight samples, which the
    // stage puts in (SeqStep::own_token). That token, once it comes back, counts as fed.
    bool ahead = false;
    bool finished = false;
    std::unique_ptr<TextStream> text;
    std::vector<TokenOut> prompt_lp;  // echo + logprobs: entry 0 is the first prompt token (NaN)
    int group = -1;            // beam search: its group in request->groups, and its beam there
    size_t beam = 0;
    bool prompt_lp_sent = false;
    int failed_batches = 0;    // micro-batches of it that a stage could not run or hand on
    // Its prompt was looked up in the prefix cache / offered to it once computed (this epoch).
    bool prefix_done = false, prefix_offered = false;
    // Where its SeqState was last sent (or forked to): the last stage of that pipeline holds it
    // while the pipeline stays in that epoch. Any other pipeline or epoch sends it again.
    int state_pipeline = -1;
    uint32_t state_epoch = 0;

    size_t generated() const { return all.size() - prompt_len; }
  };

  int64_t max_tokens_of(const CompletionRequest& r, size_t prompt_len) const;
  // A new sequence of `r` (its id the next one), recorded in seqs_ and r.seq_ids.
  Sequence& add_sequence(Request& r, size_t choice, int pipeline, std::vector<int32_t> tokens, size_t prompt_len);
  SamplingParams sampling_for(const CompletionRequest& r) const;
  // What the last stage needs to choose s's tokens (sent once, see next_batch).
  SeqState state_of(const Sequence& s) const;
  // A step being planned (batch_forming.cc).
  struct Draft {
    StepPlan plan;
    int64_t tokens = 0;                 // its rows so far
    int64_t cap_seqs = 0;               // the slices it may hold
  };
  // Admission (scheduler.cc): the pipeline `r` goes to, or null (and queue_wait_ says why);
  // `running` counts each pipeline's sequences. Fails `r` (returns false) when it is larger
  // than any pipeline's budget.
  struct Choice {
    PipelineRun* best = nullptr;
    bool fits_somewhere = true;
    int64_t max_cap = 0;
  };
  Choice choose_pipeline(const Request& r, const std::vector<int64_t>& running,
                         const std::function<bool(const PipelineRun&)>& open,
                         const std::function<int64_t(const PipelineRun&)>& kv_capacity);
  // Starts `owned` on `p`: its reservation and its first sequences (a beam group per prompt).
  void start_request(std::unique_ptr<Request> owned, PipelineRun& p);
  void start_beam_groups(Request& r, PipelineRun& p);
  // p's sequences with tokens to feed, decode steps and prompt chunks apart, and (`ahead`
  // given) those that may step ahead, by id; returns how many of p's sequences run (in flight
  // or not).
  int64_t ready_sequences(const PipelineRun& p, std::vector<Sequence*>& decode, std::vector<Sequence*>& prefill,
                          std::vector<Sequence*>* ahead);
  // Whether `s`, its step in flight, may step ahead: that step samples its next token, and a
  // token after it is still within max_tokens (and the context); not a beam (its group
  // chooses its next token).
  bool can_step_ahead(const Sequence& s) const;
  void add_ahead_steps(const PipelineRun& p, Draft& d, const std::vector<Sequence*>& ahead);
  void add_decode_steps(PipelineRun& p, Draft& d, std::vector<Sequence*>& decode);
  void add_prefill_steps(PipelineRun& p, Draft& d, const std::vector<Sequence*>& prefill);
  void add_step(PipelineRun& p, Draft& d, Sequence& s, int64_t n);
  // A token taken by on_result, for deliver().
  struct Delivery {
    uint64_t seq_id = 0;
    TokenOut token;
    const char* finish = nullptr;  // "stop" (a stop token), "length", or null
    bool is_stop_token = false;
  };
  void take_token(Sequence& s, SeqResult result);
  // Beam search: a beam's report; the group's step once every live beam has reported.
  void take_beam_report(Sequence& s, const SeqResult& result);
  void advance_group(Request& r, BeamGroup& g);
  // After a restart or a re-plan: a group's pending forks and frees refer to caches that are
  // gone, and this step's reports are taken again.
  void reset_groups(Request& r);
  struct GroupDelivery {
    Request* request = nullptr;
    size_t group = 0;
  };
  void deliver_group(Request& r, BeamGroup& g);
  void deliver_one(Sequence& s, Delivery d);
  void finish_sequence(Sequence& s, const char* reason, ChoiceUpdate update);
  // A choice's update to the client, or (best_of > n) to its sample's record until its
  // prompt's samples are all done, and then the best n as the prompt's choices
  // (sample_ranking.cc).
  void emit(Sequence& s, ChoiceUpdate update);
  void send_best_samples(Request& r, size_t prompt);
  // A running request's end: Ok when `error` is empty, else Failed.
  void finish_request(Request& r, const std::string& error);
  // The one way a request ends, queued (taken from the queue) or running (take_running): its
  // reservation returned and sequences freed when it ran, the sink told (Ending), its line in
  // the request log; then it is destroyed (request_endings.cc).
  void end_request(std::unique_ptr<Request> owned, const Ending& ending);
  std::unique_ptr<Request> take_running(Request& r);
  RequestRecord record_of(const Request& r, const Ending& ending) const;
  // Refuses, with `why`, the queued requests that arrived at or before `arrived_by`.
  void refuse_queued(std::chrono::steady_clock::time_point arrived_by, const CoreStatus& why);
  // end_request's bookkeeping: its reservation returned, its sequences freed and forgotten.
  void release_request(Request& r);
  // Prefix reuse (see the top of this file). Entries are whole granules of the K/V pages the
  // pipeline's stages describe (PipelineRun::figures), so they share pages without copies.
  PrefixCache& prefix_cache(int pipeline);
  std::vector<SeqFork>& retain_forks(int pipeline);
  int64_t& budget(int pipeline);  // the pipeline's K/V budget at the last admit (tokens)
  // Tokens of `r`'s prompts cached on pipeline p (routing).
  int64_t prefix_match(PipelineRun& p, const CompletionRequest& r);
  void reuse_prefix(PipelineRun& p, Sequence& s, StepPlan& b);
  void retain_prefix(Sequence& s);
  // Frees least recently used entries of pipeline p until `tokens` more fit its K/V budget
  // beside its reservations and entries; false when even an empty cache leaves too little.
  bool make_room(PipelineRun& p, int64_t tokens);

  const ClusterConfig& cfg_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::deque<std::unique_ptr<Request>> queue_;  // accepted, not yet admitted
  std::unordered_map<Request*, std::unique_ptr<Request>> running_;
  std::unordered_map<uint64_t, Sequence> seqs_;
  std::vector<PipelineRun>& pipelines_;
  uint64_t next_seq_id_ = 1, next_batch_id_ = 1;
  std::condition_variable idle_cv_;  // a request finished
  // Since when no pipeline has been serviceable (refuse_unserved); unset while one is.
  std::optional<std::chrono::steady_clock::time_point> unserviceable_since_;
  QueueWait queue_wait_ = QueueWait::None;
  std::vector<Delivery> deliveries_;  // taken by on_result, not yet delivered
  std::vector<GroupDelivery> group_deliveries_;  // beam groups done in on_result, not yet delivered
  // Prefix reuse, per pipeline index: the entries, the forks that make new ones (they go first
  // in the pipeline's next micro-batch), and its K/V budget at the last admit (tokens).
  std::vector<PrefixCache> prefix_;
  std::vector<std::vector<SeqFork>> retain_forks_;
  std::vector<int64_t> kv_budget_;
  PrefixStats prefix_stats_;
  int64_t discarded_tokens_ = 0;  // take_discarded_tokens
};

}  // namespace conveyor

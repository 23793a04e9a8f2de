// The scheduler's endings of a request (scheduler.h): every way one ends, finished, failed,
// timed out, refused while queued, cancelled by its client, or at shutdown, goes through
// end_request, which returns its K/V, frees its sequences, tells its sink and writes its line
// in the request log (request_log.h).
#include <numeric>

#include <spdlog/spdlog.h>

#include "coordinator/scheduler.h"

namespace conveyor {

using Clock = std::chrono::steady_clock;

namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

RequestRecord Scheduler::record_of(const Request& r, const Ending& e) const {
  RequestRecord rec = request_record(*r.req, e.outcome, e.outcome == RequestOutcome::Ok ? "" : e.error);
  rec.completion_tokens = r.generated;
  rec.cached_tokens = std::accumulate(r.cached_tokens.begin(), r.cached_tokens.end(), int64_t(0));
  if (r.first_token_at) rec.ttft_ms = ms_between(r.req->arrival, *r.first_token_at);
  rec.pipeline = r.pipeline;
  if (r.pipeline >= 0 && size_t(r.pipeline) < pipelines_.size()) rec.stages = pipelines_[size_t(r.pipeline)].view.workers;
  rec.replays = r.replays;
  return rec;
}

std::unique_ptr<Scheduler::Request> Scheduler::take_running(Request& r) {
  auto node = running_.extract(&r);
  return std::move(node.mapped());
}

void Scheduler::end_request(std::unique_ptr<Request> owned, const Ending& e) {
  Request& r = *owned;
  if (r.pipeline >= 0) release_request(r);
  log_request(record_of(r, e));
  switch (e.outcome) {
    case RequestOutcome::Ok: r.sink.on_done(""); break;
    case RequestOutcome::Failed:
    case RequestOutcome::Cancelled: r.sink.on_done(e.error); break;
    default: refuse_accepted(r.sink, e.refusal); break;
  }
  owned.reset();
  idle_cv_.notify_all();
}

void Scheduler::finish_request(Request& r, const std::string& error) {
  end_request(take_running(r), error.empty() ? Ending{} : Ending{RequestOutcome::Failed, error, {}});
}

void Scheduler::release_request(Request& r) {
  if (r.pipeline >= 0) pipelines_[size_t(r.pipeline)].kv_reserved -= r.kv_need;
  if (r.pipeline >= 0)  // beams dropped by a step whose frees had not gone out yet
    for (const BeamGroup& g : r.groups) {
      auto& frees = pipelines_[size_t(r.pipeline)].pending_frees;
      frees.insert(frees.end(), g.frees.begin(), g.frees.end());
    }
  for (uint64_t id : r.seq_ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) continue;
    if (!it->second.finished && it->second.pipeline >= 0)
      pipelines_[size_t(it->second.pipeline)].pending_frees.push_back(id);
    seqs_.erase(it);
  }
}

bool Scheduler::cancel(const CompletionRequest* request) {
  const Ending ending{RequestOutcome::Cancelled, "the client closed its connection", {}};
  for (auto it = queue_.begin(); it != queue_.end(); ++it)
    if ((*it)->req.get() == request) {
      std::unique_ptr<Request> owned = std::move(*it);
      queue_.erase(it);
      end_request(std::move(owned), ending);
      return true;
    }
  for (auto& [rp, _] : running_)
    if (rp->req.get() == request) {
      end_request(take_running(*rp), ending);
      return true;
    }
  return false;
}

void Scheduler::expire_requests() {
  if (cfg_.request_timeout_ms <= 0) return;
  const auto limit = std::chrono::milliseconds(cfg_.request_timeout_ms);
  const Clock::time_point now = Clock::now();
  const CoreStatus why = CoreStatus::refuse(
      CoreError::Timeout, "the request ran past scheduler.request_timeout_ms (" + std::to_string(cfg_.request_timeout_ms) + " ms)");
  refuse_queued(now - limit, why);
  std::vector<Request*> due;
  for (const auto& [rp, _] : running_)
    if (rp->queued_at + limit <= now) due.push_back(rp);
  for (Request* r : due) {
    spdlog::warn("coordinator: a request on pipeline {} ran past scheduler.request_timeout_ms ({} ms); ending it",
                 r->pipeline, cfg_.request_timeout_ms);
    end_request(take_running(*r), {RequestOutcome::Timeout, why.message, why});
  }
}

void Scheduler::refuse_queued(Clock::time_point arrived_by, const CoreStatus& why) {
  // The queue is in arrival order: the requests due are a prefix.
  while (!queue_.empty() && queue_.front()->queued_at <= arrived_by) {
    std::unique_ptr<Request> owned = std::move(queue_.front());
    queue_.pop_front();
    end_request(std::move(owned), {outcome_of(why.error), why.message, why});
  }
}

void Scheduler::fail_all(const std::string& why) {
  const CoreStatus refusal = CoreStatus::retry_later(CoreError::Unavailable, why, kRetryUnavailableSeconds);
  while (!queue_.empty()) {
    std::unique_ptr<Request> owned = std::move(queue_.front());
    queue_.pop_front();
    end_request(std::move(owned), {RequestOutcome::Unavailable, why, refusal});
  }
  while (!running_.empty()) finish_request(*running_.begin()->first, why);
}

}  // namespace conveyor

// The request log: one line per request the core took or refused at submission, at info
// level, when it ends: its id (the one the REST layer returns in X-Request-Id), how it ended,
// its prompt, completion and prefix-reused tokens, the time to its first token and in all,
// the pipeline and the workers of its stages, and how many times it was replayed (a stage's
// failure, a failover, a re-plan). The scheduler writes it (scheduler.h, end_request).
//
// One logging path: the line goes through spdlog like every other line of the coordinator,
// to the same sinks, from a logger named "request". The cluster file's log.format picks the
// shape of every line: `text` (spdlog's pattern; the request line in key=value pairs) or
// `json` (one JSON object a line: ts, level, logger, msg; the request line's fields at the
// top level instead of msg).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/completion.h"
#include "coordinator/core_status.h"

namespace conveyor {

enum class LogFormat { Text, Json };

// How a request ended; the log's `status`.
enum class RequestOutcome {
  Ok,
  Cancelled,    // the client went away
  Timeout,      // past scheduler.request_timeout_ms
  Unavailable,  // no pipeline could serve it (in time), or the coordinator stopped
  QueueFull,    // refused at submission
  Invalid,      // it cannot fit any pipeline's K/V
  Failed,       // a stage failed it past the replays
};
const char* outcome_name(RequestOutcome outcome);
// The outcome of a refusal of that kind.
RequestOutcome outcome_of(CoreError error);

struct RequestRecord {
  std::string id;
  RequestOutcome outcome = RequestOutcome::Ok;
  std::string error;                 // why, unless ok
  int64_t prompt_tokens = 0;         // each prompt once
  int64_t completion_tokens = 0;     // tokens the pipeline generated for it (every sample and beam)
  int64_t cached_tokens = 0;         // prompt tokens forked from the prefix cache
  size_t choices = 0;
  std::optional<double> ttft_ms;     // from its arrival to its first generated token
  double total_ms = 0;               // from its arrival to its end
  int pipeline = -1;                 // -1: never admitted
  std::vector<std::string> stages;   // the workers of that pipeline's stages, in order
  int replays = 0;                   // times its sequences were fed again from their first token
};

// What the request alone says (id, prompt tokens, choices, the time since its arrival).
RequestRecord request_record(const CompletionRequest& request, RequestOutcome outcome, std::string error);

nlohmann::json request_log_json(const RequestRecord& record);
// key=value pairs: id=... status=... prompt_tokens=... (error="..." last, quoted).
std::string request_log_text(const RequestRecord& record);

// The shape of every line the process logs through spdlog's default logger's sinks, from now
// on. Call once at start-up, after the default logger is set.
void set_log_format(LogFormat format);
// One request's line, at info level.
void log_request(const RequestRecord& record);
// The line of a request the core refused at submission.
void log_refused(const CompletionRequest& request, const CoreStatus& why);

}  // namespace conveyor

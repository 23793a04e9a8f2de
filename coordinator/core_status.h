// What the coordinator's core answers when it refuses something, in its own terms. The REST
// layer alone turns these into HTTP statuses and OpenAI error bodies.
#pragma once

#include <string>
#include <utility>

#include <nlohmann/json.hpp>

namespace conveyor {

// Why the core refused something (a submission, a drain, a plan). The core says what went
// wrong in its own terms; the REST layer alone maps a kind to an HTTP status and an OpenAI
// error body (coordinator/rest/http_server.cc).
enum class CoreError {
  None,
  Invalid,      // the input is wrong (names `param`)
  NotFound,     // no such worker
  Conflict,     // valid, but the cluster cannot do it now (too few or too small workers)
  QueueFull,    // try again later
  Unavailable,  // nothing can serve (no pipeline, shutting down)
  Timeout,      // an accepted request ran past its deadline (scheduler.request_timeout_ms)
};

struct CoreStatus {
  CoreError error = CoreError::None;
  std::string message;
  std::string param;  // the offending field, for Invalid
  // QueueFull, Unavailable: when the client may try again, in seconds (HTTP Retry-After);
  // 0 says nothing.
  int retry_after_seconds = 0;

  bool ok() const { return error == CoreError::None; }
  static CoreStatus refuse(CoreError e, std::string message, std::string param = {}) {
    return {e, std::move(message), std::move(param)};
  }
  static CoreStatus retry_later(CoreError e, std::string message, int retry_after_seconds) {
    return {e, std::move(message), {}, retry_after_seconds};
  }
};

// An operator's call (drain, re-plan): the JSON answer when status is ok.
struct AdminReply {
  CoreStatus status;
  nlohmann::json body;
};

}  // namespace conveyor

// HttpServer: the coordinator's REST API (docs/API.md) on Boost.Beast over Boost.Asio.
//
// The canonical Beast http_server_async shape: a listener accepts each connection onto its
// own strand and hands it to a session, which reads a request, answers it, and loops while
// the client keeps the connection alive. A few io threads run everything.
//
// Completions go to RestContext::backend. The backend calls the request's sink from the
// core's thread; the sink only posts onto the session's strand, so all socket work and all
// response building happen there. The sink owns the session (and the io_context) until
// on_done, so a request the core accepted always completes safely: if the client went
// away the output is dropped; if the server was stopped the posted work is discarded.
//
// Every answer carries X-Request-Id, and CORS headers when configured (rest/http_headers.h).
//
// Auth: with a non-empty api_key every route but GET /health, GET / and OPTIONS needs
// "Authorization: Bearer <key>" (compared in constant time); /health stays open for load
// balancers and orchestrators, and / is the status page, which holds no data (it asks the
// operator for the key and sends it on its own requests).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "common/status.h"
#include "coordinator/completion.h"
#include "coordinator/metrics.h"
#include "coordinator/planner.h"
#include "coordinator/rest/chat_api.h"
#include "coordinator/rest/openai_api.h"
#include "model/tokenizer.h"

namespace conveyor {

struct RestContext {
  std::string model_name;                       // what /v1/models lists and `model` must match
  ModelConfig config;
  std::shared_ptr<const Tokenizer> tokenizer;
  CompletionBackend* backend = nullptr;         // must outlive the server and its requests
  Metrics* metrics = nullptr;                   // may be null; must outlive the server
  std::string api_key;                          // empty: no auth
  std::function<std::pair<bool, nlohmann::json>()> health;  // (ready?, body); null: always ready
  std::function<nlohmann::json()> cluster;                  // GET /v1/cluster; null: 404
  // POST /v1/cluster/plan, the body parsed (rest/admin_api.h); null: 404.
  std::function<AdminReply(const PlanRequest&)> plan;
  // POST /v1/cluster/workers/{name}/drain; null: 404.
  std::function<AdminReply(const std::string& worker)> drain;
  ApiLimits limits;
  // /v1/chat/completions and /tokenize's messages: the chat template and special tokens;
  // null: no template (chat requests get a 400 saying how to give one).
  std::shared_ptr<const ChatSettings> chat;
  // http.cors_origins (rest/http_headers.h): empty, no CORS headers.
  std::vector<std::string> cors_origins;
};

class HttpServer {
 public:
  // Binds host:port (port 0: any free port, see port()) and starts `threads` io threads.
  // Errors name the address and the reason.
  static Expected<std::unique_ptr<HttpServer>> start(const std::string& host, int port, RestContext ctx,
                                                     int threads = 2);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Stops accepting, stops the io threads and drops open connections. Requests still in
  // the core finish there; their output is discarded. Idempotent.
  void stop();
  // Graceful stop: stops accepting, waits up to `timeout` for every request already read to
  // be answered in full (idle keep-alive connections do not count), then stop(). Returns
  // how many answers were cut short.
  int shutdown(std::chrono::milliseconds timeout);

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True when `a` and `b` are equal, in time that depends only on their lengths.
bool constant_time_equals(const std::string& a, const std::string& b);

}  // namespace conveyor

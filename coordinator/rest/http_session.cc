// One REST connection: see http_session.h.
#include "coordinator/rest/http_session.h"

#include <array>
#include <chrono>
#include <ctime>
#include <deque>
#include <optional>
#include <vector>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <spdlog/spdlog.h>

#include "coordinator/rest/admin_api.h"
#include "coordinator/rest/http_headers.h"
#include "coordinator/rest/status_page.h"
#include "coordinator/rest/tokenize_api.h"

namespace conveyor {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kIdleTimeout = std::chrono::seconds(60);   // waiting for the next request
constexpr auto kIoTimeout = std::chrono::seconds(60);     // one read or write making no progress
constexpr auto kLingerTime = std::chrono::seconds(2);     // draining an unread body before closing
constexpr const char* kServerName = "conveyor";

int64_t unix_now() { return int64_t(std::time(nullptr)); }

std::string_view view(beast::string_view s) { return {s.data(), s.size()}; }

// "%41" -> "A"; false on a malformed escape.
bool percent_decode(std::string_view in, std::string& out) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  out.clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out += in[i];
      continue;
    }
    if (i + 2 >= in.size()) return false;  // fewer than two digits left
    const int hi = hex(in[i + 1]), lo = hex(in[i + 2]);
    if (hi < 0 || lo < 0) return false;
    out += char(hi * 16 + lo);
    i += 2;
  }
  return true;
}

class Session;

// What a request's sink holds: the io_context (posting to a destroyed one would be
// undefined; a stopped one just discards the work) and the session (alive until on_done).
// Members are destroyed in reverse order: the session first, then the io_context.
struct SinkTarget {
  std::shared_ptr<net::io_context> ioc;
  net::any_io_executor strand;  // the session's strand
  std::shared_ptr<Session> session;
};

// One connection: read a request, answer it, repeat while keep-alive.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket&& socket, std::shared_ptr<const RestContext> ctx, std::weak_ptr<net::io_context> ioc,
          int64_t started_unix, std::shared_ptr<std::atomic<int>> answering)
      : stream_(std::move(socket)), ctx_(std::move(ctx)), ioc_(std::move(ioc)), started_unix_(started_unix),
        answering_count_(std::move(answering)) {}
  ~Session() { end_answer(); }

  void run() {
    // The socket was accepted onto a strand; start on it.
    net::dispatch(stream_.get_executor(), beast::bind_front_handler(&Session::do_read, shared_from_this()));
  }

  // Called on the strand through the request's sink.
  void on_update(ChoiceUpdate update, Clock::time_point at);
  void on_done(std::string error);
  void on_refused(CoreStatus why);

 private:
  struct Active {  // the completion or chat request this connection is serving
    std::shared_ptr<const CompletionRequest> request;
    std::unique_ptr<ResponseBuilder> builder;
    bool first_token_seen = false;
    std::vector<std::optional<Clock::time_point>> last_token_at;  // per choice
  };

  // From a request read to its answer written: counted, so a shutdown can wait for it.
  void begin_answer() {
    if (!answering_) answering_ = true, ++*answering_count_;
  }
  void end_answer() {
    if (answering_) answering_ = false, --*answering_count_;
  }

  void do_read();
  void on_read_header(beast::error_code ec, size_t);
  void read_body();
  void on_read(beast::error_code ec, size_t);
  void read_failed(beast::error_code ec);
  void handle();
  void do_close();
  void linger();

  http::response<http::string_body> make_response(http::status status, std::string body,
                                                  std::string_view content_type);
  // Server, X-Request-Id and (when configured and allowed) CORS, on every answer.
  void set_common_headers(http::fields& fields);
  void send_json(int status, const json& body);
  // retry_after_seconds > 0: a Retry-After header (the core said when to try again).
  void send_error(const ApiError& error, bool close = false, int retry_after_seconds = 0);
  void send_refusal(const CoreStatus& refusal);
  void send(http::response<http::string_body>&& res);
  void on_write(bool close, beast::error_code ec, size_t);

  bool authorized() const;
  void route(std::string_view path);
  void answer_options();
  void completions(bool chat);
  void run_request(CompletionRequest parsed, bool chat, ResponseOptions options);
  // /tokenize, /detokenize: a JSON answer computed from the body alone.
  void send_computed(bool (*compute)(std::string_view, const RestContext&, json*, ApiError*));
  void send_admin_reply(const AdminReply& reply);

  // Streaming (SSE over chunked transfer encoding).
  void start_stream();
  void queue_event(std::string event);
  void finish_stream(bool close);
  void write_next();
  void stream_broken();

  // Cancel on disconnect: while a completion is answered, the client closing its connection
  // (seen by watch_disconnect, or as a failed write of a stream) cancels it in the core.
  void watch_disconnect();
  void client_gone();

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> req_;
  std::shared_ptr<http::response<http::string_body>> res_;  // alive during its async_write
  http::response<http::empty_body> continue_res_{http::status::continue_, 11};
  std::shared_ptr<const RestContext> ctx_;
  std::weak_ptr<net::io_context> ioc_;  // weak: the io_context's queue holds us (no cycle)
  int64_t started_unix_;
  std::shared_ptr<std::atomic<int>> answering_count_;
  bool answering_ = false;
  // The request being answered: its id (X-Request-Id; the client's when acceptable) and Origin.
  std::string request_id_, origin_;

  std::unique_ptr<Active> active_;
  // Stream state: the header, then events in order, then the last chunk.
  std::optional<http::response<http::empty_body>> stream_head_;
  std::optional<http::response_serializer<http::empty_body>> stream_sr_;
  std::deque<std::string> events_;  // deque: push_back keeps the front's bytes where they are
  // After refusing a request whose body we did not read: read and discard what the client
  // still sends for a moment before closing, so the close does not reset the connection
  // (and destroy our answer in the client's receive buffer) while it is still sending.
  bool linger_on_close_ = false;
  std::unique_ptr<std::array<char, 16384>> linger_buffer_;

  bool chunked_ = true, header_done_ = false, writing_ = false, finishing_ = false, close_after_ = false,
       broken_ = false;
  bool cancelled_ = false;  // the client went away: the answer's end is not sent
  uint64_t watch_id_ = 0;   // the answer the pending watch_disconnect belongs to
};

void Session::do_read() {
  request_id_.clear();
  origin_.clear();
  parser_.emplace();
  parser_->body_limit(ctx_->limits.max_body_bytes);
  req_ = {};
  stream_.expires_after(kIdleTimeout);
  http::async_read_header(stream_, buffer_, *parser_,
                          beast::bind_front_handler(&Session::on_read_header, shared_from_this()));
}

void Session::on_read_header(beast::error_code ec, size_t) {
  if (ec) return read_failed(ec);
  const auto& h = parser_->get();
  request_id_ = client_request_id(view(h["X-Request-Id"])).value_or(new_request_id());
  origin_ = std::string(view(h[http::field::origin]));
  if (auto length = parser_->content_length(); length && *length > ctx_->limits.max_body_bytes)
    return send_error(api_error(413, "the request body has " + std::to_string(*length) +
                                         " bytes; at most " + std::to_string(ctx_->limits.max_body_bytes) +
                                         " are accepted"),
                      /*close=*/true);
  if (beast::iequals(h[http::field::expect], "100-continue")) {
    stream_.expires_after(kIoTimeout);
    continue_res_.set(http::field::server, kServerName);
    return http::async_write(stream_, continue_res_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->do_close();
      self->read_body();
    });
  }
  read_body();
}

void Session::read_body() {
  stream_.expires_after(kIoTimeout);
  http::async_read(stream_, buffer_, *parser_, beast::bind_front_handler(&Session::on_read, shared_from_this()));
}

void Session::on_read(beast::error_code ec, size_t) {
  if (ec) return read_failed(ec);
  req_ = parser_->release();
  stream_.expires_never();  // answering may wait on the core
  begin_answer();
  handle();
}

void Session::read_failed(beast::error_code ec) {
  if (ec == http::error::body_limit)
    return send_error(api_error(413, "the request body is larger than " +
                                         std::to_string(ctx_->limits.max_body_bytes) + " bytes"),
                      true);
  if (ec == http::error::header_limit)
    return send_error(api_error(431, "the request headers are too large"), true);
  const bool parse_error = &ec.category() == &make_error_code(http::error::bad_target).category() &&
                           ec != http::error::end_of_stream && ec != http::error::partial_message;
  if (!parse_error) return do_close();  // the client left, timed out or the connection failed
  send_error(api_error(400, "malformed HTTP request: " + ec.message()), true);
}

void Session::do_close() {
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  if (!linger_on_close_) return;
  linger_on_close_ = false;
  linger_buffer_ = std::make_unique<std::array<char, 16384>>();
  stream_.expires_after(kLingerTime);  // one deadline for the whole drain
  linger();
}

void Session::linger() {
  stream_.async_read_some(net::buffer(*linger_buffer_), [self = shared_from_this()](beast::error_code ec, size_t) {
    if (!ec) self->linger();  // EOF, an error or the deadline ends it; then the session goes
  });
}

http::response<http::string_body> Session::make_response(http::status status, std::string body,
                                                         std::string_view content_type) {
  http::response<http::string_body> res{status, req_.version() ? req_.version() : 11};
  set_common_headers(res);
  res.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
  res.keep_alive(req_.keep_alive());
  res.body() = std::move(body);
  res.prepare_payload();
  return res;
}

void Session::set_common_headers(http::fields& fields) {
  if (request_id_.empty()) request_id_ = new_request_id();  // a request that never got past its headers
  fields.set(http::field::server, kServerName);
  fields.set("X-Request-Id", request_id_);
  if (auto allow = cors_allow_origin(ctx_->cors_origins, origin_)) {
    fields.set(http::field::access_control_allow_origin, *allow);
    fields.set(http::field::access_control_expose_headers, "X-Request-Id");
    if (*allow != "*") fields.set(http::field::vary, "Origin");
  }
}

void Session::send_json(int status, const json& body) {
  send(make_response(http::int_to_status(unsigned(status)) == http::status::unknown ? http::status::internal_server_error
                                                                                   : http::status(status),
                     dump_json(body) + "\n", "application/json"));
}

void Session::send_error(const ApiError& error, bool close, int retry_after_seconds) {
  auto res = make_response(http::status(error.http_status), error_body(error) + "\n", "application/json");
  if (error.http_status == 401) res.set(http::field::www_authenticate, "Bearer");
  if (retry_after_seconds > 0) res.set(http::field::retry_after, std::to_string(retry_after_seconds));
  if (close) {
    res.keep_alive(false);
    linger_on_close_ = true;
  }
  send(std::move(res));
}

void Session::send(http::response<http::string_body>&& res) {
  if (ctx_->metrics) ctx_->metrics->count_request(view(req_.target()), int(res.result_int()));
  const bool close = res.need_eof();
  res_ = std::make_shared<http::response<http::string_body>>(std::move(res));
  stream_.expires_after(kIoTimeout);
  http::async_write(stream_, *res_, beast::bind_front_handler(&Session::on_write, shared_from_this(), close));
}

void Session::on_write(bool close, beast::error_code ec, size_t) {
  res_.reset();
  end_answer();
  if (ec || close) return do_close();
  do_read();
}

bool Session::authorized() const {
  if (ctx_->api_key.empty()) return true;
  std::string_view auth = view(req_[http::field::authorization]);
  constexpr std::string_view kScheme = "bearer ";
  if (auth.size() < kScheme.size() || !beast::iequals(beast::string_view(auth.data(), kScheme.size()), beast::string_view(kScheme.data(), kScheme.size()))) return false;
  auth.remove_prefix(kScheme.size());
  while (!auth.empty() && auth.front() == ' ') auth.remove_prefix(1);
  while (!auth.empty() && (auth.back() == ' ' || auth.back() == '\t')) auth.remove_suffix(1);
  return constant_time_equals(std::string(auth), ctx_->api_key);
}

void Session::handle() {
  std::string_view target = view(req_.target());
  std::string_view path = target.substr(0, target.find('?'));
  if (req_.method() == http::verb::options) return answer_options();  // preflights carry no credentials
  if (path != "/health" && path != "/" && !authorized())  // the status page holds no data
    return send_error(api_error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "",
                                "invalid_request_error", "invalid_api_key"));
  try {
    route(path);
  } catch (const std::exception& e) {  // a callback of the core threw: answer, keep serving
    spdlog::error("REST {} {}: {}", std::string(req_.method_string()), std::string(path), e.what());
    send_error(api_error(500, std::string("internal error: ") + e.what(), "", "server_error"));
  }
}

void Session::route(std::string_view path) {
  const http::verb method = req_.method();
  auto allow_only = [&](http::verb verb) {
    if (method == verb) return true;
    auto res = make_response(http::status::method_not_allowed,
                             error_body(api_error(405, "method " + std::string(req_.method_string()) + " is not allowed on " +
                                                          std::string(path) + "; use " +
                                                          std::string(http::to_string(verb)))) + "\n",
                             "application/json");
    res.set(http::field::allow, http::to_string(verb));
    send(std::move(res));
    return false;
  };
  const json model = {{"id", ctx_->model_name},
                      {"object", "model"},
                      {"created", started_unix_},
                      {"owned_by", "conveyor"},
                      {"max_model_len", ctx_->config.n_positions}};

  if (path == "/v1/completions") {
    if (allow_only(http::verb::post)) completions(/*chat=*/false);
  } else if (path == "/v1/chat/completions") {
    if (allow_only(http::verb::post)) completions(/*chat=*/true);
  } else if (path == "/tokenize" || path == "/detokenize") {
    if (allow_only(http::verb::post)) send_computed(path == "/tokenize" ? &tokenize_request : &detokenize_request);
  } else if (path == "/") {
    if (!allow_only(http::verb::get)) return;
    auto res = make_response(http::status::ok, std::string(status_page_html()), kStatusPageContentType);
    res.set(http::field::cache_control, "no-cache");
    res.set("Content-Security-Policy", std::string(kStatusPagePolicy));
    send(std::move(res));
  } else if (path == "/v1/models") {
    if (allow_only(http::verb::get)) send_json(200, {{"object", "list"}, {"data", json::array({model})}});
  } else if (path.starts_with("/v1/models/")) {
    if (!allow_only(http::verb::get)) return;
    std::string name;
    if (!percent_decode(path.substr(11), name) || name != ctx_->model_name)
      return send_error(api_error(404, "the model '" + std::string(path.substr(11)) + "' does not exist", "model",
                                  "invalid_request_error", "model_not_found"));
    send_json(200, model);
  } else if (path == "/health") {
    if (!allow_only(http::verb::get)) return;
    if (!ctx_->health) return send_json(200, {{"status", "ok"}});
    auto [ready, body] = ctx_->health();
    send_json(ready ? 200 : 503, body);
  } else if (path == "/metrics") {
    if (!allow_only(http::verb::get)) return;
    send(make_response(http::status::ok, ctx_->metrics ? ctx_->metrics->render() : std::string(),
                       Metrics::kContentType));
  } else if (path == "/v1/cluster") {
    if (!allow_only(http::verb::get)) return;
    if (!ctx_->cluster) return send_error(api_error(404, "this coordinator has no cluster view", "", "not_found_error"));
    send_json(200, ctx_->cluster());
  } else if (path == "/v1/cluster/plan") {
    if (!allow_only(http::verb::post)) return;
    if (!ctx_->plan) return send_error(api_error(404, "re-planning is not available on this coordinator", "", "not_found_error"));
    json body;
    try {
      body = req_.body().empty() ? json::object() : json::parse(req_.body());
    } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
      return send_error(api_error(400, std::string("the request body is not valid JSON: ") + e.what()));
    }
    ApiError error;
    auto request = parse_plan_body(body, &error);
    if (!request) return send_error(error);
    send_admin_reply(ctx_->plan(*request));
  } else if (path.starts_with("/v1/cluster/workers/") && path.ends_with("/drain")) {
    if (!allow_only(http::verb::post)) return;
    constexpr size_t kPrefix = std::string_view("/v1/cluster/workers/").size();
    constexpr size_t kSuffix = std::string_view("/drain").size();
    std::string worker;
    if (path.size() <= kPrefix + kSuffix || !percent_decode(path.substr(kPrefix, path.size() - kPrefix - kSuffix), worker) ||
        worker.find('/') != std::string::npos)
      return send_error(api_error(404, "no such path: " + std::string(path), "", "not_found_error"));
    if (!ctx_->drain) return send_error(api_error(404, "draining is not available on this coordinator", "", "not_found_error"));
    send_admin_reply(ctx_->drain(worker));
  } else {
    send_error(api_error(404, "no such path: " + std::string(path), "", "not_found_error"));
  }
}

void Session::send_admin_reply(const AdminReply& reply) {
  if (!reply.status.ok()) return send_refusal(reply.status);
  send_json(200, reply.body);
}

// OPTIONS on any path: 204; a CORS preflight from an allowed origin also gets what it may
// send (set_common_headers adds Access-Control-Allow-Origin).
void Session::answer_options() {
  auto res = make_response(http::status::no_content, "", "text/plain");
  res.erase(http::field::content_type);
  res.erase(http::field::content_length);  // a 204 has no body and no length
  res.set(http::field::allow, kCorsAllowMethods);
  const bool preflight = !req_[http::field::access_control_request_method].empty();
  if (preflight && cors_allow_origin(ctx_->cors_origins, origin_)) {
    res.set(http::field::access_control_allow_methods, kCorsAllowMethods);
    const auto asked = req_[http::field::access_control_request_headers];
    res.set(http::field::access_control_allow_headers, asked.empty() ? beast::string_view(kCorsAllowHeaders) : asked);
    res.set(http::field::access_control_max_age, std::to_string(kCorsMaxAgeSeconds));
  }
  send(std::move(res));
}

void Session::send_computed(bool (*compute)(std::string_view, const RestContext&, json*, ApiError*)) {
  if (!ctx_->tokenizer) return send_error(api_error(503, "the server has no tokenizer", "", "service_unavailable"));
  json body;
  ApiError error;
  if (!compute(view(req_.body()), *ctx_, &body, &error)) return send_error(error);
  send_json(200, body);
}

void Session::completions(bool chat) {
  if (!ctx_->backend || !ctx_->tokenizer)
    return send_error(api_error(503, "the server has no model backend", "", "service_unavailable"));
  ApiError error;
  ResponseOptions options;
  const ChatSettings no_chat;
  Expected<CompletionRequest> parsed =
      chat ? parse_chat_body(req_.body(), ctx_->chat ? *ctx_->chat : no_chat, *ctx_->tokenizer, ctx_->config,
                             ctx_->limits, ctx_->model_name, &error, &options)
           : parse_completion_body(req_.body(), *ctx_->tokenizer, ctx_->config, ctx_->limits, ctx_->model_name, &error,
                                   &options);
  if (!parsed.ok()) return send_error(error);
  run_request(std::move(parsed).value(), chat, std::move(options));
}

void Session::run_request(CompletionRequest parsed, bool chat, ResponseOptions options) {
  std::shared_ptr<net::io_context> ioc = ioc_.lock();
  if (!ioc) return send_error(api_error(503, "the server is stopping", "", "service_unavailable"));
  // One id for the request everywhere: the client's X-Request-Id, else the request's own.
  if (client_request_id(view(req_["X-Request-Id"]))) parsed.id = request_id_;
  else request_id_ = parsed.id;
  auto request = std::make_shared<const CompletionRequest>(std::move(parsed));
  std::unique_ptr<ResponseBuilder> builder;
  if (chat) builder = std::make_unique<ChatResponseBuilder>(request, *ctx_->tokenizer, unix_now(), std::move(options));
  else builder = std::make_unique<CompletionResponseBuilder>(request, *ctx_->tokenizer, unix_now(), std::move(options));
  active_ = std::make_unique<Active>(Active{request, std::move(builder), false, {}});
  active_->last_token_at.resize(request->num_choices());

  // The sink only posts onto this session's strand. It is called from the core's thread.
  auto target = std::make_shared<SinkTarget>(SinkTarget{std::move(ioc), stream_.get_executor(), shared_from_this()});
  CompletionSink sink;
  sink.on_update = [target](ChoiceUpdate update) {
    const Clock::time_point at = Clock::now();
    net::post(target->strand, [session = target->session, update = std::move(update), at]() mutable {
      session->on_update(std::move(update), at);
    });
  };
  sink.on_done = [target](const std::string& error) {
    net::post(target->strand, [session = target->session, error]() mutable { session->on_done(std::move(error)); });
  };
  sink.on_refused = [target](const CoreStatus& why) {
    net::post(target->strand, [session = target->session, why]() mutable { session->on_refused(std::move(why)); });
  };
  target.reset();

  CoreStatus submitted;
  try {
    submitted = ctx_->backend->submit(request, std::move(sink));
  } catch (const std::exception& e) {
    submitted = CoreStatus::refuse(CoreError::Unavailable, std::string("the scheduler failed: ") + e.what());
  }
  if (!submitted.ok()) {
    active_.reset();
    if (submitted.message.empty()) submitted.message = "the request was refused";
    return send_refusal(submitted);
  }
  if (ctx_->metrics) ctx_->metrics->add_prompt_tokens(uint64_t(active_->builder->prompt_tokens()));
  cancelled_ = false;
  watch_disconnect();
  if (request->stream) start_stream();
}

// While a completion is answered the client sends nothing (a pipelined request aside): the
// socket turning readable with no byte to read (its FIN) or failing means the client closed
// its connection. The byte is peeked, never taken: a pipelined request stays for do_read, and
// the watch ends (that client is still there). A client that half-closes its side after the
// request reads as gone too, as with vLLM.
void Session::watch_disconnect() {
  const uint64_t id = ++watch_id_;
  stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), id](beast::error_code ec) {
    if (id != self->watch_id_ || !self->active_ || self->cancelled_) return;  // that answer ended
    if (ec == net::error::operation_aborted) return;                          // the socket was closed here
    char byte;
    beast::error_code peek;
    size_t n = 0;
    if (!ec) {
      self->stream_.socket().non_blocking(true, peek);
      if (!peek) n = self->stream_.socket().receive(net::buffer(&byte, 1), tcp::socket::message_peek, peek);
      if (peek == net::error::would_block || peek == net::error::try_again) return self->watch_disconnect();
      if (!peek && n > 0) return;  // a pipelined request
    }
    self->client_gone();
  });
}

void Session::client_gone() {
  if (!active_ || cancelled_) return;
  cancelled_ = true;
  spdlog::debug("completion {}: the client closed its connection; cancelling", active_->request->id);
  ctx_->backend->cancel(*active_->request);
}

void Session::on_update(ChoiceUpdate update, Clock::time_point at) {
  if (!active_ || update.choice >= active_->last_token_at.size()) return;
  const size_t n = update.tokens.size();
  if (n > 0) {
    if (Metrics* m = ctx_->metrics) {
      m->add_generated_tokens(n);
      if (!active_->first_token_seen)
        m->observe_time_to_first_token(std::chrono::duration<double>(at - active_->request->arrival).count());
      // Tokens that arrive together share the gap since the choice's previous token.
      if (const auto& last = active_->last_token_at[update.choice])
        m->observe_inter_token_latency(std::chrono::duration<double>(at - *last).count() / double(n), n);
    }
    active_->first_token_seen = true;
    active_->last_token_at[update.choice] = at;
  }
  if (active_->request->stream) {
    if (std::string event = active_->builder->sse_chunk(update); !event.empty()) queue_event(std::move(event));
  } else {
    active_->builder->add(update);
  }
}

void Session::on_done(std::string error) {
  if (!active_) return;
  std::unique_ptr<Active> done = std::move(active_);
  if (cancelled_) {  // the client is gone: nothing to send
    cancelled_ = false;
    end_answer();
    beast::error_code ec;
    stream_.socket().close(ec);
    return;
  }
  if (!error.empty()) spdlog::warn("completion {} failed: {}", done->request->id, error);
  if (done->request->stream) {
    if (!error.empty()) {
      queue_event(CompletionResponseBuilder::sse_error(api_error(500, error, "", "server_error")));
      return finish_stream(/*close=*/true);
    }
    queue_event(done->builder->sse_finish());
    return finish_stream(/*close=*/false);
  }
  if (!error.empty()) return send_error(api_error(500, error, "", "server_error"));
  send(make_response(http::status::ok, dump_json(done->builder->response()) + "\n", "application/json"));
}

// The core refused a request it had queued (no pipeline within scheduler.pipeline_wait_ms).
// A stream has already sent its 200: the refusal is its last event.
void Session::on_refused(CoreStatus why) {
  if (!active_) return;
  if (cancelled_) return on_done({});
  std::unique_ptr<Active> done = std::move(active_);
  spdlog::warn("completion {} refused: {}", done->request->id, why.message);
  if (done->request->stream) {
    queue_event(CompletionResponseBuilder::sse_error(api_error_of(why)));
    return finish_stream(/*close=*/true);
  }
  send_refusal(why);
}

// A refusal of the core in its HTTP form, with Retry-After when the core says when to retry.
void Session::send_refusal(const CoreStatus& refusal) {
  send_error(api_error_of(refusal), false, refusal.retry_after_seconds);
}

void Session::start_stream() {
  chunked_ = req_.version() >= 11;  // HTTP/1.0 has no chunks: the body ends when we close
  stream_head_.emplace(http::status::ok, req_.version());
  set_common_headers(*stream_head_);
  stream_head_->set(http::field::content_type, "text/event-stream");
  stream_head_->set(http::field::cache_control, "no-cache");
  stream_head_->set("X-Accel-Buffering", "no");
  stream_head_->keep_alive(chunked_ && req_.keep_alive());
  if (chunked_) stream_head_->chunked(true);
  stream_sr_.emplace(*stream_head_);
  header_done_ = writing_ = finishing_ = close_after_ = broken_ = false;
  events_.clear();
  if (std::string opening = active_->builder->sse_start(); !opening.empty()) events_.push_back(std::move(opening));
  if (ctx_->metrics) ctx_->metrics->count_request(200);
  writing_ = true;
  stream_.expires_after(kIoTimeout);
  http::async_write_header(stream_, *stream_sr_, [self = shared_from_this()](beast::error_code ec, size_t) {
    self->writing_ = false;
    if (ec) return self->stream_broken();
    self->header_done_ = true;
    self->write_next();
  });
}

void Session::queue_event(std::string event) {
  if (broken_) return;
  events_.push_back(std::move(event));
  if (header_done_ && !writing_) write_next();
}

void Session::finish_stream(bool close) {
  finishing_ = true;
  close_after_ = close;
  if (broken_) return stream_broken();
  if (header_done_ && !writing_) write_next();
}

void Session::write_next() {
  if (broken_) return;
  auto after = [self = shared_from_this()](beast::error_code ec, size_t) {
    self->writing_ = false;
    self->events_.pop_front();
    if (ec) return self->stream_broken();
    self->write_next();
  };
  if (!events_.empty()) {
    writing_ = true;
    stream_.expires_after(kIoTimeout);
    const net::const_buffer data = net::buffer(events_.front());
    if (chunked_) return net::async_write(stream_, http::make_chunk(data), std::move(after));
    return net::async_write(stream_, data, std::move(after));
  }
  if (!finishing_) return;
  // Everything is out: end the body, then serve the next request or close.
  auto end = [self = shared_from_this()](beast::error_code ec, size_t) {
    self->writing_ = false;
    self->stream_sr_.reset();
    self->stream_head_.reset();
    self->end_answer();
    if (ec || self->close_after_ || !self->chunked_ || !self->req_.keep_alive()) return self->do_close();
    self->do_read();
  };
  writing_ = true;
  finishing_ = false;
  stream_.expires_after(kIoTimeout);
  if (chunked_) return net::async_write(stream_, http::make_chunk_last(), std::move(end));
  end(beast::error_code{}, 0);
}

void Session::stream_broken() {
  // The client went away (or stalled past the timeout). Drop the output and cancel the
  // request in the core; on_done still arrives here.
  broken_ = true;
  events_.clear();
  client_gone();
  beast::error_code ec;
  stream_.socket().close(ec);
}

}  // namespace

void serve_connection(tcp::socket&& socket, std::shared_ptr<const RestContext> ctx, std::weak_ptr<net::io_context> ioc,
                      int64_t started_unix, std::shared_ptr<std::atomic<int>> answering) {
  std::make_shared<Session>(std::move(socket), std::move(ctx), std::move(ioc), started_unix, std::move(answering))->run();
}

}  // namespace conveyor

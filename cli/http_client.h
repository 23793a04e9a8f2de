// A small blocking HTTP/1.1 client (Boost.Beast) for the `conveyor` command and the
// cluster tests: one request per connection, optional streaming of the body as it arrives
// (server-sent events), bounded by a timeout.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace conveyor {

struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string body;  // empty when the body was streamed to on_body
};

struct HttpRequest {
  std::string method = "GET";
  std::string target = "/";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  std::chrono::milliseconds timeout{30000};       // the whole call, from connect to the last byte
  std::chrono::milliseconds idle_timeout{0};      // > 0: the call fails when nothing arrives for this long
  std::function<void(std::string_view)> on_body;  // set: body bytes are streamed here
};

Expected<HttpResponse> http_call(const std::string& host, int port, const HttpRequest& request);

// Splits "http://host:port" (or "host:port") into host and port.
Expected<std::pair<std::string, int>> parse_http_url(const std::string& url);

// Feeds server-sent-event bytes in, calls on_event with each complete "data:" payload.
class SseParser {
 public:
  explicit SseParser(std::function<void(std::string_view data)> on_event) : on_event_(std::move(on_event)) {}
  void feed(std::string_view bytes);

 private:
  std::function<void(std::string_view)> on_event_;
  std::string buffer_;
};

}  // namespace conveyor

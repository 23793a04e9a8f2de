#include "cli/http_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace conveyor {

namespace beast = boost::beast;
namespace http = beast::http;
namespace asio = boost::asio;

namespace {

using Clock = std::chrono::steady_clock;

// What a call that timed out says: which of its limits ran out.
std::string timeout_text(const HttpRequest& req, Clock::time_point deadline) {
  const auto ms = [](std::chrono::milliseconds d) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g s", double(d.count()) / 1000.0);
    return std::string(buf);
  };
  if (req.idle_timeout.count() > 0 && Clock::now() + std::chrono::milliseconds(50) < deadline)
    return "nothing received for " + ms(req.idle_timeout) + " (the idle limit)";
  return "no whole answer within " + ms(req.timeout) + " (the call's limit)";
}

// Runs one asynchronous step on `ioc` to its end and throws its error. Asynchronous, because a
// Beast stream's expiry bounds only asynchronous operations: a synchronous read waits forever
// on a server that stops sending (issue 28).
template <class Start>
void await(asio::io_context& ioc, Start start) {
  beast::error_code result;
  start([&result](beast::error_code ec, auto&&...) { result = ec; });
  ioc.restart();
  ioc.run();
  if (result) throw beast::system_error(result);
}

}  // namespace

Expected<HttpResponse> http_call(const std::string& host, int port, const HttpRequest& req) {
  const auto deadline = Clock::now() + req.timeout;
  const std::string what = req.method + " http://" + host + ":" + std::to_string(port) + req.target + ": ";
  try {
    asio::io_context ioc;
    asio::ip::tcp::resolver resolver(ioc);
    beast::tcp_stream stream(ioc);
    // Before each step: the idle limit, or what is left of the whole call's when that is less.
    auto arm = [&] {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      stream.expires_after(req.idle_timeout.count() > 0 ? std::min(left, req.idle_timeout) : left);
    };
    arm();
    const auto endpoints = resolver.resolve(host, std::to_string(port));
    await(ioc, [&](auto done) { stream.async_connect(endpoints, done); });
    http::request<http::string_body> r{http::string_to_verb(req.method), req.target, 11};
    r.set(http::field::host, host + ":" + std::to_string(port));
    r.set(http::field::connection, "close");
    for (const auto& [k, v] : req.headers) r.set(k, v);
    if (!req.body.empty() || req.method == "POST") {
      r.set(http::field::content_type, "application/json");
      r.body() = req.body;
      r.prepare_payload();
    }
    arm();
    await(ioc, [&](auto done) { http::async_write(stream, r, done); });

    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    HttpResponse out;
    // The parser keeps a reference to the callback: it must live as long as the parser.
    auto on_chunk = [&](std::uint64_t, beast::string_view body, beast::error_code&) -> std::size_t {
      req.on_body(std::string_view(body.data(), body.size()));
      return body.size();
    };
    if (req.on_body) parser.on_chunk_body(on_chunk);
    arm();
    await(ioc, [&](auto done) { http::async_read_header(stream, buffer, parser, done); });
    out.status = int(parser.get().result_int());
    out.content_type = std::string(parser.get()[http::field::content_type]);
    while (!parser.is_done()) {
      arm();
      bool ended = false;
      await(ioc, [&](auto done) {
        http::async_read_some(stream, buffer, parser, [&, done](beast::error_code ec, std::size_t n) mutable {
          ended = ec == http::error::end_of_stream || ec == asio::error::eof;
          done(ended ? beast::error_code() : ec, n);
        });
      });
      if (ended) break;
    }
    out.body = std::move(parser.get().body());
    if (req.on_body && !parser.chunked() && !out.body.empty()) {
      req.on_body(out.body);
      out.body.clear();
    }
    beast::error_code ignored;
    stream.socket().shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    return out;
  } catch (const beast::system_error& e) {
    if (e.code() == beast::error::timeout) return Status::error(what + timeout_text(req, deadline));
    return Status::error(what + e.what());
  } catch (const std::exception& e) {
    return Status::error(what + e.what());
  }
}

Expected<std::pair<std::string, int>> parse_http_url(const std::string& url) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  if (auto slash = rest.find('/'); slash != std::string::npos) rest = rest.substr(0, slash);
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos) return std::make_pair(rest, 80);
  try {
    const int port = std::stoi(rest.substr(colon + 1));
    if (port <= 0 || port > 65535) throw std::out_of_range("port");
    return std::make_pair(rest.substr(0, colon), port);
  } catch (const std::exception&) {
    return Status::error("bad URL \"" + url + "\": expected http://HOST:PORT");
  }
}

void SseParser::feed(std::string_view bytes) {
  buffer_.append(bytes);
  size_t end;
  while ((end = buffer_.find("\n\n")) != std::string::npos) {
    const std::string event = buffer_.substr(0, end);
    buffer_.erase(0, end + 2);
    size_t pos = 0;
    while (pos < event.size()) {
      size_t nl = event.find('\n', pos);
      if (nl == std::string::npos) nl = event.size();
      std::string_view line(event.data() + pos, nl - pos);
      if (line.rfind("data:", 0) == 0) {
        line.remove_prefix(5);
        if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
        on_event_(line);
      }
      pos = nl + 1;
    }
  }
}

}  // namespace conveyor

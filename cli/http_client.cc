#include "cli/http_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace conveyor {

namespace beast = boost::beast;
namespace http = beast::http;
namespace asio = boost::asio;

Expected<HttpResponse> http_call(const std::string& host, int port, const HttpRequest& req) {
  try {
    asio::io_context ioc;
    asio::ip::tcp::resolver resolver(ioc);
    beast::tcp_stream stream(ioc);
    stream.expires_after(req.timeout);
    stream.connect(resolver.resolve(host, std::to_string(port)));
    http::request<http::string_body> r{http::string_to_verb(req.method), req.target, 11};
    r.set(http::field::host, host + ":" + std::to_string(port));
    r.set(http::field::connection, "close");
    for (const auto& [k, v] : req.headers) r.set(k, v);
    if (!req.body.empty() || req.method == "POST") {
      r.set(http::field::content_type, "application/json");
      r.body() = req.body;
      r.prepare_payload();
    }
    http::write(stream, r);

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
    http::read_header(stream, buffer, parser);
    out.status = int(parser.get().result_int());
    out.content_type = std::string(parser.get()[http::field::content_type]);
    while (!parser.is_done()) {
      beast::error_code ec;
      http::read_some(stream, buffer, parser, ec);
      if (ec == http::error::end_of_stream || ec == asio::error::eof) break;
      if (ec) throw beast::system_error(ec);
    }
    out.body = std::move(parser.get().body());
    if (req.on_body && !parser.chunked() && !out.body.empty()) {
      req.on_body(out.body);
      out.body.clear();
    }
    beast::error_code ignored;
    stream.socket().shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    return out;
  } catch (const std::exception& e) {
    return Status::error(req.method + " http://" + host + ":" + std::to_string(port) + req.target + ": " + e.what());
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

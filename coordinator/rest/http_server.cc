#include "coordinator/rest/http_server.h"

#include <atomic>
#include <chrono>
#include <ctime>
#include <thread>
#include <vector>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <spdlog/spdlog.h>

#include "coordinator/rest/http_session.h"

namespace conveyor {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

bool constant_time_equals(const std::string& given, const std::string& expected) {
  // Runs over `expected` whatever `given` is, so the time says nothing about the key's bytes.
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= static_cast<unsigned char>(g ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

namespace {

int64_t unix_now() { return int64_t(std::time(nullptr)); }

// Accepts connections, each onto its own strand.
class Listener : public std::enable_shared_from_this<Listener> {
 public:
  Listener(const std::shared_ptr<net::io_context>& ioc, std::shared_ptr<const RestContext> ctx,
           std::shared_ptr<std::atomic<int>> answering)
      : ioc_(ioc), io_(*ioc), acceptor_(net::make_strand(*ioc)), ctx_(std::move(ctx)), started_unix_(unix_now()),
        answering_(std::move(answering)) {}

  Status open(const tcp::endpoint& endpoint) {
    beast::error_code ec;
    auto fail = [&](const char* what) {
      return Status::error("cannot listen on " + endpoint.address().to_string() + ":" +
                           std::to_string(endpoint.port()) + ": " + what + ": " + ec.message());
    };
    if (acceptor_.open(endpoint.protocol(), ec); ec) return fail("open");
    if (acceptor_.set_option(net::socket_base::reuse_address(true), ec); ec) return fail("set_option");
    if (acceptor_.bind(endpoint, ec); ec) return fail("bind");
    if (acceptor_.listen(net::socket_base::max_listen_connections, ec); ec) return fail("listen");
    return ok_status();
  }

  int port() const {
    beast::error_code ec;
    return acceptor_.local_endpoint(ec).port();
  }

  void run() { net::dispatch(acceptor_.get_executor(), beast::bind_front_handler(&Listener::do_accept, shared_from_this())); }

  void stop() {
    net::post(acceptor_.get_executor(), [self = shared_from_this()] {
      beast::error_code ec;
      self->acceptor_.close(ec);
    });
  }

 private:
  void do_accept() {
    acceptor_.async_accept(net::make_strand(io_),
                           beast::bind_front_handler(&Listener::on_accept, shared_from_this()));
  }

  void on_accept(beast::error_code ec, tcp::socket socket) {
    if (!acceptor_.is_open()) return;
    if (ec) {
      spdlog::warn("REST accept: {}", ec.message());
    } else {
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);  // SSE events go out as they are written
      serve_connection(std::move(socket), ctx_, ioc_, started_unix_, answering_);
    }
    do_accept();
  }

  std::weak_ptr<net::io_context> ioc_;  // weak: the io_context's queue holds us (no cycle)
  net::io_context& io_;                 // outlives us: we die at the latest in its destructor
  tcp::acceptor acceptor_;
  std::shared_ptr<const RestContext> ctx_;
  int64_t started_unix_;
  std::shared_ptr<std::atomic<int>> answering_;
};

}  // namespace

struct HttpServer::Impl {
  std::shared_ptr<net::io_context> ioc;  // shared with every pending sink
  std::shared_ptr<Listener> listener;
  std::shared_ptr<std::atomic<int>> answering = std::make_shared<std::atomic<int>>(0);  // requests read, not yet answered
  std::vector<std::thread> threads;
  int port = 0;
  bool stopped = false;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::port() const { return impl_->port; }

Expected<std::unique_ptr<HttpServer>> HttpServer::start(const std::string& host, int port, RestContext ctx,
                                                        int threads) {
  if (port < 0 || port > 65535) return Status::error("REST port " + std::to_string(port) + " is out of range 0..65535");
  if (threads < 1) return Status::error("REST io threads must be at least 1, got " + std::to_string(threads));
  if (!ctx.tokenizer) return Status::error("REST server started without a tokenizer");
  auto impl = std::make_unique<Impl>();
  impl->ioc = std::make_shared<net::io_context>(threads);

  beast::error_code ec;
  tcp::resolver resolver(*impl->ioc);
  auto endpoints = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty())
    return Status::error("cannot resolve REST listen address '" + host + "': " + (ec ? ec.message() : "no address"));
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();

  impl->listener = std::make_shared<Listener>(impl->ioc, std::make_shared<const RestContext>(std::move(ctx)), impl->answering);
  if (Status s = impl->listener->open(endpoint); !s.ok()) return s;
  impl->port = impl->listener->port();
  impl->listener->run();
  for (int i = 0; i < threads; ++i)
    impl->threads.emplace_back([ioc = impl->ioc] {
      for (;;) {
        try {
          ioc->run();
          return;
        } catch (const std::exception& e) {  // a handler threw: log and keep the thread serving
          spdlog::error("REST io thread: {}", e.what());
        }
      }
    });
  spdlog::info("REST API listening on {}:{}", endpoint.address().to_string(), impl->port);
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

int HttpServer::shutdown(std::chrono::milliseconds timeout) {
  if (!impl_ || impl_->stopped) return 0;
  impl_->listener->stop();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (*impl_->answering > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const int left = *impl_->answering;
  stop();
  return left;
}

void HttpServer::stop() {
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  impl_->listener->stop();
  impl_->ioc->stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
  // Sessions still queued in the io_context go when it does (it may outlive us while the
  // core holds sinks); the listener goes first.
  impl_->listener.reset();
  impl_->ioc.reset();
}

}  // namespace conveyor

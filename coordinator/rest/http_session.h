// One REST connection (http_server.h's Session): reads requests, routes them, answers them
// (a JSON document, or SSE events while a completion streams), while keep-alive.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "coordinator/rest/http_server.h"

namespace conveyor {

// Serves one accepted connection until it closes. `answering` counts the requests read and
// not yet answered (HttpServer::shutdown waits for it); `ioc` is the server's io_context,
// weak because its queue holds the session. `started_unix`: the server's start, for /v1/models.
void serve_connection(boost::asio::ip::tcp::socket&& socket, std::shared_ptr<const RestContext> ctx,
                      std::weak_ptr<boost::asio::io_context> ioc, int64_t started_unix,
                      std::shared_ptr<std::atomic<int>> answering);

}  // namespace conveyor

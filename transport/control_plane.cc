#include "transport/control_plane.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iterator>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "transport/zmq_check.h"

namespace conveyor::transport {

Status zmq_status(const zmq::error_t& e, const char* call, const char* file, int line) {
  return Status::error(std::string(call) + " failed at " +
                       std::filesystem::path(file).filename().string() + ":" +
                       std::to_string(line) + ": " + e.what());
}

bool curve_available() { return zmq_has("curve") != 0; }

Expected<CurveKeyPair> generate_curve_keypair() {
  if (!curve_available()) return Status::error("libzmq was built without CURVE support");
  char public_key[41] = {};
  char secret_key[41] = {};
  if (zmq_curve_keypair(public_key, secret_key) != 0)
    return Status::error(std::string("zmq_curve_keypair failed: ") + zmq_strerror(zmq_errno()));
  return CurveKeyPair{public_key, secret_key};
}

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What both socket kinds share: a context, the socket, an eventfd that post() uses to wake
// the socket thread, the queue of posted messages, and which thread is inside a call that
// touches the socket (the ownership rule of control_plane.h, enforced by SocketUse).
struct Socket {
  zmq::context_t context{1};  // declared first: outlives the socket
  zmq::socket_t socket;
  int wake_fd = -1;
  std::mutex mu;  // guards outbox
  std::deque<std::pair<std::string, ControlMessage>> outbox;
  std::size_t dropped = 0;  // the socket thread's
  std::atomic<std::thread::id> user{};  // the thread inside recv/send/flush_posted; none: id()

  Socket() = default;
  ~Socket() {
    if (wake_fd >= 0) ::close(wake_fd);
  }

  Status init(zmq::socket_type type, const ControlTimings& t) {
    wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd < 0) return Status::error(std::string("eventfd failed: ") + std::strerror(errno));
    CONVEYOR_ZMQ_CHECK(socket = zmq::socket_t(context, type));
    CONVEYOR_ZMQ_CHECK(socket.set(zmq::sockopt::linger, 0));
    CONVEYOR_ZMQ_CHECK(
        socket.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(t.heartbeat_interval.count())));
    CONVEYOR_ZMQ_CHECK(
        socket.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(t.heartbeat_timeout.count())));
    CONVEYOR_ZMQ_CHECK(
        socket.set(zmq::sockopt::heartbeat_ttl, static_cast<int>(t.heartbeat_timeout.count())));
    CONVEYOR_ZMQ_CHECK(
        socket.set(zmq::sockopt::handshake_ivl, static_cast<int>(t.handshake_timeout.count())));
    CONVEYOR_ZMQ_CHECK(socket.set(zmq::sockopt::maxmsgsize, t.max_message_bytes));
    return ok_status();
  }

  void post(std::string peer, ControlMessage m) {
    {
      std::lock_guard lock(mu);
      outbox.emplace_back(std::move(peer), std::move(m));
    }
    // EAGAIN: the counter is full, so a wake-up is pending anyway.
    const std::uint64_t one = 1;
    if (::write(wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
      spdlog::error("control plane: write to the wake-up eventfd failed: {} (a posted message waits for the "
                    "socket thread's next poll)",
                    std::strerror(errno));
  }

  std::deque<std::pair<std::string, ControlMessage>> take_posted() {
    std::uint64_t drained;
    if (::read(wake_fd, &drained, sizeof(drained)) < 0 && errno != EAGAIN)
      spdlog::error("control plane: read of the wake-up eventfd failed: {}", std::strerror(errno));
    std::lock_guard lock(mu);
    return std::exchange(outbox, {});
  }

  // Waits until the socket has a message, a message was posted, or `deadline` passes.
  Status wait(Clock::time_point deadline, bool& readable) {
    readable = false;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return ok_status();
    zmq::pollitem_t items[] = {{socket.handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, wake_fd, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 2, left);
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) return ok_status();  // a signal: the caller looks again
      return zmq_status(e, "zmq::poll(items, 2, left)", __FILE__, __LINE__);
    }
    readable = items[0].revents & ZMQ_POLLIN;
    return ok_status();
  }

  // Receives one multipart message if one is waiting; `frames` empty when none.
  Status try_recv(std::vector<zmq::message_t>& frames) {
    frames.clear();
    zmq::recv_result_t r;
    CONVEYOR_ZMQ_CHECK(
        r = zmq::recv_multipart(socket, std::back_inserter(frames), zmq::recv_flags::dontwait));
    if (!r) frames.clear();
    return ok_status();
  }
};

// One call's hold on a Socket: the first thread in owns the socket until it leaves; a call
// nested on the same thread (recv -> flush_posted -> send) passes; a second thread is
// refused before it touches the socket.
class SocketUse {
 public:
  SocketUse(Socket& s, const char* call) : s_(s), call_(call) {
    std::thread::id none;
    if (s_.user.compare_exchange_strong(none, std::this_thread::get_id(), std::memory_order_acquire))
      held_ = true;
    else
      nested_ = none == std::this_thread::get_id();
  }
  ~SocketUse() {
    if (held_) s_.user.store(std::thread::id(), std::memory_order_release);
  }
  SocketUse(const SocketUse&) = delete;
  SocketUse& operator=(const SocketUse&) = delete;

  bool ok() const { return held_ || nested_; }
  Status refusal(const std::string& who) const {
    return Status::error(who + ": " + call_ +
                         " called while another thread is inside a call on this ZeroMQ socket; a socket "
                         "belongs to one thread (its socket thread): other threads must post()");
  }

 private:
  Socket& s_;
  const char* call_;
  bool held_ = false, nested_ = false;
};

// Frames [json] or [json][blob] -> message. Errors name what was wrong.
Expected<ControlMessage> decode(const zmq::message_t* frames, std::size_t n) {
  if (n < 1 || n > 2)
    return Status::error("control message of " + std::to_string(n) +
                         " frames, expected 1 (JSON) or 2 (JSON, binary)");
  ControlMessage m;
  m.body = nlohmann::json::parse(frames[0].to_string_view(), nullptr, /*allow_exceptions=*/false);
  if (m.body.is_discarded()) return Status::error("control message is not valid JSON");
  if (Status s = validate_control_message(m); !s.ok()) return s;
  if (n == 2) {
    const auto* p = static_cast<const std::byte*>(frames[1].data());
    m.blob.assign(p, p + frames[1].size());
  }
  return m;
}

// Sends [prefix?][json][blob?] without blocking; `what` names the destination in errors.
Status send_frames(zmq::socket_t& socket, const std::string* routing_id, const ControlMessage& m,
                   const std::string& what) {
  if (Status s = validate_control_message(m); !s.ok())
    return Status::error("send to " + what + ": " + s.message());
  const std::string json = m.body.dump();
  const bool has_blob = !m.blob.empty();
  try {
    zmq::send_result_t r;
    if (routing_id) {
      r = socket.send(zmq::buffer(*routing_id),
                      zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      if (!r) return Status::error("send to " + what + ": its queue is full (not reading)");
    }
    r = socket.send(zmq::buffer(json), has_blob
                                           ? zmq::send_flags::sndmore | zmq::send_flags::dontwait
                                           : zmq::send_flags::dontwait);
    if (!r) return Status::error("send to " + what + ": not connected, or its queue is full");
    if (has_blob) {
      r = socket.send(zmq::buffer(m.blob.data(), m.blob.size()), zmq::send_flags::dontwait);
      if (!r) return Status::error("send to " + what + ": queue full in mid-message");
    }
  } catch (const zmq::error_t& e) {
    if (e.num() == EHOSTUNREACH)
      return Status::error("send to " + what + ": not connected (gone, or never registered)");
    return Status::error("send to " + what + ": zmq send failed: " + e.what());
  }
  return ok_status();
}

std::string port_zero_to_star(const std::string& endpoint) {
  if (endpoint.rfind("tcp://", 0) == 0 && endpoint.size() > 2 &&
      endpoint.compare(endpoint.size() - 2, 2, ":0") == 0)
    return endpoint.substr(0, endpoint.size() - 1) + "*";
  return endpoint;
}

}  // namespace

// ------------------------------------------------------------------ server

struct ControlServer::Impl {
  Socket s;
  std::string endpoint;
  int port = 0;
};

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlServer::~ControlServer() = default;

Expected<std::unique_ptr<ControlServer>> ControlServer::bind(const std::string& endpoint,
                                                             ControlServerOptions options) {
  auto impl = std::make_unique<Impl>();
  zmq::socket_t& sock = impl->s.socket;
  if (Status st = impl->s.init(zmq::socket_type::router, options.timings); !st.ok()) return st;
  CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::router_mandatory, 1));
  CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::router_handover, 1));
  if (!options.curve_secret_key.empty()) {
    if (!curve_available()) return Status::error("CURVE keys given, but libzmq has no CURVE");
    if (options.curve_secret_key.size() != 40)
      return Status::error("CURVE secret key must be 40 Z85 characters");
    CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::curve_server, 1));
    CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::curve_secretkey, options.curve_secret_key));
  }
  try {
    sock.bind(port_zero_to_star(endpoint));
  } catch (const zmq::error_t& e) {
    return Status::error("control server: bind to '" + endpoint + "' failed: " + e.what());
  }
  CONVEYOR_ZMQ_CHECK(impl->endpoint = sock.get(zmq::sockopt::last_endpoint));
  if (impl->endpoint.rfind("tcp://", 0) == 0) {
    const auto colon = impl->endpoint.rfind(':');
    impl->port = std::atoi(impl->endpoint.c_str() + colon + 1);
  }
  return std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
}

const std::string& ControlServer::endpoint() const { return impl_->endpoint; }
int ControlServer::port() const { return impl_->port; }
std::size_t ControlServer::dropped_malformed() const { return impl_->s.dropped; }

Expected<std::optional<PeerMessage>> ControlServer::recv(std::chrono::milliseconds timeout) {
  SocketUse use(impl_->s, "recv()");
  if (!use.ok()) return use.refusal("control server");
  const auto deadline = Clock::now() + timeout;
  std::vector<zmq::message_t> frames;
  for (;;) {
    (void)flush_posted();  // failures are logged there
    if (Status st = impl_->s.try_recv(frames); !st.ok()) return st;
    if (!frames.empty()) {
      std::string peer = frames[0].to_string();
      auto m = decode(frames.data() + 1, frames.size() - 1);
      if (m.ok()) return std::optional<PeerMessage>(PeerMessage{std::move(peer), std::move(*m)});
      ++impl_->s.dropped;
      spdlog::warn("control server: dropped a message from '{}': {}", peer, m.error());
      continue;
    }
    if (Clock::now() >= deadline) return std::optional<PeerMessage>();
    bool readable;
    if (Status st = impl_->s.wait(deadline, readable); !st.ok()) return st;
  }
}

Status ControlServer::send(const std::string& peer, const ControlMessage& message) {
  SocketUse use(impl_->s, "send()");
  if (!use.ok()) return use.refusal("control server");
  return send_frames(impl_->s.socket, &peer, message, "peer '" + peer + "'");
}

void ControlServer::post(std::string peer, ControlMessage message) {
  impl_->s.post(std::move(peer), std::move(message));
}

Status ControlServer::flush_posted() {
  SocketUse use(impl_->s, "flush_posted()");
  if (!use.ok()) return use.refusal("control server");
  Status first;
  for (auto& [peer, m] : impl_->s.take_posted()) {
    Status st = send(peer, m);
    if (st.ok()) continue;
    spdlog::warn("control server: posted '{}' not sent: {}", m.type(), st.message());
    if (first.ok()) first = st;
  }
  return first;
}

// ------------------------------------------------------------------ client

struct ControlClient::Impl {
  Socket s;
  std::string identity;
  std::string peer;      // "the coordinator at tcp://HOST:PORT", in errors
  bool failing = false;  // the last posted message could not be sent (logged once until one is)
};

ControlClient::ControlClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlClient::~ControlClient() = default;

Expected<std::unique_ptr<ControlClient>> ControlClient::connect(const std::string& endpoint,
                                                                ControlClientOptions options) {
  if (options.identity.empty() || options.identity.size() > 255 || options.identity[0] == '\0')
    return Status::error("control client: identity must be 1..255 bytes, not starting with NUL");
  auto impl = std::make_unique<Impl>();
  impl->identity = options.identity;
  impl->peer = "the coordinator at " + endpoint;
  zmq::socket_t& sock = impl->s.socket;
  if (Status st = impl->s.init(zmq::socket_type::dealer, options.timings); !st.ok()) return st;
  CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::routing_id, options.identity));
  CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::immediate, 1));
  CONVEYOR_ZMQ_CHECK(
      sock.set(zmq::sockopt::reconnect_ivl, static_cast<int>(options.reconnect_interval.count())));
  CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::reconnect_ivl_max,
                              static_cast<int>(options.reconnect_interval_max.count())));
  if (!options.curve_server_key.empty()) {
    if (!curve_available()) return Status::error("CURVE keys given, but libzmq has no CURVE");
    if (options.curve_keys.public_key.empty()) {
      auto keys = generate_curve_keypair();
      if (!keys.ok()) return keys.status();
      options.curve_keys = *keys;
    }
    for (const std::string* k : {&options.curve_server_key, &options.curve_keys.public_key,
                                 &options.curve_keys.secret_key})
      if (k->size() != 40) return Status::error("CURVE keys must be 40 Z85 characters");
    CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::curve_serverkey, options.curve_server_key));
    CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::curve_publickey, options.curve_keys.public_key));
    CONVEYOR_ZMQ_CHECK(sock.set(zmq::sockopt::curve_secretkey, options.curve_keys.secret_key));
  }
  try {
    sock.connect(endpoint);
  } catch (const zmq::error_t& e) {
    return Status::error("control client: connect to '" + endpoint + "' failed: " + e.what());
  }
  return std::unique_ptr<ControlClient>(new ControlClient(std::move(impl)));
}

const std::string& ControlClient::identity() const { return impl_->identity; }
std::size_t ControlClient::dropped_malformed() const { return impl_->s.dropped; }

Status ControlClient::send(const ControlMessage& message, std::chrono::milliseconds timeout) {
  SocketUse use(impl_->s, "send()");
  if (!use.ok()) return use.refusal("control client '" + impl_->identity + "'");
  // IMMEDIATE: the socket is writable only with a live connection; wait for one.
  zmq::pollitem_t item = {impl_->s.socket.handle(), 0, ZMQ_POLLOUT, 0};
  CONVEYOR_ZMQ_CHECK(zmq::poll(&item, 1, timeout));
  if (!(item.revents & ZMQ_POLLOUT))
    return Status::error("send to " + impl_->peer + ": no connection within " + std::to_string(timeout.count()) +
                         " ms");
  return send_frames(impl_->s.socket, nullptr, message, impl_->peer);
}

Expected<std::optional<ControlMessage>> ControlClient::recv(std::chrono::milliseconds timeout) {
  SocketUse use(impl_->s, "recv()");
  if (!use.ok()) return use.refusal("control client '" + impl_->identity + "'");
  const auto deadline = Clock::now() + timeout;
  std::vector<zmq::message_t> frames;
  for (;;) {
    (void)flush_posted();  // failures are logged there
    if (Status st = impl_->s.try_recv(frames); !st.ok()) return st;
    if (!frames.empty()) {
      auto m = decode(frames.data(), frames.size());
      if (m.ok()) return std::optional<ControlMessage>(std::move(*m));
      ++impl_->s.dropped;
      spdlog::warn("control client '{}': dropped a message: {}", impl_->identity, m.error());
      continue;
    }
    if (Clock::now() >= deadline) return std::optional<ControlMessage>();
    bool readable;
    if (Status st = impl_->s.wait(deadline, readable); !st.ok()) return st;
  }
}

void ControlClient::post(ControlMessage message) { impl_->s.post({}, std::move(message)); }

Status ControlClient::flush_posted() {
  SocketUse use(impl_->s, "flush_posted()");
  if (!use.ok()) return use.refusal("control client '" + impl_->identity + "'");
  Status first;
  for (auto& [unused, m] : impl_->s.take_posted()) {
    Status st = send_frames(impl_->s.socket, nullptr, m, impl_->peer);
    if (st.ok()) {
      impl_->failing = false;
      continue;
    }
    // Logged once until a message goes out again: a worker that cannot reach its coordinator
    // says why itself, every few seconds (stage_worker/worker.cc).
    if (!impl_->failing)
      spdlog::warn("control client '{}': posted '{}' not sent: {} (further failures are logged at debug level "
                   "until a message goes out)",
                   impl_->identity, m.type(), st.message());
    else
      spdlog::debug("control client '{}': posted '{}' not sent: {}", impl_->identity, m.type(), st.message());
    impl_->failing = true;
    if (first.ok()) first = st;
  }
  return first;
}

}  // namespace conveyor::transport

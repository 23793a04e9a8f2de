// The control plane on ZeroMQ: the coordinator's ControlServer (a ROUTER socket) and each
// worker's ControlClient (a DEALER whose routing id is the worker's name). Messages are
// ControlMessage (control_message.h): JSON with a "type", plus an optional binary frame.
//
// Threading: a ZeroMQ socket belongs to one thread. Each server or client is driven by one
// thread (its "socket thread"), which calls recv() and send(). Other threads hand messages
// to it with post(), the one thread-safe method: post() queues the message and wakes the
// socket thread, whose next (or current, blocked) recv() sends it. A socket thread that
// does not call recv() calls flush_posted().
//
// Socket options chosen for a cluster daemon:
//  - linger 0: closing never blocks on undelivered messages;
//  - ROUTER_MANDATORY: sending to a peer that is not connected (never was, or its
//    connection closed) is an error, not a silent drop; ROUTER_HANDOVER: a worker that
//    reconnects under the same name takes its name over from the stale connection;
//  - DEALER IMMEDIATE: messages queue only on a live connection, so a client's send()
//    fails after its timeout while the coordinator is unreachable instead of piling up;
//  - ZMTP heartbeats (heartbeat_interval / heartbeat_timeout): a connection to a vanished
//    host (no TCP reset) is dropped within the timeout, so ROUTER_MANDATORY then reports the
//    peer gone. Liveness in the application sense (a worker that misses heartbeat messages
//    for the liveness window is dead, Paranoid Pirate) is the daemons' job, on top of this;
//  - max_message_bytes: a peer cannot make the coordinator allocate without bound.
//
// CURVE: when the server is given a secret key, it accepts only CURVE clients, and every
// byte is encrypted; a client then needs the server's public key (and has its own key
// pair, generated when not given). Keys are Z85 text (40 characters), from
// generate_curve_keypair(). CURVE authenticates the server to clients and encrypts; it does
// not restrict which clients may connect (the cluster token in `register` does that).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/status.h"
#include "transport/control_message.h"

namespace conveyor::transport {

struct CurveKeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters
};
// Whether this libzmq was built with CURVE (libsodium).
bool curve_available();
Expected<CurveKeyPair> generate_curve_keypair();

struct ControlTimings {
  std::chrono::milliseconds heartbeat_interval{1000};  // ZMTP PING period
  std::chrono::milliseconds heartbeat_timeout{5000};   // silent connection is dropped
  std::chrono::milliseconds handshake_timeout{5000};   // ZMTP/CURVE handshake bound
  std::int64_t max_message_bytes = 64ll << 20;         // larger messages drop the connection
};

struct ControlServerOptions {
  std::string curve_secret_key;  // the server's secret key; set: CURVE only
  ControlTimings timings;
};

struct ControlClientOptions {
  std::string identity;          // required: the worker's name (1..255 bytes)
  std::string curve_server_key;  // the server's public key; set: use CURVE
  CurveKeyPair curve_keys;       // this client's keys; generated when empty
  ControlTimings timings;
  std::chrono::milliseconds reconnect_interval{100};
  std::chrono::milliseconds reconnect_interval_max{2000};
};

// A message and the routing id of the client that sent it.
struct PeerMessage {
  std::string peer;
  ControlMessage message;
};

class ControlServer {
 public:
  // Binds a ROUTER to `endpoint` ("tcp://0.0.0.0:5555"; port 0 or * picks a free port).
  static Expected<std::unique_ptr<ControlServer>> bind(const std::string& endpoint,
                                                       ControlServerOptions options = {});
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // The endpoint as bound ("tcp://127.0.0.1:41234") and its TCP port (0 for other kinds).
  const std::string& endpoint() const;
  int port() const;

  // The next well-formed message, or std::nullopt when none arrives within `timeout`.
  // Malformed messages (not JSON, no "type", too many frames) are dropped with a warning
  // and counted in dropped_malformed(). Sends posted messages while it waits.
  Expected<std::optional<PeerMessage>> recv(std::chrono::milliseconds timeout);
  // Sends to the client whose routing id is `peer`. Fails at once when that peer is not
  // connected, or when its queue is full (it stopped reading).
  Status send(const std::string& peer, const ControlMessage& message);

  // Thread-safe: queue a message for the socket thread (errors are logged there).
  void post(std::string peer, ControlMessage message);
  // Socket thread: send what other threads posted. The first failure is returned; the
  // other messages are still sent.
  Status flush_posted();

  std::size_t dropped_malformed() const;

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class ControlClient {
 public:
  // Creates a DEALER and connects it to `endpoint` ("tcp://coordinator:5555"). Returns at
  // once: ZeroMQ connects (and reconnects) in the background.
  static Expected<std::unique_ptr<ControlClient>> connect(const std::string& endpoint,
                                                          ControlClientOptions options);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  const std::string& identity() const;

  // Sends, waiting up to `timeout` for a live connection to the server.
  Status send(const ControlMessage& message, std::chrono::milliseconds timeout);
  // The next well-formed message from the server, or std::nullopt after `timeout`.
  Expected<std::optional<ControlMessage>> recv(std::chrono::milliseconds timeout);

  // Thread-safe: queue a message for the socket thread.
  void post(ControlMessage message);
  // Socket thread: send what other threads posted (without waiting for a connection).
  Status flush_posted();

  std::size_t dropped_malformed() const;

 private:
  struct Impl;
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor::transport

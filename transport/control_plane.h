// The control plane on ZeroMQ: the coordinator's ControlServer (a ROUTER socket) and each
// worker's ControlClient (a DEALER whose routing id is the worker's name). Messages are
// ControlMessage (control_message.h): JSON with a "type", plus an optional binary frame.
//
// Threading (the ownership rule): a ZeroMQ socket is not thread-safe, so each server or
// client is driven by one thread, its "socket thread", the only one that calls recv(),
// send() and flush_posted(). Every other thread hands messages to it with post(), the one
// thread-safe method: post() queues the message and wakes the socket thread through an
// eventfd in its poll, so a socket thread blocked in recv() sends it at once (not at the end
// of its timeout). A socket thread that does not call recv() calls flush_posted(). Posted
// messages leave in the order they were posted; a thread that posts everything (the
// coordinator does) keeps its messages to one peer in order. The socket thread may change
// (a daemon hands the socket on after joining its loop: the join is the memory barrier
// ZeroMQ asks for), but never while a call is under way: recv(), send() or flush_posted()
// entered by a second thread while another is inside one of them touches nothing and
// fails, naming the rule (libzmq would otherwise corrupt the socket's state and abort later,
// far from the cause: issue 28).
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

  // Socket thread: the next well-formed message, or std::nullopt when none arrives within
  // `timeout`. Malformed messages (not JSON, no "type", too many frames) are dropped with a
  // warning and counted in dropped_malformed(). Sends posted messages while it waits.
  Expected<std::optional<PeerMessage>> recv(std::chrono::milliseconds timeout);
  // Socket thread: sends to the client whose routing id is `peer`. Fails at once when that
  // peer is not connected, or when its queue is full (it stopped reading). Goes out ahead of
  // messages posted earlier and not yet flushed.
  Status send(const std::string& peer, const ControlMessage& message);

  // Thread-safe: queue a message for the socket thread (errors are logged there).
  void post(std::string peer, ControlMessage message);
  // Socket thread: send what was posted, in order. Each failure is logged (with the
  // message's type and peer) and the first is returned; the other messages are still sent.
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

  // Socket thread: sends, waiting up to `timeout` for a live connection to the server.
  Status send(const ControlMessage& message, std::chrono::milliseconds timeout);
  // Socket thread: the next well-formed message from the server, or std::nullopt after
  // `timeout`. Sends posted messages while it waits.
  Expected<std::optional<ControlMessage>> recv(std::chrono::milliseconds timeout);

  // Thread-safe: queue a message for the socket thread.
  void post(ControlMessage message);
  // Socket thread: send what was posted, in order (without waiting for a connection). Each
  // failure is logged and the first is returned.
  Status flush_posted();

  std::size_t dropped_malformed() const;

 private:
  struct Impl;
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor::transport

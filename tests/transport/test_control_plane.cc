// Control plane: ROUTER/DEALER round trips, ordering, failure reporting, CURVE.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "transport/control_plane.h"

namespace conveyor::transport {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::unique_ptr<ControlServer> make_server(ControlServerOptions options = {}) {
  auto server = ControlServer::bind("tcp://127.0.0.1:0", std::move(options));
  EXPECT_TRUE(server.ok()) << server.error();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<ControlClient> make_client(const ControlServer& server, std::string name,
                                           ControlClientOptions options = {}) {
  options.identity = std::move(name);
  auto client = ControlClient::connect(server.endpoint(), std::move(options));
  EXPECT_TRUE(client.ok()) << client.error();
  return client.ok() ? std::move(*client) : nullptr;
}

PeerMessage server_recv(ControlServer& server, std::chrono::milliseconds timeout = 5s) {
  auto r = server.recv(timeout);
  EXPECT_TRUE(r.ok()) << r.error();
  if (!r.ok() || !r->has_value()) {
    ADD_FAILURE() << "server received nothing within " << timeout.count() << " ms";
    return {};
  }
  return std::move(**r);
}

ControlMessage client_recv(ControlClient& client, std::chrono::milliseconds timeout = 5s) {
  auto r = client.recv(timeout);
  EXPECT_TRUE(r.ok()) << r.error();
  if (!r.ok() || !r->has_value()) {
    ADD_FAILURE() << "client received nothing within " << timeout.count() << " ms";
    return {};
  }
  return std::move(**r);
}

std::vector<std::byte> bytes_of(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

TEST(ControlPlane, BindReportsPortAndEndpoint) {
  auto server = make_server();
  ASSERT_TRUE(server);
  EXPECT_GT(server->port(), 0);
  EXPECT_EQ(server->endpoint(), "tcp://127.0.0.1:" + std::to_string(server->port()));
}

TEST(ControlPlane, BindFailureIsAStatus) {
  auto server = make_server();
  ASSERT_TRUE(server);
  auto clash = ControlServer::bind(server->endpoint());  // port in use
  ASSERT_FALSE(clash.ok());
  EXPECT_NE(clash.error().find("bind"), std::string::npos) << clash.error();
  EXPECT_FALSE(ControlServer::bind("nonsense://x").ok());
  EXPECT_FALSE(ControlClient::connect("tcp://127.0.0.1:1", {}).ok()) << "empty identity";
}

TEST(ControlPlane, JsonRoundTrip) {
  auto server = make_server();
  auto client = make_client(*server, "worker-0");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(
      client->send(ControlMessage::make("register", {{"host", "node1"}, {"gpus", 8}}), 5s).ok());
  PeerMessage in = server_recv(*server);
  EXPECT_EQ(in.peer, "worker-0");
  EXPECT_EQ(in.message.type(), "register");
  EXPECT_EQ(in.message.body["host"], "node1");
  EXPECT_EQ(in.message.body["gpus"], 8);
  EXPECT_TRUE(in.message.blob.empty());

  ASSERT_TRUE(server->send("worker-0", ControlMessage::make("assign", {{"stage", 2}})).ok());
  ControlMessage reply = client_recv(*client);
  EXPECT_EQ(reply.type(), "assign");
  EXPECT_EQ(reply.body["stage"], 2);
}

TEST(ControlPlane, BinaryFrameRoundTrip) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  std::vector<std::byte> blob(4096);
  for (std::size_t i = 0; i < blob.size(); ++i) blob[i] = std::byte(i * 7 + 3);
  blob[0] = std::byte{0};  // binary, not text
  ASSERT_TRUE(client->send(ControlMessage::make("register", nullptr, blob), 5s).ok());
  PeerMessage in = server_recv(*server);
  EXPECT_EQ(in.message.blob, blob);
  ASSERT_TRUE(server->send("w", ControlMessage::make("assign", json::object(), blob)).ok());
  EXPECT_EQ(client_recv(*client).blob, blob);
}

TEST(ControlPlane, ManyMessagesInOrderBothWays) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  constexpr int kCount = 2000;
  for (int i = 0; i < kCount; ++i)
    ASSERT_TRUE(client->send(ControlMessage::make("heartbeat", {{"n", i}}), 5s).ok());
  for (int i = 0; i < kCount; ++i) {
    PeerMessage in = server_recv(*server);
    ASSERT_EQ(in.message.body["n"], i);
  }
  // The server never blocks on a slow client (a full queue is an error), so the client
  // reads on its own thread meanwhile.
  std::thread reader([&] {
    for (int i = 0; i < kCount; ++i) ASSERT_EQ(client_recv(*client).body["n"], i);
  });
  for (int i = 0; i < kCount; ++i) {
    Status s;
    for (int attempt = 0; attempt < 500; ++attempt) {  // back off while the queue is full
      s = server->send("w", ControlMessage::make("heartbeat", {{"n", i}}));
      if (s.ok()) break;
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_TRUE(s.ok()) << s.message();
  }
  reader.join();
}

TEST(ControlPlane, FullQueueIsAnErrorNotABlock) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(client->send(ControlMessage::make("register"), 5s).ok());
  EXPECT_EQ(server_recv(*server).peer, "w");
  // The client never reads: within the default high-water marks the server's sends start
  // failing instead of blocking the coordinator's loop.
  const std::string padding(1000, 'x');
  Status s;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 100000 && s.ok(); ++i)
    s = server->send("w", ControlMessage::make("heartbeat", {{"pad", padding}}));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("full"), std::string::npos) << s.message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST(ControlPlane, ManyClientsAreToldApart) {
  auto server = make_server();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<ControlClient>> clients;
  for (int i = 0; i < 8; ++i) {
    clients.push_back(make_client(*server, "w" + std::to_string(i)));
    ASSERT_TRUE(clients.back()->send(ControlMessage::make("register", {{"i", i}}), 5s).ok());
  }
  for (int k = 0; k < 8; ++k) {
    PeerMessage in = server_recv(*server);
    EXPECT_EQ(in.peer, "w" + std::to_string(in.message.body["i"].get<int>()));
    ASSERT_TRUE(server->send(in.peer, ControlMessage::make("ack", {{"to", in.peer}})).ok());
  }
  for (auto& c : clients) EXPECT_EQ(client_recv(*c).body["to"], c->identity());
}

TEST(ControlPlane, SendToUnknownPeerFails) {
  auto server = make_server();
  ASSERT_TRUE(server);
  Status s = server->send("nobody", ControlMessage::make("assign"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("nobody"), std::string::npos) << s.message();
}

TEST(ControlPlane, SendToVanishedPeerFails) {
  auto server = make_server();
  auto client = make_client(*server, "doomed");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(client->send(ControlMessage::make("register"), 5s).ok());
  EXPECT_EQ(server_recv(*server).peer, "doomed");
  ASSERT_TRUE(server->send("doomed", ControlMessage::make("assign")).ok());
  client.reset();  // the worker goes away (its TCP connection closes)

  // ZeroMQ notices the closed connection asynchronously; from then on sends fail.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  Status s;
  while (std::chrono::steady_clock::now() < deadline) {
    s = server->send("doomed", ControlMessage::make("heartbeat"));
    if (!s.ok()) break;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_FALSE(s.ok()) << "sending to a vanished peer kept succeeding for 5 s";
  EXPECT_NE(s.message().find("doomed"), std::string::npos) << s.message();
}

TEST(ControlPlane, ClientSendTimesOutWithoutServer) {
  ControlClientOptions options;
  options.identity = "lonely";
  // A port nobody listens on (bind one, note it, close it).
  std::string endpoint;
  {
    auto s = make_server();
    ASSERT_TRUE(s);
    endpoint = s->endpoint();
  }
  auto client = ControlClient::connect(endpoint, options);
  ASSERT_TRUE(client.ok()) << client.error();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = (*client)->send(ControlMessage::make("register"), 200ms);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_FALSE(s.ok());
  EXPECT_LT(waited, 3s);
}

TEST(ControlPlane, RecvTimesOut) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  for (auto timeout : {0ms, 150ms}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = server->recv(timeout);
    const auto waited = std::chrono::steady_clock::now() - t0;
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_FALSE(r->has_value());
    EXPECT_GE(waited, timeout);
    EXPECT_LT(waited, timeout + 2s);
    auto c = client->recv(timeout);
    ASSERT_TRUE(c.ok()) << c.error();
    EXPECT_FALSE(c->has_value());
  }
}

TEST(ControlPlane, PostFromOtherThreadsWakesTheSocketThread) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(client->send(ControlMessage::make("register"), 5s).ok());
  EXPECT_EQ(server_recv(*server).peer, "w");

  // The client's socket thread sits in recv(); other threads post heartbeats through it.
  constexpr int kPerThread = 100;
  std::atomic<bool> stop{false};
  std::thread socket_thread([&] {
    while (!stop) (void)client->recv(50ms);
  });
  std::vector<std::thread> posters;
  for (int t = 0; t < 3; ++t)
    posters.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i)
        client->post(ControlMessage::make("heartbeat", {{"thread", t}, {"n", i}}));
    });
  for (auto& p : posters) p.join();
  int next[3] = {0, 0, 0};
  for (int k = 0; k < 3 * kPerThread; ++k) {
    PeerMessage in = server_recv(*server, 5s);
    const int t = in.message.body["thread"];
    ASSERT_EQ(in.message.body["n"], next[t]++) << "posts from one thread stay in order";
  }
  stop = true;
  socket_thread.join();

  // And the server side: post from another thread while the socket thread waits in recv.
  std::thread poster([&] { server->post("w", ControlMessage::make("drain")); });
  auto r = server->recv(300ms);  // nothing arrives, but the posted message goes out
  poster.join();
  ASSERT_TRUE(r.ok());
  if (!server->flush_posted().ok()) ADD_FAILURE();
  EXPECT_EQ(client_recv(*client).type(), "drain");
}

// The ownership rule (control_plane.h): while the socket thread is inside recv(), another
// thread's send(), recv() or flush_posted() touches nothing and fails, naming the rule; the
// socket thread goes on undisturbed, and the socket may change threads once nobody is inside.
TEST(ControlPlane, SecondThreadIsRefusedWhileTheSocketThreadIsInside) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(client->send(ControlMessage::make("register"), 5s).ok());
  EXPECT_EQ(server_recv(*server).peer, "w");

  std::atomic<int> inside{0};  // 1: in the server's recv; 2: in the client's
  std::thread socket_thread([&] {
    inside = 1;
    auto r = server->recv(1000ms);  // nothing arrives
    EXPECT_TRUE(r.ok()) << r.error();
    inside = 2;
    auto c = client->recv(1000ms);
    EXPECT_TRUE(c.ok()) << c.error();
  });
  while (inside != 1) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(100ms);  // the socket thread is in the server's recv now
  Status s = server->send("w", ControlMessage::make("assign"));
  ASSERT_FALSE(s.ok()) << "a second thread's send() went through while the socket thread was in recv()";
  EXPECT_NE(s.message().find("other threads must post()"), std::string::npos) << s.message();
  EXPECT_FALSE(server->flush_posted().ok());
  auto r = server->recv(0ms);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().find("socket thread"), std::string::npos) << r.error();
  // And the client the same way, once the socket thread waits in its recv.
  while (inside != 2) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(100ms);
  s = client->send(ControlMessage::make("heartbeat"), 100ms);
  EXPECT_FALSE(s.ok()) << "a second thread's client send() went through while the socket thread was in recv()";
  socket_thread.join();

  // Nobody inside: this thread may take the sockets over; nothing was sent meanwhile.
  ASSERT_TRUE(server->send("w", ControlMessage::make("drain")).ok());
  EXPECT_EQ(client_recv(*client).type(), "drain");
}

// Several threads post while the socket threads of both ends receive (the coordinator's
// shape: REST handlers and the engine post, the control thread receives, and the workers
// talk meanwhile): everything arrives, each thread's messages in order.
TEST(ControlPlane, PostsFromManyThreadsWhileTheOwnersReceive) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(client->send(ControlMessage::make("register"), 5s).ok());
  EXPECT_EQ(server_recv(*server).peer, "w");

  constexpr int kPosters = 4, kPerPoster = 500, kPings = 500;
  std::atomic<bool> stop{false};
  std::atomic<int> pings_in{0};
  std::string server_error;
  // The server's socket thread: receives the client's pings (and sends posted messages).
  std::thread server_thread([&] {
    int next = 0;
    while (!stop) {
      auto r = server->recv(20ms);
      if (!r.ok()) {
        server_error = r.error();
        return;
      }
      if (!r->has_value()) continue;
      if ((**r).message.body["n"] != next) {
        server_error = "ping " + (**r).message.body["n"].dump() + " arrived when " + std::to_string(next) + " was due";
        return;
      }
      ++next;
      ++pings_in;
    }
  });
  // The client's socket thread: receives the posted messages, and posts its own pings
  // (post() from the socket thread itself: they leave at its next recv).
  std::vector<int> next(kPosters, 0);
  std::atomic<int> received{0}, posted{0};
  std::string client_error;
  std::thread client_thread([&] {
    int pings_out = 0;
    const auto deadline = Clock::now() + 20s;
    while (received < kPosters * kPerPoster && Clock::now() < deadline) {
      if (pings_out < kPings) client->post(ControlMessage::make("heartbeat", {{"n", pings_out++}}));
      auto r = client->recv(20ms);
      if (!r.ok()) {
        client_error = r.error();
        return;
      }
      if (!r->has_value()) continue;
      const int t = (**r).body["thread"], n = (**r).body["n"];
      if (n != next[size_t(t)]) {
        client_error = "thread " + std::to_string(t) + "'s message " + std::to_string(n) + " arrived when " +
                       std::to_string(next[size_t(t)]) + " was due";
        return;
      }
      ++next[size_t(t)];
      ++received;
    }
    while (pings_out < kPings) client->post(ControlMessage::make("heartbeat", {{"n", pings_out++}}));
    (void)client->flush_posted();
  });
  std::vector<std::thread> posters;
  for (int t = 0; t < kPosters; ++t)
    posters.emplace_back([&, t] {
      const auto deadline = Clock::now() + 20s;
      for (int i = 0; i < kPerPoster; ++i) {
        // Stay within the queues' high-water marks (1000 messages a pipe) however slowly the
        // client reads (ThreadSanitizer makes it several times slower): at most 500 on the way.
        while (posted - received >= 500 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
        server->post("w", ControlMessage::make("assign", {{"thread", t}, {"n", i}}));
        ++posted;
      }
    });
  for (auto& p : posters) p.join();
  client_thread.join();
  const auto deadline = Clock::now() + 10s;
  while (pings_in < kPings && Clock::now() < deadline && server_error.empty()) std::this_thread::sleep_for(5ms);
  stop = true;
  server_thread.join();
  EXPECT_EQ(client_error, "");
  EXPECT_EQ(server_error, "");
  EXPECT_EQ(received.load(), kPosters * kPerPoster);
  EXPECT_EQ(pings_in, kPings);
}

// A post wakes a socket thread blocked in recv(): the message leaves at once, not when the
// recv's timeout ends.
TEST(ControlPlane, PostIsSentWithoutWaitingForTheRecvTimeout) {
  auto server = make_server();
  auto client = make_client(*server, "w");
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(client->send(ControlMessage::make("register"), 5s).ok());
  EXPECT_EQ(server_recv(*server).peer, "w");
  std::atomic<bool> inside{false};
  std::thread socket_thread([&] {
    inside = true;
    (void)server->recv(5s);
  });
  while (!inside) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(100ms);
  const auto t0 = Clock::now();
  server->post("w", ControlMessage::make("drain"));
  EXPECT_EQ(client_recv(*client, 4s).type(), "drain");
  EXPECT_LT(Clock::now() - t0, 2s) << "the posted message waited for the socket thread's recv timeout";
  // Release the socket thread (it returns at its timeout: a message from the client ends it sooner).
  ASSERT_TRUE(client->send(ControlMessage::make("heartbeat"), 5s).ok());
  socket_thread.join();
}

TEST(ControlPlane, MalformedMessagesAreDropped) {
  auto server = make_server();
  ASSERT_TRUE(server);
  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.set(zmq::sockopt::routing_id, "raw");
  raw.connect(server->endpoint());
  raw.send(zmq::str_buffer("this is not json"), zmq::send_flags::none);
  raw.send(zmq::str_buffer("{\"no_type\": 1}"), zmq::send_flags::none);
  raw.send(zmq::str_buffer("[1,2,3]"), zmq::send_flags::none);
  raw.send(zmq::str_buffer("{\"type\": \"ok\"}"), zmq::send_flags::none);
  PeerMessage in = server_recv(*server);
  EXPECT_EQ(in.message.type(), "ok");
  EXPECT_EQ(server->dropped_malformed(), 3u);
  EXPECT_FALSE(server->send("raw", ControlMessage{json::array(), {}}).ok())
      << "messages without a type are refused on the way out too";
}

TEST(ControlPlane, CurveRoundTripAndPlainClientsRefused) {
  if (!curve_available()) GTEST_SKIP() << "libzmq without CURVE";
  auto server_keys = generate_curve_keypair();
  ASSERT_TRUE(server_keys.ok()) << server_keys.error();
  ControlServerOptions so;
  so.curve_secret_key = server_keys->secret_key;
  auto server = make_server(so);
  ASSERT_TRUE(server);

  ControlClientOptions co;
  co.curve_server_key = server_keys->public_key;
  auto client = make_client(*server, "secure", co);
  ASSERT_TRUE(client);
  ASSERT_TRUE(client->send(ControlMessage::make("register", nullptr, bytes_of("addr")), 5s).ok());
  PeerMessage in = server_recv(*server);
  EXPECT_EQ(in.peer, "secure");
  EXPECT_EQ(in.message.blob, bytes_of("addr"));
  ASSERT_TRUE(server->send("secure", ControlMessage::make("assign")).ok());
  EXPECT_EQ(client_recv(*client).type(), "assign");

  // A client without keys, or with the wrong server key, never gets through.
  auto plain = make_client(*server, "plain");
  ControlClientOptions wrong;
  auto other_keys = generate_curve_keypair();
  ASSERT_TRUE(other_keys.ok());
  wrong.curve_server_key = other_keys->public_key;
  auto impostor = make_client(*server, "impostor", wrong);
  ASSERT_TRUE(plain && impostor);
  EXPECT_FALSE(plain->send(ControlMessage::make("register"), 300ms).ok());
  EXPECT_FALSE(impostor->send(ControlMessage::make("register"), 300ms).ok());
  auto r = server->recv(300ms);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
}

TEST(ControlPlane, CurveRejectsBadKeys) {
  if (!curve_available()) GTEST_SKIP() << "libzmq without CURVE";
  ControlServerOptions so;
  so.curve_secret_key = "too short";
  EXPECT_FALSE(ControlServer::bind("tcp://127.0.0.1:0", so).ok());
}

TEST(ControlPlane, Base64RoundTrip) {
  for (std::size_t n : {0, 1, 2, 3, 4, 5, 215, 1000}) {
    std::vector<std::byte> b(n);
    for (std::size_t i = 0; i < n; ++i) b[i] = std::byte(i * 37 + n);
    const std::string text = to_base64(b);
    EXPECT_EQ(text.size() % 4, 0u);
    auto back = from_base64(text);
    ASSERT_TRUE(back.ok()) << back.error();
    EXPECT_EQ(*back, b);
  }
  EXPECT_EQ(to_base64(bytes_of("Man")), "TWFu");
  EXPECT_EQ(to_base64(bytes_of("Ma")), "TWE=");
  EXPECT_FALSE(from_base64("abc").ok());
  EXPECT_FALSE(from_base64("ab!d").ok());
}

}  // namespace
}  // namespace conveyor::transport

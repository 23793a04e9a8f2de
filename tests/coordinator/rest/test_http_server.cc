// The REST server end to end, as an HTTP server: binding, the API key, routing and methods,
// body limits, 100-continue, keep-alive and Connection: close, concurrent clients, the
// health/models/metrics/cluster endpoints, and stopping with requests in flight. What the
// completions endpoint answers is test_http_server_completions.cc; the fixture (a real
// server over the brown-gpt2 model) is http_server_test_util.h.
#include "coordinator/rest/http_server.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/coordinator/rest/http_server_test_util.h"

namespace conveyor {
namespace {

using namespace http_server_test;

TEST_F(HttpServerTest, ReportsTheBoundPortAndRefusesABusyOne) {
  EXPECT_GT(port(), 0);
  EXPECT_NE(port(), keyed_server_->port());
  Expected<std::unique_ptr<HttpServer>> again = HttpServer::start("127.0.0.1", port(), context("", true));
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.error().find(std::to_string(port())), std::string::npos) << again.error();
  EXPECT_FALSE(HttpServer::start("no.such.host.invalid", 0, context("", true)).ok());
  EXPECT_FALSE(HttpServer::start("127.0.0.1", 70000, context("", true)).ok());
}

TEST_F(HttpServerTest, ApiKeyIsRequiredWhenSet) {
  const int p = keyed_server_->port();
  Reply none = call(p, http::verb::get, "/v1/models");
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.body_json()["error"]["code"], "invalid_api_key");
  EXPECT_EQ(none.header(http::field::www_authenticate), "Bearer");
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer wrong"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer s3cret-ke"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer s3cret-key2"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "s3cret-key"}}).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/metrics").status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/nowhere").status, 401);  // no probing of paths without the key
  EXPECT_EQ(post(p, kGreedy).status, 401);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "Bearer s3cret-key"}}).status, 200);
  EXPECT_EQ(call(p, http::verb::get, "/v1/models", "", {{"Authorization", "bearer s3cret-key"}}).status, 200);
  EXPECT_EQ(post(p, kGreedy, {{"Authorization", "Bearer s3cret-key"}}).status, 200);
  EXPECT_EQ(call(p, http::verb::get, "/health").status, 200);  // open for load balancers
  // The keyless server takes anything.
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models", "", {{"Authorization", "Bearer whatever"}}).status, 200);
}

TEST_F(HttpServerTest, ConstantTimeCompare) {
  EXPECT_TRUE(constant_time_equals("abc", "abc"));
  EXPECT_FALSE(constant_time_equals("abd", "abc"));
  EXPECT_FALSE(constant_time_equals("ab", "abc"));
  EXPECT_FALSE(constant_time_equals("abcd", "abc"));
  EXPECT_FALSE(constant_time_equals("", "abc"));
  EXPECT_TRUE(constant_time_equals("", ""));
}

TEST_F(HttpServerTest, UnknownPathsAndWrongMethods) {
  Reply missing = call(port(), http::verb::get, "/v2/things");
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(missing.body_json().contains("error"));
  EXPECT_EQ(call(port(), http::verb::post, "/v1/completion", "{}").status, 404);
  Reply wrong = call(port(), http::verb::get, "/v1/completions");
  EXPECT_EQ(wrong.status, 405);
  EXPECT_EQ(wrong.header(http::field::allow), "POST");
  EXPECT_EQ(call(port(), http::verb::post, "/health", "{}").status, 405);
  EXPECT_EQ(call(port(), http::verb::delete_, "/v1/models").status, 405);
  EXPECT_EQ(call(port(), http::verb::get, "/v1/cluster/plan").status, 405);
  EXPECT_EQ(call(port(), http::verb::get, "/v1/cluster/workers/w0/drain").status, 405);
  // A query string does not change the route.
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models?x=1").status, 200);
}

TEST_F(HttpServerTest, BodyOverFourMiBIs413) {
  Connection c(port());
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
             std::to_string((4 << 20) + 1) + "\r\n\r\n{\"prompt\": ");
  const std::string reply = c.read_until("\r\n\r\n");
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 413")) << reply;
  // Chunked bodies are cut at the limit too.
  Connection d(port());
  d.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
  const std::string chunk(1 << 20, ' ');
  char hex[16];
  std::snprintf(hex, sizeof hex, "%zx\r\n", chunk.size());
  for (int i = 0; i < 6; ++i) {
    beast::error_code ec;
    net::write(d.socket, net::buffer(std::string(hex) + chunk + "\r\n"), ec);
    if (ec) break;
  }
  const std::string reply2 = d.read_until("\r\n\r\n");
  EXPECT_TRUE(reply2.starts_with("HTTP/1.1 413")) << reply2.substr(0, 100);
  // Just under the limit is read (and then refused for its content, not its size).
  Reply big = call(port(), http::verb::post, "/v1/completions",
                   "{\"prompt\": \"x\", \"user\": \"" + std::string((4 << 20) - 64, 'u') + "\"}");
  EXPECT_EQ(big.status, 200) << big.body().substr(0, 200);
}

TEST_F(HttpServerTest, Expect100ContinueIsAnswered) {
  Connection c(port());
  const std::string body = kGreedy.dump();
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: " +
             std::to_string(body.size()) + "\r\n\r\n");
  const std::string interim = c.read_until("\r\n\r\n");
  EXPECT_TRUE(interim.starts_with("HTTP/1.1 100 Continue")) << interim;
  c.send_raw(body);
  http::response<http::string_body> res;
  http::read(c.socket, c.buffer, res);
  EXPECT_EQ(res.result_int(), 200u) << res.body();
}

TEST_F(HttpServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  Connection c(port());
  EXPECT_EQ(c.call(http::verb::get, "/health").status, 200);
  Reply plain = c.call(http::verb::post, "/v1/completions", kGreedy.dump());
  EXPECT_EQ(plain.status, 200);
  json body = kGreedy;
  body["stream"] = true;
  Reply streamed = c.call(http::verb::post, "/v1/completions", body.dump());
  EXPECT_EQ(streamed.status, 200);
  EXPECT_TRUE(streamed.body().ends_with("data: [DONE]\n\n"));
  EXPECT_EQ(c.call(http::verb::post, "/v1/completions", R"({"prompt": ""})").status, 400);
  EXPECT_EQ(c.call(http::verb::get, "/nope").status, 404);
  Reply models = c.call(http::verb::get, "/v1/models");
  EXPECT_EQ(models.status, 200);
  EXPECT_TRUE(models.message.keep_alive());
  EXPECT_EQ(plain.body_json()["choices"][0]["text"], greedy_text("The jury said", 8));
}

TEST_F(HttpServerTest, ConnectionCloseIsHonoured) {
  Connection c(port());
  Reply r = c.call(http::verb::get, "/v1/models", "", {{"Connection", "close"}});
  EXPECT_EQ(r.status, 200);
  EXPECT_FALSE(r.message.keep_alive());
  EXPECT_TRUE(c.closed_by_peer());
}

TEST_F(HttpServerTest, ConcurrentClientsAllGetAnswers) {
  std::vector<std::thread> clients;
  std::vector<std::string> ids(8);
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i)
    clients.emplace_back([&, i] {
      json body = {{"prompt", "It was"}, {"max_tokens", 4}, {"seed", i}, {"stream", i % 2 == 1}};
      Reply r = post(port(), body);
      if (r.status == 200) ++ok;
      if (i % 2 == 0 && r.status == 200) ids[size_t(i)] = r.body_json()["id"];
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 8);
  std::set<std::string> distinct;
  for (int i = 0; i < 8; i += 2) distinct.insert(ids[size_t(i)]);
  EXPECT_EQ(distinct.size(), 4u);
}

TEST_F(HttpServerTest, HealthModelsMetricsAndCluster) {
  Reply health = call(port(), http::verb::get, "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body_json()["status"], "ok");
  ready_ = false;
  Reply starting = call(port(), http::verb::get, "/health");
  EXPECT_EQ(starting.status, 503);
  EXPECT_EQ(starting.body_json()["status"], "starting");
  ready_ = true;

  const json models = call(port(), http::verb::get, "/v1/models").body_json();
  EXPECT_EQ(models["object"], "list");
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "brown-gpt2");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(models["data"][0]["max_model_len"], 256);
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models/brown-gpt2").body_json()["id"], "brown-gpt2");
  EXPECT_EQ(call(port(), http::verb::get, "/v1/models/gpt-4").status, 404);

  ASSERT_EQ(post(port(), kGreedy).status, 200);
  Reply metrics = call(port(), http::verb::get, "/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_EQ(metrics.header(http::field::content_type), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_NE(metrics.body().find("conveyor_requests_total{code=\"200\"}"), std::string::npos);
  EXPECT_NE(metrics.body().find("conveyor_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), std::string::npos);
  EXPECT_EQ(metrics.body().find("conveyor_generated_tokens_total 0\n"), std::string::npos);

  Reply cluster = call(port(), http::verb::get, "/v1/cluster");
  EXPECT_EQ(cluster.status, 200);
  EXPECT_EQ(cluster.body_json()["pipelines"], 1);
  Reply plan = call(port(), http::verb::post, "/v1/cluster/plan", R"({"stages": 2})");
  EXPECT_EQ(plan.status, 200);
  EXPECT_EQ(plan.body_json()["accepted_stages"], 2);
  EXPECT_EQ(call(port(), http::verb::post, "/v1/cluster/plan", "{oops").status, 400);
  // Found by fuzzing (issue 28): a number too large for a double throws out_of_range, not
  // parse_error; it was answered 500 (internal error) instead of 400.
  EXPECT_EQ(call(port(), http::verb::post, "/v1/cluster/plan", R"({"stages": 1e999})").status, 400);
  EXPECT_EQ(call(port(), http::verb::post, "/v1/completions", R"({"prompt": "a", "temperature": 1e999})").status, 400);
  // The REST layer checks the body's form and names the field; the core is not called.
  Reply unknown = call(port(), http::verb::post, "/v1/cluster/plan", R"({"stages": 2, "pipelines": 1})");
  EXPECT_EQ(unknown.status, 400);
  EXPECT_EQ(unknown.body_json()["error"]["param"], "pipelines");
  Reply not_int = call(port(), http::verb::post, "/v1/cluster/plan", R"({"replicas": "two"})");
  EXPECT_EQ(not_int.status, 400);
  EXPECT_EQ(not_int.body_json()["error"]["param"], "replicas");
  // The core's refusals map to HTTP here alone.
  Reply conflict = call(port(), http::verb::post, "/v1/cluster/workers/busy/drain");
  EXPECT_EQ(conflict.status, 409);
  EXPECT_EQ(conflict.body_json()["error"]["type"], "conflict_error");
  Reply drain = call(port(), http::verb::post, "/v1/cluster/workers/gpu%20node-3/drain");
  EXPECT_EQ(drain.status, 200);
  EXPECT_EQ(drain.body_json()["draining"], "gpu node-3");
  EXPECT_EQ(call(port(), http::verb::post, "/v1/cluster/workers//drain").status, 404);

  // A coordinator without these callbacks says so with 404s.
  const Headers key = {{"Authorization", "Bearer s3cret-key"}};
  const int p = keyed_server_->port();
  EXPECT_EQ(call(p, http::verb::get, "/v1/cluster", "", key).status, 404);
  EXPECT_EQ(call(p, http::verb::post, "/v1/cluster/plan", "{}", key).status, 404);
  EXPECT_EQ(call(p, http::verb::post, "/v1/cluster/workers/w0/drain", "", key).status, 404);
}

TEST_F(HttpServerTest, StoppingWithRequestsInFlightIsSafe) {
  std::unique_ptr<HttpServer> server = start_server("");
  backend_->update_delay_ms = 20;
  const int done_before = backend_->done();
  Connection c(server->port());
  json body = {{"prompt", "It was"}, {"max_tokens", 25}, {"stream", true}, {"ignore_eos", true}};
  const std::string text = body.dump();
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(text.size()) +
             "\r\n\r\n" + text);
  ASSERT_NE(c.read_until("data: ").find("data: "), std::string::npos);
  server->stop();
  server.reset();  // the core still holds the sink and keeps calling it
  ASSERT_TRUE(backend_->wait_done(done_before + 1));
  EXPECT_TRUE(c.closed_by_peer());  // the connection went with the io_context
  backend_->update_delay_ms = 0;
  EXPECT_EQ(post(port(), kGreedy).status, 200);  // the other server is unaffected
}

}  // namespace
}  // namespace conveyor

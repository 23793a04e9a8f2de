// Chaos on loopback: workers die by SIGKILL while 64 mixed requests are in flight (during
// prefill, mid-stream, two in a row, while a replacement loads), data-plane connections are
// reset under live processes, operators drain workers, SIGTERM asks daemons to go, and the
// coordinator itself is killed and restarted. Every accepted request must still complete
// with exactly the engine's tokens: no error, no duplicate, no gap in any stream. The
// coordinator gives a lost stage to a spare (or re-plans over the survivors), bumps the
// pipeline's epoch and replays each sequence from its first token.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>

#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/completion_client.h"
#include "tests/cluster/connection_reset.h"

namespace conveyor {
namespace {

using namespace cluster_test;

// The name of a worker serving a stage, chosen by `rng`; empty when none is.
std::string serving_worker(Cluster& cluster, std::mt19937& rng) {
  auto r = cluster.get("/v1/cluster");
  if (!r || r->status != 200) {
    ADD_FAILURE() << "GET /v1/cluster: " << (r ? r->body : r.error());
    return "";
  }
  std::vector<std::string> names;
  const json info = json::parse(r->body);
  for (const auto& w : info.at("workers"))
    if (w.value("state", std::string()) == "ready" && w.value("stage", -1) >= 0) names.push_back(w.at("name").get<std::string>());
  return names.empty() ? "" : names[rng() % names.size()];
}

ChildProcess* worker_named(Cluster& cluster, const std::string& name) {
  for (size_t i = 0; i < cluster.workers.size(); ++i)
    if ("w" + std::to_string(i) == name) return cluster.workers[i].get();
  return nullptr;
}

// Once the cluster serves again, a worker that is ready carries no last_error: what it met
// during the failover (most often wiring to the neighbour that had died) is over, and shows
// as resolved_error with the epoch it recovered in (issue 29).
void expect_ready_workers_have_no_error(Cluster& cluster) {
  auto r = cluster.get("/v1/cluster");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : r.error());
  for (const auto& w : json::parse(r->body).at("workers")) {
    if (w.value("state", std::string()) != "ready") continue;
    EXPECT_FALSE(w.contains("last_error")) << w.dump();
    if (w.contains("resolved_error")) {
      EXPECT_NE(w["resolved_error"].get<std::string>().find("resolved: ready"), std::string::npos) << w.dump();
    }
  }
}

// Runs the mixed load while `chaos` does its damage on another thread.
void run_with_chaos(Cluster& cluster, uint32_t seed, const std::function<void(std::mt19937&)>& chaos) {
  std::mt19937 rng(seed);
  run_load(cluster, seed, 64, [&] { chaos(rng); });
  auto health = cluster.get("/health");
  EXPECT_TRUE(health && health->status == 200) << (health ? health->body : health.error());
  if (health && health->status == 200) expect_ready_workers_have_no_error(cluster);
}

class Failover : public ::testing::TestWithParam<uint32_t> {};

// One serving worker killed at a random moment of the load; a fresh worker joins after.
TEST_P(Failover, KillOneServingWorker) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("kill1-" + std::to_string(GetParam()), 3, 4, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  run_with_chaos(cluster, GetParam(), [&](std::mt19937& rng) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 600));
    const std::string victim = serving_worker(cluster, rng);
    ASSERT_FALSE(victim.empty());
    cluster.faults_expected = true;
    worker_named(cluster, victim)->signal(SIGKILL);
    cluster.add_worker("w" + std::to_string(cluster.workers.size()), cluster.token);  // the next spare
  });
}

// Two serving workers killed one after the other (the second while the first's
// replacement may still be loading).
TEST_P(Failover, KillTwoInARow) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("kill2-" + std::to_string(GetParam()), 3, 5, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  run_with_chaos(cluster, GetParam() + 100, [&](std::mt19937& rng) {
    for (int k = 0; k < 2; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 400));
      const std::string victim = serving_worker(cluster, rng);
      if (victim.empty()) continue;  // the pipeline is being repaired: nothing serves yet
      cluster.faults_expected = true;
      worker_named(cluster, victim)->signal(SIGKILL);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Seeds, Failover, ::testing::Values(1u, 2u, 3u));

// An operator drains a serving worker under load (`conveyor drain`): a spare takes its
// stage and nothing fails. Without a spare the next drain re-plans over the other two
// workers (3 stages to 2), again under load; with one serving worker left a drain is
// refused with 409 and nothing moves.
TEST(Drain, ServingWorkersUnderLoadLoseNothing) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("drain", 3, 4));
  std::string victim, second;
  run_with_chaos(cluster, 77, [&](std::mt19937& rng) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    victim = serving_worker(cluster, rng);
    ASSERT_FALSE(victim.empty());
    testing::ChildProcess cli({bin("conveyor"), "drain", victim, "--url", "http://127.0.0.1:" + std::to_string(cluster.http_port)});
    const std::string line = cli.read_line_matching("drained", std::chrono::seconds(30));
    EXPECT_NE(line.find("its stage went to"), std::string::npos) << line;
    EXPECT_EQ(cli.wait_exit(std::chrono::seconds(30)), 0);
    ASSERT_TRUE(cluster.wait_until([](const json& i) { return i["pipelines"][0]["ready"] == true; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    second = serving_worker(cluster, rng);
    testing::ChildProcess cli2({bin("conveyor"), "drain", second, "--url", "http://127.0.0.1:" + std::to_string(cluster.http_port)});
    const std::string line2 = cli2.read_line_matching("drained", std::chrono::seconds(30));
    EXPECT_NE(line2.find("the plan is now 2 stage(s) x 1 replica(s)"), std::string::npos) << line2;
    EXPECT_EQ(cli2.wait_exit(std::chrono::seconds(30)), 0);
  });
  const json info = cluster.info();
  for (const auto& w : info.at("workers"))
    if (w.at("name") == victim || w.at("name") == second) {
      EXPECT_EQ(w.at("state"), "drained");
    }
  EXPECT_EQ(info.at("plan").at("stages"), 2);
  // One stage left can still shrink to one; then nothing can take the last worker's place.
  std::mt19937 rng(5);
  auto r = cluster.post("/v1/cluster/workers/" + serving_worker(cluster, rng) + "/drain", json::object());
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r->status, 200) << r->body;
  ASSERT_TRUE(cluster.wait_until([](const json& i) { return i["plan"]["stages"] == 1; }));
  const std::string last = serving_worker(cluster, rng);
  r = cluster.post("/v1/cluster/workers/" + last + "/drain", json::object());
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r->status, 409) << r->body;
  EXPECT_NE(r->body.find("no spare worker can take it"), std::string::npos) << r->body;
  auto unknown = cluster.post("/v1/cluster/workers/nobody/drain", json::object());
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(unknown->status, 404);
  auto health = cluster.get("/health");
  EXPECT_TRUE(health && health->status == 200);
}

// The coordinator's data-plane connection to a serving worker is reset (twice, at random
// moments) while both stay alive: the pipeline is replayed on fresh connections and every
// answer is still the engine's. Over TCP (CONVEYOR_DATA_SHM=0): by default the daemons of one
// host talk over shared memory, which has no connection for `ss -K` to reset.
class DataPlaneReset : public ::testing::TestWithParam<uint32_t> {};
TEST_P(DataPlaneReset, CoordinatorConnectionLosesNothing) {
  if (std::system("ss -V >/dev/null 2>&1") != 0) GTEST_SKIP() << "ss (iproute2) is missing";
  testing::ScopedEnv over_tcp("CONVEYOR_DATA_SHM", "0");
  Cluster cluster;
  ASSERT_TRUE(cluster.start("reset-" + std::to_string(GetParam()), 3, 4, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  // Replays are the point: a reset can also fail a batch in flight between two workers while
  // the pipeline is re-wired ("batch N failed: ... Connection reset by remote peer").
  cluster.faults_expected = true;
  int resets = 0;
  run_with_chaos(cluster, GetParam() + 200, [&](std::mt19937& rng) {
    for (int k = 0; k < 2; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 500));
      const std::string victim = serving_worker(cluster, rng);
      if (victim.empty()) continue;
      resets += reset_connections(cluster.coordinator->pid(), worker_named(cluster, victim)->pid(), cluster.control_port);
    }
  });
  EXPECT_GT(resets, 0) << "no connection was reset: the test did not test anything";
}
INSTANTIATE_TEST_SUITE_P(Seeds, DataPlaneReset, ::testing::Values(1u, 2u));

// The coordinator is SIGKILLed and started again on its ports: the workers register again
// saying what they hold and get the same stages back without loading anything.
TEST(CoordinatorRestart, WorkersKeepTheirLayers) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("restart", 3, 3));
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 16, 31);
  for (const auto& f : run_cases(cluster, cases, 8)) ADD_FAILURE() << f;
  std::map<std::string, json> layers_before;
  // Views kept in variables: a range-for over `info().at(...)` reads a destroyed temporary.
  const json before = cluster.info();
  for (const auto& w : before.at("workers")) layers_before[w.at("name")] = w.at("layers");
  cluster.faults_expected = true;
  cluster.coordinator->signal(SIGKILL);
  ASSERT_TRUE(cluster.coordinator->wait_exit(std::chrono::seconds(5)));
  ASSERT_TRUE(cluster.restart_coordinator());
  ASSERT_TRUE(cluster.wait_until([](const json& i) { return i.at("workers").size() == 3; }, std::chrono::seconds(30)));
  const json after = cluster.info();
  for (const auto& w : after.at("workers")) {
    EXPECT_EQ(w.at("layers"), layers_before[w.at("name")]) << w.dump();
    EXPECT_EQ(w.at("load_seconds"), 0.0) << "it loaded again: " << w.dump();
  }
  for (const auto& w : cluster.workers) EXPECT_TRUE(w->running());
  cases = make_cases(ref, 32, 32);
  for (const auto& f : run_cases(cluster, cases, 8)) ADD_FAILURE() << f;
}

// Clients whose connections the coordinator's death cuts (two streams and two plain requests,
// each mid-answer) send the same request again, with the same seed, until the restarted
// coordinator answers: each retried answer is the engine's, token for token (issue 28).
TEST(CoordinatorRestart, AClientRetriesWithTheSameSeedAndGetsTheSameAnswer) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("restart-retry", 2, 2));
  cluster.faults_expected = true;
  Reference ref;
  struct Sent {
    json body;
    Expected_ expect;
    Answer got;
    int tries = 0;
  };
  std::vector<Sent> sent;
  for (int i = 0; i < 4; ++i) {
    SamplingParams sp;
    sp.temperature = 0.9f;
    sp.top_k = 40;
    sp.seed = 4200 + uint64_t(i);
    const std::string prompt = kSentences[size_t(i)];
    const json body = {{"prompt", prompt}, {"max_tokens", 200}, {"ignore_eos", true}, {"temperature", 0.9},
                       {"top_k", 40}, {"seed", sp.seed}, {"stream", i % 2 == 0}, {"return_token_ids", true}};
    sent.push_back({body, ref.run(ref.tokenizer.encode(prompt), 200, sp, {}), {}, 0});
  }
  std::atomic<int> events{0};
  std::atomic<bool> killed{false};
  std::vector<std::thread> clients;
  for (Sent& s : sent)
    clients.emplace_back([&] {
      CallOptions opt;
      opt.on_progress = [&] { ++events; };
      // Retried once the coordinator was killed, for at most 120 s.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      s.got = call_with_retry(cluster.http_host, cluster.http_port, s.body, opt,
                              [&](const std::string&) { return killed && std::chrono::steady_clock::now() < until; }, s.tries);
    });
  // Kill once both streams have had tokens and every request holds K/V on the pipeline.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  auto all_running = [&] {
    const json info = cluster.info();
    return info.is_object() && info["pipelines"][0].value("running_sequences", 0) == 4;
  };
  while (std::chrono::steady_clock::now() < deadline && !(events >= 4 && all_running()))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  killed = true;
  cluster.coordinator->signal(SIGKILL);
  ASSERT_TRUE(cluster.coordinator->wait_exit(std::chrono::seconds(5)));
  EXPECT_TRUE(cluster.restart_coordinator());
  for (auto& t : clients) t.join();
  for (const Sent& s : sent) {
    EXPECT_GE(s.tries, 2) << "the coordinator died before this request's connection was cut? " << s.body.dump();
    ASSERT_TRUE(s.got.ok()) << s.got.error << " for " << s.body.dump();
    ASSERT_EQ(s.got.choices.size(), 1u) << s.got.choices.dump();
    EXPECT_EQ(s.got.choices[0]["token_ids"].get<std::vector<int32_t>>(), s.expect.tokens) << s.body.dump();
    EXPECT_EQ(s.got.choices[0]["text"], s.expect.text) << s.body.dump();
    EXPECT_EQ(s.got.choices[0]["finish_reason"], s.expect.finish) << s.body.dump();
  }
}

// SIGTERM to a serving worker under load: it asks the coordinator to take its stage (a
// spare does), exits 0 once told to drop it, and nothing fails.
TEST(Sigterm, WorkerHandsItsStageOver) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("sigterm-w", 3, 4));
  ChildProcess* victim = nullptr;
  run_with_chaos(cluster, 41, [&](std::mt19937& rng) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    victim = worker_named(cluster, serving_worker(cluster, rng));
    ASSERT_NE(victim, nullptr);
    victim->signal(SIGTERM);
    EXPECT_EQ(victim->wait_exit(std::chrono::seconds(20)), 0);
  });
  EXPECT_TRUE(cluster.wait_until([](const json& i) { return i["plan"]["stages"] == 3; }));
}

// SIGTERM to the only worker: nothing can take its stage, so its pipeline takes no new
// requests, finishes the running ones and then lets it go; the requests that arrived
// meanwhile wait in the queue and are served by the worker that joins next. That includes
// the ones sent between the worker's exit and the next one's registration, when no
// pipeline can serve: they wait (scheduler.pipeline_wait_ms, 30 s by default) instead of
// being refused, so every one of the 32 must complete.
TEST(Sigterm, LastWorkerFinishesItsRequestsFirst) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("sigterm-last", 1, 1));
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 32, 61);
  std::vector<std::string> failures;
  std::thread load([&] { failures = run_cases(cluster, cases, 8); });
  EXPECT_TRUE(cluster.wait_until(requests_running, std::chrono::seconds(30)));
  cluster.workers[0]->signal(SIGTERM);
  EXPECT_EQ(cluster.workers[0]->wait_exit(std::chrono::seconds(30)), 0);
  cluster.add_worker("w1", cluster.token);
  load.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_TRUE(cluster.wait_until([](const json& i) { return i["pipelines"][0]["stages"][0]["worker"] == "w1"; }));
}

// SIGTERM to the coordinator while requests run: it takes no new request (503), lets the
// accepted ones finish with exactly the engine's tokens, and exits 0.
TEST(Sigterm, CoordinatorFinishesAcceptedRequests) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("sigterm-c", 2, 2));
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 32, 51);
  std::vector<std::string> failures;
  std::thread load([&] { failures = run_cases(cluster, cases, 8); });
  // SIGTERM once each of the 8 clients has a request accepted (queued or running): those 8
  // must complete whatever happens after the signal.
  EXPECT_TRUE(cluster.wait_until([](const json& i) { return i["outstanding"].get<int64_t>() >= 8; },
                                 std::chrono::seconds(30)));
  cluster.coordinator->signal(SIGTERM);
  bool refused = false;
  for (int k = 0; k < 200 && !refused; ++k) {
    auto h = cluster.get("/health");
    refused = h && h->status == 503 && h->body.find("shutting down") != std::string::npos;
    if (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(refused) << "/health never said it is shutting down";
  auto late = cluster.post("/v1/completions", {{"prompt", "The"}, {"max_tokens", 4}});
  load.join();
  // Requests sent after the signal are refused with 503; every one accepted before it
  // completes with the engine's answer.
  size_t refused_later = 0;
  for (const auto& f : failures) {
    if (f.find(": HTTP 503") != std::string::npos) ++refused_later;
    else ADD_FAILURE() << f;
  }
  EXPECT_LE(refused_later, cases.size() - 8) << "fewer than the 8 running requests completed";
  ASSERT_TRUE(late.ok()) << late.error();
  EXPECT_EQ(late->status, 503) << late->body;
  EXPECT_NE(late->body.find("shutting down"), std::string::npos) << late->body;
  EXPECT_EQ(cluster.coordinator->wait_exit(std::chrono::seconds(30)), 0);
}

// One HTTP/1.1 POST on a fresh connection; the whole answer (status line, headers, body)
// as sent, read until the server closes. Empty when nothing could be sent.
std::string raw_post(int port, const std::string& target, const json& body) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string text = body.dump();
    const std::string req = "POST " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" +
                            "Content-Type: application/json\r\nContent-Length: " + std::to_string(text.size()) +
                            "\r\n\r\n" + text;
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == ssize_t(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, size_t(n));
    }
  }
  ::close(fd);
  return out;
}

// SIGTERM to the only worker with nothing running: it is let go at once and no pipeline
// can serve until another worker joins.
void leave_without_worker(Cluster& cluster) {
  cluster.workers[0]->signal(SIGTERM);
  ASSERT_EQ(cluster.workers[0]->wait_exit(std::chrono::seconds(30)), 0);
  for (int k = 0; k < 200; ++k) {
    auto h = cluster.get("/health");
    if (h && h->status == 503) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  FAIL() << "/health still says a pipeline serves after its only worker left";
}

// A request sent while no worker serves waits in the queue and is answered (with the
// engine's tokens) once a worker joins within scheduler.pipeline_wait_ms.
TEST(PipelineWait, RequestWaitsForTheNextWorker) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("wait-served", 1, 1));
  leave_without_worker(cluster);
  if (HasFatalFailure()) return;
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 2, 71);  // one plain, one streamed
  std::vector<std::string> failures;
  std::thread load([&] { failures = run_cases(cluster, cases, 2); });
  // Both are queued, none refused, while nothing can serve.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  json info;
  while (std::chrono::steady_clock::now() < deadline) {
    info = cluster.info();
    if (info.is_object() && info.value("queue", 0) == 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(info.value("queue", 0), 2) << info.dump();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(cluster.info().value("queue", 0), 2) << "a queued request was answered while no worker was up";
  cluster.add_worker("w1", cluster.token);
  load.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
}

// With no worker joining, a queued request is refused after scheduler.pipeline_wait_ms
// with 503 and Retry-After. /health probes answered 503 while the cluster started are not
// counted as requests: conveyor_requests_total{code="503"} counts that refusal alone.
TEST(PipelineWait, RefusedWith503AfterTheWait) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("wait-refused", 1, 1, "scheduler: {pipeline_wait_ms: 1500}\n"));
  leave_without_worker(cluster);
  if (HasFatalFailure()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string answer = raw_post(cluster.http_port, "/v1/completions", {{"prompt", "The jury said"}, {"max_tokens", 4}});
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(answer.rfind("HTTP/1.1 503 ", 0), 0u) << answer;
  EXPECT_NE(answer.find("\r\nRetry-After: 5\r\n"), std::string::npos) << answer;
  EXPECT_NE(answer.find("pipeline_wait_ms"), std::string::npos) << answer;
  EXPECT_GE(waited, 1.4) << "refused before the wait was over";
  EXPECT_LT(waited, 10.0);
  auto metrics = cluster.get("/metrics");
  ASSERT_TRUE(metrics && metrics->status == 200);
  EXPECT_NE(metrics->body.find("\nconveyor_requests_total{code=\"503\"} 1\n"), std::string::npos) << metrics->body;
  EXPECT_EQ(cluster.info().value("queue", -1), 0);
}

}  // namespace
}  // namespace conveyor

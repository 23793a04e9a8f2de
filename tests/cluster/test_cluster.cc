// The cluster end to end on loopback: a real conveyor-coordinator and real conveyor-worker
// processes talking over ZeroMQ and UCX, clients over HTTP. Every answer must be
// token-identical to the single-process engine with the same parameters.
#include "tests/cluster/cluster_harness.h"

namespace conveyor {
namespace {

using namespace cluster_test;

TEST(Cluster, SixtyFourConcurrentRequestsMatchTheEngine) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("concurrent", 3, 3));
  Reference ref;

  std::vector<Case> cases = make_cases(ref, 64, 20261122);
  const std::vector<std::string> failures = run_cases(cluster, cases, 16);
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_TRUE(failures.empty());

  auto metrics = cluster.get("/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("conveyor_requests_total"), std::string::npos);
  // The /health polls of start() (503 while the workers loaded) are not client requests.
  EXPECT_EQ(metrics->body.find("conveyor_requests_total{code=\"503\"}"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("conveyor_requests_total{code=\"200\"} 64\n"), std::string::npos) << metrics->body;
  // Once the load is over every stage's K/V cache drains to the prefix cache's entries: the
  // finished sequences' frees reach the stages although no other work follows them. Workers
  // report every 500 ms.
  const std::regex used(R"(conveyor_kv_cache_used_tokens\{[^}]*\} ([0-9]+))");
  const std::regex cached(R"(\nconveyor_prefix_cache_tokens ([0-9]+)\n)");
  std::string last;
  bool drained = false;
  for (int k = 0; k < 60 && !drained; ++k) {
    if (k) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto m = cluster.get("/metrics");
    if (!m) continue;
    last = m->body;
    std::smatch held;
    const long entries = std::regex_search(last, held, cached) ? std::stol(held[1]) : -1;
    int stages = 0, busy = 0;
    for (std::sregex_iterator it(last.begin(), last.end(), used), end; it != end; ++it, ++stages)
      busy += std::stol((*it)[1]) > entries;
    drained = stages == 3 && busy == 0 && last.find("\nconveyor_running_sequences 0\n") != std::string::npos;
  }
  EXPECT_TRUE(drained) << "K/V still in use 3 s after the load ended:\n" << last;
  auto info = cluster.get("/v1/cluster");
  ASSERT_TRUE(info.ok());
  const json c = json::parse(info->body);
  EXPECT_EQ(c.at("workers").size(), 3u);
  EXPECT_EQ(c.at("pipelines").at(0).at("stages").size(), 3u);
  EXPECT_FALSE(c.at("pipelines").at(0).at("step_ahead").get<bool>());  // several stages: none
}

// A pipeline of one stage steps ahead (scheduler.step_ahead, the default): each decode step
// leaves while the one before is in flight, on the token the stage samples there. The answers
// are the engine's all the same, sampled with seeds, cut by stop strings and the eos token
// (which leave a step ahead to discard), at max_tokens. Each choice that stops before its
// max_tokens ran exactly one step too many, whose token the coordinator discarded.
TEST(Cluster, AOneStagePipelineSteppingAheadMatchesTheEngine) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("ahead", 1, 1));
  EXPECT_TRUE(cluster.info().at("pipelines").at(0).at("step_ahead").get<bool>());
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 48, 20261127);
  for (const auto& f : run_cases(cluster, cases, 12)) ADD_FAILURE() << f;
  for (const auto& f : run_cases(cluster, cases, 1)) ADD_FAILURE() << "one at a time: " << f;
  int early = 0;
  for (const Case& c : cases)
    early += c.expect.finish == "stop" && int(c.expect.tokens.size()) < c.body["max_tokens"].get<int>();
  EXPECT_GT(early, 0) << "no case stops early: nothing checks the discarded steps";
  auto m = cluster.get("/metrics");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(metric(m->body, "conveyor_discarded_tokens_total"), 2 * early) << "two passes of the cases";
}

// Stage workers running their layers tensor parallel (2 and 3 threads: brown-gpt2's 8 heads
// and 1024 MLP units split unevenly at 3) serve the same answers as the single-process
// engine.
TEST(Cluster, TensorParallelWorkersMatchTheEngine) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("tp", 2, 2, "", {"--tp", "2"}));
  cluster.add_worker("w2", cluster.token, {"--tp", "3"});  // a spare, for the re-plan below
  Reference ref;
  std::vector<Case> cases = make_cases(ref, 32, 20261123);
  for (const auto& f : run_cases(cluster, cases, 8)) ADD_FAILURE() << f;
  // The view is kept in a variable: a range-for over a temporary's member (`info().at(...)`)
  // reads it after the temporary is gone (ThreadSanitizer: heap-use-after-free).
  const json info = cluster.info();
  for (const auto& w : info.at("workers"))
    if (w.contains("stage")) {
      EXPECT_NE(w.at("name"), "w2") << "the spare serves: " << w.dump();
    }
  // Three stages: the tp=3 worker takes one.
  auto r = cluster.post("/v1/cluster/plan", {{"stages", 3}});
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : r.error());
  ASSERT_TRUE(cluster.wait_until([](const json& i) { return i["plan"]["stages"] == 3; }));
  cases = make_cases(ref, 32, 20261124);
  for (const auto& f : run_cases(cluster, cases, 8)) ADD_FAILURE() << f;
  // Contradictory tensor-parallel options are refused at start (exit 2): a --tp that is
  // not the number of --gpus, and --gpus on the CPU backend.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--backend", "cuda", "--tp", "3", "--gpus", "0,1"},
        std::vector<std::string>{"--backend", "cpu", "--gpus", "0"}}) {
    std::vector<std::string> argv = {bin("conveyor-worker"), "--coordinator", "127.0.0.1:1", "--join-token", "x"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto bad = testing::ChildProcess(argv);
    EXPECT_EQ(bad.wait_exit(std::chrono::seconds(10)), 2) << args[1];
  }
}

TEST(Cluster, OverloadGets429AndEveryAcceptedRequestCompletes) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("overload", 2, 2, "scheduler: {max_queue: 2, max_running: 1}\n"));
  std::atomic<int> ok{0}, busy{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 12; ++t)
    threads.emplace_back([&] {
      auto r = cluster.post("/v1/completions", {{"prompt", "The jury said"}, {"max_tokens", 40}, {"temperature", 0}});
      if (r && r->status == 200 && json::parse(r->body)["choices"][0]["text"].get<std::string>().size() > 0) ++ok;
      else if (r && r->status == 429) ++busy;
      else ++other;
    });
  for (auto& t : threads) t.join();
  EXPECT_GT(busy.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(ok + busy, 12);
}

TEST(Cluster, ApiKeyIsRequiredWhenConfigured) {
  Cluster cluster;
  cluster.api_key = "s3cret-key";
  ASSERT_TRUE(cluster.start("apikey", 1, 1));
  const json body = {{"prompt", "The jury said"}, {"max_tokens", 3}};
  auto none = cluster.post("/v1/completions", body);
  ASSERT_TRUE(none.ok()) << none.error();
  EXPECT_EQ(none->status, 401);
  auto wrong = cluster.post("/v1/completions", body, {}, {{"Authorization", "Bearer nope"}});
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(wrong->status, 401);
  auto right = cluster.post("/v1/completions", body, {}, {{"Authorization", "Bearer s3cret-key"}});
  ASSERT_TRUE(right.ok());
  EXPECT_EQ(right->status, 200) << right->body;
}

TEST(Cluster, WorkerWithWrongJoinTokenIsRefused) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("token", 1, 1));
  ChildProcess& intruder = cluster.add_worker("intruder", "not-the-token");
  const auto code = intruder.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value()) << "a worker with a wrong token is still running";
  EXPECT_EQ(*code, 3);
  EXPECT_NE(Cluster::read(cluster.dir / "intruder.log").find("wrong join token"), std::string::npos);
  auto info = cluster.get("/v1/cluster");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->body.find("intruder"), std::string::npos);
}

TEST(Cluster, ConfigErrorNamesFileAndLine) {
  const fs::path dir = temp_dir("badconfig");
  const std::string path = (dir / "cluster.yaml").string();
  std::ofstream(path) << "model: {path: \"" << model_dir() << "\"}\n"
                      << "control: {join_token: x}\n"
                      << "pipeline:\n"
                      << "  stagez: 3\n";
  ChildProcess coord({bin("conveyor-coordinator"), "--config", path}, (dir / "log").string());
  const auto code = coord.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 2);
  const std::string log = Cluster::read(dir / "log");
  EXPECT_NE(log.find(path + ":4:"), std::string::npos) << log;
  EXPECT_NE(log.find("stagez"), std::string::npos) << log;

  std::ofstream(path) << "model: {path: \"" << model_dir() << "\"}\n"
                      << "control: {join_token: x}\n"
                      << "pipeline: {stages: 9}\n";
  ChildProcess coord2({bin("conveyor-coordinator"), "--config", path}, (dir / "log2").string());
  ASSERT_TRUE(coord2.wait_exit(std::chrono::seconds(20)).has_value());
  const std::string log2 = Cluster::read(dir / "log2");
  EXPECT_NE(log2.find(path + ":3:"), std::string::npos) << log2;
  EXPECT_NE(log2.find("impossible plan"), std::string::npos) << log2;
  fs::remove_all(dir);
}

// With no --backend the launcher asks conveyor-worker for the GPUs and runs the stages on
// CUDA when there are any (here, on CI: the CPU); the workers say which in /v1/cluster.
TEST(Cluster, LocalLauncherServesAndStopsCleanly) {
  int gpus = -1;
  {
    ChildProcess probe({bin("conveyor-worker"), "--print-gpus"});
    const std::string n = probe.read_line_matching("", std::chrono::seconds(30));
    ASSERT_EQ(std::sscanf(n.c_str(), "%d", &gpus), 1) << "conveyor-worker --print-gpus said '" << n << "'";
    EXPECT_EQ(probe.wait_exit(std::chrono::seconds(10)), 0);
  }
  const fs::path dir = temp_dir("local");
  ChildProcess local({bin("conveyor"), "local", "--model", model_dir(), "--stages", "2", "--port", "0", "--log-dir",
                      dir.string()});
  const std::string found = local.read_line_matching(gpus > 0 ? "GPU(s) found" : "no GPU found", std::chrono::seconds(30));
  EXPECT_FALSE(found.empty());
  const std::string line = local.read_line_matching("ready at", std::chrono::seconds(60));
  int port = 0;
  ASSERT_EQ(std::sscanf(line.c_str(), "conveyor local: ready at http://127.0.0.1:%d", &port), 1) << line;
  HttpRequest r;
  r.method = "POST";
  r.target = "/v1/completions";
  r.body = json({{"prompt", "The jury said"}, {"max_tokens", 5}}).dump();
  auto resp = http_call("127.0.0.1", port, r);
  ASSERT_TRUE(resp.ok()) << resp.error();
  EXPECT_EQ(resp->status, 200) << resp->body;
  HttpRequest c;
  c.method = "GET";
  c.target = "/v1/cluster";
  auto info = http_call("127.0.0.1", port, c);
  ASSERT_TRUE(info.ok()) << info.error();
  const json workers = json::parse(info->body).at("workers");
  ASSERT_EQ(workers.size(), 2u);
  for (const json& w : workers) {
    EXPECT_EQ(w.value("backend", ""), gpus > 0 ? "cuda" : "cpu") << w.dump();
    EXPECT_EQ(w.at("data_plane").value("staging", ""), gpus > 0 ? "page-locked host" : "host") << w.dump();
    // CPU stages always stage; GPU stages go direct when their UCX moves CUDA memory.
    if (gpus == 0) {
      EXPECT_EQ(w.at("data_plane").value("path", ""), "staged") << w.dump();
    }
  }
  local.signal(SIGINT);
  const auto code = local.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conveyor

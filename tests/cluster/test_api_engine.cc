// Issue 29's engine side end to end on loopback: a real coordinator (its log in JSON lines) and
// two real workers.
//  - Cancel on disconnect: a client that closes its connection mid-stream, or while waiting
//    for a non-stream answer, has its request cancelled at the next step: a step or two of
//    tokens after the abort (not the rest), its K/V back on every stage, the cancellation
//    counted in /metrics and logged.
//  - The request log: one JSON line per request with its id (the X-Request-Id it was answered
//    with), status, tokens, times, pipeline, stages and replays.
//  - The scoring idiom with lm-evaluation-harness's request shape, against the engine's
//    prompt log-probs; echo with generation; best_of by sampling; n up to 128 and the K/V
//    refusal naming its numbers.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <iostream>

#include "tests/cluster/cluster_harness.h"

namespace conveyor {
namespace {

using namespace cluster_test;
using namespace std::chrono_literals;

// A client on a raw socket, so the test decides when the connection closes.
struct RawClient {
  int fd = -1;
  std::string got;  // every byte read so far

  explicit RawClient(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    timeval tv{60, 0};  // a hang guard
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawClient() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  void post(const json& body) {
    const std::string b = body.dump();
    const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
    ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  }
  // Reads until `count` SSE events have come; false on EOF or the hang guard.
  bool read_events(size_t count) {
    char buf[4096];
    while (events() < count) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return false;
      got.append(buf, size_t(n));
    }
    return true;
  }
  // Reads one whole answer with a Content-Length; returns its body.
  std::string read_answer() {
    char buf[4096];
    for (;;) {
      const size_t head = got.find("\r\n\r\n");
      const std::string length = header("Content-Length");
      if (head != std::string::npos && !length.empty() && got.size() >= head + 4 + std::stoul(length))
        return got.substr(head + 4, std::stoul(length));
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return "";
      got.append(buf, size_t(n));
    }
  }
  size_t events() const {
    size_t n = 0;
    for (size_t at = got.find("data: "); at != std::string::npos; at = got.find("data: ", at + 1)) ++n;
    return n;
  }
  std::string header(const std::string& name) const {
    const size_t at = got.find("\r\n" + name + ": ");
    if (at == std::string::npos) return "";
    const size_t from = at + name.size() + 4;
    return got.substr(from, got.find("\r\n", from) - from);
  }
};

// The request log's lines in the coordinator's log (JSON lines; another process's output on
// the same stderr, such as UCX's, is not JSON and is skipped).
std::vector<json> request_lines(const Cluster& c) {
  std::vector<json> out;
  std::istringstream in(Cluster::read(c.dir / "coordinator.log"));
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '{') continue;
    const json j = json::parse(line);  // a malformed line fails the test
    if (j.value("logger", "") == "request") out.push_back(j);
  }
  return out;
}

// Waits (bounded) for the request log's line that `match` picks.
json wait_for_line(const Cluster& c, const std::function<bool(const json&)>& match) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline) {
    for (const json& j : request_lines(c))
      if (match(j)) return j;
    std::this_thread::sleep_for(20ms);
  }
  ADD_FAILURE() << "no such request-log line; the log:\n" << Cluster::read(c.dir / "coordinator.log");
  return json();
}

double metric_now(Cluster& c, const std::string& name) {
  auto m = c.get("/metrics");
  return m ? metric(m->body, name) : std::nan("");
}

// Every stage's K/V holds no more than the prefix cache's entries, and no reservation is left
// (workers report every heartbeat, 500 ms).
::testing::AssertionResult kv_returns(Cluster& c) {
  const std::regex used(R"(conveyor_kv_cache_used_tokens\{[^}]*\} ([0-9]+))");
  std::string last;
  for (int k = 0; k < 100; ++k) {
    if (k) std::this_thread::sleep_for(50ms);
    auto m = c.get("/metrics");
    if (!m) continue;
    last = m->body;
    const double cached = metric(last, "conveyor_prefix_cache_tokens");
    int stages = 0, busy = 0;
    for (std::sregex_iterator it(last.begin(), last.end(), used), end; it != end; ++it, ++stages)
      busy += std::stod((*it)[1]) > cached;
    if (stages == 2 && busy == 0 && metric(last, "conveyor_pipeline_kv_reserved_tokens{pipeline=\"0\"}") == 0 &&
        metric(last, "conveyor_running_sequences") == 0)
      return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "K/V still held 5 s later:\n" << last;
}

std::vector<int32_t> ids(int n, int from) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(int32_t(from + 37 * i % 4000));
  return out;
}

TEST(ApiEngine, AClientThatGoesAwayIsCancelledAtTheNextStep) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("cancel", 2, 2, "log: {format: json}\n"));
  const double discarded_before = metric_now(cluster, "conveyor_discarded_tokens_total");
  // A long stream, aborted after its third event.
  RawClient stream(cluster.http_port);
  stream.post({{"prompt", ids(10, 5)}, {"max_tokens", 240}, {"stream", true}, {"ignore_eos", true}, {"temperature", 0}});
  ASSERT_TRUE(stream.read_events(3)) << stream.got;
  const size_t received = stream.events();
  stream.close();
  const std::string id = stream.header("X-Request-Id");
  ASSERT_FALSE(id.empty()) << stream.got;
  const json line = wait_for_line(cluster, [&](const json& j) { return j.value("id", "") == id; });
  EXPECT_EQ(line.value("status", ""), "cancelled") << line.dump();
  // Tokens generated after the abort: those taken before the engine heard of it, past what the
  // client had read, and those its micro-batches in flight made (discarded).
  const int64_t taken = line.value("completion_tokens", int64_t(-1));
  ASSERT_TRUE(kv_returns(cluster));
  const double discarded = metric_now(cluster, "conveyor_discarded_tokens_total") - discarded_before;
  EXPECT_LE(discarded, 2) << "steps in flight after the cancel";
  EXPECT_LE(double(taken) - double(received) + discarded, 8) << line.dump() << " (the client read " << received << ")";
  EXPECT_LT(taken, 200) << line.dump();
  std::cout << "[cancel] stream of max_tokens 240 aborted after " << received << " events: " << taken
            << " tokens taken before the cancel, " << discarded << " discarded after it\n";

  // A non-stream request whose client leaves while it runs.
  RawClient waiting(cluster.http_port);
  waiting.post({{"prompt", ids(13, 9)}, {"max_tokens", 240}, {"ignore_eos", true}, {"temperature", 0}});
  ASSERT_TRUE(cluster.wait_until([](const json& i) { return requests_running(i); }, 30s));
  waiting.close();
  const json gone = wait_for_line(cluster, [](const json& j) { return j.value("prompt_tokens", 0) == 13; });
  EXPECT_EQ(gone.value("status", ""), "cancelled") << gone.dump();
  EXPECT_LT(gone.value("completion_tokens", 240), 200) << gone.dump();
  EXPECT_EQ(gone.value("error", ""), "the client closed its connection");
  ASSERT_TRUE(kv_returns(cluster));
  EXPECT_EQ(metric_now(cluster, "conveyor_requests_cancelled_total"), 2);
  // The cluster still serves, and logs a finished request as ok.
  auto r = cluster.post("/v1/completions", {{"prompt", "The jury said"}, {"max_tokens", 5}, {"temperature", 0}});
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : r.error());
  const std::string ok_id = json::parse(r->body).at("id");
  const json ok = wait_for_line(cluster, [&](const json& j) { return j.value("id", "") == ok_id; });
  EXPECT_EQ(ok.value("status", ""), "ok");
}

// One request's line against its answer.
void expect_logged(const Cluster& c, const json& answer) {
  const std::string id = answer.at("id");
  const json line = wait_for_line(c, [&](const json& j) { return j.value("id", "") == id; });
  SCOPED_TRACE(line.dump());
  EXPECT_EQ(line.value("status", ""), "ok");
  EXPECT_EQ(line.value("level", ""), "info");
  EXPECT_EQ(line["prompt_tokens"], answer["usage"]["prompt_tokens"]);
  EXPECT_EQ(line["cached_tokens"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]);
  EXPECT_GE(line.value("completion_tokens", -1), answer["usage"]["completion_tokens"].get<int>());
  if (answer["usage"]["completion_tokens"] == 0)
    EXPECT_TRUE(line["ttft_ms"].is_null());  // nothing generated (the scoring idiom)
  else
    EXPECT_LE(line["ttft_ms"].get<double>(), line["total_ms"].get<double>());
  EXPECT_EQ(line["pipeline"], 0);
  ASSERT_TRUE(line["stages"].is_array());
  EXPECT_EQ(line["stages"].size(), 2u);
  EXPECT_EQ(line["replays"], 0);
  EXPECT_FALSE(line.contains("error"));
}

// lm-evaluation-harness's loglikelihood request (a batch of token-id prompts, then a text one,
// top-1 and top-5) against the engine's prompt log-probs; each answer in the request log.
void check_scoring(Cluster& cluster, Reference& ref, const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  for (const json& prompt : {json::array({a, b}), json("The jury said it was a fine day")})
    for (int n_top : {1, 5}) {
      const json body = {{"prompt", prompt}, {"temperature", 0}, {"max_tokens", 0}, {"echo", true},
                         {"logprobs", n_top}, {"seed", 1234}};
      auto r = cluster.post("/v1/completions", body);
      ASSERT_TRUE(r && r->status == 200) << (r ? r->body : r.error());
      const json answer = json::parse(r->body);
      EXPECT_EQ(answer["usage"]["completion_tokens"], 0);
      const auto prompts = prompt.is_string() ? std::vector<std::vector<int32_t>>{b} : std::vector<std::vector<int32_t>>{a, b};
      ASSERT_EQ(answer["choices"].size(), prompts.size());
      for (size_t i = 0; i < prompts.size(); ++i) {
        const json& ch = answer["choices"][i];
        const json& lp = ch["logprobs"];
        SCOPED_TRACE("prompt " + std::to_string(i) + ", logprobs " + std::to_string(n_top));
        EXPECT_EQ(ch["finish_reason"], "length");
        EXPECT_EQ(ch["text"], ref.tokenizer.decode(prompts[i]));
        ASSERT_EQ(lp["token_logprobs"].size(), prompts[i].size());
        EXPECT_TRUE(lp["token_logprobs"][0].is_null());
        EXPECT_TRUE(lp["top_logprobs"][0].is_null());
        GenerationRequest g;
        g.prompt = prompts[i], g.max_new_tokens = 1, g.echo_logprobs = true;
        const auto want = ref.engine->generate({g}).value()[0].prompt_logprobs;
        for (size_t t = 1; t < prompts[i].size(); ++t) {
          ASSERT_TRUE(lp["token_logprobs"][t].is_number()) << "token " << t << ": " << answer.dump();
          EXPECT_NEAR(lp["token_logprobs"][t].get<double>(), want[t], 1e-4) << "token " << t;
          EXPECT_GE(lp["top_logprobs"][t].size(), size_t(n_top));
          EXPECT_LE(lp["top_logprobs"][t].size(), size_t(n_top) + 1);  // the prompt's own token is always listed
        }
      }
      expect_logged(cluster, answer);
    }
  // Streamed: one event with the prompt and its log-probs, then [DONE].
  std::vector<json> events;
  bool done = false;
  SseParser sse([&](std::string_view data) {
    if (data == "[DONE]") done = true;
    else events.push_back(json::parse(data));
  });
  auto r = cluster.post("/v1/completions", {{"prompt", b}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}, {"stream", true}},
                        [&](std::string_view bytes) { sse.feed(bytes); });
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : r.error());
  EXPECT_TRUE(done);
  ASSERT_EQ(events.size(), 1u);
  const json& ch = events[0]["choices"][0];
  EXPECT_EQ(ch["text"], ref.tokenizer.decode(b));
  EXPECT_EQ(ch["finish_reason"], "length");
  EXPECT_EQ(ch["logprobs"]["token_logprobs"].size(), b.size());
}

// best_of by sampling decided by the request alone, streaming refused; n up to 128 where the
// K/V allows, and a request past every pipeline's K/V a 400 with its numbers.
void check_samples(Cluster& cluster) {
  // best_of by sampling: the request decides the answer; the first choice is the likelier.
  const json best = {{"prompt", "The jury said"}, {"max_tokens", 8}, {"best_of", 4}, {"n", 2}, {"temperature", 1.0},
                     {"seed", 77}, {"logprobs", 0}, {"ignore_eos", true}};
  auto first = cluster.post("/v1/completions", best), again = cluster.post("/v1/completions", best);
  ASSERT_TRUE(first && first->status == 200) << (first ? first->body : first.error());
  ASSERT_TRUE(again && again->status == 200);
  const json fa = json::parse(first->body), fb = json::parse(again->body);
  ASSERT_EQ(fa["choices"].size(), 2u);
  auto sum = [](const json& ch) {
    double s = 0;
    for (const json& v : ch["logprobs"]["token_logprobs"]) s += v.get<double>();
    return s;
  };
  EXPECT_GE(sum(fa["choices"][0]), sum(fa["choices"][1]));
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(fa["choices"][i]["text"], fb["choices"][i]["text"]);
  auto streamed = cluster.post("/v1/completions", {{"prompt", "x"}, {"best_of", 3}, {"stream", true}});
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 400) << streamed->body;
  // n up to 128 where the K/V allows; a request past every pipeline's K/V is a 400 with its numbers.
  auto many = cluster.post("/v1/completions", {{"prompt", "The jury"}, {"n", 128}, {"max_tokens", 3}});
  ASSERT_TRUE(many && many->status == 200) << (many ? many->body : many.error());
  EXPECT_EQ(json::parse(many->body)["choices"].size(), 128u);
  auto huge = cluster.post("/v1/completions", {{"prompt", ids(200, 1)}, {"n", 128}, {"max_tokens", 50}});
  ASSERT_TRUE(huge);
  EXPECT_EQ(huge->status, 400) << huge->body;
  EXPECT_NE(huge->body.find("needs 32000 K/V-cache tokens"), std::string::npos) << huge->body;
  EXPECT_NE(huge->body.find("more than a pipeline holds"), std::string::npos) << huge->body;
  const json refused = wait_for_line(cluster, [](const json& j) { return j.value("status", "") == "invalid"; });
  EXPECT_EQ(refused.value("prompt_tokens", 0), 200);
}

TEST(ApiEngine, ScoringBestOfAndTheRequestLog) {
  Cluster cluster;
  ASSERT_TRUE(cluster.start("scoring", 2, 2, "log: {format: json}\n"));
  Reference ref;
  const std::vector<int32_t> a = ref.tokenizer.encode("In the morning the old man walked down to the river, where"),
                             b = ref.tokenizer.encode("The jury said it was a fine day");
  check_scoring(cluster, ref, a, b);
  // The id in the log is the one the client got in X-Request-Id.
  RawClient raw(cluster.http_port);
  raw.post({{"prompt", "The jury said"}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}});
  const json raw_answer = json::parse(raw.read_answer());
  EXPECT_EQ(raw.header("X-Request-Id"), raw_answer.at("id").get<std::string>());
  expect_logged(cluster, raw_answer);
  // echo with generation still works: the prompt's log-probs, then the new tokens'.
  auto echoed = cluster.post("/v1/completions", {{"prompt", a}, {"max_tokens", 4}, {"echo", true}, {"logprobs", 1},
                                                 {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_TRUE(echoed && echoed->status == 200) << (echoed ? echoed->body : echoed.error());
  EXPECT_EQ(json::parse(echoed->body)["choices"][0]["logprobs"]["tokens"].size(), a.size() + 4);

  check_samples(cluster);
  // Every line of the coordinator's log is a JSON object (log.format: json), not only the request log's.
  int other = 0;
  std::istringstream in(Cluster::read(cluster.dir / "coordinator.log"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') other += json::parse(line).contains("msg");
  EXPECT_GT(other, 0);
}

}  // namespace
}  // namespace conveyor

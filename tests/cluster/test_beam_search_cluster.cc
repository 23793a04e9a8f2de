// Beam search and logit_bias through REST on a real cluster (coordinator and CPU workers on
// loopback): beam requests, streamed and not, while a serving worker is killed mid-search
// (the coordinator replays every beam from its first token on a new epoch) give the beams the
// scheduler gives in one process without a fault; a logit_bias request gives the engine's
// tokens under the same bias; bad combinations are 400s naming the field.
#include <csignal>
#include <map>

#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/completion_client.h"
#include "tests/coordinator/inproc_pipeline.h"

namespace conveyor {
namespace {

using namespace cluster_test;

struct BeamChoice {
  std::vector<int32_t> ids;
  std::string text, finish;
  bool operator==(const BeamChoice&) const = default;
};

std::string describe(const std::vector<BeamChoice>& cs) {
  std::string out;
  for (const BeamChoice& c : cs) {
    out += "[" + c.finish + ":";
    for (int32_t t : c.ids) out += " " + std::to_string(t);
    out += "] ";
  }
  return out;
}

// The choices the scheduler gives for `r` in one process, without a fault.
std::vector<BeamChoice> expected_beams(std::shared_ptr<CompletionRequest> r) {
  testing::InprocPipeline p(model_dir(), model_dir());
  testing::Collected c;
  EXPECT_TRUE(p.scheduler->submit(r, c.sink()).ok());
  p.run_until_idle();
  std::vector<BeamChoice> out(r->num_choices());
  for (const ChoiceUpdate& u : c.updates) {
    for (const TokenOut& t : u.tokens) out[u.choice].ids.push_back(t.id);
    out[u.choice].text = u.text;
    out[u.choice].finish = u.finish_reason.value_or("");
  }
  return out;
}

TEST(BeamSearchCluster, BeamsThroughRestSurviveAFailover) {
  const Tokenizer tok = Tokenizer::load(model_dir()).value();
  struct Req {
    json body;
    std::vector<BeamChoice> want;
  };
  std::vector<Req> reqs;
  const float penalties[] = {1.0f, 0.6f, 2.0f};
  const char* early[] = {"false", "true", "never"};
  for (int i = 0; i < 6; ++i) {
    const std::vector<int32_t> prompt = tok.encode(kSentences[i]);
    auto r = std::make_shared<CompletionRequest>();
    r->prompts = {prompt};
    r->use_beam_search = true;
    r->best_of = 2 + i % 3;
    r->n = 1 + i % 2;
    r->max_tokens = 60 + 10 * i;
    r->length_penalty = penalties[i % 3];
    r->early_stopping = i % 3 == 0 ? EarlyStopping::Heuristic : i % 3 == 1 ? EarlyStopping::Stop : EarlyStopping::Never;
    r->sampling.temperature = 0;
    json body = {{"prompt", kSentences[i]}, {"use_beam_search", true}, {"best_of", r->best_of}, {"n", r->n},
                 {"max_tokens", r->max_tokens}, {"length_penalty", r->length_penalty}, {"return_token_ids", true},
                 {"stream", i % 2 == 1}};
    body["early_stopping"] = std::string(early[i % 3]) == "never" ? json("never") : json(std::string(early[i % 3]) == "true");
    reqs.push_back({body, expected_beams(r)});
    ASSERT_EQ(reqs.back().want.size(), size_t(r->n));
  }

  Cluster cluster;
  ASSERT_TRUE(cluster.start("beams", 2, 3, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  std::vector<std::vector<BeamChoice>> got(reqs.size());
  std::vector<std::string> errors(reqs.size());
  std::vector<std::thread> clients;
  std::atomic<size_t> answered{0};
  for (size_t i = 0; i < reqs.size(); ++i)
    clients.emplace_back([&, i] {
      struct Count {
        std::atomic<size_t>& n;
        ~Count() { ++n; }
      } count{answered};
      const json& body = reqs[i].body;
      std::vector<BeamChoice>& out = got[i];
      out.resize(size_t(body["n"].get<int>()));
      const Answer a = call_completion(cluster.http_host, cluster.http_port, body);
      if (!a.ok()) {
        errors[i] = a.error;
        return;
      }
      int64_t tokens = 0;
      for (const auto& ch : a.choices) {
        BeamChoice& c = out.at(ch.at("index").get<size_t>());
        c.text = ch.at("text");
        c.ids = ch.at("token_ids").get<std::vector<int32_t>>();
        c.finish = ch.at("finish_reason").is_null() ? "" : ch.at("finish_reason").get<std::string>();
        tokens += int64_t(c.ids.size());
      }
      if (body["stream"].get<bool>() && a.events != body["n"].get<int>())
        errors[i] = "a stream of beams sends one event a choice, got " + std::to_string(a.events);
      if (!body["stream"].get<bool>() && a.usage.at("completion_tokens") != tokens)
        errors[i] = "usage counts " + a.usage.dump();
    });
  // A serving worker dies while the beams are searched; the spare takes its stage.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  auto info = cluster.info();
  std::string victim;
  for (const auto& w : info.at("workers"))
    if (w.value("stage", -1) == 1) victim = w.at("name");
  ASSERT_FALSE(victim.empty()) << info.dump();
  cluster.faults_expected = true;
  cluster.workers.at(size_t(std::stoi(victim.substr(1))))->signal(SIGKILL);
  const size_t answered_before = answered;
  for (auto& t : clients) t.join();
  EXPECT_LT(answered_before, reqs.size()) << "every request was answered before the worker died: no beam was replayed";
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_TRUE(errors[i].empty()) << "request " << i << ": " << errors[i];
    EXPECT_EQ(got[i], reqs[i].want) << "request " << i << " " << reqs[i].body.dump() << "\n got  " << describe(got[i])
                                    << "\n want " << describe(reqs[i].want);
  }

  // logit_bias: the engine's tokens under the same bias; a ban holds even for the greedy token.
  Reference ref;
  SamplingParams sp;
  sp.temperature = 0;
  const std::vector<int32_t> prompt = tok.encode(kSentences[1]);
  const Expected_ plain = ref.run(prompt, 12, sp, {});
  sp.logit_bias = {{0, kLogitBiasBan}, {plain.tokens[0], kLogitBiasBan}, {262, 2.5f}};
  std::sort(sp.logit_bias.begin(), sp.logit_bias.end());
  const Expected_ biased = ref.run(prompt, 12, sp, {});
  EXPECT_NE(biased.tokens[0], plain.tokens[0]);
  json body = {{"prompt", kSentences[1]}, {"max_tokens", 12}, {"temperature", 0}, {"return_token_ids", true},
               {"logit_bias", {{"0", -100}, {std::to_string(plain.tokens[0]), -100}, {"262", 2.5}}}};
  auto r = cluster.post("/v1/completions", body);
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : r.error());
  const json ch = json::parse(r->body).at("choices").at(0);
  EXPECT_EQ(ch.at("token_ids").get<std::vector<int32_t>>(), biased.tokens);
  EXPECT_EQ(ch.at("text"), biased.text);

  // 400s name the field.
  for (const auto& [field, bad] : std::vector<std::pair<std::string, json>>{
           {"logit_bias", {{"prompt", "x"}, {"logit_bias", {{"4096", 1}}}}},
           {"temperature", {{"prompt", "x"}, {"use_beam_search", true}, {"temperature", 0.5}}},
           {"n", {{"prompt", "x"}, {"use_beam_search", true}, {"best_of", 2}, {"n", 3}}},
           {"best_of", {{"prompt", "x"}, {"use_beam_search", true}, {"best_of", 11}}}}) {
    auto e = cluster.post("/v1/completions", bad);
    ASSERT_TRUE(e.ok()) << e.error();
    EXPECT_EQ(e->status, 400) << e->body;
    EXPECT_EQ(json::parse(e->body)["error"]["param"], field) << e->body;
  }
}

}  // namespace
}  // namespace conveyor

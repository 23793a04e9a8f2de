// The engine (coordinator/engine.h) on its own, without a cluster manager: snapshots are
// posted by hand, and a second UCX channel in the process plays the pipeline's only stage,
// reading the micro-batches the engine sends. The engine's safety-net wait is an hour, so
// only an event can make it act: every wait below on a micro-batch is a hang guard (60 s),
// never a timing.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

#include "coordinator/engine.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "tests/coordinator/greedy_request.h"
#include "tests/test_util.h"
#include "transport/ucx_channel.h"

namespace conveyor {
namespace {

using namespace std::chrono_literals;

struct EngineHarness {
  ClusterConfig cfg;
  std::unique_ptr<transport::UcxChannel> coordinator_channel, stage_channel;
  std::unique_ptr<Engine> engine;
  transport::PeerId to_stage = transport::kNoPeer, to_coordinator = transport::kNoPeer;
  uint64_t version = 0;

  // batch_timeout_ms 0: no timer, only events wake the engine.
  explicit EngineHarness(int batch_timeout_ms = 0) {
    const std::string model = testing::source_dir() + "/models/brown-gpt2";
    cfg.model = load_model_config(model).value();
    cfg.batch_timeout_ms = batch_timeout_ms;
    auto tok = Tokenizer::load(model);
    EXPECT_TRUE(tok.ok()) << tok.error();
    transport::UcxChannelOptions o;
    o.transports = "tcp";
    o.net_devices = "lo";
    o.name = "coordinator";
    coordinator_channel = std::move(transport::UcxChannel::create(o)).value();
    o.name = "stage0";
    stage_channel = std::move(transport::UcxChannel::create(o)).value();
    to_stage = coordinator_channel->connect(stage_channel->address(), "stage0").value();
    engine = std::make_unique<Engine>(cfg, std::make_shared<const Tokenizer>(std::move(tok).value()), nullptr,
                                      *coordinator_channel, EngineOptions{.max_wait = std::chrono::hours(1)});
  }
  ~EngineHarness() { engine->stop(); }

  // One ready, open pipeline of one stage in `epoch`.
  void post(uint32_t epoch) {
    auto s = std::make_shared<ClusterSnapshot>();
    s->version = ++version;
    PipelineView v;
    v.index = 0;
    v.epoch = epoch;
    v.workers = {"stage0"};
    v.first_peer = v.last_peer = to_stage;
    v.ready = v.open = v.recoverable = true;
    v.kv_capacity = 100000;
    v.figures = {.max_rows = 0, .sequences = 8, .prompt_rows = 64, .extra_in_flight = 0, .kv_page_tokens = 16,
                 .backends = "cpu"};
    v.depth = 1;
    s->pipelines = {v};
    s->serviceable = true;
    engine->post_snapshot(s);
  }

  CoreStatus submit(int prompt_len) {
    auto r = testing::greedy_request(prompt_len, 4);
    CompletionSink sink;
    sink.on_update = [](ChoiceUpdate) {};
    sink.on_done = [](const std::string&) {};
    return engine->submit(r, sink);
  }

  // The stage's way back to the engine, for answer().
  void connect_back() {
    auto to = stage_channel->connect(coordinator_channel->address(), "coordinator");
    ASSERT_TRUE(to.ok()) << to.error();
    to_coordinator = *to;
  }

  // The stage's result of `b`: `token` for each of its sequences.
  void answer(const MicroBatch& b, int32_t token) {
    BatchResult res;
    res.batch_id = b.batch_id, res.pipeline = 0, res.epoch = b.epoch;
    for (const SeqStep& s : b.seqs) {
      SeqResult sr;
      sr.seq_id = s.slice.seq_id, sr.token = token;
      res.seqs.push_back(sr);
    }
    const std::vector<uint8_t> bytes = encode(res);
    ASSERT_TRUE(stage_channel->send(to_coordinator, std::as_bytes(std::span(bytes)), {}, 10s).ok());
  }

  // The next micro-batch the stage receives (the test fails on none within the hang guard).
  MicroBatch next_batch() {
    auto got = stage_channel->recv(60s);
    EXPECT_TRUE(got.ok()) << got.error();
    if (!got.ok() || !got->has_value()) {
      ADD_FAILURE() << "no micro-batch reached the stage";
      return {};
    }
    const auto& h = (**got).header;
    auto b = decode_microbatch(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
    EXPECT_TRUE(b.ok()) << b.error();
    return b.ok() ? std::move(b).value() : MicroBatch{};
  }
};

// A submitted request wakes the engine at once: with an hour's safety net and no timer, the
// first micro-batch can only leave because submit() interrupted the engine's wait. The
// snapshot is applied the same way (the engine was waiting when it was posted).
TEST(Engine, ASubmitWakesTheEngine) {
  EngineHarness h;
  h.engine->start();
  h.post(5);
  ASSERT_TRUE(h.submit(20).ok());
  const MicroBatch b = h.next_batch();
  EXPECT_EQ(b.epoch, 5u);
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.seqs[0].slice.start_pos, 0);
  EXPECT_EQ(b.seqs[0].slice.num_tokens, 20);
}

// A snapshot with a new epoch restarts the pipeline's runtime: the micro-batch in flight is
// void (its result, should it come, is ignored), and the sequence is fed again from its first
// token with its state sent again to the last stage, all in the new epoch.
TEST(Engine, ASnapshotWithANewEpochRestartsThePipeline) {
  EngineHarness h;
  h.connect_back();
  h.engine->start();
  h.post(5);
  ASSERT_TRUE(h.submit(20).ok());
  const MicroBatch first = h.next_batch();
  ASSERT_EQ(first.seqs.size(), 1u);
  const uint64_t seq = first.seqs[0].slice.seq_id;
  EXPECT_EQ(decode_admissions(first.admissions).value().size(), 1u);
  EXPECT_EQ(h.engine->stats().pipelines.at(0).in_flight, 1);

  h.post(6);  // the pipeline was replayed (a stage lost, a re-wire)
  const MicroBatch again = h.next_batch();
  EXPECT_EQ(again.epoch, 6u);
  ASSERT_EQ(again.seqs.size(), 1u);
  EXPECT_EQ(again.seqs[0].slice.seq_id, seq);
  EXPECT_EQ(again.seqs[0].slice.start_pos, 0);
  EXPECT_EQ(again.seqs[0].slice.num_tokens, 20);
  EXPECT_TRUE(again.seqs[0].sample);
  EXPECT_EQ(decode_admissions(again.admissions).value().size(), 1u);  // the new epoch's last stage holds no state
  const EngineStats st = h.engine->stats();
  EXPECT_EQ(st.pipelines.at(0).epoch, 6u);
  EXPECT_EQ(st.pipelines.at(0).in_flight, 1);

  // The old epoch's result comes late and is ignored; the new one's token is taken.
  h.answer(first, 111);
  h.answer(again, 222);
  const MicroBatch decode = h.next_batch();
  EXPECT_EQ(decode.epoch, 6u);
  ASSERT_EQ(decode.seqs.size(), 1u);
  EXPECT_EQ(decode.seqs[0].slice.start_pos, 20);
  EXPECT_EQ(decode.seqs[0].slice.num_tokens, 1);
  EXPECT_EQ(decode.token_ids, std::vector<int32_t>{222});
}

// A cancelled request (its client went away) ends at once and wakes the engine: the next
// micro-batch the pipeline has room for carries its frees (here the one after the decode step
// in flight: one micro-batch in flight at a time), and its K/V reservation is back at once.
TEST(Engine, ACancelledRequestIsFreedByTheNextMicroBatch) {
  EngineHarness h;
  h.connect_back();
  h.engine->start();
  h.post(1);
  auto r = testing::greedy_request(20, 200);
  std::mutex mu;
  std::vector<std::string> done;
  CompletionSink sink;
  sink.on_update = [](ChoiceUpdate) {};
  sink.on_done = [&](const std::string& e) {
    std::lock_guard lk(mu);
    done.push_back(e);
  };
  ASSERT_TRUE(h.engine->submit(r, sink).ok());
  const MicroBatch prefill = h.next_batch();
  ASSERT_EQ(prefill.seqs.size(), 1u);
  const uint64_t seq = prefill.seqs[0].slice.seq_id;
  h.answer(prefill, 7);
  const MicroBatch decode = h.next_batch();  // in flight while the client goes
  ASSERT_EQ(decode.seqs.size(), 1u);
  h.engine->cancel(*r);
  EXPECT_EQ(h.engine->stats().pipelines.at(0).kv_reserved, 0);
  EXPECT_EQ(h.engine->stats().outstanding, 0u);
  h.answer(decode, 7);  // its token is discarded; the frees leave on the next micro-batch
  const MicroBatch frees = h.next_batch();
  EXPECT_TRUE(frees.seqs.empty());
  EXPECT_EQ(frees.free_seq_ids, std::vector<uint64_t>{seq});
  std::lock_guard lk(mu);
  EXPECT_EQ(done, std::vector<std::string>{"the client closed its connection"});
}

// A ready pipeline with work that makes no progress for batch_timeout_ms is stalled
// (EngineStats: /health says degraded), whatever the engine did about it meanwhile (here: its
// lost micro-batch made it ask a cluster that is not there for a replay). The stage takes the
// micro-batch and never answers.
TEST(Engine, APipelineWithWorkAndNoProgressIsStalled) {
  EngineHarness h(300);
  h.engine->start();
  h.post(1);
  ASSERT_TRUE(h.submit(5).ok());
  (void)h.next_batch();
  int64_t stalled = 0;
  const auto guard = std::chrono::steady_clock::now() + 60s;  // a hang guard, not a timing
  while (stalled == 0 && std::chrono::steady_clock::now() < guard) {
    const EngineStats st = h.engine->stats();
    if (!st.pipelines.empty()) stalled = st.pipelines[0].stalled_ms;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_GE(stalled, 300);
}

// A pipeline with no work is never stalled, however long it idles.
TEST(Engine, AnIdlePipelineIsNotStalled) {
  EngineHarness h(50);
  h.engine->start();
  h.post(1);
  std::this_thread::sleep_for(300ms);  // six stall windows of idling (no timing is asserted)
  const EngineStats st = h.engine->stats();
  ASSERT_EQ(st.pipelines.size(), 1u);
  EXPECT_EQ(st.pipelines[0].stalled_ms, 0);
}

}  // namespace
}  // namespace conveyor

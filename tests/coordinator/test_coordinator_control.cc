// The coordinator's control socket belongs to its control thread (issue 28): messages the
// coordinator sends from other threads (REST handlers: drain, plan; the engine) are posted
// to that thread, so none is lost, none arrives out of order, and none waits for the control
// loop's poll timeout. Before, a REST thread called the ROUTER's send while the control
// thread sat in its recv, and libzmq once aborted (`_state == term_ack_sent`, pipe.cpp).
//
// An in-process coordinator and fake workers (ControlClient, one thread each) that register
// as spares (a first one holds the only stage): each thread, over and
// over, registers, heartbeats, and drains its own worker through Coordinator::drain, as a
// REST handler does, while the others do the same; every welcome, heartbeat and unassign
// must arrive in that order. Were the coordinator to send from the calling thread again, the
// control plane would refuse the call while the control thread is inside recv (the ownership
// check of transport/control_plane.h), and the unassigns would not arrive.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/cluster_config.h"
#include "coordinator/coordinator.h"
#include "tests/test_util.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"

namespace conveyor {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using transport::ControlKind;

constexpr char kToken[] = "control-test-token";

std::unique_ptr<Coordinator> start_coordinator() {
  const std::string model = testing::source_dir() + "/models/brown-gpt2";
  auto cfg = parse_cluster_config("model: {path: \"" + model + "\"}\n" +
                                      "control: {host: 127.0.0.1, port: 0, join_token: " + kToken + "}\n" +
                                      "pipeline: {stages: 1}\n" + "heartbeat: {interval_ms: 500, liveness_ms: 60000}\n",
                                  "test");
  EXPECT_TRUE(cfg.ok()) << cfg.error();
  if (!cfg.ok()) return nullptr;
  auto tok = Tokenizer::load(model);
  EXPECT_TRUE(tok.ok()) << tok.error();
  if (!tok.ok()) return nullptr;
  auto c = Coordinator::start(*cfg, std::make_shared<const Tokenizer>(std::move(tok).value()), nullptr);
  EXPECT_TRUE(c.ok()) << c.error();
  return c.ok() ? std::move(c).value() : nullptr;
}

// A worker's control connection, driven by one thread (the test's).
struct FakeWorker {
  std::string name;
  std::unique_ptr<transport::ControlClient> control;

  ::testing::AssertionResult connect(int port) {
    transport::ControlClientOptions options;
    options.identity = name;
    auto c = transport::ControlClient::connect("tcp://127.0.0.1:" + std::to_string(port), options);
    if (!c) return ::testing::AssertionFailure() << name << ": connect: " << c.error();
    control = std::move(c).value();
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult send(const transport::ControlMessage& m) {
    if (Status s = control->send(m, 5s); !s) return ::testing::AssertionFailure() << name << ": send: " << s.message();
    return ::testing::AssertionSuccess();
  }
  // The next message must be of kind `want`, within `timeout`.
  ::testing::AssertionResult expect(ControlKind want, std::chrono::milliseconds timeout = 5s) {
    auto in = control->recv(timeout);
    if (!in) return ::testing::AssertionFailure() << name << ": recv: " << in.error();
    if (!in->has_value())
      return ::testing::AssertionFailure() << name << ": no '" << transport::control_kind_name(want) << "' within "
                                           << timeout.count() << " ms";
    auto m = transport::decode_control(**in);
    if (!m) return ::testing::AssertionFailure() << name << ": " << m.error();
    if (transport::control_kind(*m) != want)
      return ::testing::AssertionFailure() << name << ": got '" << (**in).type() << "', expected '"
                                           << transport::control_kind_name(want) << "'";
    return ::testing::AssertionSuccess();
  }
  transport::ControlMessage register_msg(std::optional<transport::HeldStage> holding = {},
                                         uint32_t last_epoch = 0) const {
    return transport::encode(transport::RegisterMsg{.name = name,
                                                    .host = "127.0.0.1",
                                                    .pid = ::getpid(),
                                                    .token = kToken,
                                                    .backend = "cpu",
                                                    .capabilities = {.dtype = DType::F32,
                                                                     .weight_format = "f32",
                                                                     .kv_page_tokens = 16,
                                                                     .max_sequences_per_step = 64,
                                                                     .max_prompt_rows_per_step = 64},
                                                    .holding = std::move(holding),
                                                    .last_epoch = last_epoch,
                                                    .data_address = {std::byte{1}, std::byte{2}}});
  }
  // Connects as `as`, registers (register_msg's arguments), is welcomed and answers with
  // what the model takes in its format (only then may the coordinator give it a stage).
  ::testing::AssertionResult join(const std::string& as, int port, std::optional<transport::HeldStage> holding = {},
                                  uint32_t last_epoch = 0) {
    name = as;
    if (auto r = connect(port); !r) return r;
    if (auto r = send(register_msg(std::move(holding), last_epoch)); !r) return r;
    if (auto r = expect(ControlKind::Welcome); !r) return r;
    return send(transport::encode(transport::FootprintMsg{.footprint = {.layer_bytes = 1000, .embedding_bytes = 100,
                                                                         .head_bytes = 100,
                                                                         .embedding_and_head_bytes = 200}}));
  }
  // The epoch of the next message, which must be an assign (0 after a failed expectation).
  uint32_t next_assignment_epoch() const {
    auto in = control->recv(5s);
    EXPECT_TRUE(in.ok()) << in.error();
    if (!in.ok() || !in->has_value()) {
      ADD_FAILURE() << "no assign";
      return 0;
    }
    auto m = transport::decode_control(**in);
    EXPECT_TRUE(m.ok()) << m.error();
    const auto* assign = m.ok() ? std::get_if<transport::AssignMsg>(&*m) : nullptr;
    if (!assign) {
      ADD_FAILURE() << "got '" << (**in).type() << "'";
      return 0;
    }
    return assign->epoch;
  }
};

TEST(CoordinatorControl, MessagesSentFromOtherThreadsArriveInOrder) {
  auto coordinator = start_coordinator();
  ASSERT_TRUE(coordinator);
  // The one stage goes to the first worker to join: this one, which keeps it (loading for
  // good), so the others stay spares.
  FakeWorker holder;
  ASSERT_TRUE(holder.join("holder", coordinator->control_port()));
  ASSERT_TRUE(holder.expect(ControlKind::Assign));
  constexpr int kWorkers = 4, kRounds = 40;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kWorkers);
  std::vector<double> worst_unassign_ms(kWorkers, 0);
  for (int i = 0; i < kWorkers; ++i)
    threads.emplace_back([&, i] {
      FakeWorker w;
      w.name = "fake" + std::to_string(i);
      auto fail = [&](const ::testing::AssertionResult& r) {
        failures[i] = r.message();
        return !r;
      };
      if (fail(w.connect(coordinator->control_port()))) return;
      for (int round = 0; round < kRounds; ++round) {
        // register -> welcome (the control thread), heartbeat -> heartbeat (the control
        // thread), then drain on this thread -> unassign (posted from here).
        if (fail(w.send(w.register_msg())) || fail(w.expect(ControlKind::Welcome))) return;
        if (fail(w.send(transport::encode(transport::HeartbeatMsg{}))) || fail(w.expect(ControlKind::Heartbeat))) return;
        const AdminReply r = coordinator->drain(w.name);
        if (!r.status.ok()) {
          failures[i] = w.name + ": drain refused: " + r.status.message;
          return;
        }
        const auto t0 = Clock::now();
        if (fail(w.expect(ControlKind::Unassign))) return;
        worst_unassign_ms[i] =
            std::max(worst_unassign_ms[i], std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kWorkers; ++i) EXPECT_EQ(failures[i], "") << "worker " << i;
  // The control thread is woken by the post: an unassign does not wait for its 20 ms poll
  // (generous bound: a loaded machine's scheduling, never the poll, sets it).
  for (int i = 0; i < kWorkers; ++i) EXPECT_LT(worst_unassign_ms[i], 1000) << "worker " << i;
}

// A restarted coordinator counts epochs from 1 again, but its workers may still have the
// last one's micro-batches queued, fenced only by their epoch: one of epoch 1 would pass for
// the new coordinator's epoch 1 (and its result for the new batch of the same id, whose own
// result is then ignored: its sequences hang). The first assignment after a worker said it
// holds epoch 7 must be above 7.
TEST(CoordinatorControl, AssignmentsStartAboveTheEpochsWorkersHold) {
  auto coordinator = start_coordinator();
  ASSERT_TRUE(coordinator);
  FakeWorker w;
  ASSERT_TRUE(w.join("survivor", coordinator->control_port(),
                     transport::HeldStage{.epoch = 7, .num_stages = 1, .layer_end = 6,
                                          .model = testing::source_dir() + "/models/brown-gpt2"}));
  EXPECT_GT(w.next_assignment_epoch(), 7u);
}

// The same for a worker that was still loading its stage when the coordinator died: it holds
// nothing, but says the epoch it was last assigned.
TEST(CoordinatorControl, AssignmentsStartAboveTheEpochAWorkerWasLoading) {
  auto coordinator = start_coordinator();
  ASSERT_TRUE(coordinator);
  FakeWorker w;
  ASSERT_TRUE(w.join("loader", coordinator->control_port(), {}, /*last_epoch=*/11));
  EXPECT_GT(w.next_assignment_epoch(), 11u);
}

// A worker describes itself (issue 27): the welcome names the model's shapes, and the
// coordinator gives a stage only to a worker that has answered with what the model takes in
// its format; one that cannot hold the model is never given one.
TEST(CoordinatorControl, AStageGoesOnlyToAWorkerThatDescribedTheModel) {
  auto coordinator = start_coordinator();
  ASSERT_TRUE(coordinator);
  FakeWorker w;
  w.name = "describer";
  ASSERT_TRUE(w.connect(coordinator->control_port()));
  ASSERT_TRUE(w.send(w.register_msg()));
  auto in = w.control->recv(5s);
  ASSERT_TRUE(in.ok() && in->has_value());
  auto welcome = transport::decode_control(**in);
  ASSERT_TRUE(welcome.ok()) << welcome.error();
  const auto& model = std::get<transport::WelcomeMsg>(*welcome).model;
  ASSERT_TRUE(model.has_value());
  const ModelConfig brown = load_model_config(testing::source_dir() + "/models/brown-gpt2").value();
  EXPECT_EQ(model->n_layer, brown.n_layer);
  EXPECT_EQ(model->n_embd, brown.n_embd);
  EXPECT_EQ(model->vocab_size, brown.vocab_size);
  // No assignment before the footprint.
  auto early = w.control->recv(300ms);
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(early->has_value()) << "got '" << (**early).type() << "' before the footprint";
  // A worker that cannot hold the model stays without a stage.
  FakeWorker unable;
  unable.name = "unable";
  ASSERT_TRUE(unable.connect(coordinator->control_port()));
  ASSERT_TRUE(unable.send(unable.register_msg()));
  ASSERT_TRUE(unable.expect(ControlKind::Welcome));
  ASSERT_TRUE(unable.send(transport::encode(transport::FootprintMsg{.error = "no room for 8 heads"})));
  auto none = unable.control->recv(300ms);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value()) << "got '" << (**none).type() << "'";
  const auto cluster = coordinator->cluster();
  for (const auto& row : cluster.at("workers"))
    if (row.at("name") == "unable") {
      EXPECT_EQ(row.at("state"), "failed");
      EXPECT_EQ(row.at("last_error"), "no room for 8 heads");
    }
  ASSERT_TRUE(w.send(transport::encode(transport::FootprintMsg{.footprint = {.layer_bytes = 10}})));
  EXPECT_TRUE(w.expect(ControlKind::Assign));
}

}  // namespace
}  // namespace conveyor

// A stage whose next stage stops taking micro-batches, then is re-assigned (issue 28's flaky
// drain and re-plan tests, made deterministic). One real worker (conveyor-worker) on
// loopback is stage 0 of 2; the test is its coordinator (tests/netns/fake_coordinator.h) and
// its next stage: a channel that takes one micro-batch of activations and reads none, so the
// worker's second hand-on stays in flight (its 10 s send timeout), its third waits queued and
// its compute thread waits for a send slot with the fourth.
//
// - Unassigned in that state (a drain), the worker keeps heartbeating while it waits for its
//   threads and sends: it stopped, for up to the send timeout, and a drained worker was taken
//   for dead (Drain.ServingWorkersUnderLoadLoseNothing read "dead").
// - Re-assigned to a new epoch with another next stage (a re-plan), the sends it cuts off by
//   dropping the old next stage fail in the old epoch: reported as of that epoch, never of
//   the new one, and no error result may reach the coordinator ("could not hand batch to the
//   next stage: send: unknown peer id 1" failed a batch and replayed the new plan in
//   Replan.StagesThreeToTwoAndBackThenTwoReplicasUnderLoad). The new wiring then carries the
//   new epoch's micro-batches.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "tests/netns/fake_coordinator.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using namespace transport;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::ChildProcess;
using testing::FakeCoordinator;

constexpr const char* kSecret = "rewire-secret";

// Four fresh prompts of 250 tokens (greedy): about 1 MB of activations out of stage 0, sent
// by UCX's rendezvous, which a receiver over its queue cap holds back.
MicroBatch big_batch(uint64_t batch_id, uint32_t epoch) {
  MicroBatch b;
  b.batch_id = batch_id;
  b.epoch = epoch;
  std::vector<Admission> admissions;
  for (int32_t s = 1; s <= 4; ++s) {
    constexpr int32_t kTokens = 250;  // the demo model takes 256 positions
    b.seqs.push_back({.slice = {.seq_id = uint64_t(s), .start_pos = 0, .num_tokens = kTokens}, .prefill = true});
    for (int32_t t = 0; t < kTokens; ++t) b.token_ids.push_back(100 + (s * 37 + t) % 3000);
    b.free_seq_ids.push_back(uint64_t(s));  // fresh each time (frees are applied before running)
    Admission a{.seq_id = uint64_t(s), .state = {}};
    a.state.prompt_len = kTokens;
    a.state.sampling.temperature = 0;
    admissions.push_back(a);
  }
  b.admissions = encode_admissions(admissions);
  return b;
}

struct WorkerRewire : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("conveyor-test-rewire-" + std::to_string(::getpid()));
  FakeCoordinator c;
  std::unique_ptr<UcxChannel> next, next2;  // stage 1 before and after the re-assignment
  std::unique_ptr<ChildProcess> worker;
  PeerId to_worker = kNoPeer;
  // What the worker said: its heartbeats' arrival times and figures, and its reports.
  std::vector<std::pair<Clock::time_point, WorkerFigures>> heartbeats;
  std::vector<DataErrorMsg> reports;

  std::string log() const { return testing::read_text_file((dir / "w.log").string()); }

  static std::unique_ptr<UcxChannel> channel(const std::string& name, size_t max_queued_bytes) {
    auto ch = UcxChannel::create(
        {.name = name, .net_devices = "lo", .max_queued_bytes = max_queued_bytes, .auth_secret = kSecret});
    EXPECT_TRUE(ch.ok()) << ch.error();
    return ch ? std::move(ch).value() : nullptr;
  }

  void SetUp() override {
    fs::remove_all(dir);
    fs::create_directories(dir);
    ASSERT_TRUE(c.bind_loopback(kSecret));
    next = channel("next", 64 << 10);  // over its cap once it holds one micro-batch
    next2 = channel("next2", size_t(1) << 30);
    ASSERT_TRUE(next && next2);
    c.on_message = [this](const AnyControlMsg& m) {
      if (auto* h = std::get_if<HeartbeatMsg>(&m); h && h->figures) heartbeats.emplace_back(Clock::now(), *h->figures);
      if (auto* e = std::get_if<DataErrorMsg>(&m)) reports.push_back(*e);
    };
    std::vector<std::string> argv = c.worker_argv("w", kSecret);
    argv.insert(argv.end(), {"--heartbeat-ms", "100"});
    worker = std::make_unique<ChildProcess>(argv, (dir / "w.log").string());
    ASSERT_TRUE(c.pump([&] { return !c.worker.empty(); }, milliseconds(30000))) << log();
    ASSERT_TRUE(assign(1, *next)) << log();
    auto p = c.channel->connect(c.worker_address, "w");
    ASSERT_TRUE(p.ok()) << p.error();
    to_worker = *p;
  }

  void TearDown() override {
    if (to_worker != kNoPeer) (void)c.channel->disconnect(to_worker);
    worker.reset();
    if (!HasFailure()) fs::remove_all(dir);
  }

  // Stage 0 of 2, layers [0, 3), its next stage at `to`; waits for its ready.
  ::testing::AssertionResult assign(uint32_t epoch, const UcxChannel& to) {
    AssignMsg a{.epoch = epoch, .pipeline = 0, .stage = 0, .num_stages = 2, .layer_begin = 0, .layer_end = 3,
                .model = testing::source_dir() + "/models/brown-gpt2", .next_address = to.address(),
                .prev_address = c.channel->address(), .coordinator_address = c.channel->address()};
    if (auto s = c.control->send(c.worker, encode(a)); !s) return ::testing::AssertionFailure() << s.message();
    return c.pump([&] { return c.ready_epoch == epoch; }, milliseconds(30000));
  }

  ::testing::AssertionResult send_batch(uint64_t id, uint32_t epoch) {
    const std::vector<uint8_t> header = encode(big_batch(id, epoch));
    if (Status s = c.channel->send(to_worker, std::as_bytes(std::span(header)), {}, milliseconds(5000)); !s)
      return ::testing::AssertionFailure() << s.message();
    return ::testing::AssertionSuccess();
  }

  // Four micro-batches of epoch 1: the first is taken, the second's send stays in flight, the
  // third waits queued behind it and the fourth for a send slot. Three steps have ended once
  // a heartbeat counts them; two heartbeats later the fourth has been waiting for a while.
  ::testing::AssertionResult stall_the_hand_on() {
    for (uint64_t id = 1; id <= 4; ++id)
      if (auto r = send_batch(id, 1); !r) return r;
    size_t counted = 0;
    return c.pump(
        [&] {
          if (!counted && !heartbeats.empty() && heartbeats.back().second.batches >= 3) counted = heartbeats.size();
          return counted && heartbeats.size() >= counted + 2;
        },
        milliseconds(30000));
  }

  // The longest silence between the worker's heartbeats from `since` until its figures say
  // Idle (none: it never got there).
  std::optional<milliseconds> longest_silence_until_idle(Clock::time_point since) const {
    Clock::time_point last = since;
    milliseconds longest{0};
    for (const auto& [at, figures] : heartbeats) {
      if (at < since) continue;
      longest = std::max(longest, std::chrono::duration_cast<milliseconds>(at - last));
      last = at;
      if (figures.state == WorkerState::Idle) return longest;
    }
    return std::nullopt;
  }
};

TEST_F(WorkerRewire, AnUnassignedWorkerKeepsHeartbeatingWhileItsSendsTimeOut) {
  ASSERT_TRUE(stall_the_hand_on()) << log();
  const auto unassigned = Clock::now();
  ASSERT_TRUE(c.control->send(c.worker, encode(UnassignMsg{})));
  // Idle once the send in flight has timed out (10 s); a heartbeat every 100 ms meanwhile.
  ASSERT_TRUE(c.pump([&] { return longest_silence_until_idle(unassigned).has_value(); }, milliseconds(30000)))
      << log();
  const milliseconds silence = *longest_silence_until_idle(unassigned);
  EXPECT_LT(silence.count(), 2000) << "the worker was silent for " << silence.count()
                                   << " ms while it stopped (the coordinator's liveness window is 3000 ms)\n"
                                   << log();
}

TEST_F(WorkerRewire, SendsCutOffByARePlanAreNoErrorOfTheNewEpoch) {
  ASSERT_TRUE(stall_the_hand_on()) << log();
  // Re-assigned the same layers in epoch 2, with another next stage: the old one is dropped.
  ASSERT_TRUE(assign(2, *next2)) << log();
  for (const DataErrorMsg& e : reports)  // the coordinator replays only on its current epoch's
    EXPECT_EQ(e.epoch.value_or(0), 1u) << "a failure of epoch 1 reported as of another: " << e.error;
  // The new wiring carries epoch 2, and nothing comes back to the coordinator (a first stage
  // sends it nothing but an error result).
  ASSERT_TRUE(send_batch(10, 2));
  std::optional<MicroBatch> handed_on;
  ASSERT_TRUE(c.pump(
      [&] {
        auto got = next2->recv(milliseconds(10));
        if (!got.ok() || !got->has_value()) return false;
        const auto& h = (**got).header;
        auto b = decode_microbatch(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
        if (b.ok()) handed_on = *b;
        return true;
      },
      milliseconds(30000)))
      << log();
  ASSERT_TRUE(handed_on.has_value());
  EXPECT_EQ(handed_on->batch_id, 10u);
  EXPECT_EQ(handed_on->epoch, 2u);
  auto back = c.channel->recv(milliseconds(1000));
  ASSERT_TRUE(back.ok()) << back.error();
  if (back->has_value()) {
    const auto& h = (**back).header;
    auto r = decode_batch_result(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
    ADD_FAILURE() << "the coordinator got a result of batch " << (r ? r->batch_id : 0) << " (epoch "
                  << (r ? r->epoch : 0) << "): " << (r ? r->error : r.error());
  }
  EXPECT_NE(log().find("the stage has been re-assigned since"), std::string::npos) << log();
}

}  // namespace
}  // namespace conveyor

// The authenticated data plane (transport/data_auth.h) against a stranger: one real worker
// (conveyor-worker, its data plane keyed by its --join-token), driven by a stand-in
// coordinator in this process that knows the cluster's secret, and a real stranger process
// (conveyor-data-stranger) that has the worker's data-plane address but not the secret. The
// stranger connects and sends a well-formed micro-batch of the running epoch: once under an id
// of its own, once posing as the coordinator's channel. Both are refused and logged, nothing
// comes back to the stranger and nothing runs, and the worker goes on serving the coordinator
// with the same answers. The same program with the right secret gets through (so the refusal
// is the key's doing), and its result goes to the coordinator, never to the sender.
// The worker that tries to join with a wrong token: Cluster.WorkerWithWrongJoinTokenIsRefused.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "protocol/batch_result.h"
#include "tests/netns/fake_coordinator.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using namespace transport;
using std::chrono::milliseconds;
using testing::ChildProcess;
using testing::FakeCoordinator;
using testing::prompt_batch;

constexpr const char* kSecret = "the-cluster-secret";

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct StrangerTest : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("conveyor-test-stranger-" + std::to_string(::getpid()));
  FakeCoordinator c;
  std::unique_ptr<ChildProcess> worker;
  PeerId peer = kNoPeer;

  void SetUp() override {
    fs::remove_all(dir);
    fs::create_directories(dir);
    ASSERT_TRUE(c.bind_loopback(kSecret));
    worker = std::make_unique<ChildProcess>(c.worker_argv("w", kSecret), (dir / "w.log").string());
    ASSERT_TRUE(c.pump([&] { return !c.worker.empty(); }, milliseconds(30000))) << read(dir / "w.log");
    ASSERT_TRUE(c.assign(1, testing::source_dir() + "/models/brown-gpt2")) << read(dir / "w.log");
    auto p = c.channel->connect(c.worker_address, "w");
    ASSERT_TRUE(p.ok()) << p.error();
    peer = *p;
    std::ofstream(dir / "address", std::ios::binary)
        .write(reinterpret_cast<const char*>(c.worker_address.data()), std::streamsize(c.worker_address.size()));
  }
  void TearDown() override {
    if (peer != kNoPeer) (void)c.channel->disconnect(peer);
    worker.reset();
    if (!HasFailure()) fs::remove_all(dir);
  }

  // Serves the worker's control plane (heartbeats) for `d`.
  ::testing::AssertionResult serve(milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    return c.pump([&] { return std::chrono::steady_clock::now() >= until; }, d + milliseconds(1000));
  }

  // Runs the stranger with `secret` under `channel_id` (0: its own), serving the worker's
  // control plane meanwhile; its report line.
  std::string run_stranger(const std::string& secret, uint32_t channel_id) {
    ChildProcess s({std::string(CONVEYOR_BINARY_DIR) + "/tests/conveyor-data-stranger", (dir / "address").string(), secret,
                    std::to_string(channel_id), "1", "1500"},
                   (dir / "stranger.log").string());
    for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
         std::chrono::steady_clock::now() < until && s.running();) {
      if (std::string line = s.read_line_matching("stranger:", milliseconds(20)); !line.empty()) return line;
      EXPECT_TRUE(serve(milliseconds(20)));
    }
    // Ended: what it wrote is still in the pipe.
    if (std::string line = s.read_line_matching("stranger:", milliseconds(1000)); !line.empty()) return line;
    return "(no report) " + read(dir / "stranger.log");
  }

  // The next result the worker sends the coordinator, or an error after `timeout`.
  Expected<BatchResult> next_result(milliseconds timeout) {
    for (const auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;) {
      auto got = c.channel->recv(milliseconds(20));
      if (!got) return got.status();
      if (*got) {
        const auto& h = (**got).header;
        return decode_batch_result(std::span(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
      }
      if (auto r = serve(milliseconds(10)); !r) return Status::error(r.message());
    }
    return Status::error("no result");
  }

  Expected<BatchResult> run_batch(uint64_t id) {
    const std::vector<uint8_t> header = encode(prompt_batch(id, 1));
    if (Status s = c.channel->send(peer, std::as_bytes(std::span(header)), {}, milliseconds(5000)); !s) return s;
    return next_result(milliseconds(30000));
  }
};

TEST_F(StrangerTest, AStrangerCannotInjectAMicroBatchOrReadAResultAndTheStageGoesOn) {
  auto first = run_batch(10);
  ASSERT_TRUE(first.ok()) << first.error() << read(dir / "w.log");
  ASSERT_EQ(first->seqs.size(), 1u) << first->error;

  // Under an id of its own, then posing as the coordinator's channel: refused both times.
  for (const uint32_t id : {0u, c.channel->id()}) {
    const std::string report = run_stranger("not-the-secret", id);
    EXPECT_EQ(report, "stranger: sent ok; received 0 message(s)") << read(dir / "stranger.log");
    auto stray = next_result(milliseconds(500));
    EXPECT_FALSE(stray.ok()) << "the stranger's micro-batch ran: a result for batch " << stray->batch_id;
  }
  const std::string log = read(dir / "w.log");
  EXPECT_NE(log.find("a handshake with the wrong key (not a member of this cluster)"), std::string::npos) << log;
  EXPECT_NE(log.find("it has not proved it belongs to this cluster"), std::string::npos) << log;
  EXPECT_NE(log.find("a wrong MAC"), std::string::npos) << log;

  // The stage goes on: the same work, the same answer.
  auto after = run_batch(20);
  ASSERT_TRUE(after.ok()) << after.error() << read(dir / "w.log");
  ASSERT_EQ(after->seqs.size(), 1u) << after->error;
  EXPECT_EQ(after->seqs[0].token, first->seqs[0].token);

  // With the secret the same program gets through; the result goes to the coordinator.
  EXPECT_EQ(run_stranger(kSecret, 0), "stranger: sent ok; received 0 message(s)") << read(dir / "stranger.log");
  auto member = next_result(milliseconds(30000));
  ASSERT_TRUE(member.ok()) << member.error() << read(dir / "w.log");
  EXPECT_EQ(member->batch_id, 77u);
  EXPECT_EQ(c.channel->refused_messages(), 0u);
}

}  // namespace
}  // namespace conveyor

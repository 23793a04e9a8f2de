// The fence: a node that comes back after it was replaced cannot push its micro-batches into
// the new epoch. One real worker on a node of its own (tests/netns/netns_harness.h); the
// test is its coordinator, from the root namespace, over the same control and data planes
// as the real one. It assigns the whole model in epoch 1 and runs a micro-batch, re-assigns
// the same layers in epoch 2 (what a failover's re-wiring does to a stage that stays), then
// plays the node that was cut off in epoch 1 and comes back: it pushes a micro-batch of
// epoch 1, then one of epoch 2, on the same connection. Messages of one connection arrive in
// order, so by the time the epoch-2 result is back the stale batch has been dealt with: it
// must have been dropped (no result for it, and the worker says so).
//
// tests/netns/test_netns_faults.cc shows the same fence at work in a whole cluster (the
// neighbours of a node cut off or partitioned drop its micro-batches), where how many there
// are depends on timing; here it is deterministic.
#include <gtest/gtest.h>

#include <span>

#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "tests/netns/fake_coordinator.h"
#include "tests/netns/netns_harness.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
#include "transport/net_interface.h"
#include "transport/ucx_channel.h"

namespace conveyor {
namespace {

using namespace netns_test;
using namespace transport;
using testing::FakeCoordinator;
using testing::prompt_batch;

TEST(NetnsFence, AReplacedNodesMicroBatchesAreDroppedByTheNewEpoch) {
  if (const std::string why = netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
  const fs::path dir = fs::temp_directory_path() / ("conveyor-test-netns-fence-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  ASSERT_FALSE(ec) << ec.message();
  Topology topo;
  ASSERT_TRUE(topo.create(dir, {"w"}));
  const Node& node = topo.node("w");
  const std::string model = testing::source_dir() + "/models/brown-gpt2";

  FakeCoordinator c;
  auto server = ControlServer::bind("tcp://" + topo.host_address() + ":0");
  ASSERT_TRUE(server.ok()) << server.error();
  c.control = std::move(server).value();
  auto iface = data_plane_interface(topo.host_address());
  ASSERT_TRUE(iface.ok()) << iface.error();
  UcxChannelOptions copt;
  copt.name = "coordinator";
  copt.net_devices = *iface;  // the bridge: the worker reaches us on the cluster network only
  copt.auth_secret = "t";     // the worker's --join-token: its data plane takes only the cluster's
  auto channel = UcxChannel::create(copt);
  ASSERT_TRUE(channel.ok()) << channel.error();
  c.channel = std::move(channel).value();

  std::string error;
  auto worker = Process::start(node.netns,
                               {testing::bin_dir() + "/conveyor-worker", "--coordinator",
                                topo.host_address() + ":" + std::to_string(c.control->port()), "--host", node.address,
                                "--name", "w", "--join-token", "t", "--backend", "cpu", "--kv-cache-mb", "64"},
                               (dir / "w.log").string(), false, error);
  ASSERT_TRUE(worker) << error;
  ASSERT_TRUE(c.pump([&] { return !c.worker.empty(); }, milliseconds(30000))) << Topology::read(dir / "w.log");
  ASSERT_TRUE(c.assign(1, model)) << Topology::read(dir / "w.log");
  auto peer = c.channel->connect(c.worker_address, "w");
  ASSERT_TRUE(peer.ok()) << peer.error();

  auto push = [&](const MicroBatch& b) {
    const std::vector<uint8_t> header = encode(b);
    return c.channel->send(*peer, std::as_bytes(std::span<const uint8_t>(header)), PayloadView{}, milliseconds(5000));
  };
  // The next result to come back (serving the control plane meanwhile).
  auto next_result = [&]() -> Expected<BatchResult> {
    const auto deadline = Clock::now() + seconds(30);
    while (Clock::now() < deadline) {
      auto got = c.channel->recv(milliseconds(50));
      if (!got) return got.status();
      if (*got) {
        const auto& h = (**got).header;
        return decode_batch_result(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
      }
      if (auto r = c.pump([] { return true; }, milliseconds(10)); !r) return Status::error(r.message());
    }
    return Status::error("no result within 30 s");
  };

  // Epoch 1 serves.
  ASSERT_TRUE(push(prompt_batch(10, 1)).ok());
  auto first = next_result();
  ASSERT_TRUE(first.ok()) << first.error() << Topology::read(dir / "w.log");
  ASSERT_EQ(first->batch_id, 10u);
  ASSERT_TRUE(first->error.empty()) << first->error;
  ASSERT_EQ(first->seqs.size(), 1u);

  // The failover's new epoch, the same layers; then the stale node pushes epoch 1.
  ASSERT_TRUE(c.assign(2, model)) << Topology::read(dir / "w.log");
  ASSERT_TRUE(push(prompt_batch(11, 1)).ok());
  ASSERT_TRUE(push(prompt_batch(20, 2)).ok());
  auto second = next_result();
  ASSERT_TRUE(second.ok()) << second.error() << Topology::read(dir / "w.log");
  EXPECT_EQ(second->batch_id, 20u) << "the micro-batch of epoch 1 came through into epoch 2";
  EXPECT_EQ(second->epoch, 2u);
  ASSERT_EQ(second->seqs.size(), 1u);
  EXPECT_EQ(second->seqs[0].token, first->seqs[0].token);  // the same work gives the same token
  // Nothing else comes back, and the worker said why.
  auto extra = c.channel->recv(milliseconds(500));
  ASSERT_TRUE(extra.ok()) << extra.error();
  EXPECT_FALSE(extra->has_value()) << "a second result came back";
  const std::string log = Topology::read(dir / "w.log");
  EXPECT_NE(log.find("dropped a stale micro-batch (batch 11, epoch 1; this stage runs epoch 2)"), std::string::npos) << log;

  (void)c.channel->disconnect(*peer);  // before the worker goes: no endpoint timeout to report
  worker.reset();
  c.channel.reset();
  if (!::testing::Test::HasFailure()) fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace conveyor

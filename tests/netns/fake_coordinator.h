// A stand-in for the coordinator, in the test's own process, for tests that drive one real
// worker directly: its control plane (welcome, heartbeats, assign, ready) and a data-plane
// channel (given the cluster's secret: the worker's data plane is authenticated).
// Used by tests/netns/test_netns_fence.cc, tests/transport/test_data_plane_stranger.cc and
// tests/stage_worker/test_worker_rewire.cc.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tests/netns/prompt_batch.h"
#include "tests/test_util.h"
#include "transport/control_messages.h"
#include "transport/control_plane.h"
#include "transport/ucx_channel.h"

namespace conveyor::testing {

using namespace transport;

struct FakeCoordinator {
  std::unique_ptr<ControlServer> control;
  std::unique_ptr<UcxChannel> channel;
  std::string worker;                  // its routing id, once it registered
  std::vector<std::byte> worker_address;
  uint32_t ready_epoch = 0;
  // Sees every message the worker sends, before pump() answers it (tests that watch its
  // heartbeats or its reports).
  std::function<void(const AnyControlMsg&)> on_message;

  // On loopback: the control plane on a free port, the data plane on `lo`, keyed by `secret`.
  ::testing::AssertionResult bind_loopback(const std::string& secret) {
    auto server = ControlServer::bind("tcp://127.0.0.1:0");
    if (!server) return ::testing::AssertionFailure() << server.error();
    control = std::move(server).value();
    auto ch = UcxChannel::create({.name = "coordinator", .net_devices = "lo", .auth_secret = secret});
    if (!ch) return ::testing::AssertionFailure() << ch.error();
    channel = std::move(ch).value();
    return ::testing::AssertionSuccess();
  }

  // A CPU conveyor-worker named `name` that joins this coordinator (bind_loopback's) with `secret`.
  std::vector<std::string> worker_argv(const std::string& name, const std::string& secret) const {
    return {bin_dir() + "/conveyor-worker", "--coordinator", "127.0.0.1:" + std::to_string(control->port()),
            "--host", "127.0.0.1", "--name", name, "--join-token", secret, "--backend", "cpu", "--kv-cache-mb", "64"};
  }

  // Serves the worker's control messages (welcome, heartbeats, ready) until `done` or the timeout.
  ::testing::AssertionResult pump(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      if (std::chrono::steady_clock::now() >= deadline) return ::testing::AssertionFailure() << "timed out waiting for the worker";
      auto in = control->recv(std::chrono::milliseconds(50));
      if (!in) return ::testing::AssertionFailure() << "control recv: " << in.error();
      if (!*in) continue;
      auto msg = decode_control((*in)->message);
      if (!msg) return ::testing::AssertionFailure() << "bad control message: " << msg.error();
      const std::string peer = (*in)->peer;
      if (on_message) on_message(*msg);
      if (auto* r = std::get_if<RegisterMsg>(&*msg)) {
        worker = peer;
        worker_address = r->data_address;
        if (auto s = control->send(peer, encode(WelcomeMsg{.heartbeat_ms = 200})); !s)
          return ::testing::AssertionFailure() << "send welcome: " << s.message();
      } else if (std::holds_alternative<HeartbeatMsg>(*msg)) {
        if (auto s = control->send(peer, encode(HeartbeatMsg{})); !s)
          return ::testing::AssertionFailure() << "send heartbeat: " << s.message();
      } else if (auto* ready = std::get_if<ReadyMsg>(&*msg)) {
        ready_epoch = ready->epoch;
      } else if (auto* failed = std::get_if<LoadFailedMsg>(&*msg)) {
        return ::testing::AssertionFailure() << "the worker failed to load: " << failed->error;
      }
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult assign(uint32_t epoch, const std::string& model) {
    AssignMsg a{.epoch = epoch, .pipeline = 0, .stage = 0, .num_stages = 1, .layer_begin = 0, .layer_end = 6,
                .model = model, .next_address = {}, .prev_address = channel->address(),
                .coordinator_address = channel->address()};
    if (auto s = control->send(worker, encode(a)); !s) return ::testing::AssertionFailure() << "send assign: " << s.message();
    return pump([&] { return ready_epoch == epoch; }, std::chrono::milliseconds(30000));
  }
};

}  // namespace conveyor::testing

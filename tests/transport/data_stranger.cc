// conveyor-data-stranger: a process that is not a member of the cluster and tries its data
// plane anyway (tests/transport/test_data_plane_stranger.cc). It reads a channel's address
// from a file, makes a UCX channel of its own with the secret it is given (a wrong one), under
// the channel id it is given (0: a random one; a member's id to pose as that member), connects,
// sends a well-formed micro-batch of the given epoch, and listens for anything that comes back.
//
//   conveyor-data-stranger ADDRESS_FILE SECRET CHANNEL_ID EPOCH LISTEN_MS
//
// Prints "stranger: sent <ok|error ...>; received N message(s)" and exits 0, or 1 when it could
// not even try (no address, no channel).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "tests/netns/prompt_batch.h"
#include "transport/ucx_channel.h"

using namespace conveyor;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s ADDRESS_FILE SECRET CHANNEL_ID EPOCH LISTEN_MS\n", argv[0]);
    return 1;
  }
  std::ifstream in(argv[1], std::ios::binary);
  const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (raw.empty()) {
    std::fprintf(stderr, "stranger: no address in %s\n", argv[1]);
    return 1;
  }
  const auto* first = reinterpret_cast<const std::byte*>(raw.data());
  const std::vector<std::byte> address(first, first + raw.size());
  transport::UcxChannelOptions o;
  o.name = "stranger";
  o.net_devices = "lo";
  o.auth_secret = argv[2];
  o.channel_id = uint32_t(std::strtoul(argv[3], nullptr, 10));
  auto channel = transport::UcxChannel::create(o);
  if (!channel) {
    std::fprintf(stderr, "stranger: %s\n", channel.error().c_str());
    return 1;
  }
  auto peer = (*channel)->connect(address, "member");
  if (!peer) {
    std::fprintf(stderr, "stranger: %s\n", peer.error().c_str());
    return 1;
  }
  const std::vector<uint8_t> header = encode(testing::prompt_batch(77, uint32_t(std::atoi(argv[4]))));
  const Status sent = (*channel)->send(*peer, std::as_bytes(std::span(header)), {}, std::chrono::milliseconds(5000));
  int received = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::atoi(argv[5]));
  while (std::chrono::steady_clock::now() < until) {
    auto got = (*channel)->recv(std::chrono::milliseconds(50));
    if (got && got->has_value()) ++received;
  }
  std::printf("stranger: sent %s; received %d message(s)\n", sent.ok() ? "ok" : ("error " + sent.message()).c_str(),
              received);
  std::fflush(stdout);
  (void)(*channel)->disconnect(*peer);
  return 0;
}

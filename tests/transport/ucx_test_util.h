// What the UcxChannel test programs (test_ucx_channel.cc, test_ucx_processes.cc) share:
// channels made per transport choice, the two data paths (staged: host payloads; direct:
// CUDA device payloads, skipped without a GPU or a UCX built with CUDA) and their fixtures,
// and payload buffers on either path.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "tests/transport/transport_test_util.h"
#include "transport/ucx_channel.h"

namespace conveyor::transport::ucx_test {

using namespace std::chrono_literals;
using conveyor::testing::check_pattern;
using conveyor::testing::ChildProcess;
using conveyor::testing::fill_pattern;
using Clock = std::chrono::steady_clock;

inline constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

// A channel on loopback unless `options` names its interfaces, as `conveyor local` binds its
// data plane: every peer of these tests is on this host, and an interface another program
// adds for a while (a network-namespace test's bridge in the root namespace) is never offered
// to a peer. Offering every interface, a channel beside such a test connected once to a
// bridge that then went away ("connection establishment ... was unsuccessful", then
// "Endpoint timeout"; 2 of 728 tests, with the netns tests repeated beside the suite).
// `transports` "shm": UCX's default choice, with host_shared_memory (two channels of this host
// then talk over shared memory, each watching the other's process).
inline constexpr const char* kHostShm = "shm";
inline std::unique_ptr<UcxChannel> make_channel(const std::string& transports, const std::string& name,
                                         UcxChannelOptions options = {}) {
  options.name = name;
  options.transports = transports == kHostShm ? std::string() : transports;
  if (transports == kHostShm) options.host_shared_memory = true;
  if (options.net_devices.empty()) options.net_devices = "lo";
  auto ch = UcxChannel::create(options);
  EXPECT_TRUE(ch.ok()) << ch.error();
  return ch.ok() ? std::move(*ch) : nullptr;
}

inline Message recv_one(Channel& ch, std::chrono::milliseconds timeout = 10s) {
  auto r = ch.recv(timeout);
  EXPECT_TRUE(r.ok()) << r.error();
  if (!r.ok() || !r->has_value()) {
    ADD_FAILURE() << "no message within " << timeout.count() << " ms";
    return {};
  }
  return std::move(**r);
}

// Payload seed for message `i` of sender `who`.
inline std::uint64_t seed_of(int who, std::uint64_t i) { return (std::uint64_t(who) << 40) + i; }

class UcxChannelTest : public ::testing::TestWithParam<std::string> {
 protected:
  const std::string& transports() const { return GetParam(); }
};

// ------------------------------------------------------------------ the two data paths

enum class Path { kStaged, kDirect };
inline void PrintTo(Path path, std::ostream* os) { *os << (path == Path::kDirect ? "direct" : "staged"); }

// Whether this process can use the direct path at all: a CUDA build and a GPU. (The UCX's
// CUDA support is asked of a channel: UcxChannel::supports_cuda_memory.)
inline bool have_gpu() {
#ifdef CONVEYOR_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

// A channel's options for `path`: the direct path receives device payloads into GPU 0's
// memory (cudaMalloc), with GPU 0 current on the progress thread, as a GPU worker's channel.
inline UcxChannelOptions path_options(Path path, UcxChannelOptions o = {}) {
#ifdef CONVEYOR_HAVE_CUDA
  if (path == Path::kDirect) {
    o.device_allocator.allocate = [](std::size_t n) -> void* {
      void* p = nullptr;
      return cudaSetDevice(0) == cudaSuccess && cudaMalloc(&p, n) == cudaSuccess ? p : nullptr;
    };
    o.device_allocator.release = [](void* p) { cudaFree(p); };
    o.progress_thread_init = [] { cudaSetDevice(0); };
  }
#else
  (void)path;
#endif
  return o;
}

// A payload buffer on the path's side: host memory (staged) or GPU 0's memory (direct),
// filled and checked through host copies.
class PathBuffer {
 public:
  PathBuffer(Path path, std::size_t bytes) : path_(path), host_(bytes) {
#ifdef CONVEYOR_HAVE_CUDA
    if (path_ == Path::kDirect && bytes) {
      EXPECT_EQ(cudaMalloc(&device_, bytes), cudaSuccess);
    }
#endif
  }
  ~PathBuffer() {
#ifdef CONVEYOR_HAVE_CUDA
    if (device_) cudaFree(device_);
#endif
  }
  PathBuffer(const PathBuffer&) = delete;
  PathBuffer& operator=(const PathBuffer&) = delete;

  void fill(std::size_t n, std::uint64_t seed) {
    fill_pattern(host_.data(), n, seed);
#ifdef CONVEYOR_HAVE_CUDA
    if (device_) {
      EXPECT_EQ(cudaMemcpy(device_, host_.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    }
#endif
  }
  PayloadView view(std::size_t n) const {
    if (path_ == Path::kDirect) return {device_, n, true};
    return {host_.data(), n};
  }

 private:
  Path path_;
  std::vector<unsigned char> host_;
  void* device_ = nullptr;
};

// Where a received payload differs from fill_pattern(seed) (-1: nowhere). A message of the
// direct path must have its payload in device memory (unless empty), the staged path's in
// host memory.
inline long long check_received(Path path, const Message& m, std::uint64_t seed) {
  const std::size_t n = m.payload.size();
  if (path == Path::kStaged || n == 0) {
    EXPECT_FALSE(m.payload_on_device);
    return check_pattern(m.payload.data(), n, seed);
  }
  EXPECT_TRUE(m.payload_on_device) << "a device payload of " << n << " bytes arrived in host memory";
  if (!m.payload_on_device) return check_pattern(m.payload.data(), n, seed);
#ifdef CONVEYOR_HAVE_CUDA
  std::vector<unsigned char> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), m.payload.data(), n, cudaMemcpyDeviceToHost), cudaSuccess);
  return check_pattern(host.data(), n, seed);
#else
  return 0;
#endif
}

class UcxPathTest : public ::testing::TestWithParam<std::tuple<std::string, Path>> {
 protected:
  Path path() const { return std::get<1>(GetParam()); }
  std::string transports() const {
    const std::string& t = std::get<0>(GetParam());
    return path() == Path::kDirect && t == "tcp" ? "tcp,cuda_copy" : t;
  }
  void SetUp() override {
    if (path() == Path::kDirect && !have_gpu()) GTEST_SKIP() << "direct path: no GPU (or a build without CUDA)";
  }
  // Skips the direct path when this UCX cannot move CUDA memory (Debian's 1.13.1).
  // With CONVEYOR_EXPECT_UCX_CUDA=1 (a GPU run that ships the UCX built with CUDA) a UCX
  // without CUDA is a failure, not a skip.
  bool skip_without_cuda_ucx(const UcxChannel& ch) {
    if (path() != Path::kDirect || ch.takes_device_memory()) return false;
    const char* expected = std::getenv("CONVEYOR_EXPECT_UCX_CUDA");
    if (expected && std::string(expected) == "1")
      ADD_FAILURE() << "this UCX cannot move CUDA memory (CONVEYOR_EXPECT_UCX_CUDA=1)";
    return true;
  }
};

// Both fixtures run under each transport choice, UcxPathTest over both paths as well:
// Transports/UcxChannelTest.X/{Default,tcp,shm}, Paths/UcxPathTest.X/{Default,tcp,shm}_{Staged,Direct}.
inline std::string transports_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param.empty() ? std::string("Default") : info.param;
}
inline std::string path_name(const ::testing::TestParamInfo<std::tuple<std::string, Path>>& info) {
  const std::string& t = std::get<0>(info.param);
  return (t.empty() ? std::string("Default") : t) + (std::get<1>(info.param) == Path::kDirect ? "_Direct" : "_Staged");
}

}  // namespace conveyor::transport::ucx_test

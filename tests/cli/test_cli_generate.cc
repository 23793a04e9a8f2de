// `conveyor generate` against a server that stops sending (a stuck cluster, issue 28): the
// stream is bounded by --idle-timeout (nothing received for that long) and by --timeout (the
// whole completion; a server that trickles bytes forever), each failing with a line that
// names the limit, and Ctrl-C ends the command at once. The server is a socket of the test
// that answers like the REST API's stream and then says nothing more, or only keep-alives.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using conveyor::testing::ChildProcess;
using Clock = std::chrono::steady_clock;

// A one-connection server on 127.0.0.1: it answers the request with a stream's header and
// one token, then stays silent, or (`trickle`) sends an SSE comment every 200 ms, until it is
// destroyed.
class StuckServer {
 public:
  explicit StuckServer(bool trickle) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 1) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      return;
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this, trickle] { serve(trickle); });
  }
  ~StuckServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  void send_chunk(int c, const std::string& data) {
    char size[16];
    std::snprintf(size, sizeof size, "%zx\r\n", data.size());
    const std::string chunk = size + data + "\r\n";
    (void)::send(c, chunk.data(), chunk.size(), MSG_NOSIGNAL);
  }
  void serve(bool trickle) {
    const int c = ::accept(fd_, nullptr, nullptr);
    if (c < 0) return;
    char buf[4096];
    (void)::recv(c, buf, sizeof buf, 0);  // the request (small: one read)
    const std::string head =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    (void)::send(c, head.data(), head.size(), MSG_NOSIGNAL);
    send_chunk(c, "data: {\"choices\":[{\"index\":0,\"text\":\" stuck\",\"finish_reason\":null}]}\n\n");
    for (int k = 0; !stop_; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (trickle && k % 10 == 9) send_chunk(c, ": still here\n\n");
    }
    ::close(c);
  }

  int fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct Generated {
  std::optional<int> code;
  double seconds = 0;
  std::string err;
};

// `conveyor generate` against `server` with `flags`; `interrupt_after`: Ctrl-C (SIGINT) then.
Generated generate(const StuckServer& server, const std::vector<std::string>& flags,
             std::optional<std::chrono::milliseconds> interrupt_after = std::nullopt) {
  const fs::path err = fs::temp_directory_path() / ("conveyor-test-generate-" + std::to_string(::getpid()) + ".err");
  std::vector<std::string> argv = {conveyor::testing::bin_dir() + "/conveyor", "generate", "--url",
                                   "http://127.0.0.1:" + std::to_string(server.port())};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back("The jury said");
  Generated r;
  const auto t0 = Clock::now();
  {
    ChildProcess p(argv, err.string());
    if (interrupt_after) {
      std::this_thread::sleep_for(*interrupt_after);
      p.signal(SIGINT);
    }
    r.code = p.wait_exit(std::chrono::seconds(20));
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  r.err = conveyor::testing::read_text_file(err.string());
  fs::remove(err);
  return r;
}

TEST(ConveyorGenerate, AStreamThatGoesSilentEndsAtTheIdleLimitWithItsName) {
  StuckServer server(false);
  ASSERT_GT(server.port(), 0);
  const Generated r = generate(server, {"--idle-timeout", "1"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 4.0);
  EXPECT_NE(r.err.find("nothing received for 1 s (the idle limit)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the cluster may be stuck"), std::string::npos) << r.err;
}

TEST(ConveyorGenerate, AStreamThatNeverEndsEndsAtTheCallsLimit) {
  StuckServer server(true);  // keep-alives every 200 ms: the idle limit never strikes
  ASSERT_GT(server.port(), 0);
  const Generated r = generate(server, {"--idle-timeout", "1", "--timeout", "2"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_GE(r.seconds, 1.9);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.err.find("no whole answer within 2 s (the call's limit)"), std::string::npos) << r.err;
}

TEST(ConveyorGenerate, CtrlCEndsAStuckStreamAtOnce) {
  StuckServer server(false);
  ASSERT_GT(server.port(), 0);
  const auto t0 = Clock::now();
  const Generated r = generate(server, {}, std::chrono::milliseconds(300));  // limits of 60 s and 600 s
  const double after_signal = std::chrono::duration<double>(Clock::now() - t0).count() - 0.3;
  EXPECT_EQ(r.code, 128 + SIGINT) << r.err;
  EXPECT_LT(after_signal, 1.0);
}

}  // namespace

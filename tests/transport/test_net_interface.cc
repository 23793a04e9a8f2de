// Which interface a daemon's data plane uses (transport/net_interface.h): the one holding
// its address, `lo` for a loopback address (what `conveyor local` gives its daemons), every
// one for a wildcard address; UCX_NET_DEVICES and --data-interface win over the address.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "transport/endpoint.h"
#include "transport/net_interface.h"

#include "tests/test_util.h"

namespace conveyor::transport {
namespace {

// An IPv4 address of an interface that is up and not loopback, and that interface's name.
std::optional<std::pair<std::string, std::string>> some_non_loopback_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::pair<std::string, std::string>> out;
  for (const ifaddrs* i = list; i && !out; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP))
      continue;
    char buf[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf)))
      out = std::pair{std::string(buf), std::string(i->ifa_name)};
  }
  ::freeifaddrs(list);
  return out;
}

TEST(NetInterface, LoopbackAddressesUseTheLoopbackInterface) {
  testing::ScopedEnv no_env("UCX_NET_DEVICES", nullptr);
  auto lo = loopback_interface();
  ASSERT_TRUE(lo.ok()) << lo.error();
  EXPECT_EQ(*lo, "lo");  // Linux's name for it
  // 127.0.0.1, the name that resolves to it, and the rest of 127/8 (Debian maps the host's own
  // name to 127.0.1.1, which no interface lists): all of them on `lo`.
  for (const char* host : {"127.0.0.1", "localhost", "127.0.1.1"}) {
    auto iface = data_plane_interface(host);
    ASSERT_TRUE(iface.ok()) << host << ": " << iface.error();
    EXPECT_EQ(*iface, *lo) << host;
  }
  // What `conveyor local` runs with: the coordinator's control.host and the workers' --host.
  auto chosen = choose_data_interface("127.0.0.1");
  ASSERT_TRUE(chosen.ok()) << chosen.error();
  EXPECT_EQ(chosen->net_devices, "lo");
  EXPECT_EQ(chosen->shown, "lo");
  EXPECT_EQ(chosen->source, "address 127.0.0.1");
}

TEST(NetInterface, WildcardAndNoAddressLeaveTheChoiceToUcx) {
  testing::ScopedEnv no_env("UCX_NET_DEVICES", nullptr);
  for (const char* host : {"0.0.0.0", "*", ""}) {
    auto chosen = choose_data_interface(host);
    ASSERT_TRUE(chosen.ok()) << host << ": " << chosen.error();
    EXPECT_EQ(chosen->net_devices, "") << host;
    EXPECT_EQ(chosen->shown, "any") << host;
  }
  EXPECT_EQ(choose_data_interface("0.0.0.0")->source, "wildcard address 0.0.0.0");
  EXPECT_EQ(choose_data_interface("")->source, "no address given");
}

TEST(NetInterface, AnAddressUsesTheInterfaceHoldingIt) {
  testing::ScopedEnv no_env("UCX_NET_DEVICES", nullptr);
  const auto addr = some_non_loopback_address();
  if (!addr) GTEST_SKIP() << "this host has no non-loopback IPv4 interface up";
  auto chosen = choose_data_interface(addr->first);
  ASSERT_TRUE(chosen.ok()) << chosen.error();
  EXPECT_EQ(chosen->net_devices, addr->second);
  EXPECT_EQ(chosen->source, "address " + addr->first);
  // An address no interface holds is an error naming it (TEST-NET-1: never assigned).
  auto foreign = choose_data_interface("192.0.2.254");
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.error().find("'192.0.2.254' (192.0.2.254) is not an address of this host"), std::string::npos)
      << foreign.error();
}

TEST(NetInterface, ExplicitInterfaceWinsOverTheAddress) {
  testing::ScopedEnv no_env("UCX_NET_DEVICES", nullptr);
  auto any = choose_data_interface("127.0.0.1", "any");
  ASSERT_TRUE(any.ok()) << any.error();
  EXPECT_EQ(any->net_devices, "");
  EXPECT_EQ(any->shown, "any");
  EXPECT_EQ(any->source, "--data-interface");
  auto lo = choose_data_interface("0.0.0.0", "lo");
  ASSERT_TRUE(lo.ok()) << lo.error();
  EXPECT_EQ(lo->net_devices, "lo");
  // RDMA devices (device:port) and exclusions are UCX's to judge; plain names must exist.
  auto rdma = choose_data_interface("127.0.0.1", "mlx5_0:1,lo");
  ASSERT_TRUE(rdma.ok()) << rdma.error();
  EXPECT_EQ(rdma->net_devices, "mlx5_0:1,lo");
  auto missing = choose_data_interface("127.0.0.1", "lo,nosuchif0");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().find("no interface 'nosuchif0'"), std::string::npos) << missing.error();
  EXPECT_NE(missing.error().find("lo"), std::string::npos) << "names the interfaces there are: " << missing.error();
  EXPECT_FALSE(choose_data_interface("127.0.0.1", "lo,").ok());
}

TEST(NetInterface, UcxNetDevicesInTheEnvironmentWins) {
  testing::ScopedEnv env("UCX_NET_DEVICES", "eth9");
  for (const char* requested : {"", "lo", "any"}) {
    auto chosen = choose_data_interface("127.0.0.1", requested);
    ASSERT_TRUE(chosen.ok()) << chosen.error();
    EXPECT_EQ(chosen->net_devices, "") << "UcxChannel leaves the environment's value alone";
    EXPECT_EQ(chosen->shown, "eth9");
    EXPECT_EQ(chosen->source, "UCX_NET_DEVICES");
  }
}

// A worker given no --host keeps its data plane on the interface of its route to the
// coordinator: `lo` towards a loopback coordinator (what `conveyor local` runs), the
// interface holding the route's source address otherwise.
TEST(NetInterface, NoAddressFollowsTheRouteToThePeer) {
  testing::ScopedEnv no_env("UCX_NET_DEVICES", nullptr);
  auto local = local_address_toward({.host = "127.0.0.1", .port = 5555});
  ASSERT_TRUE(local.ok()) << local.error();
  EXPECT_EQ(*local, "127.0.0.1");
  for (const char* host : {"", "0.0.0.0"}) {
    auto chosen = choose_data_interface(host, "", HostPort{.host = "localhost", .port = 5555});
    ASSERT_TRUE(chosen.ok()) << chosen.error();
    EXPECT_EQ(chosen->net_devices, "lo") << host;
    EXPECT_EQ(chosen->source, "route to localhost:5555 (address 127.0.0.1)") << host;
  }
  // An address or --data-interface still wins over the route.
  EXPECT_EQ(choose_data_interface("127.0.0.1", "", HostPort{.host = "10.9.9.9", .port = 1})->source, "address 127.0.0.1");
  EXPECT_EQ(choose_data_interface("", "any", HostPort{.host = "127.0.0.1", .port = 1})->shown, "any");
  if (const auto addr = some_non_loopback_address()) {
    auto chosen = choose_data_interface("", "", HostPort{.host = addr->first, .port = 5555});
    ASSERT_TRUE(chosen.ok()) << chosen.error();
    // Towards one of its own addresses the route's source is that address: its interface.
    EXPECT_EQ(chosen->net_devices, addr->second) << chosen->source;
  }
  auto nowhere = choose_data_interface("", "", HostPort{.host = "nosuchhost.invalid", .port = 5555});
  ASSERT_FALSE(nowhere.ok());
  EXPECT_NE(nowhere.error().find("cannot resolve 'nosuchhost.invalid'"), std::string::npos) << nowhere.error();
}

TEST(Endpoint, HostAndPortAreParsedWithClearErrors) {
  auto plain = parse_host_port("10.0.0.1:5555");
  ASSERT_TRUE(plain.ok()) << plain.error();
  EXPECT_EQ(plain->host, "10.0.0.1");
  EXPECT_EQ(plain->port, 5555);
  auto zmq = parse_host_port("tcp://coord.example:6000");
  ASSERT_TRUE(zmq.ok()) << zmq.error();
  EXPECT_EQ(zmq->text(), "coord.example:6000");
  EXPECT_NE(parse_host_port("10.0.0.1").error().find("'10.0.0.1' has no port"), std::string::npos);
  EXPECT_NE(parse_host_port(":5555").error().find("no host"), std::string::npos);
  for (const char* bad : {"h:0", "h:65536", "h:12ab", "h:"})
    EXPECT_NE(parse_host_port(bad).error().find("not a number in 1..65535"), std::string::npos) << bad;
}

TEST(Endpoint, ProbeSaysWhyAPeerCannotBeReached) {
  EXPECT_NE(resolve_host("nosuchhost.invalid").error().find("cannot resolve 'nosuchhost.invalid'"), std::string::npos);
  EXPECT_EQ(*resolve_host("localhost"), "127.0.0.1");
  // A port bound and closed again: nothing listens there.
  const HostPort to{.host = "127.0.0.1", .port = testing::unused_loopback_port()};
  ASSERT_NE(to.port, 0);
  Status refused = probe_tcp(to, std::chrono::milliseconds(1000));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.message(), "connection refused");
  // Listening: the probe opens a connection.
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
  EXPECT_TRUE(probe_tcp({.host = "127.0.0.1", .port = ntohs(a.sin_port)}, std::chrono::milliseconds(1000)).ok());
  ::close(listener);
}

}  // namespace
}  // namespace conveyor::transport

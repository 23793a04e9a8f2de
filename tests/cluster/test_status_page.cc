// The status page (GET /) in a real headless browser against a real CPU cluster with an API
// key: the page is served without the key, asks for it, and with it (#key=...) shows the
// stages and workers /v1/cluster reports. Then a serving worker is killed; a fresh browser
// (fresh storage) loading the page once must show the death among its events, seeded from
// what /v1/cluster says of the past. Screenshots go to the build folder:
// status_page.png (steady, under load) and status_page_failover.png (after the kill).
//
// Needs Debian's `chromium` (scripts/setup.sh); skipped with a message without it.
#include <cstdlib>
#include <map>
#include <set>
#include <tuple>

#include "tests/cluster/cluster_harness.h"

namespace conveyor {
namespace {

using namespace cluster_test;

constexpr const char* kKey = "page-key-42";
constexpr int kChromiumTimeoutSeconds = 60;

std::string find_chromium() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    for (const char* name : {"chromium", "chromium-browser"})
      if (fs::path p = fs::path(dir) / name; ::access(p.c_str(), X_OK) == 0) return p.string();
  return "";
}

// One headless chromium, bounded in time, with a profile of its own (fresh storage).
// `mode` is "--dump-dom" (the DOM after the page's scripts ran goes to `out`) or
// "--screenshot=PATH". True when chromium exited 0.
bool run_chromium(const std::string& chromium, const fs::path& work, const std::string& name, const std::string& mode,
                  const std::string& url, const fs::path& out) {
  const fs::path profile = work / ("chromium-" + name);
  fs::remove_all(profile);
  // --virtual-time-budget: run the page's timers for 6 s of virtual time (network fetches
  // pause it), i.e. three polls: enough for rates, which need two /metrics answers.
  const std::string command = "timeout -k 5 " + std::to_string(kChromiumTimeoutSeconds) + " '" + chromium +
                              "' --headless --no-sandbox --disable-gpu --no-first-run --no-default-browser-check"
                              " --disable-dev-shm-usage --hide-scrollbars --window-size=1280,900"
                              " --virtual-time-budget=6000 --user-data-dir='" + profile.string() + "' " + mode + " '" +
                              url + "' > '" + out.string() + "' 2> '" + (work / (name + ".chromium.log")).string() + "'";
  const int rc = std::system(command.c_str());
  fs::remove_all(profile);
  return rc == 0;
}

// The attributes of every `tag` element of the DOM dump whose class list starts with `cls`.
std::vector<std::map<std::string, std::string>> elements(const std::string& dom, const std::string& tag_name,
                                                         const std::string& cls) {
  std::vector<std::map<std::string, std::string>> out;
  const std::regex tag("<" + tag_name + R"(\s([^>]*)>)");
  static const std::regex attribute(R"re(([a-zA-Z-]+)="([^"]*)")re");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), tag); it != std::sregex_iterator(); ++it) {
    const std::string attrs = (*it)[1];
    std::map<std::string, std::string> m;
    for (auto a = std::sregex_iterator(attrs.begin(), attrs.end(), attribute); a != std::sregex_iterator(); ++a)
      m[(*a)[1]] = (*a)[2];
    const std::string c = m["class"];
    if (c == cls || c.starts_with(cls + " ")) out.push_back(std::move(m));
  }
  return out;
}

using WorkerStates = std::set<std::pair<std::string, std::string>>;         // (name, state)
using Stages = std::set<std::tuple<std::string, std::string, std::string>>;  // (pipeline, stage, worker)

WorkerStates workers_in(const json& info) {
  WorkerStates out;
  for (const auto& w : info.at("workers")) out.insert({w.at("name").get<std::string>(), w.at("state").get<std::string>()});
  return out;
}
Stages stages_in(const json& info) {
  Stages out;
  for (const auto& p : info.at("pipelines"))
    for (const auto& s : p.at("stages"))
      out.insert({std::to_string(p.at("pipeline").get<int>()), std::to_string(s.at("stage").get<int>()),
                  s.at("worker").is_null() ? "" : s.at("worker").get<std::string>()});
  return out;
}
WorkerStates workers_in(const std::string& dom) {
  WorkerStates out;
  for (auto& e : elements(dom, "tr", "worker")) out.insert({e["data-worker"], e["data-state"]});
  return out;
}
Stages stages_in(const std::string& dom) {
  Stages out;
  for (auto& e : elements(dom, "div", "stage")) out.insert({e["data-pipeline"], e["data-stage"], e["data-worker"]});
  return out;
}

std::string describe(const WorkerStates& w) {
  std::string s;
  for (const auto& [name, state] : w) s += name + "=" + state + " ";
  return s;
}
std::string describe(const Stages& stages) {
  std::string s;
  for (const auto& [p, st, w] : stages) s += "p" + p + "/s" + st + "=" + w + " ";
  return s;
}

class StatusPage : public ::testing::Test {
 protected:
  void SetUp() override {
    chromium_ = find_chromium();
    if (chromium_.empty()) GTEST_SKIP() << "chromium is not installed (apt-get install chromium); the status page is not tested";
  }

  Expected<HttpResponse> get(Cluster& cluster, const std::string& target, bool with_key, const std::string& method = "GET") {
    HttpRequest r;
    r.method = method;
    r.target = target;
    r.timeout = std::chrono::seconds(5);
    if (with_key) r.headers = {{"Authorization", std::string("Bearer ") + kKey}};
    return http_call("127.0.0.1", cluster.http_port, r);
  }
  json info(Cluster& cluster) {
    auto r = get(cluster, "/v1/cluster", true);
    return r && r->status == 200 ? json::parse(r->body, nullptr, false) : json();
  }
  // Waits (bounded) until `ok(/v1/cluster)` holds.
  ::testing::AssertionResult wait_for(Cluster& cluster, const std::function<bool(const json&)>& ok) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    json last;
    while (std::chrono::steady_clock::now() < deadline) {
      last = info(cluster);
      if (last.is_object() && ok(last)) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return ::testing::AssertionFailure() << "the cluster did not get there; last /v1/cluster: " << last.dump();
  }
  // Loads the page once in a fresh browser; its DOM after the scripts ran.
  std::string dump(Cluster& cluster, const std::string& name, const std::string& url) {
    const fs::path out = cluster.dir / (name + ".html");
    EXPECT_TRUE(run_chromium(chromium_, cluster.dir, name, "--dump-dom", url, out))
        << "chromium failed: " << Cluster::read(cluster.dir / (name + ".chromium.log")).substr(0, 4000);
    return Cluster::read(out);
  }
  void screenshot(Cluster& cluster, const std::string& name, const std::string& url, const fs::path& png) {
    fs::remove(png);
    EXPECT_TRUE(run_chromium(chromium_, cluster.dir, name, "--screenshot=" + png.string(), url, cluster.dir / (name + ".out")))
        << Cluster::read(cluster.dir / (name + ".chromium.log")).substr(0, 4000);
    EXPECT_TRUE(fs::exists(png) && fs::file_size(png) > 10000) << "no screenshot at " << png;
  }

  std::string chromium_;
};

bool whole(const json& info) {
  for (const auto& p : info.at("pipelines"))
    if (!p.at("ready").get<bool>()) return false;
  for (const auto& w : info.at("workers"))
    if (w.at("state") == "loading") return false;
  return !info.at("pipelines").empty();
}

TEST_F(StatusPage, ShowsTheClusterAndAFailover) {
  Cluster cluster;
  cluster.api_key = kKey;
  ASSERT_TRUE(cluster.start("status-page", 3, 4, "heartbeat: {interval_ms: 200, liveness_ms: 2000}\n"));
  const std::string base = "http://127.0.0.1:" + std::to_string(cluster.http_port) + "/";

  // The page itself needs no key and holds no data; the data does.
  auto page = get(cluster, "/", false);
  ASSERT_TRUE(page.ok()) << page.error();
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->body.find("<title>Conveyor status</title>"), std::string::npos);
  EXPECT_EQ(page->body.find("http://"), page->body.find("http://www.w3.org/2000/svg")) << "the page loads nothing from elsewhere";
  auto data = get(cluster, "/v1/cluster", false);
  ASSERT_TRUE(data.ok()) << data.error();
  EXPECT_EQ(data->status, 401);
  auto post = get(cluster, "/", false, "POST");
  ASSERT_TRUE(post.ok()) << post.error();
  EXPECT_EQ(post->status, 405);

  ASSERT_TRUE(wait_for(cluster, whole));

  // Some load, so the charts have something to show.
  std::atomic<bool> stop{false};
  std::thread load([&] {
    for (int i = 0; !stop; ++i)
      cluster.post("/v1/completions", {{"prompt", kSentences[size_t(i) % std::size(kSentences)]}, {"max_tokens", 24},
                                       {"temperature", 0.8}, {"seed", i}},
                   {}, {{"Authorization", std::string("Bearer ") + kKey}});
  });
  struct Join {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Join() { stop = true; if (t.joinable()) t.join(); }
  } join{stop, load};

  // Without the key the page asks for it and shows nothing.
  const std::string asking = dump(cluster, "no-key", base);
  EXPECT_NE(asking.find("needs-key"), std::string::npos) << asking.substr(0, 2000);
  EXPECT_EQ(asking.find("data-ready"), std::string::npos);
  EXPECT_TRUE(workers_in(asking).empty());

  // With it, the stages and workers of /v1/cluster.
  const std::string url = base + "#key=" + kKey;
  const json before = info(cluster);
  const std::string dom = dump(cluster, "steady", url);
  const json after = info(cluster);
  EXPECT_NE(dom.find("data-ready=\"1\""), std::string::npos) << dom.substr(0, 4000);
  EXPECT_EQ(workers_in(dom), workers_in(after)) << "page: " << describe(workers_in(dom))
                                                << "\n/v1/cluster: " << describe(workers_in(after));
  EXPECT_EQ(stages_in(dom), stages_in(after)) << "page: " << describe(stages_in(dom))
                                              << "\n/v1/cluster: " << describe(stages_in(after));
  EXPECT_EQ(stages_in(before), stages_in(after)) << "the cluster moved while the page loaded";
  EXPECT_EQ(stages_in(dom).size(), 3u);
  EXPECT_EQ(workers_in(dom).size(), 4u);
  screenshot(cluster, "steady-shot", url, fs::path(CONVEYOR_BINARY_DIR) / "status_page.png");

  // Kill the worker serving stage 1; the spare takes its place.
  std::string victim;
  for (const auto& s : after.at("pipelines").at(0).at("stages"))
    if (s.at("stage") == 1) victim = s.at("worker").get<std::string>();
  ASSERT_FALSE(victim.empty());
  ChildProcess* process = nullptr;
  for (size_t i = 0; i < cluster.workers.size(); ++i)
    if ("w" + std::to_string(i) == victim) process = cluster.workers[i].get();
  ASSERT_NE(process, nullptr);
  cluster.faults_expected = true;
  process->signal(SIGKILL);
  ASSERT_TRUE(wait_for(cluster, [&](const json& j) {
    for (const auto& w : j.at("workers"))
      if (w.at("name") == victim && w.at("state") != "dead") return false;
    return whole(j) && j.at("pipelines").at(0).at("epoch").get<int>() > 1;
  }));

  // A fresh browser, one load: the death is among the events, the table and stages current.
  const std::string failed = dump(cluster, "failover", url);
  const json now = info(cluster);
  bool death_shown = false, rewire_shown = false;
  for (auto& e : elements(failed, "li", "event")) {
    death_shown |= e["data-kind"] == "dead" && e["data-worker"] == victim;
    rewire_shown |= e["data-kind"] == "rewired";
  }
  EXPECT_TRUE(death_shown) << "no event for the death of " << victim << ":\n" << failed.substr(failed.find("id=\"events\""), 3000);
  EXPECT_TRUE(rewire_shown);
  EXPECT_TRUE(workers_in(failed).count({victim, "dead"})) << describe(workers_in(failed));
  EXPECT_EQ(workers_in(failed), workers_in(now));
  EXPECT_EQ(stages_in(failed), stages_in(now)) << "page: " << describe(stages_in(failed))
                                               << "\n/v1/cluster: " << describe(stages_in(now));
  // The survivors serve again: none shows an error as if it still stood (issue 29); what
  // they met while the victim was dying is resolved, naming the re-wire after its death.
  for (const auto& w : now.at("workers")) {
    if (w.at("state") != "ready") continue;
    EXPECT_FALSE(w.contains("last_error")) << w.dump();
    if (w.contains("resolved_error")) {
      EXPECT_NE(w.at("resolved_error").get<std::string>().find("re-wired after " + victim), std::string::npos) << w.dump();
    }
  }
  screenshot(cluster, "failover-shot", url, fs::path(CONVEYOR_BINARY_DIR) / "status_page_failover.png");
}

}  // namespace
}  // namespace conveyor

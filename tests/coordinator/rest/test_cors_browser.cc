// CORS as a browser sees it: headless Chromium loads a page from another origin (a second
// HTTP server on another port) whose script POSTs JSON with an Authorization header to the
// REST API, which makes the browser send a preflight first. From an origin in
// http.cors_origins the call succeeds and the script can read X-Request-Id; from one that is
// not (the same page as http://localhost:PORT) the browser blocks it. Needs Debian's
// `chromium` (scripts/setup.sh); skipped with a message without it.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "coordinator/rest/http_server.h"
#include "model/tokenizer.h"
#include "tests/process_util.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using testing::ChildProcess;

constexpr const char* kKey = "cors-key-7";

std::string executable_on_path(const std::vector<std::string>& names) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    for (const std::string& name : names)
      if (fs::path p = fs::path(dir) / name; ::access(p.c_str(), X_OK) == 0) return p.string();
  return "";
}


// The page: one cross-origin call, its outcome written into #out.
std::string page(int api_port) {
  return R"(<!doctype html><html><body><pre id="out">pending</pre><script>
fetch("http://127.0.0.1:)" + std::to_string(api_port) + R"(/tokenize", {
  method: "POST",
  headers: {"Content-Type": "application/json", "Authorization": "Bearer )" + kKey + R"("},
  body: JSON.stringify({prompt: "The jury said"})
}).then(async (r) => {
  const body = await r.json();
  document.getElementById("out").textContent = "status=" + r.status + " count=" + body.count +
      " request-id=" + r.headers.get("X-Request-Id");
}).catch((e) => { document.getElementById("out").textContent = "blocked: " + e.name; });
</script></body></html>)";
}

struct Browser {
  std::string chromium;
  fs::path work;
  // The DOM after the page's script ran (chromium --dump-dom), bounded in time.
  std::string dump(const std::string& name, const std::string& url) {
    const fs::path profile = work / ("profile-" + name);
    ChildProcess c({"/usr/bin/timeout", "-k", "5", "60", chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--no-first-run", "--disable-dev-shm-usage", "--virtual-time-budget=5000",
                    "--user-data-dir=" + profile.string(), "--dump-dom", url},
                   (work / (name + ".log")).string());
    std::string dom, line;
    while (!(line = c.read_line_matching("", std::chrono::seconds(70))).empty() || c.running()) dom += line + "\n";
    fs::remove_all(profile);
    return dom;
  }
};

TEST(CorsBrowser, AnAllowedOriginsPageCallsTheApiAnotherIsBlocked) {
  const std::string chromium = executable_on_path({"chromium", "chromium-browser"});
  if (chromium.empty()) GTEST_SKIP() << "chromium is not installed (apt-get install chromium); CORS is tested over HTTP only";
  const std::string python = executable_on_path({"python3"});
  ASSERT_FALSE(python.empty()) << "python3 serves the page";
  const fs::path work = fs::temp_directory_path() / ("conveyor-test-cors-" + std::to_string(::getpid()));
  fs::remove_all(work);
  fs::create_directories(work / "site");

  // The page's server first: its port is the allowed origin's.
  ChildProcess site({python, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", (work / "site").string()},
                    (work / "site.log").string());
  const std::string serving = site.read_line_matching("Serving HTTP", std::chrono::seconds(20));
  ASSERT_NE(serving, "") << testing::read_text_file(work / "site.log");
  const size_t at = serving.find(" port ");
  const int site_port = std::stoi(serving.substr(at + 6));

  RestContext ctx;
  ctx.model_name = "brown-gpt2";
  ctx.config = load_model_config(testing::source_dir() + "/models/brown-gpt2").value();
  ctx.tokenizer = std::make_shared<const Tokenizer>(Tokenizer::load(testing::source_dir() + "/models/brown-gpt2").value());
  ctx.api_key = kKey;
  ctx.cors_origins = {"http://127.0.0.1:" + std::to_string(site_port)};
  auto server = HttpServer::start("127.0.0.1", 0, std::move(ctx), 1).value();
  std::ofstream(work / "site" / "call.html") << page(server->port());

  Browser browser{chromium, work};
  const std::string allowed = browser.dump("allowed", "http://127.0.0.1:" + std::to_string(site_port) + "/call.html");
  EXPECT_NE(allowed.find("status=200 count=4 request-id=req-"), std::string::npos)
      << allowed << "\nchromium: " << testing::read_text_file(work / "allowed.log").substr(0, 3000);
  const std::string other = browser.dump("other", "http://localhost:" + std::to_string(site_port) + "/call.html");
  EXPECT_NE(other.find("blocked: TypeError"), std::string::npos)
      << other << "\nchromium: " << testing::read_text_file(work / "other.log").substr(0, 3000);
  server->stop();
  site.stop(std::chrono::seconds(5));
  fs::remove_all(work);
}

}  // namespace
}  // namespace conveyor

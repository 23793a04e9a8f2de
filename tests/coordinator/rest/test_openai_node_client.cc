// OpenAI's official Node client (the `openai` npm package, pinned in tools/package.json)
// against `conveyor local` on the demo model with the built-in chatml template: chat, a chat
// stream, completions and a completions stream, compared with each other and with the golden
// rendering of the conversation (openai_node_client.js does the calls and the checks). Real
// processes on loopback, bounded in time, always stopped.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using conveyor::testing::ChildProcess;

std::string source(const std::string& path) { return conveyor::testing::source_dir() + "/" + path; }


std::string find_node() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (fs::path p = fs::path(dir) / "node"; ::access(p.c_str(), X_OK) == 0) return p.string();
  return "";
}

TEST(OpenAINodeClient, ChatStreamsAndCompletionsAgainstConveyorLocal) {
  const std::string node = find_node();
  ASSERT_FALSE(node.empty()) << "node is not on PATH (scripts/setup.sh installs it)";
  ASSERT_TRUE(fs::exists(source("tools/node_modules/openai/package.json")))
      << "the openai npm package is missing: (cd tools && npm install)";
  const fs::path dir = fs::temp_directory_path() / ("conveyor-test-openai-node-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    ChildProcess local({conveyor::testing::bin_dir() + "/conveyor", "local", "--port", "0", "--backend", "cpu",
                        "--log-dir", (dir / "logs").string(), "--model", source("models/brown-gpt2"), "--stages", "2",
                        "--chat-template", "chatml"},
                       (dir / "local.err").string());
    const std::string ready = local.read_line_matching("ready at", std::chrono::seconds(120));
    ASSERT_NE(ready, "") << "conveyor local did not become ready:\n" << conveyor::testing::read_text_file(dir / "local.err");
    const size_t at = ready.find("http://");
    ASSERT_NE(at, std::string::npos) << ready;
    const std::string url = ready.substr(at, ready.find_first_of(" \n", at) - at);

    ChildProcess client({"/usr/bin/timeout", "-k", "5", "120", node, source("tests/coordinator/rest/openai_node_client.js"), url,
                         "brown-gpt2", source("tests/data/chat_templates/golden/chatml.system_user.gen.txt")},
                        (dir / "node.err").string());
    std::string lines, line;
    while (!(line = client.read_line_matching("", std::chrono::seconds(130))).empty()) lines += line + "\n";
    const std::optional<int> code = client.wait_exit(std::chrono::seconds(10));
    EXPECT_EQ(code, 0) << lines << conveyor::testing::read_text_file(dir / "node.err");
    for (const char* check : {"renders as the golden chatml prompt", "chat answers", "give the same text",
                              "chat stream gives the same text", "completions stream gives the same text",
                              "logprobs.content spells the answer", "client's request id"})
      EXPECT_NE(lines.find(check), std::string::npos) << "missing check '" << check << "':\n" << lines;
    std::cout << lines;
    local.stop(std::chrono::seconds(15));
  }
  fs::remove_all(dir);
}

}  // namespace

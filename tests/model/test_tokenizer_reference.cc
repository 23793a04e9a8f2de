// The C++ GPT-2 tokenizer against the reference JavaScript encoder (gpt-3-encoder, run with
// node by tests/tokenizer/reference_encode.js) on tests/data/tokenizer_corpus.txt, token for
// token, line by line and in multi-line blocks; decode(encode(x)) on the corpus, throughput,
// concurrent use, and the committed Unicode tables against node's.
//
// node and tools/node_modules are required: without them the comparison tests FAIL and say
// to run scripts/setup.sh (a silently skipped conformance test is worse than a red one).
#include "model/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/model/tokenizer_test_util.h"

namespace conveyor {
namespace {

using namespace tokenizer_test;

// The corpus reference, computed once for all tests that need it.
const Reference* corpus_reference() {
  static const std::optional<Reference> ref = run_reference(kCorpus);
  if (!ref) ADD_FAILURE() << "no reference encodings for " << kCorpus;
  return ref ? &*ref : nullptr;
}

// ---- the corpus against the JavaScript reference ---------------------------------------------

TEST(Tokenizer, CorpusMatchesJavaScriptLineByLine) {
  const Tokenizer* tok = gpt2();
  const Reference* ref = corpus_reference();
  ASSERT_TRUE(tok && ref);
  const std::vector<std::string> lines = split_lines(read_text(kCorpus));
  ASSERT_GE(lines.size(), 10000u);
  for (const Ids& ids : ref->lines) {
    ASSERT_TRUE(std::find(ids.begin(), ids.end(), -1) == ids.end()) << "JS produced null ids";
  }
  expect_same_encodings(*tok, lines, ref->lines, "corpus line");
  std::cout << "[ compared ] " << lines.size() << " corpus lines token for token\n";
}

TEST(Tokenizer, MultiLineBlocksMatchJavaScript) {
  const Tokenizer* tok = gpt2();
  const Reference* ref = corpus_reference();
  ASSERT_TRUE(tok && ref);
  std::vector<std::string> texts;
  std::vector<Ids> ids;
  bool crlf = false;
  for (const auto& [text, expected] : ref->blocks) {
    texts.push_back(text);
    ids.push_back(expected);
    crlf = crlf || text.find("\r\n") != std::string::npos;
  }
  EXPECT_GE(texts.size(), 20u);
  EXPECT_TRUE(crlf);
  expect_same_encodings(*tok, texts, ids, "block");
}

TEST(Tokenizer, DecodeInvertsEncodeOnCorpus) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  const std::string text = read_text(kCorpus);
  int failures = 0;
  for (const std::string& line : split_lines(text)) {
    if (tok->decode(tok->encode(line)) != line && ++failures <= 5) {
      ADD_FAILURE() << "decode(encode(x)) != x for \"" << escaped(line) << "\"";
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(tok->decode(tok->encode(text)), text);  // the whole file at once
}

TEST(Tokenizer, EncodeThroughput) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  const std::vector<std::string> lines = split_lines(read_text(kCorpus));
  size_t bytes = 0;
  for (const auto& l : lines) bytes += l.size();
  auto fresh = Tokenizer::load(kGpt2Dir);  // empty cache
  ASSERT_TRUE(fresh.ok()) << fresh.error();
  auto time_pass = [&](const Tokenizer& t) {
    const auto start = std::chrono::steady_clock::now();
    size_t tokens = 0;
    for (const auto& l : lines) tokens += t.encode(l).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::pair<double, size_t>{bytes / s / 1e6, tokens};
  };
  const auto [cold, tokens] = time_pass(*fresh);
  const auto [warm, tokens2] = time_pass(*fresh);
  EXPECT_EQ(tokens, tokens2);
  std::cout << "[ speed    ] encode " << bytes / 1e6 << " MB (" << tokens << " tokens): cold cache "
            << cold << " MB/s, warm cache " << warm << " MB/s\n";
  EXPECT_GT(warm, 1.0);  // far below what it does; catches only pathological slowdowns
}

TEST(Tokenizer, ConcurrentEncodeAgreesWithSerial) {
  const std::vector<std::string> lines = split_lines(read_text(kCorpus));
  auto tok = Tokenizer::load(kGpt2Dir);
  ASSERT_TRUE(tok.ok()) << tok.error();
  std::vector<Ids> serial;
  {
    auto other = Tokenizer::load(kGpt2Dir);
    ASSERT_TRUE(other.ok());
    for (const auto& l : lines) serial.push_back(other->encode(l));
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < lines.size() + t; ++i) {  // each thread its own order
        const size_t k = (i * 7 + t * 1013) % lines.size();
        if (tok->encode(lines[k]) != serial[k]) ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// The committed tables are what this node's regex engine says, when it is the same Unicode.
TEST(Tokenizer, UnicodeTablesMatchNode) {
  const std::string node = find_node();
  ASSERT_FALSE(node.empty()) << "node is not on PATH; " << kSetupHint;
  const RunResult run = run_program({node, kRepo + "/scripts/gen_unicode_tables.js", "--stdout"},
                                    std::chrono::seconds(60));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto body = [](const std::string& s) { return s.substr(s.find("constexpr")); };
  const std::string committed = read_text(kRepo + "/model/unicode_tables.inc");
  const std::string node_version = body(run.out).substr(0, body(run.out).find('\n'));
  const std::string table_version = body(committed).substr(0, body(committed).find('\n'));
  if (node_version != table_version) {
    std::cout << "[ note     ] this node's Unicode differs from the committed tables ("
              << node_version << " vs " << table_version << "); not compared\n";
    return;
  }
  EXPECT_EQ(body(run.out), body(committed))
      << "model/unicode_tables.inc is stale: run node scripts/gen_unicode_tables.js";
}

}  // namespace
}  // namespace conveyor

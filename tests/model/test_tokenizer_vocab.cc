// The C++ tokenizer on hand-made vocabularies: the JavaScript encoder's merge quirks (merges
// file lines dropped, later ranks overwriting earlier ones, comma keys, the rightmost tie),
// merges and bytes outside the vocabulary, compared with the JS where it has an answer; and
// loading: the file names looked for and the errors for bad files.
#include "model/tokenizer.h"

#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/model/tokenizer_test_util.h"

namespace conveyor {
namespace {

using namespace tokenizer_test;

// ---- hand-made vocabularies -----------------------------------------------------------------

// Token text of a byte in the byte-level alphabet.
std::string byte_token(int b) {
  int next = 256, cp = -1;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
    const int code = printable ? x : next++;
    if (x == b) cp = code;
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// vocab.json text: the 256 byte tokens (ids 0..255) then `extra` in order.
std::string vocab_json(const std::vector<std::string>& extra) {
  nlohmann::json v = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) v[byte_token(b)] = b;
  int id = 256;
  for (const auto& t : extra) {
    if (!v.contains(t)) v[t] = id++;
  }
  return v.dump();
}

// Every string a merge can make in the JS (each split of a key "first,second" at one of its
// commas, concatenated), so that a vocabulary holding them never makes the JS answer null.
std::vector<std::string> merge_results(const std::string& merges_text) {
  std::vector<std::string> out;
  std::vector<std::string> lines = split_lines(merges_text);
  for (size_t i = 1; i < lines.size(); ++i) {
    std::istringstream parts(lines[i]);
    std::string a, b;
    if (!(parts >> a >> b)) continue;
    const std::string key = a + "," + b;
    for (size_t c = key.find(','); c != std::string::npos; c = key.find(',', c + 1)) {
      if (c > 0 && c + 1 < key.size()) out.push_back(key.substr(0, c) + key.substr(c + 1));
    }
  }
  return out;
}

// A vocabulary in a temp dir, loaded.
struct Hand {
  TempDir dir;
  std::string vocab, merges;
  Expected<Tokenizer> tok = Status::error("not loaded");
  Hand(const std::string& vocab_text, const std::string& merges_text)
      : vocab(dir.file("vocab.json")), merges(dir.file("merges.txt")) {
    write_text(vocab, vocab_text);
    write_text(merges, merges_text);
    tok = Tokenizer::load(dir.path);
  }
  int32_t id(const std::string& token) const { return tok->token_id(token).value_or(-2); }
  // The reference encoder, given these files, encodes `words` (one a line) as `tok` does.
  void expect_reference_agrees(const std::vector<std::string>& words, const std::string& what) const {
    TempDir corpus_dir;
    std::string corpus;
    for (const auto& w : words) corpus += w + "\n";
    write_text(corpus_dir.file("corpus.txt"), corpus);
    auto ref = run_reference(corpus_dir.file("corpus.txt"), vocab, merges);
    ASSERT_TRUE(ref);
    expect_same_encodings(*tok, words, ref->lines, what);
  }
};

TEST(Tokenizer, MergesFileFirstAndLastLinesAreDroppedAsInJs) {
  const std::string vocab = vocab_json({"ab", "abc"});
  {
    Hand with_newline(vocab, "#version: 0.2\na b\nab c\n");
    ASSERT_TRUE(with_newline.tok.ok()) << with_newline.tok.error();
    EXPECT_EQ(with_newline.tok->encode("abc"), (Ids{with_newline.id("abc")}));
  }
  {
    Hand without_newline(vocab, "#version: 0.2\na b\nab c");  // JS drops "ab c"
    ASSERT_TRUE(without_newline.tok.ok());
    EXPECT_EQ(without_newline.tok->encode("abc"), (Ids{without_newline.id("ab"), 'c'}));
  }
  {
    Hand no_header(vocab, "a b\nab c\n");  // the first line is dropped whatever it holds
    ASSERT_TRUE(no_header.tok.ok());
    EXPECT_EQ(no_header.tok->encode("abc"), (Ids{'a', 'b', 'c'}));
  }
  {
    Hand crlf(vocab, "#version: 0.2\r\na b\r\n\r\nab c\r\n");  // \r is whitespace; blank skipped
    ASSERT_TRUE(crlf.tok.ok()) << crlf.tok.error();
    EXPECT_EQ(crlf.tok->encode("abc"), (Ids{crlf.id("abc")}));
  }
}

TEST(Tokenizer, LaterMergeWithTheSameKeyOverwritesTheRank) {
  // "b c" first gives (b,c) rank 0; repeating it after "a b" moves it to rank 2.
  Hand hand(vocab_json({"bc", "ab", "abc"}), "#version: 0.2\nb c\na b\nb c\nab c\n");
  ASSERT_TRUE(hand.tok.ok()) << hand.tok.error();
  EXPECT_EQ(hand.tok->encode("abc"), (Ids{hand.id("abc")}));  // a b first, then ab c
}

TEST(Tokenizer, CommaKeysMatchOtherSplitsAndTheRightmostTieWins) {
  // JS looks a pair up by first + "," + second, so the pair ("!,?", ".") finds the rank of
  // the merge "! ?,." (same key "!,?,.") and makes "!,?." -- not the "!?,." of that line.
  // In "!?,.!,?." both ("!", "?,.") and ("!,?", ".") hold that rank at once; JS merges the
  // rightmost, after which ("?,.", "!,?.") (rank 4) wins and the left pair never merges.
  const std::string merges =
      "#version: 0.2\n? ,\n?, .\n! ,\n!, ?\n?,. !,?.\n! ?,.\n";
  Hand hand(vocab_json(merge_results(merges)), merges);
  ASSERT_TRUE(hand.tok.ok()) << hand.tok.error();
  EXPECT_EQ(hand.tok->encode("!,?."), (Ids{hand.id("!,?.")}));
  EXPECT_EQ(hand.tok->encode("!?,."), (Ids{hand.id("!?,.")}));
  EXPECT_EQ(hand.tok->encode("!?,.!,?."), (Ids{'!', hand.id("?,.!,?.")}));  // leftmost: "!?,." "!,?."

  // The same against the JS itself, in short words and in long ones (the heap-based BPE).
  std::vector<std::string> words = {"!,?.", "!?,.", "!?,.!,?.", "!,?.!?,.,,", "?,.!,?.!?,."};
  std::string long_word;
  for (int i = 0; i < 12; ++i) long_word += i % 3 ? "!?,.!,?." : "!,?.?";
  words.push_back(long_word);
  std::string repeated;
  for (int i = 0; i < 8; ++i) repeated += "!?,.!,?.";
  words.push_back(repeated);
  hand.expect_reference_agrees(words, "word");
}

TEST(Tokenizer, MergeOutsideTheVocabularyIsAcceptedAndFallsBackToBytes) {
  // JS accepts it too (and would output null for "ab"); we emit the bytes' tokens.
  Hand hand(vocab_json({}), "#version: 0.2\na b\nzz top\n");
  ASSERT_TRUE(hand.tok.ok()) << hand.tok.error();
  EXPECT_EQ(hand.tok->encode("ab"), (Ids{'a', 'b'}));
  EXPECT_EQ(hand.tok->decode(hand.tok->encode("xaby")), "xaby");
}

TEST(Tokenizer, VocabularyWithoutSomeBytesDropsThem) {
  nlohmann::json v = {{"a", 0}, {"b", 1}, {"ab", 2}};
  Hand hand(v.dump(), "#version: 0.2\na b\n");
  ASSERT_TRUE(hand.tok.ok()) << hand.tok.error();
  EXPECT_EQ(hand.tok->encode("abcab"), (Ids{2, 2}));
  EXPECT_EQ(hand.tok->vocab_size(), 3);
}

// Random merges over punctuation (commas included), compared with the JS on random words:
// exercises the comma-key quirk, the rightmost-wins tie rule and both BPE algorithms.
TEST(Tokenizer, RandomCommaHeavyVocabulariesMatchJavaScript) {
  std::mt19937 rng(42);
  const std::string alphabet = ",!?.'";  // all "other": each word is one pre-token piece
  auto random_string = [&](size_t max_len) {
    std::string s(1 + rng() % max_len, ' ');
    for (char& c : s) c = alphabet[rng() % alphabet.size()];
    return s;
  };
  for (int round = 0; round < 4; ++round) {
    // Merges build on earlier results so that long symbols (and many commas) appear.
    std::vector<std::string> symbols;
    for (char c : alphabet) symbols.emplace_back(1, c);
    std::string merges = "#version: 0.2\n";
    for (int m = 0; m < 120; ++m) {
      const std::string a = symbols[rng() % symbols.size()];
      const std::string b = symbols[rng() % symbols.size()];
      merges += a + " " + b + (round == 1 ? "\r\n" : "\n");
      if (a.size() + b.size() <= 6) symbols.push_back(a + b);
      if (m % 40 == 39) merges += "\n";  // blank lines are ignored (JS: key "")
    }
    if (round == 2) merges.pop_back();  // no final newline: JS drops the last merge
    Hand hand(vocab_json(merge_results(merges)), merges);
    ASSERT_TRUE(hand.tok.ok()) << hand.tok.error();
    std::vector<std::string> words;
    for (int w = 0; w < 300; ++w) words.push_back(random_string(w % 3 == 0 ? 150 : 20));
    hand.expect_reference_agrees(words, "round " + std::to_string(round) + " word");
  }
}

// ---- loading errors ----------------------------------------------------------------------------

TEST(Tokenizer, LoadPrefersHfFilesAndFallsBackToGpt2Names) {
  TempDir dir;
  write_text(dir.file("encoder.json"), vocab_json({"ab"}));
  write_text(dir.file("vocab.bpe"), "#version: 0.2\na b\n");
  auto gpt2_names = Tokenizer::load(dir.path);
  ASSERT_TRUE(gpt2_names.ok()) << gpt2_names.error();
  EXPECT_EQ(gpt2_names->encode("ab"), (Ids{256}));
  write_text(dir.file("vocab.json"), vocab_json({"xy"}));
  write_text(dir.file("merges.txt"), "#version: 0.2\nx y\n");
  auto hf_names = Tokenizer::load(dir.path);
  ASSERT_TRUE(hf_names.ok()) << hf_names.error();
  EXPECT_EQ(hf_names->encode("ab"), (Ids{'a', 'b'}));
  EXPECT_EQ(hf_names->encode("xy"), (Ids{256}));
}

TEST(Tokenizer, LoadErrorsNameTheFileAndTheProblem) {
  TempDir dir;
  auto none = Tokenizer::load(dir.path);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().find(dir.path), std::string::npos) << none.error();
  EXPECT_NE(none.error().find("vocab.json"), std::string::npos) << none.error();

  auto missing_dir = Tokenizer::load(dir.file("nope"));
  ASSERT_FALSE(missing_dir.ok());
  EXPECT_NE(missing_dir.error().find(dir.file("nope")), std::string::npos) << missing_dir.error();

  write_text(dir.file("vocab.json"), vocab_json({}));
  auto no_merges = Tokenizer::load(dir.path);
  ASSERT_FALSE(no_merges.ok());
  EXPECT_NE(no_merges.error().find(dir.file("merges.txt")), std::string::npos) << no_merges.error();

  auto expect_error = [&](const std::string& vocab, const std::string& merges,
                          const std::string& file, const std::string& words) {
    write_text(dir.file("vocab.json"), vocab);
    write_text(dir.file("merges.txt"), merges);
    auto t = Tokenizer::load(dir.path);
    ASSERT_FALSE(t.ok()) << "loaded: " << vocab.substr(0, 40) << " / " << merges;
    EXPECT_NE(t.error().find(dir.file(file)), std::string::npos) << t.error();
    EXPECT_NE(t.error().find(words), std::string::npos) << t.error();
  };
  const std::string good_merges = "#version: 0.2\na b\n";
  expect_error("{\"a\": 0, ", good_merges, "vocab.json", "not valid JSON");
  expect_error("[1, 2]", good_merges, "vocab.json", "JSON object");
  expect_error("{}", good_merges, "vocab.json", "empty");
  expect_error("{\"a\": \"x\"}", good_merges, "vocab.json", "\"a\"");
  expect_error("{\"a\": -1}", good_merges, "vocab.json", "\"a\"");
  expect_error("{\"a\": 1.5}", good_merges, "vocab.json", "\"a\"");
  expect_error("{\"a\": 4000000000}", good_merges, "vocab.json", "\"a\"");
  expect_error("{\"a\": 0, \"b\": 0}", good_merges, "vocab.json", "id 0");
  expect_error(vocab_json({}), "#version: 0.2\na b\nlonely\n", "merges.txt", "line 3");
  expect_error(vocab_json({}), "#version: 0.2\na b c\n", "merges.txt", "line 2");
  // Directories are not files.
  fs::remove(dir.file("merges.txt"));
  fs::create_directory(dir.file("merges.txt"));
  write_text(dir.file("vocab.json"), vocab_json({}));
  auto is_dir = Tokenizer::load(dir.path);
  ASSERT_FALSE(is_dir.ok());
  EXPECT_NE(is_dir.error().find("merges.txt"), std::string::npos) << is_dir.error();
}

}  // namespace
}  // namespace conveyor

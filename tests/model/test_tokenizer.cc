// The C++ GPT-2 tokenizer on the GPT-2 vocabulary: known encodings, every byte, the
// pre-tokenizer against the JS regex, invalid UTF-8, decoding, empty and copied tokenizers.
// The comparison with the reference JavaScript encoder is test_tokenizer_reference.cc; the
// hand-made vocabularies (merge quirks, loading errors) are test_tokenizer_vocab.cc.
#include "model/tokenizer.h"

#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/model/tokenizer_test_util.h"

namespace conveyor {
namespace {

using namespace tokenizer_test;

TEST(Tokenizer, KnownGpt2Encodings) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eos_id(), 50256);
  EXPECT_EQ(tok->token_id("<|endoftext|>"), 50256);
  EXPECT_EQ(tok->token_id("Ġworld"), 995);
  EXPECT_EQ(tok->token_id("no such token"), std::nullopt);
  EXPECT_EQ(tok->encode("Hello world"), (Ids{15496, 995}));
  EXPECT_EQ(tok->encode(" Hello"), (Ids{18435}));
  EXPECT_EQ(tok->encode(" 's"), (Ids{705, 82}));  // " '" then "s": no contraction after a space
  // Plain text, as in the JS: not the end-of-text token.
  EXPECT_EQ(tok->encode("<|endoftext|>"), (Ids{27, 91, 437, 1659, 5239, 91, 29}));
  EXPECT_EQ(tok->encode("héllo wörld 你好 😀"),
            (Ids{71, 2634, 18798, 266, 30570, 335, 220, 19526, 254, 25001, 121, 30325, 222}));
  EXPECT_EQ(tok->decode(Ids{15496, 995}), "Hello world");
  EXPECT_EQ(tok->token_bytes(995), " world");
  EXPECT_EQ(tok->token_bytes(50256), "<|endoftext|>");
}

TEST(Tokenizer, EmptyString) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  EXPECT_TRUE(tok->encode("").empty());
  EXPECT_EQ(tok->decode(Ids{}), "");
  EXPECT_TRUE(Tokenizer::pre_tokenize("").empty());
}

TEST(Tokenizer, EverySingleByteIsOneToken) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  std::set<int32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const std::string s(1, static_cast<char>(b));
    const Ids ids = tok->encode(s);
    ASSERT_EQ(ids.size(), 1u) << "byte " << b;
    EXPECT_EQ(tok->decode(ids), s) << "byte " << b;
    EXPECT_EQ(tok->token_bytes(ids[0]), s);
    seen.insert(ids[0]);
  }
  EXPECT_EQ(seen.size(), 256u);
}

std::vector<std::string> pieces(std::string_view s) {
  std::vector<std::string> out;
  for (auto p : Tokenizer::pre_tokenize(s)) out.emplace_back(p);
  return out;
}
using Pieces = std::vector<std::string>;

TEST(Tokenizer, PreTokenizerFollowsTheJsRegex) {
  // Each expectation is what String.prototype.matchAll with the GPT-2 pattern gives in node.
  EXPECT_EQ(pieces(" 's"), (Pieces{" '", "s"}));
  EXPECT_EQ(pieces("don't"), (Pieces{"don", "'t"}));
  EXPECT_EQ(pieces("y'all'd've"), (Pieces{"y", "'", "all", "'d", "'ve"}));
  EXPECT_EQ(pieces("I'M 'S"), (Pieces{"I", "'", "M", " '", "S"}));
  EXPECT_EQ(pieces("we're they'll I'm"), (Pieces{"we", "'re", " they", "'ll", " I", "'m"}));
  EXPECT_EQ(pieces("  word"), (Pieces{" ", " word"}));
  EXPECT_EQ(pieces("Hello  world  "), (Pieces{"Hello", " ", " world", "  "}));
  EXPECT_EQ(pieces("\u00a0x"), (Pieces{"\u00a0", "x"}));
  EXPECT_EQ(pieces("x \u00a0y"), (Pieces{"x", " ", "\u00a0", "y"}));
  EXPECT_EQ(pieces("a\t\tb"), (Pieces{"a", "\t", "\t", "b"}));
  EXPECT_EQ(pieces("a \n b"), (Pieces{"a", " \n", " b"}));
  EXPECT_EQ(pieces(" \n"), (Pieces{" \n"}));
  EXPECT_EQ(pieces("1,000 ١٢٣ abc123"), (Pieces{"1", ",", "000", " ١٢٣", " abc", "123"}));
  EXPECT_EQ(pieces("\u0085x"), (Pieces{"\u0085", "x"}));  // U+0085 is not \s in JS
  EXPECT_EQ(pieces("<|endoftext|>"), (Pieces{"<|", "endoftext", "|>"}));
  EXPECT_EQ(pieces("\u3000\u3000x"), (Pieces{"\u3000", "\u3000", "x"}));
  EXPECT_EQ(pieces("e\u0301t\u00e9"), (Pieces{"e", "\u0301", "t\u00e9"}));  // marks are "other"
}

TEST(Tokenizer, InvalidUtf8KeepsItsBytes) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  // An invalid byte is one "other" code point: it joins a run of punctuation, splits letters.
  EXPECT_EQ(pieces("ab\xff" "cd"), (Pieces{"ab", "\xff", "cd"}));
  EXPECT_EQ(pieces("\xff\xfe!"), (Pieces{"\xff\xfe!"}));
  EXPECT_EQ(pieces(" \xc3"), (Pieces{" \xc3"}));
  EXPECT_EQ(pieces("\xc3\xa9\xc3"), (Pieces{"\xc3\xa9", "\xc3"}));  // é then a truncated é
  const std::vector<std::string> bad = {
      "\xff", "a\xc3", "\xc3(", "\xed\xa0\x80", "\xc0\xaf", "\xe0\x80\xaf", "\xf4\x90\x80\x80",
      "\xf8\x88\x80\x80\x80", "\x80\x80", "abc\xe2\x82", "\xf0\x9f\x98", std::string("\0x\0", 3)};
  for (const auto& s : bad) {
    EXPECT_EQ(tok->decode(tok->encode(s)), s) << escaped(s);
    std::string joined;
    for (auto p : Tokenizer::pre_tokenize(s)) joined += p;
    EXPECT_EQ(joined, s);
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 300; ++i) {
    std::string s(rng() % 200, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    ASSERT_EQ(tok->decode(tok->encode(s)), s);
  }
}

TEST(Tokenizer, DecodeSkipsUnknownIdsAndDecodeCheckedReportsThem) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->decode(Ids{15496, -1, 50257, 1 << 30, 995}), "Hello world");
  EXPECT_EQ(tok->token_bytes(-1), "");
  EXPECT_EQ(tok->token_bytes(50257), "");
  auto ok = tok->decode_checked(Ids{15496, 995});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, "Hello world");
  auto bad = tok->decode_checked(Ids{15496, 50257});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find("50257"), std::string::npos) << bad.error();
  EXPECT_NE(bad.error().find("position 1"), std::string::npos) << bad.error();
  // A character split across tokens decodes to its bytes, split the same way.
  const Ids ids = tok->encode("你");
  ASSERT_GT(ids.size(), 1u);
  EXPECT_EQ(tok->decode(std::span<const int32_t>(ids).first(1)), "\xe4\xbd");
}

TEST(Tokenizer, DefaultConstructedIsEmptyAndAssignable) {
  Tokenizer empty;
  EXPECT_TRUE(empty.encode("Hello world").empty());
  EXPECT_EQ(empty.decode(Ids{1, 2}), "");
  EXPECT_EQ(empty.vocab_size(), 0);
  EXPECT_EQ(empty.eos_id(), std::nullopt);
  auto loaded = Tokenizer::load(kGpt2Dir);
  ASSERT_TRUE(loaded.ok()) << loaded.error();
  empty = std::move(loaded).value();
  EXPECT_EQ(empty.encode("Hello world"), (Ids{15496, 995}));
}

TEST(Tokenizer, CopiesShareTablesAndWork) {
  const Tokenizer* tok = gpt2();
  ASSERT_TRUE(tok);
  Tokenizer copy = *tok;
  EXPECT_EQ(copy.encode("Hello world"), (Ids{15496, 995}));
}

}  // namespace
}  // namespace conveyor

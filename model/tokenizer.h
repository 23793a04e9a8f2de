// GPT-2 byte-level BPE: text <-> token ids, agreeing token for token with the reference
// JavaScript encoder (gpt-3-encoder 1.1.4, Encoder.js), for any vocabulary in the GPT-2
// format: HF `vocab.json` + `merges.txt`, or OpenAI's `encoder.json` + `vocab.bpe`.
//
// encode(text):
//   1. Pre-tokenize with the GPT-2 regex, with JavaScript semantics:
//        /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu
//      \s, \p{L}, \p{N} come from model/unicode_tables.inc, generated from Node by
//      scripts/gen_unicode_tables.js; the matcher is hand-written (tokenizer.cc).
//   2. Map each piece's UTF-8 bytes to the byte-level alphabet (bytes_to_unicode).
//   3. Apply merges as Encoder.js's bpe() does, quirks included: a pair's rank is looked up
//      by the string first + "," + second (so pairs whose texts contain commas can hit
//      another merge's rank), the lowest rank wins, among equal ranks the rightmost pair
//      wins, and every occurrence of the chosen pair is merged left to right.
//   4. Emit each final symbol's id from the vocabulary.
//
// Merges file: split on '\n'; like the JS (and OpenAI's Python), the first line and the
// LAST piece are dropped (lines.slice(1, -1)). A file ending in '\n' loses nothing; one
// without a final newline loses its last merge, exactly as the reference does. Blank lines
// are ignored; a line that does not hold exactly two whitespace-separated parts is an
// error. A merge whose parts or result are not in the vocabulary is accepted (as in JS).
//
// Where the reference has no answer, Conveyor chooses (documented, tested):
//   - Invalid UTF-8 input: each byte that does not start a valid sequence is one code point
//     of class "other" (as U+FFFD would be) but keeps its original byte, so
//     decode(encode(x)) == x for ANY byte string. (The JS cannot see invalid UTF-8.)
//   - A final BPE symbol that is not in the vocabulary (JS: null) is emitted as the ids of
//     its single-byte symbols; a byte with no token in the vocabulary is dropped.
//   - "<|endoftext|>" in the text is NOT special: it is encoded as plain text, as the JS
//     does. Callers that want the end-of-text token use eos_id().
//
// Thread safety: a loaded Tokenizer is immutable except for its word cache, which is
// sharded and mutex-guarded, so encode/decode may be called from any number of threads
// at once. Copies are cheap and share the tables and the cache.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor {

class Tokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";

  // An empty tokenizer (no vocabulary): encode gives no ids, decode "", vocab_size 0.
  // For declaring one before load()ing into it.
  Tokenizer();

  // Loads `model_dir`/vocab.json + merges.txt, else `model_dir`/encoder.json + vocab.bpe.
  // Errors name the directory or file and what is wrong.
  static Expected<Tokenizer> load(const std::string& model_dir);
  // vocab_json: a JSON object {token text: id}; merges_txt: "#version..." line, then one
  // "first second" merge per line, highest priority first.
  static Expected<Tokenizer> load_files(const std::string& vocab_json,
                                        const std::string& merges_txt);

  std::vector<int32_t> encode(std::string_view utf8) const;

  // The bytes the ids stand for, concatenated. The result may end inside a multi-byte
  // UTF-8 character (a character can span tokens); it is raw bytes, not repaired. An id
  // with no token (negative, >= vocab_size(), or a gap in the vocabulary) is SKIPPED:
  // serving must not throw on a bad id. Use decode_checked to be told instead.
  std::string decode(std::span<const int32_t> ids) const;
  // As decode, but an id with no token is an error naming the id and its position.
  Expected<std::string> decode_checked(std::span<const int32_t> ids) const;

  // The bytes one token stands for; "" for an id with no token.
  std::string token_bytes(int32_t id) const;
  // 1 + the largest id in the vocabulary (the embedding matrix needs this many rows).
  int32_t vocab_size() const;
  // The id of a token by its text as written in the vocabulary (byte-level alphabet, e.g.
  // "Ġworld" for " world", or "<|endoftext|>").
  std::optional<int32_t> token_id(std::string_view token_text) const;
  std::optional<int32_t> eos_id() const { return token_id(kEndOfText); }

  // The pre-tokenizer alone: the regex matches of `utf8`, in order (views into it; their
  // concatenation is `utf8`). For tests and diagnostics.
  static std::vector<std::string_view> pre_tokenize(std::string_view utf8);
  // The Unicode version the code point tables were generated from (Node's).
  static std::string_view unicode_version();

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace conveyor

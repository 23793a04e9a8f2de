// Private to the tokenizer (model/tokenizer*.cc): the GPT-2 pre-tokenizer and the UTF-8 and
// code point class helpers under it. The public entry point is Tokenizer::pre_tokenize.
//
// The pre-tokenizer cuts text into the matches of the GPT-2 regex with JavaScript semantics
// (see tokenizer.h); \s, \p{L}, \p{N} come from model/unicode_tables.inc. Invalid UTF-8 is
// never an error: a byte that does not start a valid sequence is one code point of class
// "other" (as U+FFFD would be), one byte long, so the pieces always tile the input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace conveyor::tokenizer_detail {

// What the JS regex's \s, \p{L}, \p{N} say about a code point; kOther is none of them.
enum CodePointClass : uint8_t { kOther = 0, kSpace = 1, kLetter = 2, kNumber = 3 };

// One code point of a UTF-8 string.
struct CodePoint {
  uint32_t length;  // bytes, >= 1
  CodePointClass cls;
};

// The code point value at s[i] (i < s.size()) and its length in *length; -1 (and length 1)
// when the bytes there are not valid UTF-8. Strict: no overlongs, no surrogates, nothing
// above U+10FFFF.
int32_t decode_utf8(std::string_view s, size_t i, uint32_t* length);

// The code point at s[i] (i < s.size()) and its class; invalid bytes as decode_utf8.
CodePoint code_point_at(std::string_view s, size_t i);

// End (byte offset) of the pre-token that starts at byte p < s.size(); always > p. Calling
// it again from the end, until s.size(), gives the regex's matches in order.
size_t pre_token_end(std::string_view s, size_t p);

// The Unicode version of the code point tables (Node's, when they were generated).
std::string_view unicode_tables_version();

}  // namespace conveyor::tokenizer_detail

// The GPT-2 pre-tokenizer (contract in pre_tokenizer.h and tokenizer.h): code point classes,
// strict UTF-8 decoding, and the GPT-2 regex, hand-written.
#include "model/pre_tokenizer.h"

#include <algorithm>
#include <array>
#include <iterator>

namespace conveyor::tokenizer_detail {
namespace {

// ---- Code point classes (what \s, \p{L}, \p{N} mean to the JS regex) ----------------------

struct CodePointRange {
  uint32_t first;
  uint32_t last;  // inclusive
  CodePointClass cls;
};
#include "model/unicode_tables.inc"

// Class of every BMP code point, built once from the ranges; above the BMP, binary search.
const std::array<uint8_t, 0x10000>& bmp_classes() {
  static const auto* table = [] {
    auto* t = new std::array<uint8_t, 0x10000>();
    t->fill(kOther);
    for (const CodePointRange& r : kCodePointRanges) {
      for (uint32_t cp = r.first; cp <= r.last && cp < 0x10000; ++cp) (*t)[cp] = r.cls;
    }
    return t;
  }();
  return *table;
}

CodePointClass classify(uint32_t cp) {
  if (cp < 0x10000) return static_cast<CodePointClass>(bmp_classes()[cp]);
  const auto* end = std::end(kCodePointRanges);
  const auto* it = std::upper_bound(std::begin(kCodePointRanges), end, cp,
                                    [](uint32_t v, const CodePointRange& r) { return v < r.first; });
  if (it == std::begin(kCodePointRanges)) return kOther;
  --it;
  return cp <= it->last ? it->cls : kOther;
}

inline bool is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// ASCII classes without touching the big table (most text is mostly ASCII).
constexpr std::array<uint8_t, 128> kAsciiClasses = [] {
  std::array<uint8_t, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 9 && c <= 13) || c == ' ') t[c] = kSpace;
    else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) t[c] = kLetter;
    else if (c >= '0' && c <= '9') t[c] = kNumber;
    else t[c] = kOther;
  }
  return t;
}();

// ---- UTF-8 ------------------------------------------------------------------------------

// decode_utf8 and code_point_at (pre_tokenizer.h) are defined here, inline, because the
// pre-tokenizer calls them for every code point; the exported functions below wrap them.
inline int32_t decode_utf8_impl(std::string_view s, size_t i, uint32_t* length) {
  const size_t n = s.size();
  const auto b0 = static_cast<unsigned char>(s[i]);
  *length = 1;
  if (b0 < 0x80) return b0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (i + 1 < n && is_continuation(static_cast<unsigned char>(s[i + 1]))) {
      *length = 2;
      return ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3F);
    }
    return -1;
  }
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (i + 2 >= n) return -1;
    const auto b1 = static_cast<unsigned char>(s[i + 1]);
    const auto b2 = static_cast<unsigned char>(s[i + 2]);
    const unsigned char lo = b0 == 0xE0 ? 0xA0 : 0x80;
    const unsigned char hi = b0 == 0xED ? 0x9F : 0xBF;
    if (b1 < lo || b1 > hi || !is_continuation(b2)) return -1;
    *length = 3;
    return ((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F);
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (i + 3 >= n) return -1;
    const auto b1 = static_cast<unsigned char>(s[i + 1]);
    const auto b2 = static_cast<unsigned char>(s[i + 2]);
    const auto b3 = static_cast<unsigned char>(s[i + 3]);
    const unsigned char lo = b0 == 0xF0 ? 0x90 : 0x80;
    const unsigned char hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (b1 < lo || b1 > hi || !is_continuation(b2) || !is_continuation(b3)) return -1;
    *length = 4;
    return ((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F);
  }
  return -1;
}

inline CodePoint code_point_at_impl(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, static_cast<CodePointClass>(kAsciiClasses[b0])};
  uint32_t length = 1;
  const int32_t cp = decode_utf8_impl(s, i, &length);
  return {length, cp < 0 ? kOther : classify(static_cast<uint32_t>(cp))};
}

}  // namespace

int32_t decode_utf8(std::string_view s, size_t i, uint32_t* length) {
  return decode_utf8_impl(s, i, length);
}

CodePoint code_point_at(std::string_view s, size_t i) { return code_point_at_impl(s, i); }

// ---- Pre-tokenizer ----------------------------------------------------------------------
//
// The alternatives of the regex, tried in order at each position p (the regex engine
// backtracks, but for these alternatives the outcome reduces to):
//   1. 's 't 're 've 'm 'll 'd   (ASCII apostrophe, lower case only)
//   2-4. ' '? then a run of letters | numbers | others ("others": not \s, \p{L}, \p{N});
//        the space is taken only when the code point after it starts such a run.
//   5. \s+(?!\S): the whitespace run [p, q); at the end of the text all of it, else (a
//      non-space follows) all but its last code point, if that leaves at least one.
//   6. \s+: otherwise (a single whitespace code point before a non-space).
// Every code point is in one class, so no position is ever skipped: the pieces tile the text.

namespace {

size_t contraction_length(std::string_view s, size_t p) {
  if (p + 1 >= s.size()) return 0;
  const char c1 = s[p + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (p + 2 >= s.size()) return 0;
  const char c2 = s[p + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// End (byte offset) of the run of class `cls` that starts at p.
size_t run_end(std::string_view s, size_t p, CodePointClass cls) {
  while (p < s.size()) {
    const CodePoint c = code_point_at_impl(s, p);
    if (c.cls != cls) break;
    p += c.length;
  }
  return p;
}

}  // namespace

size_t pre_token_end(std::string_view s, size_t p) {
  const size_t n = s.size();
  if (s[p] == '\'') {
    if (const size_t length = contraction_length(s, p); length != 0) return p + length;
  }
  const CodePoint c = code_point_at_impl(s, p);
  if (c.cls != kSpace) return run_end(s, p + c.length, c.cls);
  if (s[p] == ' ' && p + 1 < n && code_point_at_impl(s, p + 1).cls != kSpace) {
    const CodePoint next = code_point_at_impl(s, p + 1);
    return run_end(s, p + 1 + next.length, next.cls);
  }
  size_t last = p;  // start of the run's last code point
  size_t q = p;
  while (q < n) {
    const CodePoint w = code_point_at_impl(s, q);
    if (w.cls != kSpace) break;
    last = q;
    q += w.length;
  }
  return (q == n || last == p) ? q : last;
}

std::string_view unicode_tables_version() { return kUnicodeTablesVersion; }

}  // namespace conveyor::tokenizer_detail

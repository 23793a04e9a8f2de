// The chat template lexer: the source cut into text and tags with Jinja's whitespace rules
// (as transformers configures them: trim_blocks, lstrip_blocks), and each tag's tokens.
#include <cctype>
#include <charconv>
#include <set>

#include "model/chat_template_syntax.h"

namespace conveyor::chat_template_detail {

std::string position_text(const std::string& source, Pos pos) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < pos && i < source.size(); ++i) {
    if (source[i] == '\n') ++line, column = 1;
    else ++column;
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

namespace {

// ---------------------------------------------------------------------------------------
// Text and tags

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Where the tag opened at `open` (its inside starting at `inner`) closes: the index of its
// closing delimiter, skipping string literals. npos when it never closes.
size_t find_tag_end(const std::string& src, size_t inner, char kind) {
  if (kind == '#') return src.find("#}", inner);
  const char close = kind == '{' ? '}' : '%';
  char quote = 0;
  for (size_t i = inner; i + 1 < src.size(); ++i) {
    const char c = src[i];
    if (quote) {
      if (c == '\\') ++i;
      else if (c == quote) quote = 0;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (c == close && src[i + 1] == '}') {
      return i;
    }
  }
  return std::string::npos;
}

// Applies what comes before a tag to the text in front of it: '-' strips all whitespace,
// lstrip_blocks strips spaces and tabs back to the line's start (block and comment tags).
void strip_before_tag(std::string& text, char sign, char kind, bool line_starting) {
  if (sign == '-') {
    while (!text.empty() && is_space(text.back())) text.pop_back();
    return;
  }
  if (sign == '+' || kind == '{') return;
  const size_t nl = text.rfind('\n');
  const size_t from = nl == std::string::npos ? 0 : nl + 1;
  if (nl == std::string::npos && !line_starting) return;
  for (size_t i = from; i < text.size(); ++i)
    if (text[i] != ' ' && text[i] != '\t') return;
  text.resize(from);
}

}  // namespace

std::vector<Piece> split_pieces(const std::string& src) {
  std::vector<Piece> out;
  size_t pos = 0;
  for (;;) {
    size_t open = pos;
    while ((open = src.find('{', open)) != std::string::npos &&
           (open + 1 >= src.size() || (src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')))
      ++open;
    std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({Piece::Kind::Text, std::move(text), pos});
      return out;
    }
    const char kind = src[open + 1];
    size_t inner = open + 2;
    const char left = inner < src.size() && (src[inner] == '-' || src[inner] == '+') ? src[inner] : 0;
    if (left) ++inner;
    strip_before_tag(text, left, kind, pos == 0 || src[pos - 1] == '\n');
    if (!text.empty()) out.push_back({Piece::Kind::Text, std::move(text), pos});
    const size_t close = find_tag_end(src, inner, kind);
    if (close == std::string::npos)
      throw TemplateFailure(open, std::string("this ") + (kind == '{' ? "'{{'" : kind == '%' ? "'{%'" : "'{#'") +
                                      " is never closed");
    size_t inner_end = close;
    const char right = close > inner && (src[close - 1] == '-' || src[close - 1] == '+') ? src[close - 1] : 0;
    if (right) --inner_end;
    if (kind != '#')
      out.push_back({kind == '{' ? Piece::Kind::Var : Piece::Kind::Block, src.substr(inner, inner_end - inner), inner});
    pos = close + 2;
    if (right == '-') {
      while (pos < src.size() && is_space(src[pos])) ++pos;
    } else if (right != '+' && kind != '{' && pos < src.size() && src[pos] == '\n') {
      ++pos;  // trim_blocks
    }
  }
}

// ---------------------------------------------------------------------------------------
// Tokens of one tag

namespace {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6)), out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  }
}

// A string literal's body with Python's escapes (\n \t \r \\ \' \" \xNN \uNNNN \UNNNNNNNN);
// an unknown escape stays as written, as in Python.
std::string decode_string(const std::string& body, Pos at) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    const size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
    if (digits) {
      uint32_t cp = 0;
      const auto [end, ec] = std::from_chars(body.data() + i + 1, body.data() + std::min(body.size(), i + 1 + digits), cp, 16);
      if (ec != std::errc() || end != body.data() + i + 1 + digits || cp > 0x10FFFF)
        throw TemplateFailure(at, std::string("bad \\") + e + " escape in a string");
      append_utf8(out, cp);
      i += digits;
      continue;
    }
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case '\n': break;  // a line continuation
      default: out += '\\', out += e;
    }
  }
  return out;
}

}  // namespace

std::vector<Token> tokenize(const std::string& src, size_t begin, size_t end) {
  static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "=",
                               "|", ".", ",", ":", "(", ")", "[", "]", "{", "}"};
  std::vector<Token> out;
  size_t i = begin;
  while (i < end) {
    const char c = src[i];
    if (is_space(c)) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < end && (std::isalnum(static_cast<unsigned char>(src[j])) || src[j] == '_')) ++j;
      out.push_back({Token::Kind::Name, src.substr(i, j - i), i});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < end && (std::isdigit(static_cast<unsigned char>(src[j])) || src[j] == '_')) ++j;
      bool is_float = false;
      if (j + 1 < end && src[j] == '.' && std::isdigit(static_cast<unsigned char>(src[j + 1]))) {
        is_float = true;
        for (++j; j < end && (std::isdigit(static_cast<unsigned char>(src[j])) || src[j] == '_');) ++j;
      }
      if (j < end && (src[j] == 'e' || src[j] == 'E')) {
        size_t k = j + 1;
        if (k < end && (src[k] == '+' || src[k] == '-')) ++k;
        if (k < end && std::isdigit(static_cast<unsigned char>(src[k]))) {
          is_float = true;
          for (j = k; j < end && std::isdigit(static_cast<unsigned char>(src[j]));) ++j;
        }
      }
      std::string digits;
      for (size_t k = i; k < j; ++k)
        if (src[k] != '_') digits += src[k];
      Token t{is_float ? Token::Kind::Float : Token::Kind::Int, digits, i};
      if (is_float) t.f = std::stod(digits);
      else if (std::from_chars(digits.data(), digits.data() + digits.size(), t.i).ec != std::errc())
        throw TemplateFailure(i, "the integer " + digits + " is too large");
      out.push_back(std::move(t));
      i = j;
    } else if (c == '\'' || c == '"') {
      size_t j = i + 1;
      while (j < end && src[j] != c) j += src[j] == '\\' ? 2 : 1;
      if (j >= end) throw TemplateFailure(i, "this string is never closed");
      out.push_back({Token::Kind::String, decode_string(src.substr(i + 1, j - i - 1), i), i});
      i = j + 1;
    } else {
      const char* op = nullptr;
      for (const char* o : kOps)
        if (src.compare(i, std::char_traits<char>::length(o), o) == 0 && i + std::char_traits<char>::length(o) <= end) {
          op = o;
          break;
        }
      if (!op) throw TemplateFailure(i, std::string("unexpected character '") + c + "'");
      out.push_back({Token::Kind::Op, op, i});
      i += std::char_traits<char>::length(op);
    }
  }
  out.push_back({Token::Kind::End, "", end});
  return out;
}

}  // namespace conveyor::chat_template_detail

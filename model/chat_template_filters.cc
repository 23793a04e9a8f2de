// What the chat template renderer calls by name: filters (x|trim), tests (x is defined),
// string and dict methods (x.strip(), d.items()), and the Python meanings of a value as
// text, as JSON, as a truth value and in comparisons.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <optional>

#include "model/chat_template_syntax.h"

namespace conveyor::chat_template_detail {

const Value* Value::find(const std::string& key) const {
  if (!dict) return nullptr;
  for (const auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "undefined";
    case Value::Kind::None: return "none";
    case Value::Kind::Bool: return "a boolean";
    case Value::Kind::Int: return "an integer";
    case Value::Kind::Float: return "a float";
    case Value::Kind::String: return "a string";
    case Value::Kind::List: return "a list";
    case Value::Kind::Dict: return "a dict";
    case Value::Kind::Namespace: return "a namespace";
  }
  return "a value";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return false;
    case Value::Kind::Bool: return v.b;
    case Value::Kind::Int: return v.i != 0;
    case Value::Kind::Float: return v.f != 0;
    case Value::Kind::String: return !v.s.empty();
    case Value::Kind::List: return !v.list->empty();
    case Value::Kind::Dict: return !v.dict->empty();
    case Value::Kind::Namespace: return true;
  }
  return false;
}

size_t utf8_length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

namespace {

// Python's repr() of a float: the shortest digits that read back, fixed notation for
// exponents -4..15, else d.ddde+XX.
std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, end);  // d.ddde±XX
  const size_t e = sci.find('e');
  const int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c >= '0' && c <= '9') digits += c;
  const std::string sign = x < 0 ? "-" : "";
  if (exp < -4 || exp >= 16) {
    std::string m = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    char tail[16];
    std::snprintf(tail, sizeof tail, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return sign + m + tail;
  }
  if (exp < 0) return sign + "0." + std::string(size_t(-exp - 1), '0') + digits;
  if (digits.size() <= size_t(exp) + 1) return sign + digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
  return sign + digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
}

std::string python_repr_string(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else out += c;
  }
  return out + q;
}

std::string repr(const Value& v) { return v.is_string() ? python_repr_string(v.s) : to_text(v); }

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

bool is_py_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f); }

std::string strip(const std::string& s, bool left, bool right, const std::string* chars) {
  auto drop = [&](unsigned char c) { return chars ? chars->find(char(c)) != std::string::npos : is_py_space(c); };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && drop(static_cast<unsigned char>(s[b]))) ++b;
  if (right)
    while (e > b && drop(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string ascii_case(std::string s, int mode) {  // 0 lower, 1 upper, 2 capitalize, 3 title
  bool word_start = true;
  for (size_t i = 0; i < s.size(); ++i) {
    char& c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    const bool up = mode == 1 || (mode == 2 && i == 0) || (mode == 3 && word_start);
    if (up && c >= 'a' && c <= 'z') c = char(c - 32);
    else if (!up && c >= 'A' && c <= 'Z') c = char(c + 32);
    word_start = !alpha;
  }
  return s;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out += s.substr(pos, hit - pos) + to;
    pos = hit + from.size();
  }
  return out + s.substr(pos);
}

List python_split(const std::string& s, const Value* sep, int64_t maxsplit) {
  List out;
  if (!sep || sep->kind == Value::Kind::None) {
    size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && is_py_space(static_cast<unsigned char>(s[i]))) ++i;
      if (i == s.size()) break;
      size_t j = i;
      if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) j = s.size();
      while (j < s.size() && !is_py_space(static_cast<unsigned char>(s[j]))) ++j;
      out.push_back(Value::string(maxsplit >= 0 && int64_t(out.size()) == maxsplit ? strip(s.substr(i), false, true, nullptr) : s.substr(i, j - i)));
      i = j;
    }
    return out;
  }
  size_t pos = 0;
  for (size_t hit; (maxsplit < 0 || int64_t(out.size()) < maxsplit) && (hit = s.find(sep->s, pos)) != std::string::npos;) {
    out.push_back(Value::string(s.substr(pos, hit - pos)));
    pos = hit + sep->s.size();
  }
  out.push_back(Value::string(s.substr(pos)));
  return out;
}

const Value* kwarg(const std::vector<std::pair<std::string, Value>>& kwargs, const char* name) {
  for (const auto& [k, v] : kwargs)
    if (k == name) return &v;
  return nullptr;
}

// Argument i, or keyword `name`, or null.
const Value* arg(const std::vector<Value>& args, size_t i, const std::vector<std::pair<std::string, Value>>& kwargs,
                 const char* name) {
  if (i < args.size()) return &args[i];
  return kwarg(kwargs, name);
}

void need_string(const Value& v, const std::string& what, Pos at) {
  if (!v.is_string()) throw TemplateFailure(at, what + " needs a string, got " + kind_name(v));
}

Value attribute_of(const Value& item, const std::string& path) {
  Value v = item;
  size_t pos = 0;
  while (pos <= path.size()) {
    const size_t dot = path.find('.', pos);
    const std::string key = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    const Value* next = v.is_mapping() ? v.find(key) : nullptr;
    if (!next) return Value::undefined("no attribute '" + path + "'");
    v = *next;
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return v;
}

}  // namespace

std::string to_text(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.b ? "True" : "False";
    case Value::Kind::Int: return std::to_string(v.i);
    case Value::Kind::Float: return python_float(v.f);
    case Value::Kind::String: return v.s;
    case Value::Kind::List: {
      std::string out = "[";
      for (size_t i = 0; i < v.list->size(); ++i) out += (i ? ", " : "") + repr((*v.list)[i]);
      return out + "]";
    }
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      std::string out = v.kind == Value::Kind::Namespace ? "<Namespace {" : "{";
      for (size_t i = 0; i < v.dict->size(); ++i)
        out += (i ? ", " : "") + python_repr_string((*v.dict)[i].first) + ": " + repr((*v.dict)[i].second);
      return out + (v.kind == Value::Kind::Namespace ? "}>" : "}");
    }
  }
  return "";
}

std::string to_json_text(const Value& v, int indent, int depth) {
  const bool pretty = indent >= 0;
  const std::string inner = pretty ? "\n" + std::string(size_t(indent * (depth + 1)), ' ') : "";
  const std::string outer = pretty ? "\n" + std::string(size_t(indent * depth), ' ') : "";
  const std::string comma = pretty ? "," : ", ";
  switch (v.kind) {
    case Value::Kind::Undefined: throw TemplateFailure(0, "tojson: the value is undefined (" + v.s + ")");
    case Value::Kind::None: return "null";
    case Value::Kind::Bool: return v.b ? "true" : "false";
    case Value::Kind::Int: return std::to_string(v.i);
    case Value::Kind::Float:
      return std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : python_float(v.f);
    case Value::Kind::String: return json_string(v.s);
    case Value::Kind::List: {
      if (v.list->empty()) return "[]";
      std::string out = "[";
      for (size_t i = 0; i < v.list->size(); ++i) out += (i ? comma : "") + inner + to_json_text((*v.list)[i], indent, depth + 1);
      return out + outer + "]";
    }
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      if (v.dict->empty()) return "{}";
      std::string out = "{";
      for (size_t i = 0; i < v.dict->size(); ++i)
        out += (i ? comma : "") + inner + json_string((*v.dict)[i].first) + ": " +
               to_json_text((*v.dict)[i].second, indent, depth + 1);
      return out + outer + "}";
    }
  }
  return "null";
}

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Float || b.kind == Value::Kind::Float)
      return (a.kind == Value::Kind::Float ? a.f : double(a.kind == Value::Kind::Bool ? a.b : a.i)) ==
             (b.kind == Value::Kind::Float ? b.f : double(b.kind == Value::Kind::Bool ? b.b : b.i));
    return (a.kind == Value::Kind::Bool ? int64_t(a.b) : a.i) == (b.kind == Value::Kind::Bool ? int64_t(b.b) : b.i);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::String: return a.s == b.s;
    case Value::Kind::List:
      return a.list->size() == b.list->size() &&
             std::equal(a.list->begin(), a.list->end(), b.list->begin(), values_equal);
    case Value::Kind::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict)
        if (const Value* w = b.find(k); !w || !values_equal(v, *w)) return false;
      return true;
    default: return a.dict == b.dict;
  }
}

List items_of(const Value& v, Pos at) {
  switch (v.kind) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List: return *v.list;
    case Value::Kind::Dict: {
      List keys;
      for (const auto& kv : *v.dict) keys.push_back(Value::string(kv.first));
      return keys;
    }
    case Value::Kind::String: {
      List chars;
      for (size_t i = 0; i < v.s.size();) {
        size_t n = 1;
        while (i + n < v.s.size() && (static_cast<unsigned char>(v.s[i + n]) & 0xC0) == 0x80) ++n;
        chars.push_back(Value::string(v.s.substr(i, n)));
        i += n;
      }
      return chars;
    }
    default: throw TemplateFailure(at, std::string(kind_name(v)) + " cannot be iterated over");
  }
}

bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args, Pos at) {
  using K = Value::Kind;
  auto need_arg = [&]() -> const Value& {
    if (args.empty()) throw TemplateFailure(at, "the test '" + name + "' needs an argument");
    return args[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.kind == K::None;
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind == K::Int;
  if (name == "float") return v.kind == K::Float;
  if (name == "boolean") return v.kind == K::Bool;
  if (name == "true") return v.kind == K::Bool && v.b;
  if (name == "false") return v.kind == K::Bool && !v.b;
  if (name == "mapping") return v.kind == K::Dict;
  if (name == "sequence") return v.kind == K::List || v.is_string() || v.kind == K::Dict;
  if (name == "iterable") return v.kind == K::List || v.is_string() || v.kind == K::Dict;
  if (name == "callable") return false;
  if (name == "odd" || name == "even") {
    if (v.kind != K::Int) throw TemplateFailure(at, "the test '" + name + "' needs an integer, got " + kind_name(v));
    return (v.i % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    const Value& d = need_arg();
    if (v.kind != K::Int || d.kind != K::Int || d.i == 0) throw TemplateFailure(at, "divisibleby needs non-zero integers");
    return v.i % d.i == 0;
  }
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return values_equal(v, need_arg());
  if (name == "ne" || name == "!=") return !values_equal(v, need_arg());
  if (name == "in") {
    const Value& c = need_arg();
    if (c.is_string()) return v.is_string() && c.s.find(v.s) != std::string::npos;
    if (c.is_mapping()) return v.is_string() && c.find(v.s);
    for (const Value& x : items_of(c, at))
      if (values_equal(v, x)) return true;
    return false;
  }
  throw TemplateFailure(at, "unknown test '" + name + "'");
}

namespace {

using Kwargs = std::vector<std::pair<std::string, Value>>;

// The filters of one value as text or number; nullopt: not one of them.
std::optional<Value> scalar_filter(const std::string& name, const Value& v, const std::vector<Value>& args,
                                   const Kwargs& kwargs, Pos at) {
  using K = Value::Kind;
  const std::string what = "the filter '" + name + "'";
  if (name == "safe") return v;
  if (name == "trim") {
    const Value* chars = arg(args, 0, kwargs, "chars");
    return Value::string(strip(to_text(v), true, true, chars && chars->is_string() ? &chars->s : nullptr));
  }
  if (name == "length" || name == "count") {
    if (v.is_string()) return Value::integer(int64_t(utf8_length(v.s)));
    if (v.kind == K::List) return Value::integer(int64_t(v.list->size()));
    if (v.is_mapping()) return Value::integer(int64_t(v.dict->size()));
    if (v.is_undefined()) return Value::integer(0);
    throw TemplateFailure(at, what + " needs a string, list or dict, got " + kind_name(v));
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title")
    return Value::string(ascii_case(to_text(v), name == "lower" ? 0 : name == "upper" ? 1 : name == "capitalize" ? 2 : 3));
  if (name == "tojson") {
    const Value* indent = arg(args, 0, kwargs, "indent");
    if (indent && indent->kind != K::None && indent->kind != K::Int) throw TemplateFailure(at, "tojson's indent must be an integer");
    try {
      return Value::string(to_json_text(v, indent && indent->kind == K::Int ? int(indent->i) : -1));
    } catch (const TemplateFailure& f) {
      throw TemplateFailure(at, f.what());
    }
  }
  if (name == "string") return Value::string(to_text(v));
  if (name == "int" || name == "float") {
    double x = 0;
    if (v.is_number()) x = v.kind == K::Float ? v.f : double(v.kind == K::Bool ? v.b : v.i);
    else if (v.is_string()) {
      const std::string t = strip(v.s, true, true, nullptr);
      auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), x);
      if (ec != std::errc() || p != t.data() + t.size()) x = 0;
    }
    if (name == "float") return Value::number(x);
    return v.kind == K::Int ? v : Value::integer(int64_t(std::trunc(x)));
  }
  if (name == "replace") {
    if (args.size() < 2) throw TemplateFailure(at, what + " takes (old, new[, count])");
    need_string(args[0], what, at);
    return Value::string(replace_all(to_text(v), args[0].s, to_text(args[1]), args.size() > 2 ? args[2].i : -1));
  }
  if (name == "abs") {
    if (!v.is_number()) throw TemplateFailure(at, what + " needs a number, got " + kind_name(v));
    return v.kind == K::Float ? Value::number(std::fabs(v.f)) : Value::integer(std::llabs(v.kind == K::Bool ? v.b : v.i));
  }
  return std::nullopt;
}

// The filters of sequences and dicts; nullopt: not one of them.
std::optional<Value> sequence_filter(const std::string& name, const Value& v, const std::vector<Value>& args,
                                     const Kwargs& kwargs, Pos at) {
  const std::string what = "the filter '" + name + "'";
  if (name == "default" || name == "d") {
    const Value* fallback = arg(args, 0, kwargs, "default_value");
    const Value* boolean = arg(args, 1, kwargs, "boolean");
    const bool use = v.is_undefined() || (boolean && truthy(*boolean) && !truthy(v));
    return use ? (fallback ? *fallback : Value::string("")) : v;
  }
  if (name == "first" || name == "last") {
    const List items = items_of(v, at);
    if (items.empty()) return Value::undefined(what + ": the sequence is empty");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const Value* sep = arg(args, 0, kwargs, "d");
    const Value* attribute = arg(args, 1, kwargs, "attribute");
    std::string out;
    bool first = true;
    for (const Value& x : items_of(v, at)) {
      out += (first ? "" : sep ? to_text(*sep) : "") + to_text(attribute ? attribute_of(x, to_text(*attribute)) : x);
      first = false;
    }
    return Value::string(std::move(out));
  }
  if (name == "list") return Value::of_list(items_of(v, at));
  if (name == "reverse") {
    List items = items_of(v, at);
    std::reverse(items.begin(), items.end());
    if (!v.is_string()) return Value::of_list(std::move(items));
    std::string s;
    for (const Value& c : items) s += c.s;
    return Value::string(std::move(s));
  }
  if (name == "items") {
    if (!v.is_mapping()) throw TemplateFailure(at, what + " needs a dict, got " + kind_name(v));
    List out;
    for (const auto& [k, x] : *v.dict) out.push_back(Value::of_list({Value::string(k), x}));
    return Value::of_list(std::move(out));
  }
  if (name == "selectattr" || name == "rejectattr") {
    if (args.empty()) throw TemplateFailure(at, what + " needs an attribute name");
    const std::string attribute = to_text(args[0]);
    const std::string test = args.size() > 1 ? to_text(args[1]) : "";
    const std::vector<Value> test_args(args.begin() + std::min<size_t>(2, args.size()), args.end());
    List out;
    for (const Value& x : items_of(v, at)) {
      const Value a = attribute_of(x, attribute);
      const bool pass = test.empty() ? truthy(a) : apply_test(test, a, test_args, at);
      if (pass == (name == "selectattr")) out.push_back(x);
    }
    return Value::of_list(std::move(out));
  }
  if (name == "map") {
    const Value* attribute = kwarg(kwargs, "attribute");
    if (!attribute && args.empty()) throw TemplateFailure(at, what + " needs attribute= or a filter name");
    List out;
    for (const Value& x : items_of(v, at))
      out.push_back(attribute ? attribute_of(x, to_text(*attribute))
                              : apply_filter(to_text(args[0]), x, std::vector<Value>(args.begin() + 1, args.end()), {}, at));
    return Value::of_list(std::move(out));
  }
  return std::nullopt;
}

}  // namespace

Value apply_filter(const std::string& name, const Value& v, const std::vector<Value>& args, const Kwargs& kwargs, Pos at) {
  if (std::optional<Value> out = scalar_filter(name, v, args, kwargs, at)) return *std::move(out);
  if (std::optional<Value> out = sequence_filter(name, v, args, kwargs, at)) return *std::move(out);
  throw TemplateFailure(at, "unknown filter '" + name + "'");
}

Value call_method(const Value& object, const std::string& name, const std::vector<Value>& args, Pos at) {
  const std::string what = "the method '" + name + "'";
  if (object.is_undefined()) throw TemplateFailure(at, object.s.empty() ? "a value is undefined" : object.s);
  if (object.is_string()) {
    const std::string& s = object.s;
    const std::string* chars = !args.empty() && args[0].is_string() ? &args[0].s : nullptr;
    if (name == "strip") return Value::string(strip(s, true, true, chars));
    if (name == "lstrip") return Value::string(strip(s, true, false, chars));
    if (name == "rstrip") return Value::string(strip(s, false, true, chars));
    if (name == "upper" || name == "lower" || name == "capitalize" || name == "title")
      return Value::string(ascii_case(s, name == "lower" ? 0 : name == "upper" ? 1 : name == "capitalize" ? 2 : 3));
    if (name == "startswith" || name == "endswith") {
      if (args.empty()) throw TemplateFailure(at, what + " needs a prefix");
      List options = args[0].kind == Value::Kind::List ? *args[0].list : List{args[0]};
      for (const Value& o : options) {
        need_string(o, what, at);
        if (name == "startswith" ? s.starts_with(o.s) : s.ends_with(o.s)) return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "split") {
      if (!args.empty() && args[0].is_string() && args[0].s.empty()) throw TemplateFailure(at, "split: empty separator");
      return Value::of_list(python_split(s, args.empty() ? nullptr : &args[0], args.size() > 1 ? args[1].i : -1));
    }
    if (name == "replace") {
      if (args.size() < 2 || !args[0].is_string() || !args[1].is_string())
        throw TemplateFailure(at, what + " takes (old, new[, count]) strings");
      return Value::string(replace_all(s, args[0].s, args[1].s, args.size() > 2 ? args[2].i : -1));
    }
    if (name == "join") {
      std::string out;
      if (args.empty()) throw TemplateFailure(at, what + " needs a list");
      List items = items_of(args[0], at);
      for (size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + to_text(items[i]);
      return Value::string(std::move(out));
    }
  }
  if (object.kind == Value::Kind::Dict) {
    if (name == "get") {
      if (args.empty()) throw TemplateFailure(at, what + " needs a key");
      const Value* v = args[0].is_string() ? object.find(args[0].s) : nullptr;
      return v ? *v : args.size() > 1 ? args[1] : Value::none();
    }
    if (name == "items") return apply_filter("items", object, {}, {}, at);
    if (name == "keys") return Value::of_list(items_of(object, at));
    if (name == "values") {
      List out;
      for (const auto& kv : *object.dict) out.push_back(kv.second);
      return Value::of_list(std::move(out));
    }
  }
  throw TemplateFailure(at, std::string(kind_name(object)) + " has no method '" + name + "'");
}

}  // namespace conveyor::chat_template_detail

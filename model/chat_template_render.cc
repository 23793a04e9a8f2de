// The chat template renderer: statements write to one output string, expressions evaluate
// to Values (chat_template_syntax.h) with Jinja's (Python's) meaning of each operator.
// Scopes: each for-loop iteration has its own, so a `set` inside a loop does not outlive
// it (why templates use namespace()); `if` opens none.
#include <algorithm>
#include <cmath>
#include <optional>
#include <ctime>
#include <unordered_map>

#include "model/chat_template_syntax.h"

namespace conveyor::chat_template_detail {

namespace {

constexpr size_t kMaxOutputBytes = size_t(64) << 20;
constexpr int64_t kMaxRange = 1'000'000;

enum class Flow { Normal, Break, Continue };

[[noreturn]] void fail_undefined(const Value& v, Pos at) {
  throw TemplateFailure(at, v.s.empty() ? "a value is undefined" : v.s);
}

double as_double(const Value& v) { return v.kind == Value::Kind::Float ? v.f : v.kind == Value::Kind::Bool ? double(v.b) : double(v.i); }
int64_t as_int(const Value& v) { return v.kind == Value::Kind::Bool ? int64_t(v.b) : v.i; }
bool is_integral(const Value& v) { return v.kind == Value::Kind::Int || v.kind == Value::Kind::Bool; }

class Renderer {
 public:
  explicit Renderer(const Value& variables) {
    frames_.emplace_back();
    if (variables.is_mapping())
      for (const auto& [k, v] : *variables.dict) frames_.back()[k] = v;
  }

  std::string run(const Body& body) {
    exec(body);
    return std::move(out_);
  }

 private:
  Flow exec(const Body& body);
  Flow exec_for(const Stmt& s);
  void assign(const std::string& name, Value v) { frames_.back()[name] = std::move(v); }
  Value lookup(const std::string& name) const {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f)
      if (auto it = f->find(name); it != f->end()) return it->second;
    return Value::undefined("'" + name + "' is undefined");
  }
  void write(const std::string& text, Pos at) {
    if (out_.size() + text.size() > kMaxOutputBytes)
      throw TemplateFailure(at, "the output is larger than " + std::to_string(kMaxOutputBytes >> 20) + " MiB");
    out_ += text;
  }

  Value eval(const Expr& e);
  Value eval_attr(const Expr& e);
  Value eval_index(const Expr& e);
  Value eval_slice(const Expr& e);
  Value eval_call(const Expr& e);
  Value eval_binary(const Expr& e);
  Value arithmetic(const std::string& op, const Value& a, const Value& b, Pos at);
  std::vector<Value> eval_args(const Expr& e, size_t skip) {
    std::vector<Value> out;
    for (size_t i = skip; i < e.args.size(); ++i) out.push_back(eval(*e.args[i]));
    return out;
  }
  std::vector<std::pair<std::string, Value>> eval_kwargs(const Expr& e) {
    std::vector<std::pair<std::string, Value>> out;
    for (const auto& [k, v] : e.kwargs) out.emplace_back(k, eval(*v));
    return out;
  }

  std::vector<std::unordered_map<std::string, Value>> frames_;
  std::string out_;
};

Flow Renderer::exec(const Body& body) {
  for (const Stmt& s : body) {
    switch (s.kind) {
      case Stmt::Kind::Text: write(s.text, s.pos); break;
      case Stmt::Kind::Output: write(to_text(eval(*s.expr)), s.pos); break;
      case Stmt::Kind::Set: assign(s.text, eval(*s.expr)); break;
      case Stmt::Kind::SetAttr: {
        Value ns = lookup(s.text);
        if (ns.kind != Value::Kind::Namespace)
          throw TemplateFailure(s.pos, "cannot set '" + s.attr + "' on '" + s.text + "', which is not a namespace()");
        Value v = eval(*s.expr);
        auto it = std::find_if(ns.dict->begin(), ns.dict->end(), [&](const auto& kv) { return kv.first == s.attr; });
        if (it == ns.dict->end()) ns.dict->emplace_back(s.attr, std::move(v));
        else it->second = std::move(v);
        break;
      }
      case Stmt::Kind::If:
        for (const auto& [cond, branch] : s.branches)
          if (!cond || truthy(eval(*cond))) {
            if (Flow f = exec(branch); f != Flow::Normal) return f;
            break;
          }
        break;
      case Stmt::Kind::For: exec_for(s); break;
      case Stmt::Kind::Break: return Flow::Break;
      case Stmt::Kind::Continue: return Flow::Continue;
    }
  }
  return Flow::Normal;
}

Flow Renderer::exec_for(const Stmt& s) {
  const List all = items_of(eval(*s.expr), s.expr->pos);
  auto bind = [&](const Value& item) {
    if (s.targets.size() == 1) return assign(s.targets[0], item);
    if (item.kind != Value::Kind::List || item.list->size() != s.targets.size())
      throw TemplateFailure(s.pos, "cannot unpack " + std::string(kind_name(item)) + " into " +
                                       std::to_string(s.targets.size()) + " loop variables");
    for (size_t i = 0; i < s.targets.size(); ++i) assign(s.targets[i], (*item.list)[i]);
  };
  List items;
  for (const Value& item : all) {
    if (!s.filter) {
      items.push_back(item);
      continue;
    }
    frames_.emplace_back();
    bind(item);
    const bool keep = truthy(eval(*s.filter));
    frames_.pop_back();
    if (keep) items.push_back(item);
  }
  if (items.empty()) return exec(s.else_body);
  const int64_t n = int64_t(items.size());
  for (int64_t i = 0; i < n; ++i) {
    frames_.emplace_back();
    bind(items[size_t(i)]);
    Dict loop = {{"index", Value::integer(i + 1)},      {"index0", Value::integer(i)},
                 {"revindex", Value::integer(n - i)},    {"revindex0", Value::integer(n - i - 1)},
                 {"first", Value::boolean(i == 0)},      {"last", Value::boolean(i == n - 1)},
                 {"length", Value::integer(n)},
                 {"previtem", i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item")},
                 {"nextitem", i + 1 < n ? items[size_t(i + 1)] : Value::undefined("there is no next item")}};
    assign("loop", Value::of_dict(std::move(loop)));
    const Flow f = exec(s.body);
    frames_.pop_back();
    if (f == Flow::Break) break;
  }
  return Flow::Normal;
}

Value Renderer::eval(const Expr& e) {
  switch (e.kind) {
    case Expr::Kind::Literal: return e.literal;
    case Expr::Kind::Name: return lookup(e.name);
    case Expr::Kind::Attr: return eval_attr(e);
    case Expr::Kind::Index: return eval_index(e);
    case Expr::Kind::Slice: return eval_slice(e);
    case Expr::Kind::Call: return eval_call(e);
    case Expr::Kind::Filter: return apply_filter(e.name, eval(*e.args[0]), eval_args(e, 1), eval_kwargs(e), e.pos);
    case Expr::Kind::Test: return Value::boolean(apply_test(e.name, eval(*e.args[0]), eval_args(e, 1), e.pos) != e.negated);
    case Expr::Kind::Unary: {
      const Value v = eval(*e.args[0]);
      if (e.name == "not") return Value::boolean(!truthy(v));
      if (!v.is_number()) throw TemplateFailure(e.pos, "unary '" + e.name + "' needs a number, got " + kind_name(v));
      if (e.name == "+") return v;
      return v.kind == Value::Kind::Float ? Value::number(-v.f) : Value::integer(-as_int(v));
    }
    case Expr::Kind::Binary: return eval_binary(e);
    case Expr::Kind::Cond:
      if (truthy(eval(*e.args[1]))) return eval(*e.args[0]);
      return e.args[2] ? eval(*e.args[2]) : Value::undefined("the condition was false and there is no else");
    case Expr::Kind::ListLit: return Value::of_list(eval_args(e, 0));
    case Expr::Kind::DictLit: {
      Dict d;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        const Value k = eval(*e.args[i]);
        if (!k.is_string()) throw TemplateFailure(e.args[i]->pos, "dict keys must be strings here");
        d.emplace_back(k.s, eval(*e.args[i + 1]));
      }
      return Value::of_dict(std::move(d));
    }
  }
  throw TemplateFailure(e.pos, "unknown expression");
}

Value Renderer::eval_attr(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  if (obj.is_undefined()) fail_undefined(obj, e.pos);
  if (obj.is_mapping())
    if (const Value* v = obj.find(e.name)) return *v;
  return Value::undefined("'" + std::string(kind_name(obj)) + "' has no attribute '" + e.name + "'");
}

Value Renderer::eval_index(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  const Value key = eval(*e.args[1]);
  if (obj.is_undefined()) fail_undefined(obj, e.pos);
  if (obj.is_mapping()) {
    if (key.is_string())
      if (const Value* v = obj.find(key.s)) return *v;
    return Value::undefined("'" + std::string(kind_name(obj)) + "' has no key " + to_json_text(key, -1));
  }
  if ((obj.kind == Value::Kind::List || obj.is_string()) && is_integral(key)) {
    const List items = obj.kind == Value::Kind::List ? *obj.list : items_of(obj, e.pos);
    int64_t i = as_int(key);
    if (i < 0) i += int64_t(items.size());
    if (i < 0 || i >= int64_t(items.size()))
      return Value::undefined(std::string(kind_name(obj)) + " index " + std::to_string(as_int(key)) + " is out of range");
    return items[size_t(i)];
  }
  throw TemplateFailure(e.pos, std::string("cannot index ") + kind_name(obj) + " with " + kind_name(key));
}

Value Renderer::eval_slice(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  if (obj.kind != Value::Kind::List && !obj.is_string())
    throw TemplateFailure(e.pos, std::string("cannot slice ") + kind_name(obj));
  const List items = obj.kind == Value::Kind::List ? *obj.list : items_of(obj, e.pos);
  const int64_t n = int64_t(items.size());
  auto bound = [&](const ExprPtr& x, int64_t fallback) -> std::optional<int64_t> {
    if (!x) return std::nullopt;
    const Value v = eval(*x);
    if (v.kind == Value::Kind::None) return std::nullopt;
    if (!is_integral(v)) throw TemplateFailure(x->pos, std::string("slice bounds must be integers, got ") + kind_name(v));
    (void)fallback;
    return as_int(v);
  };
  const int64_t step = bound(e.args[3], 1).value_or(1);
  if (step == 0) throw TemplateFailure(e.pos, "slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {  // Python's rules for slice bounds
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t start = clamp(bound(e.args[1], 0), step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(bound(e.args[2], 0), step > 0 ? n : -1);
  List out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(items[size_t(i)]);
  if (obj.kind == Value::Kind::List) return Value::of_list(std::move(out));
  std::string s;
  for (const Value& c : out) s += c.s;
  return Value::string(std::move(s));
}

Value Renderer::eval_call(const Expr& e) {
  if (e.method) return call_method(eval(*e.args[0]), e.name, eval_args(e, 1), e.pos);
  std::vector<Value> args = eval_args(e, 0);
  if (e.name == "raise_exception")
    throw TemplateFailure(e.pos, args.empty() ? "raise_exception() was called" : to_text(args[0]), /*raised=*/true);
  if (e.name == "namespace") {
    Dict d;
    if (!args.empty() && args[0].is_mapping()) d = *args[0].dict;
    for (auto& [k, v] : eval_kwargs(e)) d.emplace_back(k, std::move(v));
    return Value::of_namespace(std::move(d));
  }
  if (e.name == "range") {
    if (args.empty() || args.size() > 3 || !std::all_of(args.begin(), args.end(), is_integral))
      throw TemplateFailure(e.pos, "range() takes one to three integers");
    const int64_t start = args.size() > 1 ? as_int(args[0]) : 0, stop = as_int(args[args.size() > 1 ? 1 : 0]);
    const int64_t step = args.size() > 2 ? as_int(args[2]) : 1;
    if (step == 0) throw TemplateFailure(e.pos, "range() step cannot be zero");
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (int64_t(out.size()) >= kMaxRange) throw TemplateFailure(e.pos, "range() is too long");
      out.push_back(Value::integer(i));
    }
    return Value::of_list(std::move(out));
  }
  if (e.name == "strftime_now") {
    if (args.size() != 1 || !args[0].is_string()) throw TemplateFailure(e.pos, "strftime_now() takes one format string");
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, args[0].s.c_str(), &local);
    return Value::string(std::string(buf, n));
  }
  const Value callee = lookup(e.name);
  if (callee.is_undefined()) throw TemplateFailure(e.pos, "unknown function '" + e.name + "'");
  throw TemplateFailure(e.pos, "'" + e.name + "' is " + kind_name(callee) + ", which cannot be called");
}

Value Renderer::eval_binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and" || op == "or") {  // Python: the deciding operand itself
    Value a = eval(*e.args[0]);
    if (truthy(a) == (op == "or")) return a;
    return eval(*e.args[1]);
  }
  const Value a = eval(*e.args[0]), b = eval(*e.args[1]);
  if (op == "==") return Value::boolean(values_equal(a, b));
  if (op == "!=") return Value::boolean(!values_equal(a, b));
  if (op == "in" || op == "not in") {
    bool found = false;
    if (b.is_string()) {
      if (!a.is_string()) throw TemplateFailure(e.pos, std::string("'in <string>' needs a string on the left, got ") + kind_name(a));
      found = b.s.find(a.s) != std::string::npos;
    } else if (b.is_mapping()) {
      found = a.is_string() && b.find(a.s);
    } else {
      for (const Value& x : items_of(b, e.pos)) found = found || values_equal(a, x);
    }
    return Value::boolean(found == (op == "in"));
  }
  if (op == "~") return Value::string(to_text(a) + to_text(b));
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    int c;
    if (a.is_number() && b.is_number()) c = as_double(a) < as_double(b) ? -1 : as_double(a) > as_double(b) ? 1 : 0;
    else if (a.is_string() && b.is_string()) c = a.s.compare(b.s);
    else throw TemplateFailure(e.pos, "cannot compare " + std::string(kind_name(a)) + " and " + kind_name(b) + " with '" + op + "'");
    return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  return arithmetic(op, a, b, e.pos);
}

Value Renderer::arithmetic(const std::string& op, const Value& a, const Value& b, Pos at) {
  if (op == "+" && a.is_string() && b.is_string()) return Value::string(a.s + b.s);
  if (op == "+" && a.kind == Value::Kind::List && b.kind == Value::Kind::List) {
    List out = *a.list;
    out.insert(out.end(), b.list->begin(), b.list->end());
    return Value::of_list(std::move(out));
  }
  if (op == "*" && a.is_string() && is_integral(b)) {
    std::string out;
    for (int64_t i = 0; i < as_int(b) && out.size() < kMaxOutputBytes; ++i) out += a.s;
    return Value::string(std::move(out));
  }
  if (!a.is_number() || !b.is_number())
    throw TemplateFailure(at, "cannot apply '" + op + "' to " + kind_name(a) + " and " + kind_name(b));
  const bool ints = is_integral(a) && is_integral(b);
  const double x = as_double(a), y = as_double(b);
  if ((op == "/" || op == "//" || op == "%") && y == 0) throw TemplateFailure(at, "division by zero");
  if (op == "/") return Value::number(x / y);
  if (op == "**") return ints && as_int(b) >= 0 ? Value::integer(int64_t(std::pow(x, y))) : Value::number(std::pow(x, y));
  if (ints) {
    const int64_t i = as_int(a), j = as_int(b);
    if (op == "+") return Value::integer(i + j);
    if (op == "-") return Value::integer(i - j);
    if (op == "*") return Value::integer(i * j);
    const int64_t q = i / j - ((i % j != 0) && ((i < 0) != (j < 0)) ? 1 : 0);  // floor division
    return op == "//" ? Value::integer(q) : Value::integer(i - q * j);
  }
  if (op == "+") return Value::number(x + y);
  if (op == "-") return Value::number(x - y);
  if (op == "*") return Value::number(x * y);
  if (op == "//") return Value::number(std::floor(x / y));
  return Value::number(x - std::floor(x / y) * y);
}

}  // namespace

std::string render_program(const Program& program, const Value& variables) {
  return Renderer(variables).run(program.body);
}

}  // namespace conveyor::chat_template_detail

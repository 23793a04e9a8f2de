// The chat template parser: statements over the lexer's pieces, expressions over one tag's
// tokens, by recursive descent with Jinja's precedence (lowest first): `a if c else b`, or,
// and, not, comparisons (in, not in, ==, ...), + -, ~, * / // %, **, unary -, then postfix
// (.attr, [index], [slice], (call)), filters (|f) and tests (is t).
#include <algorithm>
#include <set>

#include "model/chat_template_syntax.h"

namespace conveyor::chat_template_detail {

namespace {

ExprPtr make(Expr::Kind kind, Pos pos, std::string name = {}) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->pos = pos;
  e->name = std::move(name);
  return e;
}

Stmt make_stmt(Stmt::Kind kind, Pos pos) {
  Stmt s;
  s.kind = kind;
  s.pos = pos;
  return s;
}

const std::set<std::string>& unsupported_tags() {
  static const std::set<std::string> k = {"macro", "call", "filter", "raw", "include", "import", "from",
                                          "extends", "block", "with", "autoescape"};
  return k;
}

class Parser {
 public:
  explicit Parser(const std::string& source) : pieces_(split_pieces(source)), source_(source) {}

  Body parse_all() {
    std::string end;
    Body body = parse_body({}, &end);
    return body;
  }

 private:
  // Statements up to a block tag whose keyword is in `ends` (its tokens stay current, past
  // the keyword); at the end of the source when `ends` is empty.
  Body parse_body(const std::set<std::string>& ends, std::string* ended_by);
  void parse_block(Body& body, const std::string& keyword, Pos at);
  void parse_if(Body& body, Pos at);
  void parse_for(Body& body, Pos at);
  void parse_set(Body& body, Pos at);

  // The current tag's tokens.
  void start_tag(const Piece& p) {
    toks_ = tokenize(source_, p.pos, p.pos + p.text.size());
    k_ = 0;
  }
  const Token& peek(size_t ahead = 0) const { return toks_[std::min(k_ + ahead, toks_.size() - 1)]; }
  const Token& next() { return toks_[std::min(k_++, toks_.size() - 1)]; }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).kind == Token::Kind::Op && peek(ahead).text == op; }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::Name && peek(ahead).text == name;
  }
  bool accept_op(const char* op) { return is_op(op) ? (++k_, true) : false; }
  bool accept_name(const char* name) { return is_name(name) ? (++k_, true) : false; }
  [[noreturn]] void unexpected(const char* wanted) const {
    const Token& t = peek();
    const std::string got = t.kind == Token::Kind::End ? "the end of the tag" : "'" + t.text + "'";
    throw TemplateFailure(t.pos, std::string("expected ") + wanted + ", got " + got);
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) unexpected((std::string("'") + op + "'").c_str());
  }
  std::string expect_name(const char* what) {
    if (peek().kind != Token::Kind::Name) unexpected(what);
    return next().text;
  }
  void expect_end() {
    if (peek().kind != Token::Kind::End) unexpected("the end of the tag");
  }

  ExprPtr expression(bool with_cond = true);
  ExprPtr logical(const char* word, ExprPtr (Parser::*operand)());
  ExprPtr or_expr();
  ExprPtr and_expr();
  ExprPtr not_expr();
  ExprPtr compare();
  ExprPtr binary_level(int level);
  ExprPtr unary(bool with_filters);
  ExprPtr primary();
  ExprPtr postfix(ExprPtr e);
  ExprPtr filters_and_tests(ExprPtr e);
  ExprPtr sequence_literal(Pos at, const char* close, Expr::Kind kind);
  void call_args(Expr& call);

  std::vector<Piece> pieces_;
  size_t piece_ = 0;
  const std::string& source_;
  std::vector<Token> toks_;
  size_t k_ = 0;
};

Body Parser::parse_body(const std::set<std::string>& ends, std::string* ended_by) {
  Body body;
  while (piece_ < pieces_.size()) {
    const Piece& p = pieces_[piece_++];
    if (p.kind == Piece::Kind::Text) {
      Stmt s = make_stmt(Stmt::Kind::Text, p.pos);
      s.text = p.text;
      body.push_back(std::move(s));
      continue;
    }
    start_tag(p);
    if (p.kind == Piece::Kind::Var) {
      Stmt s = make_stmt(Stmt::Kind::Output, p.pos);
      s.expr = expression();
      expect_end();
      body.push_back(std::move(s));
      continue;
    }
    const Pos at = peek().pos;
    const std::string keyword = expect_name("a statement (if, for, set, ...)");
    if (ends.count(keyword)) {
      *ended_by = keyword;
      return body;
    }
    parse_block(body, keyword, at);
  }
  if (!ends.empty()) {
    std::string list;
    for (const std::string& e : ends) list += (list.empty() ? "'" : " or '") + e + "'";
    throw TemplateFailure(source_.size(), "the template ended where " + list + " was expected");
  }
  return body;
}

void Parser::parse_block(Body& body, const std::string& keyword, Pos at) {
  if (keyword == "if") return parse_if(body, at);
  if (keyword == "for") return parse_for(body, at);
  if (keyword == "set") return parse_set(body, at);
  if (keyword == "break" || keyword == "continue") {
    expect_end();
    body.push_back(make_stmt(keyword == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue, at));
    return;
  }
  if (keyword == "generation") {  // transformers' assistant-mask marker: renders its body
    expect_end();
    std::string end;
    for (Stmt& s : parse_body({"endgeneration"}, &end)) body.push_back(std::move(s));
    expect_end();
    return;
  }
  if (unsupported_tags().count(keyword))
    throw TemplateFailure(at, "the '" + keyword + "' tag is not supported by Conveyor's template engine");
  throw TemplateFailure(at, "unknown tag '" + keyword + "'");
}

void Parser::parse_if(Body& body, Pos at) {
  Stmt s = make_stmt(Stmt::Kind::If, at);
  ExprPtr cond = expression();
  for (;;) {
    expect_end();
    std::string end;
    Body branch = parse_body({"elif", "else", "endif"}, &end);
    s.branches.emplace_back(std::move(cond), std::move(branch));
    if (end == "endif") break;
    if (end == "elif") {
      cond = expression();
      continue;
    }
    expect_end();
    Body otherwise = parse_body({"endif"}, &end);
    s.branches.emplace_back(nullptr, std::move(otherwise));
    break;
  }
  expect_end();
  body.push_back(std::move(s));
}

void Parser::parse_for(Body& body, Pos at) {
  Stmt s = make_stmt(Stmt::Kind::For, at);
  const bool parenthesised = accept_op("(");
  do s.targets.push_back(expect_name("a loop variable"));
  while (accept_op(","));
  if (parenthesised) expect_op(")");
  if (!accept_name("in")) unexpected("'in'");
  s.expr = expression(/*with_cond=*/false);
  if (accept_name("if")) s.filter = expression(false);
  if (is_name("recursive")) throw TemplateFailure(peek().pos, "recursive loops are not supported");
  expect_end();
  std::string end;
  s.body = parse_body({"else", "endfor"}, &end);
  if (end == "else") {
    expect_end();
    s.else_body = parse_body({"endfor"}, &end);
  }
  expect_end();
  body.push_back(std::move(s));
}

void Parser::parse_set(Body& body, Pos at) {
  Stmt s = make_stmt(Stmt::Kind::Set, at);
  s.text = expect_name("a variable name");
  if (accept_op(".")) {
    s.kind = Stmt::Kind::SetAttr;
    s.attr = expect_name("an attribute name");
  }
  if (peek().kind == Token::Kind::End)
    throw TemplateFailure(at, "block assignments ({% set x %}...{% endset %}) are not supported");
  expect_op("=");
  s.expr = expression();
  if (is_op(",")) throw TemplateFailure(peek().pos, "assigning tuples is not supported");
  expect_end();
  body.push_back(std::move(s));
}

ExprPtr Parser::expression(bool with_cond) {
  ExprPtr e = or_expr();
  if (!with_cond || !is_name("if")) return e;
  auto c = make(Expr::Kind::Cond, next().pos);
  c->args.push_back(std::move(e));
  c->args.push_back(or_expr());
  c->args.push_back(accept_name("else") ? expression() : nullptr);
  return c;
}

// `operand (word operand)*`, left-associative: `or` over `and`, `and` over `not`.
ExprPtr Parser::logical(const char* word, ExprPtr (Parser::*operand)()) {
  ExprPtr e = (this->*operand)();
  while (is_name(word)) {
    auto b = make(Expr::Kind::Binary, next().pos, word);
    b->args.push_back(std::move(e));
    b->args.push_back((this->*operand)());
    e = std::move(b);
  }
  return e;
}

ExprPtr Parser::or_expr() { return logical("or", &Parser::and_expr); }
ExprPtr Parser::and_expr() { return logical("and", &Parser::not_expr); }

ExprPtr Parser::not_expr() {
  if (!is_name("not")) return compare();
  auto u = make(Expr::Kind::Unary, next().pos, "not");
  u->args.push_back(not_expr());
  return u;
}

ExprPtr Parser::compare() {
  ExprPtr e = binary_level(0);
  for (;;) {
    std::string op;
    const Pos at = peek().pos;
    if (peek().kind == Token::Kind::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                           peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
      op = next().text;
    } else if (is_name("in")) {
      op = next().text;
    } else if (is_name("not") && is_name("in", 1)) {
      k_ += 2;
      op = "not in";
    } else {
      return e;
    }
    auto b = make(Expr::Kind::Binary, at, op);
    b->args.push_back(std::move(e));
    b->args.push_back(binary_level(0));
    e = std::move(b);
  }
}

// Levels 0..3: + -, ~, * / // %, ** (each left-associative, as Jinja parses them).
ExprPtr Parser::binary_level(int level) {
  static const std::vector<std::vector<const char*>> kLevels = {{"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
  if (level == int(kLevels.size())) return unary(true);
  ExprPtr e = binary_level(level + 1);
  for (;;) {
    const char* op = nullptr;
    for (const char* o : kLevels[size_t(level)])
      if (is_op(o)) op = o;
    if (!op) return e;
    auto b = make(Expr::Kind::Binary, next().pos, op);
    b->args.push_back(std::move(e));
    b->args.push_back(binary_level(level + 1));
    e = std::move(b);
  }
}

ExprPtr Parser::unary(bool with_filters) {
  if (is_op("-") || is_op("+")) {
    auto u = make(Expr::Kind::Unary, peek().pos, next().text);
    u->args.push_back(unary(false));
    return with_filters ? filters_and_tests(std::move(u)) : std::move(u);
  }
  ExprPtr e = postfix(primary());
  return with_filters ? filters_and_tests(std::move(e)) : std::move(e);
}

ExprPtr Parser::primary() {
  const Token& t = peek();
  const Pos at = t.pos;
  switch (t.kind) {
    case Token::Kind::Name: {
      const std::string name = next().text;
      auto lit = make(Expr::Kind::Literal, at);
      if (name == "true" || name == "True") lit->literal = Value::boolean(true);
      else if (name == "false" || name == "False") lit->literal = Value::boolean(false);
      else if (name == "none" || name == "None") lit->literal = Value::none();
      else return make(Expr::Kind::Name, at, name);
      return lit;
    }
    case Token::Kind::String: {
      std::string text;
      while (peek().kind == Token::Kind::String) text += next().text;  // adjacent strings join
      auto lit = make(Expr::Kind::Literal, at);
      lit->literal = Value::string(std::move(text));
      return lit;
    }
    case Token::Kind::Int:
    case Token::Kind::Float: {
      auto lit = make(Expr::Kind::Literal, at);
      lit->literal = t.kind == Token::Kind::Int ? Value::integer(t.i) : Value::number(t.f);
      ++k_;
      return lit;
    }
    default: break;
  }
  if (accept_op("(")) {
    ExprPtr e = expression();
    if (is_op(",")) {  // a tuple: a list here
      auto list = make(Expr::Kind::ListLit, at);
      list->args.push_back(std::move(e));
      while (accept_op(",") && !is_op(")")) list->args.push_back(expression());
      e = std::move(list);
    }
    expect_op(")");
    return e;
  }
  if (accept_op("[")) return sequence_literal(at, "]", Expr::Kind::ListLit);
  if (accept_op("{")) return sequence_literal(at, "}", Expr::Kind::DictLit);
  unexpected("an expression");
}

ExprPtr Parser::sequence_literal(Pos at, const char* close, Expr::Kind kind) {
  auto e = make(kind, at);
  while (!is_op(close)) {
    e->args.push_back(expression());
    if (kind == Expr::Kind::DictLit) {
      expect_op(":");
      e->args.push_back(expression());
    }
    if (!accept_op(",")) break;
  }
  expect_op(close);
  return e;
}

ExprPtr Parser::postfix(ExprPtr e) {
  for (;;) {
    const Pos at = peek().pos;
    if (accept_op(".")) {
      auto a = make(Expr::Kind::Attr, at, expect_name("an attribute name"));
      a->args.push_back(std::move(e));
      e = std::move(a);
    } else if (accept_op("[")) {
      ExprPtr parts[3];
      int colons = 0;
      for (;;) {
        if (!is_op(":") && !is_op("]")) parts[colons] = expression();
        if (colons < 2 && accept_op(":")) ++colons;
        else break;
      }
      expect_op("]");
      auto x = make(colons ? Expr::Kind::Slice : Expr::Kind::Index, at);
      if (!colons && !parts[0]) throw TemplateFailure(at, "an empty subscript []");
      x->args.push_back(std::move(e));
      for (int i = 0; i <= (colons ? 2 : 0); ++i) x->args.push_back(std::move(parts[i]));
      e = std::move(x);
    } else if (is_op("(")) {
      ++k_;
      ExprPtr call;
      if (e->kind == Expr::Kind::Name) {
        call = make(Expr::Kind::Call, e->pos, e->name);
      } else if (e->kind == Expr::Kind::Attr) {
        call = make(Expr::Kind::Call, e->pos, e->name);
        call->method = true;
        call->args.push_back(std::move(e->args[0]));
      } else {
        throw TemplateFailure(at, "only names and methods can be called");
      }
      call_args(*call);
      e = std::move(call);
    } else {
      return e;
    }
  }
}

// After '(': positional then keyword arguments, up to ')'.
void Parser::call_args(Expr& call) {
  while (!is_op(")")) {
    if (peek().kind == Token::Kind::Name && is_op("=", 1)) {
      std::string key = next().text;
      ++k_;
      call.kwargs.emplace_back(std::move(key), expression());
    } else {
      if (!call.kwargs.empty()) throw TemplateFailure(peek().pos, "a positional argument after keyword arguments");
      call.args.push_back(expression());
    }
    if (!accept_op(",")) break;
  }
  expect_op(")");
}

ExprPtr Parser::filters_and_tests(ExprPtr e) {
  for (;;) {
    const Pos at = peek().pos;
    if (accept_op("|")) {
      auto f = make(Expr::Kind::Filter, at, expect_name("a filter name"));
      f->args.push_back(std::move(e));
      if (accept_op("(")) call_args(*f);
      e = std::move(f);
    } else if (accept_name("is")) {
      auto t = make(Expr::Kind::Test, at);
      t->negated = accept_name("not");
      t->name = expect_name("a test name");
      t->args.push_back(std::move(e));
      const Token& n = peek();
      if (accept_op("(")) {
        call_args(*t);
      } else if ((n.kind == Token::Kind::String || n.kind == Token::Kind::Int || n.kind == Token::Kind::Float ||
                  (n.kind == Token::Kind::Name && n.text != "else" && n.text != "or" && n.text != "and" &&
                   n.text != "if" && n.text != "in" && n.text != "is" && n.text != "not"))) {
        t->args.push_back(postfix(primary()));  // `x is equalto 'a'`
      }
      e = std::move(t);
    } else {
      return e;
    }
  }
}

}  // namespace

std::string normalise_source(std::string source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

Program parse_program(std::string source, std::string name) {
  Program p;
  p.name = std::move(name);
  p.source = std::move(source);
  Parser parser(p.source);
  p.body = parser.parse_all();
  return p;
}

}  // namespace conveyor::chat_template_detail

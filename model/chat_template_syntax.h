// The inside of model/chat_template.h: values, the syntax tree, and the error the parser
// and the renderer throw. Private to model/chat_template*.cc. Exceptions stay inside these
// files: ChatTemplate::parse and ::render turn them into Status / ChatTemplateError.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace conveyor::chat_template_detail {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict

// A Jinja value. Lists and dicts are shared and never changed after they are built (a
// namespace is the one mutable object, shared by reference as in Jinja).
struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                      // String; for Undefined: the name that was missing
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;         // Dict (never changed) and Namespace (changed by set)

  static Value undefined(std::string what) { Value v; v.s = std::move(what); return v; }
  static Value none() { Value v; v.kind = Kind::None; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = Kind::Int; v.i = x; return v; }
  static Value number(double x) { Value v; v.kind = Kind::Float; v.f = x; return v; }
  static Value string(std::string x) { Value v; v.kind = Kind::String; v.s = std::move(x); return v; }
  static Value of_list(List x) { Value v; v.kind = Kind::List; v.list = std::make_shared<const List>(std::move(x)); return v; }
  static Value of_dict(Dict x) { Value v; v.kind = Kind::Dict; v.dict = std::make_shared<Dict>(std::move(x)); return v; }
  static Value of_namespace(Dict x) { Value v = of_dict(std::move(x)); v.kind = Kind::Namespace; return v; }

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool is_mapping() const { return kind == Kind::Dict || kind == Kind::Namespace; }
  const Value* find(const std::string& key) const;  // a dict's or namespace's entry
};

// Where in the source: a byte offset (made into line and column for messages).
using Pos = size_t;

struct TemplateFailure : std::runtime_error {
  TemplateFailure(Pos at, const std::string& what, bool raised_by_template = false)
      : std::runtime_error(what), pos(at), raised(raised_by_template) {}
  Pos pos;
  bool raised;
};

struct Expr {
  enum class Kind { Literal, Name, Attr, Index, Slice, Call, Filter, Test, Unary, Binary, Cond, ListLit, DictLit };
  Kind kind = Kind::Literal;
  Pos pos = 0;
  Value literal;                    // Literal
  std::string name;                 // Name, Attr, Call (a global's name, or a method's), Filter, Test, operators
  // Attr/Index/Filter/Test/Call(method): args[0] is the object; Slice: object, start, stop,
  // step (null when absent); Unary: operand; Binary: left, right; Cond: then, cond, else
  // (else may be null); ListLit: items; DictLit: key, value, key, value...
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;  // Call, Filter, Test
  bool method = false;              // Call: args[0] is the object whose method `name` is called
  bool negated = false;             // Test: `is not`
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt;
using Body = std::vector<Stmt>;

struct Stmt {
  enum class Kind { Text, Output, If, For, Set, SetAttr, Break, Continue };
  Kind kind = Kind::Text;
  Pos pos = 0;
  std::string text;                 // Text; Set/SetAttr: the name (SetAttr: the namespace's)
  std::string attr;                 // SetAttr: the attribute
  ExprPtr expr;                     // Output, Set/SetAttr value, For: the iterable
  ExprPtr filter;                   // For: `if cond` (may be null)
  std::vector<std::string> targets; // For: the loop variables (one, or unpacked pairs)
  std::vector<std::pair<ExprPtr, Body>> branches;  // If: (condition, body); else: null condition
  Body body, else_body;             // For
};

struct Program {
  std::string name;
  std::string source;               // as parsed (newlines normalised), for positions
  Body body;
};

// The lexer (chat_template_lex.cc): the source as text and tags, whitespace control
// applied and comments dropped; then one tag's inside as tokens (ending with End).
struct Piece {
  enum class Kind { Text, Var, Block };
  Kind kind;
  std::string text;  // the text, or a tag's inside (without delimiters and '-'/'+')
  Pos pos;           // where it starts in the source (a tag: its inside)
};
std::vector<Piece> split_pieces(const std::string& source);

struct Token {
  enum class Kind { Name, String, Int, Float, Op, End };
  Kind kind;
  std::string text;  // Name, String (decoded), Op
  Pos pos;
  int64_t i = 0;
  double f = 0;
};
std::vector<Token> tokenize(const std::string& source, size_t begin, size_t end);

// "line L, column C" of `pos` in `source` (both from 1; columns count bytes).
std::string position_text(const std::string& source, Pos pos);

// The parser (chat_template_parse.cc) and the renderer's parts (chat_template_render.cc,
// chat_template_filters.cc).
// The source as Jinja reads it: \r\n and \r become \n, and one final newline is dropped
// (keep_trailing_newline is off). parse_program takes it so.
std::string normalise_source(std::string source);
Program parse_program(std::string normalised_source, std::string name);
std::string render_program(const Program& program, const Value& variables);

// Shared by the renderer and the filters.
bool truthy(const Value& v);
std::string to_text(const Value& v);               // Python's str()
std::string to_json_text(const Value& v, int indent, int depth = 0);  // json.dumps(ensure_ascii=False)
bool values_equal(const Value& a, const Value& b);
const char* kind_name(const Value& v);
List items_of(const Value& v, Pos at);              // what `for` walks over (a dict: its keys)
size_t utf8_length(const std::string& s);           // code points
Value apply_filter(const std::string& name, const Value& input, const std::vector<Value>& args,
                   const std::vector<std::pair<std::string, Value>>& kwargs, Pos at);
bool apply_test(const std::string& name, const Value& input, const std::vector<Value>& args, Pos at);
Value call_method(const Value& object, const std::string& name, const std::vector<Value>& args, Pos at);

}  // namespace conveyor::chat_template_detail

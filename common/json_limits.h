// Nesting limits for JSON that comes from outside the process (REST bodies, control
// messages, checkpoint headers). nlohmann's parser is iterative, so a body of 100,000 '['
// parses; but copying, comparing and dump()ing a value recurse once per level, and such a
// value overflows the stack the first time it is copied or printed in an error message
// (found by fuzz/, issue 28). Parsers of outside input refuse anything deeper than
// kMaxJsonDepth before touching it further; neither check below recurses.
#pragma once

#include <string_view>
#include <utility>
#include <vector>

namespace conveyor {

// Far deeper than any document Conveyor reads (the deepest, a plan's "layers", is 2).
constexpr int kMaxJsonDepth = 64;

// Whether `value` nests more than `max_depth` levels: a scalar is depth 0, [] and {} are 1,
// [[1]] is 2. Works for nlohmann::json and nlohmann::ordered_json.
template <class Json>
bool json_deeper_than(const Json& value, int max_depth) {
  std::vector<std::pair<const Json*, int>> pending{{&value, 0}};
  while (!pending.empty()) {
    const auto [v, depth] = pending.back();
    pending.pop_back();
    if (!v->is_structured()) continue;
    if (depth + 1 > max_depth) return true;
    for (const Json& child : *v) pending.emplace_back(&child, depth + 1);
  }
  return false;
}

// The same test on JSON text, before parsing: brackets outside strings, counted in one pass.
// For ordered_json, whose parser itself copies a nested value (growing an object's vector of
// members copies them, since a member's pair<const key, value> cannot be moved noexcept),
// so the depth must be known before parse(). Malformed text is the parser's to refuse.
inline bool json_text_deeper_than(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

}  // namespace conveyor

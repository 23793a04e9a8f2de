// A benchmark flag's list of counts: "1,64,256".
#pragma once

#include <cstdint>
#include <cstdlib>
#include <vector>

// The positive integers of a comma-separated list; empty when any item is not one (the caller
// names the flag).
inline std::vector<int64_t> parse_count_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const long long x = std::strtoll(p, &end, 10);
    if (end == p || x <= 0) return {};
    v.push_back(x);
    p = *end == ',' ? end + 1 : end;
    if (*end != ',' && *end != '\0') return {};
  }
  return v;
}

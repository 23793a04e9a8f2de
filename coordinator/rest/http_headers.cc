// X-Request-Id and CORS rules: see http_headers.h.
#include "coordinator/rest/http_headers.h"

#include <algorithm>
#include <cstdio>
#include <random>

namespace conveyor {

std::optional<std::string> client_request_id(std::string_view header) {
  if (header.empty() || header.size() > kMaxRequestIdLength) return std::nullopt;
  if (!std::all_of(header.begin(), header.end(), [](char c) { return c >= 0x21 && c <= 0x7e; })) return std::nullopt;
  return std::string(header);
}

std::string new_request_id() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  char buf[40];
  std::snprintf(buf, sizeof buf, "req-%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return buf;
}

std::optional<std::string> cors_allow_origin(const std::vector<std::string>& origins, std::string_view origin) {
  if (origins.empty() || origin.empty()) return std::nullopt;
  if (origins.size() == 1 && origins[0] == "*") return std::string("*");
  for (const std::string& o : origins)
    if (o == origin) return o;
  return std::nullopt;
}

}  // namespace conveyor

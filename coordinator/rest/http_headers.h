// Headers every REST answer may carry: the request's id (X-Request-Id) and CORS
// (Access-Control-*), with the rules for each. The session (http_session.cc) applies them.
//
// X-Request-Id: a client's own id is echoed when it is 1 to 128 printable ASCII characters
// (0x21..0x7e); otherwise the server makes one. A completion or chat request then runs under
// that id (CompletionRequest::id, which its answer's `id` and the coordinator's log lines
// carry); without a client id a completion's id is "cmpl-..." / "chatcmpl-..." and the
// header repeats it. Every answer has the header, errors included.
//
// CORS (cluster file `http.cors_origins`, checked there): a list of origins
// ("https://app.example.com", scheme://host[:port]) or ["*"]. Unset: no Access-Control-* headers at all. An allowed
// Origin gets Access-Control-Allow-Origin (the origin itself, with Vary: Origin, or "*") and
// Access-Control-Expose-Headers: X-Request-Id on every answer. OPTIONS is answered 204 on any
// path, without auth: a preflight from an allowed origin also gets Allow-Methods,
// Allow-Headers and Max-Age; any other OPTIONS just the Allow header.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>


namespace conveyor {

inline constexpr size_t kMaxRequestIdLength = 128;
inline constexpr int kCorsMaxAgeSeconds = 600;
inline constexpr const char* kCorsAllowMethods = "GET, POST, OPTIONS";
inline constexpr const char* kCorsAllowHeaders = "Authorization, Content-Type, X-Request-Id";

// The client's X-Request-Id when it is acceptable (see above), else nullopt.
std::optional<std::string> client_request_id(std::string_view header);
// A fresh id: "req-" and 32 hex digits.
std::string new_request_id();

// The Access-Control-Allow-Origin value for a request from `origin` (empty: no Origin
// header), or nullopt when CORS is off or the origin is not allowed.
std::optional<std::string> cors_allow_origin(const std::vector<std::string>& origins, std::string_view origin);

}  // namespace conveyor

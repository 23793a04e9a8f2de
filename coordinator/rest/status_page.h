// The operator's status page, served at GET / (docs/API.md, docs/OPERATIONS.md).
//
// One self-contained HTML file, coordinator/rest/status_page.html, with its style and script
// inline: no CDN, no build step. CMake reads it at configure time into a raw string literal
// (coordinator/CMakeLists.txt), so the page ships inside the coordinator binary and an edit
// to the .html re-runs the configure step. The page holds no data: it reads /v1/cluster,
// /health and /metrics from the browser, with the API key the operator gives it.
#pragma once

#include <string_view>

namespace conveyor {

// The page's bytes (UTF-8 HTML), alive for the program's lifetime.
std::string_view status_page_html();

// What GET / answers with, as response headers: the type, and a policy that lets the page
// run its own inline script and read this origin only (nothing else loads).
inline constexpr std::string_view kStatusPageContentType = "text/html; charset=utf-8";
inline constexpr std::string_view kStatusPagePolicy =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

}  // namespace conveyor

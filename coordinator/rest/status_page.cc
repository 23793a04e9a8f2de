#include "coordinator/rest/status_page.h"

namespace conveyor {

namespace {

// Generated at configure time from coordinator/rest/status_page.html: one raw string literal.
constexpr std::string_view kHtml =
#include "status_page_html.inc"
    ;

}  // namespace

std::string_view status_page_html() { return kHtml; }

}  // namespace conveyor

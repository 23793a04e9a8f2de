// A control-plane message: a small JSON object with a string "type" (register, assign,
// load_progress, ready, heartbeat, drain, shutdown, ...) and an optional binary frame for
// bytes that JSON carries badly (a UCX address, a checksum). On the wire it is one ZeroMQ
// multipart message: [JSON text] or [JSON text][binary frame] (a ROUTER adds the sender's
// identity frame in front).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

struct ControlMessage {
  nlohmann::json body = nlohmann::json::object();
  std::vector<std::byte> blob;  // the optional binary frame; empty = none

  // A message {"type": type, ...fields}. `fields` must be an object (or null).
  static ControlMessage make(std::string type, nlohmann::json fields = nullptr,
                             std::vector<std::byte> blob = {});
  // body["type"], or "" when missing or not a string.
  std::string type() const;
};

// Ok when `body` is an object whose "type" is a non-empty string.
Status validate_control_message(const ControlMessage& m);

// Base64 (RFC 4648, with padding), for bytes inside JSON fields (e.g. the next and previous
// stages' data-plane addresses in one `assign`).
std::string to_base64(std::span<const std::byte> bytes);
Expected<std::vector<std::byte>> from_base64(std::string_view text);

}  // namespace conveyor::transport

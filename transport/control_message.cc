#include "transport/control_message.h"

#include <array>

namespace conveyor::transport {

ControlMessage ControlMessage::make(std::string type, nlohmann::json fields,
                                    std::vector<std::byte> blob) {
  ControlMessage m;
  if (fields.is_object()) m.body = std::move(fields);
  m.body["type"] = std::move(type);
  m.blob = std::move(blob);
  return m;
}

std::string ControlMessage::type() const {
  if (!body.is_object()) return {};
  auto it = body.find("type");
  return it != body.end() && it->is_string() ? it->get<std::string>() : std::string();
}

Status validate_control_message(const ControlMessage& m) {
  if (!m.body.is_object())
    return Status::error(std::string("control message is a JSON ") + m.body.type_name() +
                         ", expected an object");
  auto it = m.body.find("type");
  if (it == m.body.end()) return Status::error("control message has no \"type\" field");
  if (!it->is_string() || it->get_ref<const std::string&>().empty())
    return Status::error("control message \"type\" must be a non-empty string");
  return ok_status();
}

namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

std::string to_base64(std::span<const std::byte> bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const unsigned v = std::to_integer<unsigned>(bytes[i]) << 16 |
                       std::to_integer<unsigned>(bytes[i + 1]) << 8 |
                       std::to_integer<unsigned>(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  const std::size_t rest = bytes.size() - i;
  if (rest) {
    unsigned v = std::to_integer<unsigned>(bytes[i]) << 16;
    if (rest == 2) v |= std::to_integer<unsigned>(bytes[i + 1]) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

Expected<std::vector<std::byte>> from_base64(std::string_view text) {
  std::array<int, 256> value;
  value.fill(-1);
  for (int i = 0; i < 64; ++i) value[static_cast<unsigned char>(kAlphabet[i])] = i;
  if (text.size() % 4 != 0)
    return Status::error("base64 text of " + std::to_string(text.size()) +
                         " characters (not a multiple of 4)");
  std::vector<std::byte> out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    unsigned v = 0;
    int pad = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const char c = text[i + k];
      if (c == '=' && i + 4 == text.size() && k >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      const int d = value[static_cast<unsigned char>(c)];
      if (d < 0 || pad) return Status::error("invalid base64 at offset " + std::to_string(i + k));
      v = v << 6 | static_cast<unsigned>(d);
    }
    out.push_back(std::byte(v >> 16));
    if (pad < 2) out.push_back(std::byte(v >> 8 & 0xff));
    if (pad < 1) out.push_back(std::byte(v & 0xff));
  }
  return out;
}

}  // namespace conveyor::transport

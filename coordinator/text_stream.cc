#include "coordinator/text_stream.h"

#include <algorithm>

namespace conveyor {

size_t utf8_complete_prefix(const std::string& s) {
  // Look at most 3 bytes back for the lead byte of a multi-byte character.
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(3, n); ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = 0;
    if ((c & 0xE0) == 0xC0) need = 2;
    else if ((c & 0xF0) == 0xE0) need = 3;
    else if ((c & 0xF8) == 0xF0) need = 4;
    return need > back ? n - back : n;  // lead with missing continuation bytes: hold it
  }
  return n;
}

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings)
    : tokenizer_(tokenizer), stop_(std::move(stop_strings)) {
  std::erase_if(stop_, [](const std::string& s) { return s.empty(); });
}

std::string TextStream::push(int32_t token) {
  if (stopped_) return {};
  bytes_ += tokenizer_.token_bytes(token);
  // A stop string can only start at or after emitted_: the tail that could begin one was held.
  size_t stop_at = std::string::npos;
  for (const std::string& s : stop_) stop_at = std::min(stop_at, bytes_.find(s, emitted_));
  size_t end;
  if (stop_at != std::string::npos) {
    stopped_ = true;
    end = stop_at;
  } else {
    size_t hold = 0;
    for (const std::string& s : stop_)
      for (size_t k = std::min(s.size() - 1, bytes_.size() - emitted_); k > hold; --k)
        if (bytes_.compare(bytes_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    end = std::min(bytes_.size() - hold, utf8_complete_prefix(bytes_));
  }
  if (end <= emitted_) return {};
  std::string delta = bytes_.substr(emitted_, end - emitted_);
  emitted_ = end;
  emitted_text_ += delta;
  return delta;
}

std::string TextStream::flush() {
  if (stopped_ || emitted_ >= bytes_.size()) return {};
  std::string delta = bytes_.substr(emitted_);
  emitted_ = bytes_.size();
  emitted_text_ += delta;
  return delta;
}

}  // namespace conveyor

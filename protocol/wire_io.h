// Little-endian byte writing and checked reading for the data-plane messages of this folder
// (microbatch.cc, seq_state.cc, batch_result.cc). Both ends are the same build of Conveyor on
// little-endian machines, so a field is its bytes in memory.
//
// Reader never reads past its span: a field that does not fit, or a count whose elements
// cannot fit in the bytes left, stops it and records the field's name, which status() puts
// in the error ("malformed micro-batch: field 'token_ids' runs past the end of the 40-byte
// message").
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/status.h"

namespace conveyor::wire {

inline constexpr uint32_t kMaxCount = 1u << 24;  // no field of a sane message is this long

class Writer {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  template <class T>
  void put_vec(const std::vector<T>& v) {
    put<uint32_t>(uint32_t(v.size()));
    put_bytes(v.data(), v.size() * sizeof(T));
  }
  void put_bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + n);
  }
  void put_str(const std::string& s) {
    put<uint32_t>(uint32_t(s.size()));
    put_bytes(s.data(), s.size());
  }
  void put_pairs(const std::vector<std::pair<int32_t, float>>& pairs) {
    put<uint32_t>(uint32_t(pairs.size()));
    for (const auto& [id, value] : pairs) put(id), put(value);
  }
  size_t size() const { return out_.size(); }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  // `what` names the message in errors ("micro-batch").
  Reader(std::span<const uint8_t> in, const char* what) : in_(in), what_(what) {}

  template <class T>
  bool get(T& v, const char* field) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in_.size() - pos_ < sizeof(T)) return fail(field);
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // A u32 count of elements of elem_bytes each, all of which must fit in what is left.
  bool count(uint32_t& n, const char* field, size_t elem_bytes) {
    if (!get(n, field)) return false;
    if (n > kMaxCount || size_t(n) * elem_bytes > in_.size() - pos_) return fail(field);
    return true;
  }
  template <class T>
  bool get_vec(std::vector<T>& v, const char* field) {
    uint32_t n;
    if (!count(n, field, sizeof(T))) return false;
    v.resize(n);
    if (n) std::memcpy(v.data(), in_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return true;
  }
  // A u32 length and that many bytes, as a view into the input (no copy).
  bool get_span(std::span<const uint8_t>& bytes, const char* field) {
    uint32_t n;
    if (!count(n, field, 1)) return false;
    bytes = in_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  bool get_str(std::string& s, const char* field) {
    std::span<const uint8_t> bytes;
    if (!get_span(bytes, field)) return false;
    s.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return true;
  }
  bool get_pairs(std::vector<std::pair<int32_t, float>>& pairs, const char* field) {
    uint32_t n;
    if (!count(n, field, 8)) return false;
    pairs.resize(n);
    for (auto& [id, value] : pairs)
      if (!get(id, field) || !get(value, field)) return false;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }
  // The error for a get that returned false.
  Status status() const {
    return Status::error(std::string("malformed ") + what_ + ": field '" + failed_field_ +
                         "' runs past the end of the " + std::to_string(in_.size()) + "-byte message");
  }
  // An error about the message's content, named like status()'s.
  Status error(const std::string& why) const { return Status::error(std::string("malformed ") + what_ + ": " + why); }

 private:
  bool fail(const char* field) {
    failed_field_ = field;
    return false;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  const char* what_;
  const char* failed_field_ = "";
};

}  // namespace conveyor::wire

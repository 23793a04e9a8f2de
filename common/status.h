// Status and Expected<T>: how operations that can fail in normal running (bad input,
// a corrupt file, a peer gone) report it. The message always names what was wrong.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace conveyor {

class Status {
 public:
  Status() = default;
  static Status error(std::string message) { return Status(std::move(message)); }
  bool ok() const { return !failed_; }
  explicit operator bool() const { return ok(); }
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
  bool failed_ = false;
  std::string message_;
};

inline Status ok_status() { return Status(); }

// Thrown only where a caller asked for the value of a failed Expected (start-up code).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class T>
class Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}                       // NOLINT(implicit)
  Expected(Status status) : v_(std::move(status)) {                 // NOLINT(implicit)
    if (std::get<Status>(v_).ok()) throw Error("Expected built from an ok Status");
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  const std::string& error() const { return status().message(); }
  T& value() & {
    if (!ok()) throw Error(error());
    return std::get<T>(v_);
  }
  const T& value() const& {
    if (!ok()) throw Error(error());
    return std::get<T>(v_);
  }
  T&& value() && {
    if (!ok()) throw Error(error());
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace conveyor

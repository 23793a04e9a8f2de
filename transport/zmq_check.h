// One place that turns cppzmq exceptions into Status. cppzmq reports failures by throwing
// zmq::error_t; the control plane catches them at each call and returns a Status naming
// the call, the file and line, and zmq's error text.
#pragma once

#include <zmq.hpp>

#include "common/status.h"

namespace conveyor::transport {

// "socket_.bind(endpoint) failed at control_plane.cc:88: Address already in use"
Status zmq_status(const zmq::error_t& e, const char* call, const char* file, int line);

}  // namespace conveyor::transport

// Runs a statement that makes zmq calls; if it throws zmq::error_t, returns (from the
// enclosing function, which returns Status or Expected<T>) a Status naming the call.
#define CONVEYOR_ZMQ_CHECK(statement)                                                     \
  do {                                                                                    \
    try {                                                                                 \
      statement;                                                                          \
    } catch (const zmq::error_t& conveyor_zmq_error_) {                                   \
      return ::conveyor::transport::zmq_status(conveyor_zmq_error_, #statement, __FILE__, \
                                               __LINE__);                                 \
    }                                                                                     \
  } while (0)

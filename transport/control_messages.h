// The control protocol between the coordinator and its workers, defined once: one plain
// struct per message kind, one encode and one decode for each, used by both ends.
//
// Underneath is the framing of control_message.h: a JSON body whose "type" is
// control_kind_name(kind), plus an optional binary frame (only `register` uses it, for the
// worker's data-plane address). The JSON on the wire is what the daemons exchanged before
// these types existed; tests/transport/test_control_messages.cc pins it.
//
// Decoding never throws: a malformed message is an error naming the message and the field
// ("assign: field 'layers' must be [begin, end] integers"). Fields a decoder does not know
// are ignored, so either end may add one without breaking the other.
//
// Every member has an initializer, `{}` included, so that a designated initializer may leave
// fields out (`HeartbeatMsg{.register_again = true}`) without GCC 12's missing-initializer
// warning.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/model_config.h"
#include "common/stage_description.h"
#include "common/status.h"
#include "transport/control_message.h"

namespace conveyor::transport {

// In the order of AnyControlMsg's alternatives (checked in control_messages.cc).
enum class ControlKind {
  Register,      // w -> c: join, or join again naming the stage still loaded
  Welcome,       // c -> w: accepted
  Rejected,      // c -> w: refused (the worker exits with status 3)
  Assign,        // c -> w: load these layers and wire the ring
  Unassign,      // c -> w: drop the stage, become a spare
  LoadProgress,  // w -> c
  Ready,         // w -> c: the stage runs in this epoch
  LoadFailed,    // w -> c
  Heartbeat,     // both ways
  DataError,     // w -> c: a data-plane send/receive failed
  Draining,      // w -> c: take my stage, I am going
  Leaving,       // w -> c: gone now
  Goodbye,       // c -> w: the coordinator stops; keep the layers
  Drain,         // c -> w: stop taking new work
  Shutdown,      // c -> w: exit
  Footprint,     // w -> c: what the welcome's model takes in this worker's format
};

// The wire "type": "register", "welcome", ..., "load_progress", ...
const char* control_kind_name(ControlKind kind);
// The kind whose wire type is `name`, if any.
std::optional<ControlKind> control_kind_from_name(std::string_view name);

// What a worker is doing, as its heartbeat reports it.
enum class WorkerState { Idle, Loading, Ready, Draining };
const char* worker_state_name(WorkerState state);  // "idle", "loading", "ready", "draining"

// A stage a worker still has loaded, named when it registers again so that a restarted
// coordinator can give it the same stage without a reload. Layers are [layer_begin, layer_end).
struct HeldStage {
  uint32_t epoch = 0;
  uint32_t pipeline = 0;
  int stage = 0;
  int num_stages = 0;
  int64_t layer_begin = 0, layer_end = 0;
  std::string model{};
  bool operator==(const HeldStage&) const = default;
};

struct RegisterMsg {
  static constexpr ControlKind kind = ControlKind::Register;
  std::string name{}, host{};
  int64_t pid = 0;
  std::string token{};                 // the cluster's join token
  std::string backend{};               // "cpu" | "cuda"
  int tensor_parallel = 1;
  std::vector<int> gpus{};             // empty on the CPU
  int64_t memory_bytes = 0;            // where the weights live: GPU(s) or host (shown)
  StageCapabilities capabilities{};   // wire: "capabilities": {...}
  nlohmann::json data_plane = nlohmann::json::object();  // free-form, shown in /v1/cluster
  std::optional<HeldStage> holding{};
  // The highest epoch this worker was ever assigned (0: none), whether it holds that stage or
  // was still loading it: a restarted coordinator starts its epochs above it.
  uint32_t last_epoch = 0;
  std::vector<std::byte> data_address{};  // the binary frame, not JSON; the coordinator needs one
  bool operator==(const RegisterMsg&) const = default;
};

// The shapes of the coordinator's model, as the welcome names them: what a worker needs to
// say what the model takes in its own format (FootprintMsg).
struct ModelShape {
  int64_t n_layer = 0, n_embd = 0, n_head = 0, n_inner = 0, n_positions = 0, vocab_size = 0;
  bool tie_word_embeddings = true;
  bool operator==(const ModelShape&) const = default;
};
ModelShape model_shape(const ModelConfig& config);
ModelConfig model_config(const ModelShape& shape);  // the shapes; the other fields their defaults

struct WelcomeMsg {
  static constexpr ControlKind kind = ControlKind::Welcome;
  int64_t heartbeat_ms = 0;
  // The model the coordinator serves: the worker answers with its footprint. Absent from a
  // coordinator that plans nothing (a test's).
  std::optional<ModelShape> model{};
  bool operator==(const WelcomeMsg&) const = default;
};

struct RejectedMsg {
  static constexpr ControlKind kind = ControlKind::Rejected;
  std::string reason{};
  bool operator==(const RejectedMsg&) const = default;
};

// Data-plane addresses travel base64 in JSON. The last stage's next_address is empty; the
// first stage's prev_address is the coordinator's. coordinator_address is never empty
// (decode refuses an assign without one).
struct AssignMsg {
  static constexpr ControlKind kind = ControlKind::Assign;
  uint32_t epoch = 0;
  uint32_t pipeline = 0;
  int stage = 0;
  int num_stages = 0;
  int64_t layer_begin = 0, layer_end = 0;  // wire: "layers": [begin, end]
  std::string model{};
  std::vector<std::byte> next_address{}, prev_address{}, coordinator_address{};  // wire: next, prev, coordinator
  // Close the data-plane connections to these peers and dial them again, even to peers that
  // keep their place (a replay after a micro-batch was lost: the old ones may be dead without
  // an error, e.g. over an interface that went away). Wire: "redial": true, absent when false.
  bool redial = false;
  bool operator==(const AssignMsg&) const = default;
};

struct UnassignMsg {
  static constexpr ControlKind kind = ControlKind::Unassign;
  bool operator==(const UnassignMsg&) const = default;
};

struct LoadProgressMsg {
  static constexpr ControlKind kind = ControlKind::LoadProgress;
  double fraction = 0;  // 0..1
  int64_t bytes_done = 0, bytes_total = 0;
  bool operator==(const LoadProgressMsg&) const = default;
};

struct ReadyMsg {
  static constexpr ControlKind kind = ControlKind::Ready;
  uint32_t epoch = 0;
  uint32_t pipeline = 0;
  int stage = 0;
  int64_t layer_begin = 0, layer_end = 0;  // wire: "layers": [begin, end]
  int64_t kv_bytes_per_token = 0;
  int64_t kv_capacity_tokens = 0;
  std::string backend{};     // the backend's own description
  double load_seconds = 0;   // 0 when the layers were already loaded (only re-wired)
  int64_t load_bytes = 0;    // checkpoint bytes read
  bool operator==(const ReadyMsg&) const = default;
};

struct LoadFailedMsg {
  static constexpr ControlKind kind = ControlKind::LoadFailed;
  std::string error{};
  bool operator==(const LoadFailedMsg&) const = default;
};

// What a worker reports in each heartbeat. The kv_* and sequences figures are there only
// while a stage is loaded.
struct WorkerFigures {
  WorkerState state = WorkerState::Idle;
  double load_fraction = 0;
  double busy_fraction = 0;       // since the previous heartbeat, 0..1
  int64_t batches = 0;            // cumulative
  double busy_seconds_total = 0;  // cumulative
  double clock_seconds = 0;       // the worker's steady clock
  std::optional<int64_t> kv_used_tokens{}, kv_capacity_tokens{}, sequences{};
  // Cumulative, between steps (stage_worker/step_trace.h): waiting for an input that had not
  // arrived, and sitting with one that had. Optional on the wire (older workers).
  std::optional<double> wait_input_seconds_total{}, idle_ready_seconds_total{};
  bool operator==(const WorkerFigures&) const = default;
};

// Both directions: a worker's carries `figures` (wire: flat fields beside "type", all of
// them or none); the coordinator's carries none, and `register_again` (wire: "register",
// sent only when true) when it does not know the worker.
struct HeartbeatMsg {
  static constexpr ControlKind kind = ControlKind::Heartbeat;
  std::optional<WorkerFigures> figures{};
  bool register_again = false;
  bool operator==(const HeartbeatMsg&) const = default;
};

struct DataErrorMsg {
  static constexpr ControlKind kind = ControlKind::DataError;
  std::string error{};
  std::string peer{};               // "next", "coordinator", or "" (unknown, or wiring)
  std::optional<uint32_t> epoch{};  // the epoch it happened in, when the worker had one
  bool operator==(const DataErrorMsg&) const = default;
};

struct DrainingMsg {
  static constexpr ControlKind kind = ControlKind::Draining;
  std::string reason{};
  bool operator==(const DrainingMsg&) const = default;
};

struct LeavingMsg {
  static constexpr ControlKind kind = ControlKind::Leaving;
  std::string reason{};
  bool operator==(const LeavingMsg&) const = default;
};

struct GoodbyeMsg {
  static constexpr ControlKind kind = ControlKind::Goodbye;
  std::string reason{};
  bool operator==(const GoodbyeMsg&) const = default;
};

struct DrainMsg {
  static constexpr ControlKind kind = ControlKind::Drain;
  bool operator==(const DrainMsg&) const = default;
};

struct ShutdownMsg {
  static constexpr ControlKind kind = ControlKind::Shutdown;
  bool operator==(const ShutdownMsg&) const = default;
};

// w -> c, answering the welcome: the footprint, or why this worker cannot hold the model
// (then `error` alone is on the wire, and the coordinator never plans it).
struct FootprintMsg {
  static constexpr ControlKind kind = ControlKind::Footprint;
  StageFootprint footprint{};
  std::string error{};
  bool operator==(const FootprintMsg&) const = default;
};

using AnyControlMsg =
    std::variant<RegisterMsg, WelcomeMsg, RejectedMsg, AssignMsg, UnassignMsg, LoadProgressMsg, ReadyMsg,
                 LoadFailedMsg, HeartbeatMsg, DataErrorMsg, DrainingMsg, LeavingMsg, GoodbyeMsg, DrainMsg,
                 ShutdownMsg, FootprintMsg>;

ControlKind control_kind(const AnyControlMsg& msg);

ControlMessage encode(const RegisterMsg& msg);
ControlMessage encode(const WelcomeMsg& msg);
ControlMessage encode(const RejectedMsg& msg);
ControlMessage encode(const AssignMsg& msg);
ControlMessage encode(const UnassignMsg& msg);
ControlMessage encode(const LoadProgressMsg& msg);
ControlMessage encode(const ReadyMsg& msg);
ControlMessage encode(const LoadFailedMsg& msg);
ControlMessage encode(const HeartbeatMsg& msg);
ControlMessage encode(const DataErrorMsg& msg);
ControlMessage encode(const DrainingMsg& msg);
ControlMessage encode(const LeavingMsg& msg);
ControlMessage encode(const GoodbyeMsg& msg);
ControlMessage encode(const DrainMsg& msg);
ControlMessage encode(const ShutdownMsg& msg);
ControlMessage encode(const FootprintMsg& msg);
ControlMessage encode(const AnyControlMsg& msg);

// The message `m` carries, or an error naming its type and the offending field.
Expected<AnyControlMsg> decode_control(const ControlMessage& m);

}  // namespace conveyor::transport

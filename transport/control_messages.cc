#include "transport/control_messages.h"

#include <array>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "common/json_limits.h"

namespace conveyor::transport {

using json = nlohmann::json;

namespace {

// One wire name per kind, indexed by ControlKind; the variant's alternatives are in the
// same order, so a message's variant index is its kind.
constexpr std::array<const char*, 16> kKindNames = {
    "register",  "welcome",    "rejected", "assign",  "unassign", "load_progress", "ready",    "load_failed",
    "heartbeat", "data_error", "draining", "leaving", "goodbye",  "drain",         "shutdown", "footprint",
};
static_assert(kKindNames.size() == std::variant_size_v<AnyControlMsg>);

template <std::size_t... I>
constexpr bool kinds_in_variant_order(std::index_sequence<I...>) {
  return ((std::variant_alternative_t<I, AnyControlMsg>::kind == ControlKind(I)) && ...);
}
static_assert(kinds_in_variant_order(std::make_index_sequence<std::variant_size_v<AnyControlMsg>>()),
              "AnyControlMsg's alternatives must follow ControlKind's order");

constexpr std::array<const char*, 4> kStateNames = {"idle", "loading", "ready", "draining"};

// Reads the fields of one message body. The first problem is kept, with the message type
// and the field's name; after it every read returns a default, so a decoder reads straight
// through and checks ok() once at the end.
class FieldReader {
 public:
  FieldReader(ControlKind kind, const json& body, std::string prefix = "")
      : kind_(kind), body_(body), prefix_(std::move(prefix)) {}

  bool ok() const { return error_.empty(); }
  Status status() const { return ok() ? ok_status() : Status::error(error_); }
  void keep_first_error(const FieldReader& inner) {
    if (ok() && !inner.ok()) error_ = inner.error_;
  }

  // Present and not null: absent and null both mean "not given" for optional fields.
  bool has(const char* key) const {
    auto it = body_.find(key);
    return it != body_.end() && !it->is_null();
  }

  std::string string(const char* key) {
    const json* v = find(key);
    if (!v) return {};
    if (!v->is_string()) return fail(key, "must be a string"), std::string();
    return v->get<std::string>();
  }

  bool boolean(const char* key) {
    const json* v = find(key);
    if (!v) return false;
    if (!v->is_boolean()) return fail(key, "must be true or false"), false;
    return v->get<bool>();
  }

  double number(const char* key) {
    const json* v = find(key);
    if (!v) return 0;
    if (!v->is_number() || !std::isfinite(v->get<double>())) return fail(key, "must be a number"), 0.0;
    return v->get<double>();
  }

  template <class Int>
  Int integer(const char* key) {
    const json* v = find(key);
    if (!v) return 0;
    auto x = as_integer<Int>(*v);
    if (!x) fail(key, "must be an integer from " + std::to_string(std::numeric_limits<Int>::min()) + " to " +
                          std::to_string(std::numeric_limits<Int>::max()));
    return x.value_or(0);
  }

  std::vector<int> int_list(const char* key) {
    const json* v = find(key);
    std::vector<int> out;
    if (!v) return out;
    bool good = v->is_array();
    for (std::size_t i = 0; good && i < v->size(); ++i) {
      auto x = as_integer<int>((*v)[i]);
      good = x.has_value();
      if (good) out.push_back(*x);
    }
    if (!good) fail(key, "must be an array of integers");
    return out;
  }

  // "layers": [begin, end], end >= begin >= 0.
  std::pair<int64_t, int64_t> layers(const char* key) {
    const json* v = find(key);
    if (!v) return {};
    std::optional<int64_t> b, e;
    if (v->is_array() && v->size() == 2) b = as_integer<int64_t>((*v)[0]), e = as_integer<int64_t>((*v)[1]);
    if (!b || !e || *b < 0 || *e < *b) return fail(key, "must be [begin, end] integers"), std::pair<int64_t, int64_t>{};
    return {*b, *e};
  }

  // Base64 bytes; "" means none.
  std::vector<std::byte> bytes(const char* key) {
    const std::string text = string(key);
    auto b = from_base64(text);
    if (!b) return fail(key, "is not base64: " + b.error()), std::vector<std::byte>();
    return std::move(b).value();
  }

  const json* object(const char* key) {
    const json* v = find(key);
    if (v && !v->is_object()) return fail(key, "must be a JSON object"), nullptr;
    return v;
  }

  const char* type() const { return kKindNames[std::size_t(kind_)]; }
  ControlKind kind() const { return kind_; }
  const std::string& prefix() const { return prefix_; }

  void fail(const char* key, const std::string& what) {
    if (ok()) error_ = std::string(type()) + ": field '" + prefix_ + key + "' " + what;
  }

 private:
  const json* find(const char* key) {
    auto it = body_.find(key);
    if (it == body_.end() || it->is_null()) {
      if (ok()) error_ = std::string(type()) + ": missing field '" + prefix_ + key + "'";
      return nullptr;
    }
    return &*it;
  }

  template <class Int>
  static std::optional<Int> as_integer(const json& v) {
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      if (u > uint64_t(std::numeric_limits<Int>::max())) return std::nullopt;
      return Int(u);
    }
    if (!v.is_number_integer()) return std::nullopt;
    const auto i = v.get<int64_t>();  // negative here: non-negative ones parse as unsigned
    if (i < int64_t(std::numeric_limits<Int>::min()) ||
        (i > 0 && uint64_t(i) > uint64_t(std::numeric_limits<Int>::max())))
      return std::nullopt;
    return Int(i);
  }

  ControlKind kind_;
  const json& body_;
  std::string prefix_;
  std::string error_;
};

template <class Msg>
ControlMessage make(json fields, std::vector<std::byte> blob = {}) {
  return ControlMessage::make(control_kind_name(Msg::kind), std::move(fields), std::move(blob));
}

json layers_json(int64_t begin, int64_t end) { return json::array({begin, end}); }

// ---- decoders, one per kind ----

HeldStage decode_held_stage(const json& body, FieldReader& outer) {
  FieldReader r(outer.kind(), body, "holding.");
  HeldStage h;
  h.epoch = r.integer<uint32_t>("epoch");
  h.pipeline = r.integer<uint32_t>("pipeline");
  h.stage = r.integer<int>("stage");
  h.num_stages = r.integer<int>("num_stages");
  std::tie(h.layer_begin, h.layer_end) = r.layers("layers");
  h.model = r.string("model");
  outer.keep_first_error(r);
  return h;
}

StageCapabilities decode_capabilities(const json& body, FieldReader& outer) {
  FieldReader r(outer.kind(), body, "capabilities.");
  StageCapabilities c;
  const std::string dtype = r.string("dtype");
  if (r.ok()) {
    if (auto d = activation_dtype_from_wire(dtype)) c.dtype = *d;
    else r.fail("dtype", "must be f32, f16 or bf16, got '" + dtype + "'");
  }
  c.weight_format = r.string("weight_format");
  c.weight_memory_bytes = r.integer<int64_t>("weight_memory_bytes");
  c.kv_page_tokens = r.integer<int64_t>("kv_page_tokens");
  if (r.ok() && c.kv_page_tokens < 1) r.fail("kv_page_tokens", "must be at least 1");
  c.max_rows_per_step = r.integer<int64_t>("max_rows_per_step");
  c.max_sequences_per_step = r.integer<int64_t>("max_sequences_per_step");
  c.max_prompt_rows_per_step = r.integer<int64_t>("max_prompt_rows_per_step");
  c.extra_in_flight = r.integer<int>("extra_in_flight");
  for (auto [key, v] : {std::pair<const char*, int64_t>{"weight_memory_bytes", c.weight_memory_bytes},
                        {"max_rows_per_step", c.max_rows_per_step},
                        {"max_sequences_per_step", c.max_sequences_per_step},
                        {"max_prompt_rows_per_step", c.max_prompt_rows_per_step},
                        {"extra_in_flight", c.extra_in_flight}})
    if (r.ok() && v < 0) r.fail(key, "must not be negative");
  outer.keep_first_error(r);
  return c;
}

ModelShape decode_model_shape(const json& body, FieldReader& outer) {
  FieldReader r(outer.kind(), body, "model.");
  ModelShape m;
  m.n_layer = r.integer<int64_t>("n_layer");
  m.n_embd = r.integer<int64_t>("n_embd");
  m.n_head = r.integer<int64_t>("n_head");
  m.n_inner = r.integer<int64_t>("n_inner");
  m.n_positions = r.integer<int64_t>("n_positions");
  m.vocab_size = r.integer<int64_t>("vocab_size");
  m.tie_word_embeddings = r.boolean("tie_word_embeddings");
  outer.keep_first_error(r);
  return m;
}

WelcomeMsg decode_welcome(FieldReader& r) {
  WelcomeMsg m;
  m.heartbeat_ms = r.integer<int64_t>("heartbeat_ms");
  if (r.has("model"))
    if (const json* model = r.object("model")) m.model = decode_model_shape(*model, r);
  return m;
}

FootprintMsg decode_footprint(FieldReader& r) {
  FootprintMsg m;
  if (r.has("error")) {
    m.error = r.string("error");
    return m;
  }
  StageFootprint& f = m.footprint;
  f.layer_bytes = r.integer<int64_t>("layer_bytes");
  f.embedding_bytes = r.integer<int64_t>("embedding_bytes");
  f.head_bytes = r.integer<int64_t>("head_bytes");
  f.embedding_and_head_bytes = r.integer<int64_t>("embedding_and_head_bytes");
  f.kv_bytes_per_token_per_layer = r.integer<int64_t>("kv_bytes_per_token_per_layer");
  for (auto [key, v] : {std::pair<const char*, int64_t>{"layer_bytes", f.layer_bytes},
                        {"embedding_bytes", f.embedding_bytes},
                        {"head_bytes", f.head_bytes},
                        {"embedding_and_head_bytes", f.embedding_and_head_bytes},
                        {"kv_bytes_per_token_per_layer", f.kv_bytes_per_token_per_layer}})
    if (r.ok() && v < 0) r.fail(key, "must not be negative");
  return m;
}

RegisterMsg decode_register(FieldReader& r, const std::vector<std::byte>& blob) {
  RegisterMsg m;
  m.name = r.string("name");
  m.host = r.string("host");
  m.pid = r.integer<int64_t>("pid");
  m.token = r.string("token");
  m.backend = r.string("backend");
  m.tensor_parallel = r.integer<int>("tensor_parallel");
  m.gpus = r.int_list("gpus");
  m.memory_bytes = r.integer<int64_t>("memory_bytes");
  if (const json* caps = r.object("capabilities")) m.capabilities = decode_capabilities(*caps, r);
  if (const json* dp = r.object("data_plane")) m.data_plane = *dp;
  if (r.has("holding"))
    if (const json* h = r.object("holding")) m.holding = decode_held_stage(*h, r);
  if (r.has("last_epoch")) m.last_epoch = r.integer<uint32_t>("last_epoch");
  m.data_address = blob;
  return m;
}

AssignMsg decode_assign(FieldReader& r) {
  AssignMsg m;
  m.epoch = r.integer<uint32_t>("epoch");
  m.pipeline = r.integer<uint32_t>("pipeline");
  m.stage = r.integer<int>("stage");
  m.num_stages = r.integer<int>("num_stages");
  std::tie(m.layer_begin, m.layer_end) = r.layers("layers");
  m.model = r.string("model");
  m.next_address = r.bytes("next");
  m.prev_address = r.bytes("prev");
  m.coordinator_address = r.bytes("coordinator");
  if (r.ok() && m.coordinator_address.empty()) r.fail("coordinator", "must be a data-plane address, not empty");
  if (r.has("redial")) m.redial = r.boolean("redial");
  return m;
}

ReadyMsg decode_ready(FieldReader& r) {
  ReadyMsg m;
  m.epoch = r.integer<uint32_t>("epoch");
  m.pipeline = r.integer<uint32_t>("pipeline");
  m.stage = r.integer<int>("stage");
  std::tie(m.layer_begin, m.layer_end) = r.layers("layers");
  m.kv_bytes_per_token = r.integer<int64_t>("kv_bytes_per_token");
  m.kv_capacity_tokens = r.integer<int64_t>("kv_capacity_tokens");
  m.backend = r.string("backend");
  m.load_seconds = r.number("load_seconds");
  m.load_bytes = r.integer<int64_t>("load_bytes");
  return m;
}

WorkerState decode_state(FieldReader& r, const char* key) {
  const std::string s = r.string(key);
  for (std::size_t i = 0; i < kStateNames.size(); ++i)
    if (s == kStateNames[i]) return WorkerState(i);
  r.fail(key, "must be one of idle, loading, ready, draining");
  return WorkerState::Idle;
}

// The figures are there when any of their fields is; then all but the kv ones must be.
HeartbeatMsg decode_heartbeat(FieldReader& r) {
  HeartbeatMsg m;
  if (r.has("register")) m.register_again = r.boolean("register");
  bool any = false;
  for (const char* key : {"state", "load_fraction", "busy_fraction", "batches", "busy_seconds_total", "clock_seconds"})
    any = any || r.has(key);
  if (!any) return m;
  WorkerFigures f;
  f.state = decode_state(r, "state");
  f.load_fraction = r.number("load_fraction");
  f.busy_fraction = r.number("busy_fraction");
  f.batches = r.integer<int64_t>("batches");
  f.busy_seconds_total = r.number("busy_seconds_total");
  f.clock_seconds = r.number("clock_seconds");
  if (r.has("kv_used_tokens")) f.kv_used_tokens = r.integer<int64_t>("kv_used_tokens");
  if (r.has("kv_capacity_tokens")) f.kv_capacity_tokens = r.integer<int64_t>("kv_capacity_tokens");
  if (r.has("sequences")) f.sequences = r.integer<int64_t>("sequences");
  if (r.has("wait_input_seconds_total")) f.wait_input_seconds_total = r.number("wait_input_seconds_total");
  if (r.has("idle_ready_seconds_total")) f.idle_ready_seconds_total = r.number("idle_ready_seconds_total");
  m.figures = f;
  return m;
}

DataErrorMsg decode_data_error(FieldReader& r) {
  DataErrorMsg m;
  m.error = r.string("error");
  if (r.has("peer")) m.peer = r.string("peer");  // older workers left it out of wiring failures
  if (r.has("epoch")) m.epoch = r.integer<uint32_t>("epoch");
  return m;
}

AnyControlMsg decode_fields(FieldReader& r, const std::vector<std::byte>& blob) {
  switch (r.kind()) {
    case ControlKind::Register: return decode_register(r, blob);
    case ControlKind::Welcome: return decode_welcome(r);
    case ControlKind::Rejected: return RejectedMsg{.reason = r.string("reason")};
    case ControlKind::Assign: return decode_assign(r);
    case ControlKind::Unassign: return UnassignMsg{};
    case ControlKind::LoadProgress:
      return LoadProgressMsg{.fraction = r.number("fraction"),
                             .bytes_done = r.integer<int64_t>("bytes_done"),
                             .bytes_total = r.integer<int64_t>("bytes_total")};
    case ControlKind::Ready: return decode_ready(r);
    case ControlKind::LoadFailed: return LoadFailedMsg{.error = r.string("error")};
    case ControlKind::Heartbeat: return decode_heartbeat(r);
    case ControlKind::DataError: return decode_data_error(r);
    case ControlKind::Draining: return DrainingMsg{.reason = r.string("reason")};
    case ControlKind::Leaving: return LeavingMsg{.reason = r.string("reason")};
    case ControlKind::Goodbye: return GoodbyeMsg{.reason = r.string("reason")};
    case ControlKind::Drain: return DrainMsg{};
    case ControlKind::Shutdown: return ShutdownMsg{};
    case ControlKind::Footprint: return decode_footprint(r);
  }
  r.fail("type", "names no known kind");
  return ShutdownMsg{};
}

}  // namespace

const char* control_kind_name(ControlKind kind) {
  const auto i = std::size_t(kind);
  return i < kKindNames.size() ? kKindNames[i] : "?";
}

std::optional<ControlKind> control_kind_from_name(std::string_view name) {
  for (std::size_t i = 0; i < kKindNames.size(); ++i)
    if (name == kKindNames[i]) return ControlKind(i);
  return std::nullopt;
}

const char* worker_state_name(WorkerState state) {
  const auto i = std::size_t(state);
  return i < kStateNames.size() ? kStateNames[i] : "?";
}

ControlKind control_kind(const AnyControlMsg& msg) { return ControlKind(msg.index()); }

ModelShape model_shape(const ModelConfig& c) {
  return {.n_layer = c.n_layer, .n_embd = c.n_embd, .n_head = c.n_head, .n_inner = c.n_inner,
          .n_positions = c.n_positions, .vocab_size = c.vocab_size, .tie_word_embeddings = c.tie_word_embeddings};
}

ModelConfig model_config(const ModelShape& m) {
  ModelConfig c;
  c.n_layer = m.n_layer, c.n_embd = m.n_embd, c.n_head = m.n_head, c.n_inner = m.n_inner;
  c.n_positions = m.n_positions, c.vocab_size = m.vocab_size, c.tie_word_embeddings = m.tie_word_embeddings;
  return c;
}

// ---- encoders, one per kind ----

ControlMessage encode(const RegisterMsg& m) {
  const StageCapabilities& c = m.capabilities;
  const json caps = {{"dtype", activation_dtype_wire_name(c.dtype)}, {"weight_format", c.weight_format},
                     {"weight_memory_bytes", c.weight_memory_bytes}, {"kv_page_tokens", c.kv_page_tokens},
                     {"max_rows_per_step", c.max_rows_per_step}, {"max_sequences_per_step", c.max_sequences_per_step},
                     {"max_prompt_rows_per_step", c.max_prompt_rows_per_step}, {"extra_in_flight", c.extra_in_flight}};
  json body = {{"name", m.name}, {"host", m.host}, {"pid", m.pid}, {"token", m.token},
               {"backend", m.backend}, {"tensor_parallel", m.tensor_parallel}, {"gpus", m.gpus},
               {"memory_bytes", m.memory_bytes}, {"capabilities", caps}, {"data_plane", m.data_plane}};
  if (m.last_epoch > 0) body["last_epoch"] = m.last_epoch;
  if (m.holding) {
    const HeldStage& h = *m.holding;
    body["holding"] = {{"epoch", h.epoch}, {"pipeline", h.pipeline}, {"stage", h.stage},
                       {"num_stages", h.num_stages}, {"layers", layers_json(h.layer_begin, h.layer_end)},
                       {"model", h.model}};
  }
  return make<RegisterMsg>(std::move(body), m.data_address);
}

ControlMessage encode(const WelcomeMsg& m) {
  json body = {{"heartbeat_ms", m.heartbeat_ms}};
  if (m.model) {
    const ModelShape& s = *m.model;
    body["model"] = {{"n_layer", s.n_layer}, {"n_embd", s.n_embd}, {"n_head", s.n_head}, {"n_inner", s.n_inner},
                     {"n_positions", s.n_positions}, {"vocab_size", s.vocab_size},
                     {"tie_word_embeddings", s.tie_word_embeddings}};
  }
  return make<WelcomeMsg>(std::move(body));
}
ControlMessage encode(const RejectedMsg& m) { return make<RejectedMsg>({{"reason", m.reason}}); }

ControlMessage encode(const AssignMsg& m) {
  json body = {{"epoch", m.epoch}, {"pipeline", m.pipeline}, {"stage", m.stage},
               {"num_stages", m.num_stages}, {"layers", layers_json(m.layer_begin, m.layer_end)},
               {"model", m.model}, {"next", to_base64(m.next_address)},
               {"prev", to_base64(m.prev_address)}, {"coordinator", to_base64(m.coordinator_address)}};
  if (m.redial) body["redial"] = true;
  return make<AssignMsg>(std::move(body));
}

ControlMessage encode(const UnassignMsg&) { return make<UnassignMsg>(nullptr); }

ControlMessage encode(const LoadProgressMsg& m) {
  return make<LoadProgressMsg>({{"fraction", m.fraction}, {"bytes_done", m.bytes_done}, {"bytes_total", m.bytes_total}});
}

ControlMessage encode(const ReadyMsg& m) {
  return make<ReadyMsg>({{"epoch", m.epoch}, {"pipeline", m.pipeline}, {"stage", m.stage},
                         {"layers", layers_json(m.layer_begin, m.layer_end)},
                         {"kv_bytes_per_token", m.kv_bytes_per_token}, {"kv_capacity_tokens", m.kv_capacity_tokens},
                         {"backend", m.backend}, {"load_seconds", m.load_seconds}, {"load_bytes", m.load_bytes}});
}

ControlMessage encode(const LoadFailedMsg& m) { return make<LoadFailedMsg>({{"error", m.error}}); }

ControlMessage encode(const HeartbeatMsg& m) {
  json body = json::object();
  if (m.figures) {
    const WorkerFigures& f = *m.figures;
    body = {{"state", worker_state_name(f.state)}, {"load_fraction", f.load_fraction},
            {"busy_fraction", f.busy_fraction}, {"batches", f.batches},
            {"busy_seconds_total", f.busy_seconds_total}, {"clock_seconds", f.clock_seconds}};
    if (f.kv_used_tokens) body["kv_used_tokens"] = *f.kv_used_tokens;
    if (f.kv_capacity_tokens) body["kv_capacity_tokens"] = *f.kv_capacity_tokens;
    if (f.sequences) body["sequences"] = *f.sequences;
    if (f.wait_input_seconds_total) body["wait_input_seconds_total"] = *f.wait_input_seconds_total;
    if (f.idle_ready_seconds_total) body["idle_ready_seconds_total"] = *f.idle_ready_seconds_total;
  }
  if (m.register_again) body["register"] = true;
  return make<HeartbeatMsg>(std::move(body));
}

ControlMessage encode(const DataErrorMsg& m) {
  json body = {{"error", m.error}, {"peer", m.peer}};
  if (m.epoch) body["epoch"] = *m.epoch;
  return make<DataErrorMsg>(std::move(body));
}

ControlMessage encode(const DrainingMsg& m) { return make<DrainingMsg>({{"reason", m.reason}}); }
ControlMessage encode(const LeavingMsg& m) { return make<LeavingMsg>({{"reason", m.reason}}); }
ControlMessage encode(const GoodbyeMsg& m) { return make<GoodbyeMsg>({{"reason", m.reason}}); }
ControlMessage encode(const DrainMsg&) { return make<DrainMsg>(nullptr); }
ControlMessage encode(const ShutdownMsg&) { return make<ShutdownMsg>(nullptr); }

ControlMessage encode(const FootprintMsg& m) {
  if (!m.error.empty()) return make<FootprintMsg>({{"error", m.error}});
  const StageFootprint& f = m.footprint;
  return make<FootprintMsg>({{"layer_bytes", f.layer_bytes}, {"embedding_bytes", f.embedding_bytes},
                             {"head_bytes", f.head_bytes}, {"embedding_and_head_bytes", f.embedding_and_head_bytes},
                             {"kv_bytes_per_token_per_layer", f.kv_bytes_per_token_per_layer}});
}

ControlMessage encode(const AnyControlMsg& msg) {
  return std::visit([](const auto& m) { return encode(m); }, msg);
}

Expected<AnyControlMsg> decode_control(const ControlMessage& m) {
  if (Status s = validate_control_message(m); !s) return s;
  const std::string type = m.type();
  const auto kind = control_kind_from_name(type);
  if (!kind) return Status::error("unknown control message type '" + type + "'");
  // Before anything copies the body (data_plane is kept): a deeper one overflows the stack.
  if (json_deeper_than(m.body, kMaxJsonDepth))
    return Status::error(type + ": the message nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  try {
    FieldReader r(*kind, m.body);
    AnyControlMsg msg = decode_fields(r, m.blob);
    if (!r.ok()) return r.status();
    return msg;
  } catch (const std::exception& e) {  // the reader checks types first; this is a backstop
    return Status::error(type + ": malformed message: " + e.what());
  }
}

}  // namespace conveyor::transport

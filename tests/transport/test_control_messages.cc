// The typed control messages: every kind survives encode -> wire text -> decode, the JSON on
// the wire is the format the daemons spoke before these types (pinned literally), and
// malformed input is an error naming the message and the field, never an exception.
#include "transport/control_messages.h"

#include <gtest/gtest.h>

#include <set>

namespace conveyor::transport {
namespace {

using json = nlohmann::json;

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> out;
  for (char c : s) out.push_back(std::byte(c));
  return out;
}

// What the other end gets: the body as JSON text, parsed again, and the binary frame.
ControlMessage over_the_wire(const ControlMessage& m) {
  ControlMessage out;
  out.body = json::parse(m.body.dump());
  out.blob = m.blob;
  return out;
}

AnyControlMsg round_trip(const AnyControlMsg& msg) {
  auto back = decode_control(over_the_wire(encode(msg)));
  EXPECT_TRUE(back.ok()) << back.error();
  return back.ok() ? *back : AnyControlMsg{ShutdownMsg{}};
}

AssignMsg sample_assign() {
  return {.epoch = 7, .pipeline = 1, .stage = 2, .num_stages = 3, .layer_begin = 8, .layer_end = 12,
          .model = "/models/gpt2", .next_address = {}, .prev_address = bytes_of("prev-stage"),
          .coordinator_address = bytes_of("coord\x01\xff")};
}

RegisterMsg sample_register() {
  return {.name = "w1", .host = "node1", .pid = 4242, .token = "secret", .backend = "cuda",
          .tensor_parallel = 2, .gpus = {0, 3}, .memory_bytes = int64_t(80) << 30,
          .capabilities = {.dtype = DType::BF16, .weight_format = "int8", .weight_memory_bytes = int64_t(72) << 30,
                           .kv_page_tokens = 16, .max_rows_per_step = 4096, .max_sequences_per_step = 256,
                           .max_prompt_rows_per_step = 512, .extra_in_flight = 0},
          .data_plane = {{"staging", "page-locked host"}, {"ucx_cuda_memory", false}},
          .holding = HeldStage{.epoch = 3, .pipeline = 0, .stage = 1, .num_stages = 2, .layer_begin = 6,
                               .layer_end = 12, .model = "/models/gpt2"},
          .last_epoch = 5,
          .data_address = bytes_of("CVYA-address")};
}

ModelShape sample_model() {
  return {.n_layer = 48, .n_embd = 1600, .n_head = 25, .n_inner = 6400, .n_positions = 1024, .vocab_size = 50257,
          .tie_word_embeddings = true};
}

FootprintMsg sample_footprint() {
  return {.footprint = {.layer_bytes = 61444096, .embedding_bytes = 164105216, .head_bytes = 160826368,
                        .embedding_and_head_bytes = 164111616, .kv_bytes_per_token_per_layer = 6400}};
}

HeartbeatMsg sample_worker_heartbeat() {
  return {.figures = WorkerFigures{.state = WorkerState::Ready, .load_fraction = 1, .busy_fraction = 0.25,
                                   .batches = 99, .busy_seconds_total = 12.5, .clock_seconds = 1234.5,
                                   .kv_used_tokens = 300, .kv_capacity_tokens = 4096, .sequences = 4,
                                   .wait_input_seconds_total = 1.5, .idle_ready_seconds_total = 0.25}};
}

// One message of every kind, with values other than the defaults.
std::vector<AnyControlMsg> every_kind() {
  return {sample_register(),
          WelcomeMsg{.heartbeat_ms = 500, .model = sample_model()},
          RejectedMsg{.reason = "wrong join token"},
          sample_assign(),
          UnassignMsg{},
          LoadProgressMsg{.fraction = 0.5, .bytes_done = 1000, .bytes_total = 2000},
          ReadyMsg{.epoch = 7, .pipeline = 1, .stage = 2, .layer_begin = 8, .layer_end = 12,
                   .kv_bytes_per_token = 18432, .kv_capacity_tokens = 29127, .backend = "cpu (2 threads)",
                   .load_seconds = 1.75, .load_bytes = 123456789},
          LoadFailedMsg{.error = "no such file"},
          sample_worker_heartbeat(),
          DataErrorMsg{.error = "cut off", .peer = "next", .epoch = 7},
          DrainingMsg{.reason = "signal"},
          LeavingMsg{.reason = "signal"},
          GoodbyeMsg{.reason = "the coordinator is stopping"},
          DrainMsg{},
          ShutdownMsg{},
          sample_footprint()};
}

TEST(ControlMessages, EveryKindRoundTrips) {
  std::set<ControlKind> seen;
  for (const AnyControlMsg& msg : every_kind()) {
    const ControlKind kind = control_kind(msg);
    seen.insert(kind);
    const ControlMessage wire = encode(msg);
    EXPECT_EQ(wire.type(), control_kind_name(kind));
    EXPECT_EQ(round_trip(msg), msg) << control_kind_name(kind) << ": " << wire.body.dump();
  }
  EXPECT_EQ(seen.size(), std::variant_size_v<AnyControlMsg>);
}

TEST(ControlMessages, OptionalFieldsRoundTripWhenAbsent) {
  RegisterMsg r = sample_register();
  r.holding.reset();
  r.gpus.clear();
  EXPECT_EQ(round_trip(r), AnyControlMsg(r));
  EXPECT_EQ(round_trip(WelcomeMsg{.heartbeat_ms = 5}), AnyControlMsg(WelcomeMsg{.heartbeat_ms = 5}));
  EXPECT_EQ(round_trip(FootprintMsg{.error = "no"}), AnyControlMsg(FootprintMsg{.error = "no"}));
  HeartbeatMsg h = sample_worker_heartbeat();
  h.figures->kv_used_tokens.reset();
  h.figures->kv_capacity_tokens.reset();
  h.figures->sequences.reset();
  EXPECT_EQ(round_trip(h), AnyControlMsg(h));
  EXPECT_EQ(round_trip(HeartbeatMsg{}), AnyControlMsg(HeartbeatMsg{}));
  EXPECT_EQ(round_trip(HeartbeatMsg{.register_again = true}), AnyControlMsg(HeartbeatMsg{.register_again = true}));
  EXPECT_EQ(round_trip(DataErrorMsg{.error = "x"}), AnyControlMsg(DataErrorMsg{.error = "x"}));
}

TEST(ControlMessages, KindNamesAreTheWireTypes) {
  const char* expected[] = {"register",  "welcome",    "rejected", "assign",  "unassign",
                            "load_progress", "ready",  "load_failed", "heartbeat", "data_error",
                            "draining",  "leaving",    "goodbye",  "drain",   "shutdown",
                            "footprint"};
  for (int i = 0; i < int(std::size(expected)); ++i) {
    EXPECT_STREQ(control_kind_name(ControlKind(i)), expected[i]);
    EXPECT_EQ(control_kind_from_name(expected[i]), ControlKind(i));
  }
  EXPECT_EQ(control_kind_from_name("hello"), std::nullopt);
  EXPECT_STREQ(worker_state_name(WorkerState::Idle), "idle");
  EXPECT_STREQ(worker_state_name(WorkerState::Loading), "loading");
  EXPECT_STREQ(worker_state_name(WorkerState::Ready), "ready");
  EXPECT_STREQ(worker_state_name(WorkerState::Draining), "draining");
}

// ---- the wire format, pinned ----

TEST(ControlMessages, AssignWireJson) {
  const ControlMessage m = encode(sample_assign());
  EXPECT_EQ(m.body, json::parse(R"({"type": "assign", "epoch": 7, "pipeline": 1, "stage": 2, "num_stages": 3,
      "layers": [8, 12], "model": "/models/gpt2", "next": "", "prev": "cHJldi1zdGFnZQ==",
      "coordinator": "Y29vcmQB/w=="})"));
  EXPECT_TRUE(m.blob.empty());
  // A replay after a lost micro-batch: "redial" (absent when false), and it comes back.
  AssignMsg redial = sample_assign();
  redial.redial = true;
  const ControlMessage r = encode(redial);
  EXPECT_EQ(r.body.value("redial", false), true) << r.body.dump();
  EXPECT_EQ(round_trip(redial), AnyControlMsg(redial));
  ControlMessage bad = r;
  bad.body["redial"] = "yes";
  auto refused = decode_control(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().find("redial"), std::string::npos) << refused.error();
}

TEST(ControlMessages, RegisterWireJson) {
  const ControlMessage m = encode(sample_register());
  EXPECT_EQ(m.body, json::parse(R"({"type": "register", "name": "w1", "host": "node1", "pid": 4242,
      "token": "secret", "backend": "cuda", "tensor_parallel": 2, "gpus": [0, 3],
      "memory_bytes": 85899345920, "last_epoch": 5,
      "capabilities": {"dtype": "bf16", "weight_format": "int8", "weight_memory_bytes": 77309411328,
                       "kv_page_tokens": 16, "max_rows_per_step": 4096, "max_sequences_per_step": 256,
                       "max_prompt_rows_per_step": 512, "extra_in_flight": 0},
      "data_plane": {"staging": "page-locked host", "ucx_cuda_memory": false},
      "holding": {"epoch": 3, "pipeline": 0, "stage": 1, "num_stages": 2, "layers": [6, 12],
                  "model": "/models/gpt2"}})"));
  EXPECT_EQ(m.blob, bytes_of("CVYA-address"));  // the address travels in the binary frame
}

TEST(ControlMessages, HeartbeatWireJson) {
  EXPECT_EQ(encode(sample_worker_heartbeat()).body,
            json::parse(R"({"type": "heartbeat", "state": "ready", "load_fraction": 1.0, "busy_fraction": 0.25,
                "batches": 99, "busy_seconds_total": 12.5, "clock_seconds": 1234.5, "kv_used_tokens": 300,
                "kv_capacity_tokens": 4096, "sequences": 4, "wait_input_seconds_total": 1.5,
                "idle_ready_seconds_total": 0.25})"));
  EXPECT_EQ(encode(HeartbeatMsg{}).body, json::parse(R"({"type": "heartbeat"})"));
  EXPECT_EQ(encode(HeartbeatMsg{.register_again = true}).body,
            json::parse(R"({"type": "heartbeat", "register": true})"));
}

TEST(ControlMessages, SmallMessagesWireJson) {
  EXPECT_EQ(encode(ReadyMsg{.epoch = 2, .pipeline = 0, .stage = 1, .layer_begin = 6, .layer_end = 12,
                            .kv_bytes_per_token = 10, .kv_capacity_tokens = 20, .backend = "cpu",
                            .load_seconds = 0.5, .load_bytes = 30})
                .body,
            json::parse(R"({"type": "ready", "epoch": 2, "pipeline": 0, "stage": 1, "layers": [6, 12],
                "kv_bytes_per_token": 10, "kv_capacity_tokens": 20, "backend": "cpu", "load_seconds": 0.5,
                "load_bytes": 30})"));
  EXPECT_EQ(encode(DataErrorMsg{.error = "e", .peer = "next", .epoch = 4}).body,
            json::parse(R"({"type": "data_error", "error": "e", "peer": "next", "epoch": 4})"));
  EXPECT_EQ(encode(LoadProgressMsg{.fraction = 0.5, .bytes_done = 1, .bytes_total = 2}).body,
            json::parse(R"({"type": "load_progress", "fraction": 0.5, "bytes_done": 1, "bytes_total": 2})"));
  EXPECT_EQ(encode(WelcomeMsg{.heartbeat_ms = 500}).body, json::parse(R"({"type": "welcome", "heartbeat_ms": 500})"));
  EXPECT_EQ(encode(WelcomeMsg{.heartbeat_ms = 500, .model = sample_model()}).body,
            json::parse(R"({"type": "welcome", "heartbeat_ms": 500, "model": {"n_layer": 48, "n_embd": 1600,
                "n_head": 25, "n_inner": 6400, "n_positions": 1024, "vocab_size": 50257,
                "tie_word_embeddings": true}})"));
  EXPECT_EQ(encode(sample_footprint()).body,
            json::parse(R"({"type": "footprint", "layer_bytes": 61444096, "embedding_bytes": 164105216,
                "head_bytes": 160826368, "embedding_and_head_bytes": 164111616,
                "kv_bytes_per_token_per_layer": 6400})"));
  EXPECT_EQ(encode(FootprintMsg{.error = "3 GPUs for 2 heads"}).body,
            json::parse(R"({"type": "footprint", "error": "3 GPUs for 2 heads"})"));
  EXPECT_EQ(encode(UnassignMsg{}).body, json::parse(R"({"type": "unassign"})"));
  EXPECT_EQ(encode(LeavingMsg{.reason = "signal"}).body, json::parse(R"({"type": "leaving", "reason": "signal"})"));
}

// Messages as the coordinator builds them by hand today decode to the structs.
TEST(ControlMessages, DecodesTheHandBuiltFormat) {
  auto assign = decode_control(ControlMessage::make(
      "assign", {{"epoch", 7}, {"pipeline", 1}, {"stage", 2}, {"num_stages", 3}, {"layers", {8, 12}},
                 {"model", "/models/gpt2"}, {"coordinator", to_base64(bytes_of("coord\x01\xff"))},
                 {"next", ""}, {"prev", to_base64(bytes_of("prev-stage"))}}));
  ASSERT_TRUE(assign.ok()) << assign.error();
  EXPECT_EQ(*assign, AnyControlMsg(sample_assign()));

  auto hb = decode_control(ControlMessage::make("heartbeat"));
  ASSERT_TRUE(hb.ok()) << hb.error();
  EXPECT_EQ(*hb, AnyControlMsg(HeartbeatMsg{}));

  // Wiring failures used to carry no peer.
  auto de = decode_control(ControlMessage::make("data_error", {{"error", "wiring: x"}, {"epoch", 3}}));
  ASSERT_TRUE(de.ok()) << de.error();
  EXPECT_EQ(*de, AnyControlMsg(DataErrorMsg{.error = "wiring: x", .epoch = 3}));

  // Fields a decoder does not know are ignored; null is "not given" for an optional field.
  auto reg = encode(sample_register());
  reg.body["future_field"] = {1, 2};
  reg.body["holding"] = nullptr;
  auto back = decode_control(reg);
  ASSERT_TRUE(back.ok()) << back.error();
  EXPECT_FALSE(std::get<RegisterMsg>(*back).holding.has_value());
}

// ---- malformed input ----

std::string decode_error(const ControlMessage& m) {
  auto r = decode_control(m);
  return r.ok() ? "(decoded)" : r.error();
}

ControlMessage assign_with(const char* key, json value) {
  ControlMessage m = encode(sample_assign());
  if (value.is_discarded()) m.body.erase(key);
  else m.body[key] = std::move(value);
  return m;
}

TEST(ControlMessages, ErrorsNameMessageAndField) {
  EXPECT_EQ(decode_error(assign_with("epoch", json(json::value_t::discarded))), "assign: missing field 'epoch'");
  EXPECT_EQ(decode_error(assign_with("layers", "0-4")), "assign: field 'layers' must be [begin, end] integers");
  EXPECT_EQ(decode_error(assign_with("layers", {4, 2})), "assign: field 'layers' must be [begin, end] integers");
  EXPECT_EQ(decode_error(assign_with("layers", {0, 1.5})), "assign: field 'layers' must be [begin, end] integers");
  EXPECT_EQ(decode_error(assign_with("epoch", -1)), "assign: field 'epoch' must be an integer from 0 to 4294967295");
  EXPECT_EQ(decode_error(assign_with("stage", "1")),
            "assign: field 'stage' must be an integer from -2147483648 to 2147483647");
  EXPECT_EQ(decode_error(assign_with("model", 3)), "assign: field 'model' must be a string");
  EXPECT_EQ(decode_error(assign_with("model", nullptr)), "assign: missing field 'model'");
  EXPECT_EQ(decode_error(assign_with("coordinator", "")),
            "assign: field 'coordinator' must be a data-plane address, not empty");
  const std::string bad64 = decode_error(assign_with("next", "not base64!"));
  EXPECT_EQ(bad64.rfind("assign: field 'next' is not base64: ", 0), 0u) << bad64;

  EXPECT_EQ(decode_error(ControlMessage::make("welcome", {{"heartbeat_ms", "fast"}})),
            "welcome: field 'heartbeat_ms' must be an integer from -9223372036854775808 to 9223372036854775807");
  EXPECT_EQ(decode_error(ControlMessage::make("rejected")), "rejected: missing field 'reason'");
  EXPECT_EQ(decode_error(ControlMessage::make("load_progress", {{"fraction", "half"}, {"bytes_done", 1},
                                                                {"bytes_total", 2}})),
            "load_progress: field 'fraction' must be a number");

  ControlMessage reg = encode(sample_register());
  reg.body["holding"]["layers"] = "all";
  EXPECT_EQ(decode_error(reg), "register: field 'holding.layers' must be [begin, end] integers");
  reg = encode(sample_register());
  reg.body["gpus"] = {0, "1"};
  EXPECT_EQ(decode_error(reg), "register: field 'gpus' must be an array of integers");
  reg.body["gpus"] = json::array();
  reg.body["data_plane"] = "ucx";
  EXPECT_EQ(decode_error(reg), "register: field 'data_plane' must be a JSON object");
  // A register without its capabilities (a worker older than them) is refused, naming them.
  reg = encode(sample_register());
  reg.body.erase("capabilities");
  EXPECT_EQ(decode_error(reg), "register: missing field 'capabilities'");
  reg = encode(sample_register());
  reg.body["capabilities"]["kv_page_tokens"] = 0;
  EXPECT_EQ(decode_error(reg), "register: field 'capabilities.kv_page_tokens' must be at least 1");
  reg.body["capabilities"]["kv_page_tokens"] = 16;
  reg.body["capabilities"]["max_rows_per_step"] = -1;
  EXPECT_EQ(decode_error(reg), "register: field 'capabilities.max_rows_per_step' must not be negative");
  EXPECT_EQ(decode_error(ControlMessage::make("footprint", {{"layer_bytes", 1}})),
            "footprint: missing field 'embedding_bytes'");
  EXPECT_EQ(decode_error(ControlMessage::make("footprint", {{"layer_bytes", -1}, {"embedding_bytes", 0},
                                                            {"head_bytes", 0}, {"embedding_and_head_bytes", 0},
                                                            {"kv_bytes_per_token_per_layer", 0}})),
            "footprint: field 'layer_bytes' must not be negative");
  ControlMessage welcome = encode(WelcomeMsg{.heartbeat_ms = 1, .model = sample_model()});
  welcome.body["model"]["n_layer"] = "many";
  EXPECT_EQ(decode_error(welcome),
            "welcome: field 'model.n_layer' must be an integer from -9223372036854775808 to 9223372036854775807");

  ControlMessage hb = encode(sample_worker_heartbeat());
  hb.body["state"] = "sleeping";
  EXPECT_EQ(decode_error(hb), "heartbeat: field 'state' must be one of idle, loading, ready, draining");
  EXPECT_EQ(decode_error(ControlMessage::make("heartbeat", {{"busy_fraction", 0.5}})),
            "heartbeat: missing field 'state'");  // figures come whole or not at all
  EXPECT_EQ(decode_error(ControlMessage::make("heartbeat", {{"register", "yes"}})),
            "heartbeat: field 'register' must be true or false");
}

TEST(ControlMessages, ErrorsForTheFrame) {
  EXPECT_EQ(decode_error(ControlMessage::make("x")), "unknown control message type 'x'");
  ControlMessage no_type;
  EXPECT_EQ(decode_error(no_type), "control message has no \"type\" field");
  ControlMessage not_object;
  not_object.body = json::array({1});
  EXPECT_EQ(decode_error(not_object), "control message is a JSON array, expected an object");
}

// Every field of every kind replaced by values of every JSON type: decoding never throws,
// and a failure names the message.
TEST(ControlMessages, MalformedFieldsNeverThrow) {
  const json oddities[] = {nullptr, true, -1, 1.5, 1e300, "text", json::array(), json::array({1, 2}),
                           json::object(), json(uint64_t(1) << 63)};
  for (const AnyControlMsg& msg : every_kind()) {
    const ControlMessage good = encode(msg);
    const std::string type = good.type();
    for (const auto& [key, _] : good.body.items()) {
      if (key == "type") continue;
      for (const json& odd : oddities) {
        ControlMessage m = good;
        m.body[key] = odd;
        Expected<AnyControlMsg> r = AnyControlMsg{};
        ASSERT_NO_THROW(r = decode_control(m)) << type << "." << key << " = " << odd.dump();
        if (!r.ok()) {
          EXPECT_EQ(r.error().rfind(type + ": ", 0), 0u) << r.error();
        }
      }
    }
  }
}


// Found by fuzz/fuzz_control (issue 28): a register whose data_plane nested 100,000 arrays
// parsed (nlohmann's parser is iterative) but overflowed the stack when decode copied it, so
// one message from any peer that reached the control port could kill the coordinator. A
// body deeper than kMaxJsonDepth is now refused before anything copies it.
TEST(ControlMessages, DeeplyNestedBodyIsRefusedNotCopied) {
  const int depth = 100000;
  const std::string text = R"({"type":"register","name":"w","host":"h","pid":1,"token":"t","backend":"cpu",)"
                           R"("tensor_parallel":1,"gpus":[],"memory_bytes":1,"kv_cache_bytes":1,)"
                           R"("int8_weights":false,"data_plane":{"a":)" +
                           std::string(depth, '[') + std::string(depth, ']') + "}}";
  ControlMessage m;
  m.body = json::parse(text);
  EXPECT_EQ(decode_error(m), "register: the message nests deeper than 64 levels");
  // As deep as a real message gets, and a little more, is fine.
  RegisterMsg reg;
  reg.data_plane = {{"a", {{"b", json::array({json::array({1})})}}}};
  EXPECT_TRUE(decode_control(encode(reg)).ok());
}

}  // namespace
}  // namespace conveyor::transport

#include "fuzz/fuzz_targets.h"

#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "common/sampling_params.h"
#include "coordinator/cluster_config.h"
#include "coordinator/rest/admin_api.h"
#include "coordinator/rest/openai_api.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"
#include "transport/control_messages.h"

#ifndef CONVEYOR_SOURCE_DIR
#error "fuzz_targets.cc needs CONVEYOR_SOURCE_DIR (the repository root, for models/brown-gpt2)"
#endif

namespace conveyor::fuzz {
namespace {

using nlohmann::json;

std::string_view as_text(std::span<const uint8_t> data) {
  return {reinterpret_cast<const char*>(data.data()), data.size()};
}

// A refusal must say what was wrong.
std::string check_refusal(const char* what, const Status& s) {
  return s.message().empty() ? std::string(what) + ": refused with an empty message" : std::string();
}

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::load(fuzz_model_dir()).value();
  return t;
}

const ModelConfig& model_config() {
  static const ModelConfig c = load_model_config(fuzz_model_dir()).value();
  return c;
}

}  // namespace

std::string fuzz_model_dir() {
  const char* env = std::getenv("CONVEYOR_SOURCE_DIR");
  return std::string(env && *env ? env : CONVEYOR_SOURCE_DIR) + "/models/brown-gpt2";
}

// ---- data wire: micro-batches and batch results ----------------------------------------

// The admissions section, as the last stage reads it: canonical, like the result.
std::string fuzz_admissions(std::span<const uint8_t> bytes) {
  auto a = decode_admissions(bytes);
  if (!a.ok()) return check_refusal("admissions", a.status());
  if (encode_admissions(*a) != std::vector<uint8_t>(bytes.begin(), bytes.end()) && !a->empty())
    return "admissions: encode(decode(x)) differs from x";
  for (const Admission& one : *a) (void)validate(one.state, model_config());
  return {};
}

std::string fuzz_microbatch(std::span<const uint8_t> data) {
  // A lookahead token is sent only with its flag, so compare re-encodings, not the input.
  if (auto b = decode_microbatch(data); b.ok()) {
    const std::vector<uint8_t> once = encode(*b);
    auto again = decode_microbatch(once);
    if (!again.ok()) return "micro-batch: decode(encode(x)) refused: " + again.error();
    if (encode(*again) != once) return "micro-batch: decode(encode(x)) differs from x";
    if (b->total_tokens() != int64_t(b->token_ids.size())) return "micro-batch: slices and token ids disagree";
    (void)validate(*b, model_config());
    if (std::string e = fuzz_admissions(b->admissions); !e.empty()) return e;
  } else if (std::string e = check_refusal("micro-batch", b.status()); !e.empty()) {
    return e;
  }
  // Any bytes as an admissions section, too.
  if (std::string e = fuzz_admissions(data); !e.empty()) return e;
  // The result format is canonical: what decodes re-encodes to the same bytes.
  if (auto r = decode_batch_result(data); r.ok()) {
    if (encode(*r) != std::vector<uint8_t>(data.begin(), data.end()))
      return "batch result: encode(decode(x)) differs from x";
  } else if (std::string e = check_refusal("batch result", r.status()); !e.empty()) {
    return e;
  }
  return {};
}

// ---- control plane ---------------------------------------------------------------------

std::string fuzz_control(std::span<const uint8_t> data) {
  // As transport/control_plane.cc receives a message: frame 0 is JSON text, frame 1 (here:
  // the bytes after the first NUL) the optional binary frame.
  const std::string_view text = as_text(data);
  const size_t nul = text.find('\0');
  transport::ControlMessage m;
  m.body = json::parse(text.substr(0, nul), nullptr, /*allow_exceptions=*/false);
  if (m.body.is_discarded()) return {};
  if (nul != std::string_view::npos) {
    const auto* p = reinterpret_cast<const std::byte*>(text.data() + nul + 1);
    m.blob.assign(p, p + (text.size() - nul - 1));
  }
  auto msg = transport::decode_control(m);
  if (!msg.ok()) return check_refusal("control message", msg.status());
  // Through the wire again: encode, dump, parse, decode.
  const transport::ControlMessage out = transport::encode(*msg);
  transport::ControlMessage back;
  back.body = json::parse(out.body.dump(), nullptr, /*allow_exceptions=*/false);
  back.blob = out.blob;
  auto again = transport::decode_control(back);
  if (!again.ok()) return "control message: decode(encode(x)) refused: " + again.error();
  if (!(*again == *msg)) return "control message: decode(encode(x)) differs from x: " + out.body.dump();
  return {};
}

// ---- configuration files ---------------------------------------------------------------

std::string fuzz_cluster_config(std::span<const uint8_t> data) {
  // The join token must come from the file, not from the environment of whoever runs this.
  static const bool unset = (::unsetenv("CONVEYOR_JOIN_TOKEN"), ::unsetenv("CONVEYOR_API_KEY"), true);
  (void)unset;
  // model.path relative to models/, so "path: brown-gpt2" finds a real model.
  const std::string models = fuzz_model_dir() + "/..";
  auto c = parse_cluster_config(std::string(as_text(data)), "fuzz.yaml", models);
  if (!c.ok()) return check_refusal("cluster config", c.status());
  if (c->stages < 1 || c->replicas < 1) return "cluster config: accepted stages/replicas below 1";
  if (Status s = check_layer_split(c->layers, c->stages, c->model.n_layer); !s)
    return "cluster config: accepted an impossible plan: " + s.message();
  if (c->http_port < 0 || c->http_port > 65535 || c->control_port < 0 || c->control_port > 65535)
    return "cluster config: accepted a port outside 0..65535";
  if (c->in_flight < 1) return "cluster config: in_flight below 1";
  if (c->join_token.empty()) return "cluster config: accepted without a join token";
  return {};
}

std::string fuzz_model_config(std::span<const uint8_t> data) {
  auto c = parse_model_config(std::string(as_text(data)), "config.json");
  if (!c.ok()) return check_refusal("model config", c.status());
  return {};
}

// ---- checkpoints -----------------------------------------------------------------------

std::string fuzz_safetensors(std::span<const uint8_t> data) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data.data()), data.size());
  auto tensors = parse_safetensors(file, "fuzz.safetensors");
  if (!tensors.ok()) return check_refusal("safetensors", tensors.status());
  std::vector<float> f32;
  for (const TensorInfo& t : *tensors) {
    if (t.offset > file.size() || t.size_bytes > file.size() - t.offset)
      return "safetensors: tensor \"" + t.name + "\" lies outside the file";
    if (uint64_t(t.num_elements()) * uint64_t(dtype_bytes(t.dtype)) != t.size_bytes)
      return "safetensors: tensor \"" + t.name + "\": shape and size disagree";
    // Read every accepted byte (ASan sees a read past the input).
    const size_t n = size_t(t.num_elements());
    if (t.dtype == DType::F32 || t.dtype == DType::F16 || t.dtype == DType::BF16) {
      f32.resize(n);
      if (Status s = convert_to_f32(t.dtype, file.data() + t.offset, n, f32.data()); !s)
        return "safetensors: convert_to_f32 refused a float tensor: " + s.message();
    }
  }
  return {};
}

// ---- tokenizer -------------------------------------------------------------------------

std::string fuzz_tokenizer(std::span<const uint8_t> data) {
  const Tokenizer& t = tokenizer();
  const std::string_view text = as_text(data);
  // encode: any bytes, and decode(encode(x)) == x (model/tokenizer.h).
  const std::vector<int32_t> ids = t.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= t.vocab_size()) return "tokenizer: encode gave id " + std::to_string(id) + " outside the vocabulary";
  if (t.decode(ids) != text) return "tokenizer: decode(encode(x)) != x";
  std::string joined;
  for (std::string_view piece : Tokenizer::pre_tokenize(text)) joined += piece;
  if (joined != text) return "tokenizer: the pre-tokenizer's pieces do not concatenate to the input";
  // decode: the same bytes read as int32 ids, any value.
  std::vector<int32_t> any(data.size() / 4);
  if (!any.empty()) std::memcpy(any.data(), data.data(), any.size() * 4);
  std::string expect;
  bool all_known = true;
  for (int32_t id : any) {
    const std::string bytes = t.token_bytes(id);
    all_known = all_known && !bytes.empty();
    expect += bytes;
  }
  if (t.decode(any) != expect) return "tokenizer: decode differs from the concatenated token_bytes";
  auto checked = t.decode_checked(any);
  if (checked.ok() != all_known) return "tokenizer: decode_checked disagrees with token_bytes on which ids exist";
  if (checked.ok() && *checked != expect) return "tokenizer: decode_checked differs from decode";
  if (!checked.ok()) return check_refusal("tokenizer decode_checked", checked.status());
  return {};
}

// ---- REST bodies -----------------------------------------------------------------------

std::string fuzz_completion(std::span<const uint8_t> data) {
  const ApiLimits limits;
  const ModelConfig& cfg = model_config();
  ApiError error;
  ResponseOptions options;
  auto r = parse_completion_body(as_text(data), tokenizer(), cfg, limits, "brown-gpt2", &error, &options);
  if (r.ok()) {
    const CompletionRequest& q = *r;
    if (q.prompts.empty() || q.prompts.size() > size_t(limits.max_prompts)) return "completion: prompt count out of range";
    for (const auto& p : q.prompts) {
      if (p.empty()) return "completion: accepted an empty prompt";
      for (int32_t id : p)
        if (id < 0 || id >= tokenizer().vocab_size()) return "completion: prompt token outside the vocabulary";
      if (int64_t(p.size()) + q.max_tokens > cfg.n_positions) return "completion: prompt + max_tokens exceeds the context";
    }
    if (q.max_tokens < 0 || q.n < 1 || q.n > limits.max_n) return "completion: max_tokens or n out of range";
    if (q.logprobs < -1 || q.logprobs > limits.max_logprobs) return "completion: logprobs out of range";
    if (q.stop.size() > size_t(limits.max_stop)) return "completion: too many stop strings";
    if (Status s = validate_sampling_params(q.sampling, cfg.vocab_size); !s)
      return "completion: accepted sampling parameters the stages refuse: " + s.message();
  } else {
    if (error.message.empty() || error.message != r.error()) return "completion: refusal without its message";
    if (error.http_status < 400 || error.http_status > 499) return "completion: refusal is not a 4xx";
    (void)error_body(error);
  }
  // The operator's plan body, from the same JSON.
  const json body = json::parse(as_text(data), nullptr, /*allow_exceptions=*/false);
  if (!body.is_discarded()) {
    ApiError plan_error;
    auto plan = parse_plan_body(body, &plan_error);
    if (!plan.ok() && plan_error.message.empty()) return "plan: refusal without a message";
  }
  return {};
}

std::span<const NamedTarget> all_targets() {
  static const NamedTarget targets[] = {
      {"microbatch", fuzz_microbatch},       {"control", fuzz_control},       {"cluster_config", fuzz_cluster_config},
      {"model_config", fuzz_model_config},   {"safetensors", fuzz_safetensors}, {"tokenizer", fuzz_tokenizer},
      {"completion", fuzz_completion},
  };
  return targets;
}

}  // namespace conveyor::fuzz

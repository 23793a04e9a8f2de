#include "protocol/seq_state.h"

#include <string>

#include "protocol/wire_io.h"

namespace conveyor {
namespace {

// The fixed part of one admission: ids, lengths and the scalar sampling parameters, up to
// and including the two counts.
constexpr size_t kFixedAdmissionBytes = 8 + 4 + 4 + 8 + 4 * 7 + 8 + 4 + 4;

void put_state(wire::Writer& w, const SeqState& s) {
  w.put(s.prompt_len), w.put(s.top_logprobs), w.put(s.sample_index);
  const SamplingParams& p = s.sampling;
  w.put(p.temperature), w.put(int32_t(p.top_k)), w.put(p.top_p), w.put(p.repetition_penalty);
  w.put(p.presence_penalty), w.put(p.frequency_penalty), w.put(int32_t(p.min_tokens));
  w.put(p.seed);
  w.put_vec(p.stop_token_ids);
  w.put_pairs(p.logit_bias);
}

bool get_state(wire::Reader& r, SeqState& s) {
  SamplingParams& p = s.sampling;
  int32_t top_k = 0, min_tokens = 0;
  const bool ok = r.get(s.prompt_len, "prompt_len") && r.get(s.top_logprobs, "top_logprobs") &&
                  r.get(s.sample_index, "sample_index") && r.get(p.temperature, "temperature") &&
                  r.get(top_k, "top_k") && r.get(p.top_p, "top_p") &&
                  r.get(p.repetition_penalty, "repetition_penalty") &&
                  r.get(p.presence_penalty, "presence_penalty") &&
                  r.get(p.frequency_penalty, "frequency_penalty") && r.get(min_tokens, "min_tokens") &&
                  r.get(p.seed, "seed") && r.get_vec(p.stop_token_ids, "stop_token_ids") &&
                  r.get_pairs(p.logit_bias, "logit_bias");
  p.top_k = top_k;
  p.min_tokens = min_tokens;
  return ok;
}

}  // namespace

std::vector<uint8_t> encode_admissions(std::span<const Admission> admissions) {
  if (admissions.empty()) return {};
  wire::Writer w;
  w.put<uint32_t>(uint32_t(admissions.size()));
  for (const Admission& a : admissions) {
    w.put(a.seq_id);
    put_state(w, a.state);
  }
  return w.take();
}

Expected<std::vector<Admission>> decode_admissions(std::span<const uint8_t> bytes) {
  std::vector<Admission> out;
  if (bytes.empty()) return out;
  wire::Reader r(bytes, "admissions");
  uint32_t n = 0;
  if (!r.count(n, "count", kFixedAdmissionBytes)) return r.status();
  out.resize(n);
  for (Admission& a : out)
    if (!r.get(a.seq_id, "seq_id") || !get_state(r, a.state)) return r.status();
  if (!r.done()) return r.error("trailing bytes after the last admission");
  return out;
}

Status validate(const SeqState& s, const ModelConfig& config) {
  if (s.prompt_len < 0 || s.prompt_len > config.n_positions)
    return Status::error("prompt_len " + std::to_string(s.prompt_len) + " is outside 0.." +
                         std::to_string(config.n_positions));
  if (s.top_logprobs < 0 || s.top_logprobs > 20)
    return Status::error("top_logprobs " + std::to_string(s.top_logprobs) + " is outside 0..20");
  return validate_sampling_params(s.sampling, config.vocab_size);
}

}  // namespace conveyor

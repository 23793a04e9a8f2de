#include "protocol/microbatch.h"

#include <cstring>
#include <string>

#include "protocol/wire_io.h"

namespace conveyor {
namespace {

constexpr uint32_t kBatchMagic = 0x34424d43;  // "CMB4" (2: activation dtype; 3: logit_bias, forks; 4: state once)
constexpr size_t kDTypeOffset = 4 + 8 + 4 + 4;  // magic, batch_id, pipeline, epoch
constexpr size_t kMinStepBytes = 8 + 4 + 4 + 1;  // a SeqStep without its lookahead token
constexpr size_t kForkBytes = 8 + 8 + 4;

// SeqStep::flags on the wire.
constexpr uint8_t kStepSample = 1;
constexpr uint8_t kStepPromptLogprobs = 2;
constexpr uint8_t kStepPrefill = 4;
constexpr uint8_t kStepOwnToken = 8;
constexpr uint8_t kStepKnownFlags = kStepSample | kStepPromptLogprobs | kStepPrefill | kStepOwnToken;

void put_step(wire::Writer& w, const SeqStep& s) {
  w.put(s.slice.seq_id), w.put(s.slice.start_pos), w.put(s.slice.num_tokens);
  w.put<uint8_t>(uint8_t((s.sample ? kStepSample : 0) | (s.prompt_logprobs ? kStepPromptLogprobs : 0) |
                         (s.prefill ? kStepPrefill : 0) | (s.own_token ? kStepOwnToken : 0)));
  if (s.prompt_logprobs) w.put(s.lookahead_token);
}

Status get_step(wire::Reader& r, SeqStep& s) {
  uint8_t flags = 0;
  if (!r.get(s.slice.seq_id, "seq_id") || !r.get(s.slice.start_pos, "start_pos") ||
      !r.get(s.slice.num_tokens, "num_tokens") || !r.get(flags, "flags"))
    return r.status();
  if (flags & ~kStepKnownFlags)
    return r.error("sequence " + std::to_string(s.slice.seq_id) + " has unknown step flags " + std::to_string(flags));
  s.sample = flags & kStepSample;
  s.prompt_logprobs = flags & kStepPromptLogprobs;
  s.prefill = flags & kStepPrefill;
  s.own_token = flags & kStepOwnToken;
  s.lookahead_token = -1;
  if (s.prompt_logprobs && !r.get(s.lookahead_token, "lookahead_token")) return r.status();
  return ok_status();
}

Status get_head(wire::Reader& r, MicroBatch& b) {
  uint32_t magic = 0;
  uint8_t dtype = 0;
  if (!r.get(magic, "magic")) return r.status();
  if (magic != kBatchMagic) return r.error("bad magic word (not a Conveyor micro-batch, or another version)");
  if (!r.get(b.batch_id, "batch_id") || !r.get(b.pipeline, "pipeline") || !r.get(b.epoch, "epoch") ||
      !r.get(dtype, "activation_dtype"))
    return r.status();
  b.activation_dtype = DType(dtype);
  if (!is_activation_dtype(b.activation_dtype))
    return r.error("activation dtype " + std::to_string(dtype) + " is not F32, F16 or BF16");
  return ok_status();
}

Status get_forks(wire::Reader& r, std::vector<SeqFork>& forks) {
  uint32_t n = 0;
  if (!r.count(n, "forks", kForkBytes)) return r.status();
  forks.resize(n);
  for (SeqFork& f : forks)
    if (!r.get(f.parent, "forks") || !r.get(f.child, "forks") || !r.get(f.num_tokens, "forks")) return r.status();
  return ok_status();
}

// The slices are well formed and cover the token ids exactly.
Status check_slices(const MicroBatch& b) {
  int64_t total = 0;
  for (const SeqStep& s : b.seqs) {
    if (s.slice.num_tokens <= 0 || s.slice.start_pos < 0)
      return Status::error("malformed micro-batch: sequence " + std::to_string(s.slice.seq_id) + " has start_pos " +
                           std::to_string(s.slice.start_pos) + " and num_tokens " + std::to_string(s.slice.num_tokens));
    total += s.slice.num_tokens;
  }
  if (total != int64_t(b.token_ids.size()))
    return Status::error("malformed micro-batch: slices cover " + std::to_string(total) + " tokens but " +
                         std::to_string(b.token_ids.size()) + " token ids were sent");
  return ok_status();
}

}  // namespace

std::vector<SeqSlice> MicroBatch::slices() const {
  std::vector<SeqSlice> out;
  out.reserve(seqs.size());
  for (const SeqStep& s : seqs) out.push_back(s.slice);
  return out;
}

int64_t MicroBatch::total_tokens() const {
  int64_t n = 0;
  for (const SeqStep& s : seqs) n += s.slice.num_tokens;
  return n;
}

std::vector<uint8_t> encode(const MicroBatch& b) {
  wire::Writer w;
  w.put(kBatchMagic);
  w.put(b.batch_id), w.put(b.pipeline), w.put(b.epoch);
  w.put<uint8_t>(uint8_t(b.activation_dtype));
  w.put<uint32_t>(uint32_t(b.seqs.size()));
  for (const SeqStep& s : b.seqs) put_step(w, s);
  w.put_vec(b.token_ids);
  w.put<uint32_t>(uint32_t(b.forks.size()));
  for (const SeqFork& f : b.forks) w.put(f.parent), w.put(f.child), w.put(f.num_tokens);
  w.put_vec(b.free_seq_ids);
  w.put_vec(b.admissions);
  return w.take();
}

Expected<MicroBatch> decode_microbatch(std::span<const uint8_t> bytes) {
  wire::Reader r(bytes, "micro-batch");
  MicroBatch b;
  if (Status s = get_head(r, b); !s) return s;
  uint32_t n = 0;
  if (!r.count(n, "seqs", kMinStepBytes)) return r.status();
  b.seqs.resize(n);
  for (SeqStep& s : b.seqs)
    if (Status st = get_step(r, s); !st) return st;
  if (!r.get_vec(b.token_ids, "token_ids")) return r.status();
  if (Status s = get_forks(r, b.forks); !s) return s;
  if (!r.get_vec(b.free_seq_ids, "free_seq_ids") || !r.get_vec(b.admissions, "admissions")) return r.status();
  if (!r.done()) return r.error("trailing bytes after the admissions");
  if (Status s = check_slices(b); !s) return s;
  return b;
}

Status patch_activation_dtype(std::span<std::byte> header, DType dtype) {
  uint32_t magic = 0;
  if (header.size() <= kDTypeOffset)
    return Status::error("malformed micro-batch: " + std::to_string(header.size()) + " bytes are too few for a header");
  std::memcpy(&magic, header.data(), sizeof(magic));
  if (magic != kBatchMagic)
    return Status::error("malformed micro-batch: bad magic word (not a Conveyor micro-batch, or another version)");
  if (!is_activation_dtype(dtype))
    return Status::error("activation dtype " + std::to_string(int(dtype)) + " is not F32, F16 or BF16");
  header[kDTypeOffset] = std::byte(uint8_t(dtype));
  return ok_status();
}

Status validate(const MicroBatch& b, const ModelConfig& config) {
  if (Status s = check_slices(b); !s) return s;
  size_t offset = 0;  // the slice's first token in token_ids
  for (const SeqStep& s : b.seqs) {
    const std::string who = "sequence " + std::to_string(s.slice.seq_id);
    if (int64_t(s.slice.start_pos) + s.slice.num_tokens > config.n_positions)
      return Status::error(who + " runs to position " + std::to_string(s.slice.start_pos + s.slice.num_tokens) +
                           ", beyond n_positions " + std::to_string(config.n_positions));
    if (s.lookahead_token >= config.vocab_size || s.lookahead_token < -1)
      return Status::error(who + ": lookahead token " + std::to_string(s.lookahead_token) + " is out of range");
    const auto tokens = std::span(b.token_ids).subspan(offset, size_t(s.slice.num_tokens));
    offset += tokens.size();
    if (s.own_token) {
      if (s.slice.num_tokens != 1 || s.prefill || s.prompt_logprobs || tokens[0] != kOwnTokenPlaceholder)
        return Status::error(who + ": a step on the stage's own token must be one decode token, without prompt "
                                   "log-probs, its token id the placeholder " + std::to_string(kOwnTokenPlaceholder));
      continue;
    }
    for (int32_t id : tokens)
      if (id < 0 || id >= config.vocab_size)
        return Status::error("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                             std::to_string(config.vocab_size) + ")");
  }
  for (const SeqFork& f : b.forks) {
    if (f.parent == f.child)
      return Status::error("fork of sequence " + std::to_string(f.parent) + " into itself");
    if (f.num_tokens < 1 || f.num_tokens > config.n_positions)
      return Status::error("fork of sequence " + std::to_string(f.parent) + " into " + std::to_string(f.child) +
                           ": num_tokens " + std::to_string(f.num_tokens) + " is outside 1.." +
                           std::to_string(config.n_positions));
  }
  return ok_status();
}

}  // namespace conveyor

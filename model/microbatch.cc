#include "model/microbatch.h"

#include <cstring>
#include <limits>
#include <type_traits>

namespace conveyor {
namespace {

constexpr uint32_t kBatchMagic = 0x33424d43;   // "CMB3" (2: the activations' dtype; 3: logit_bias, forks)
constexpr uint32_t kResultMagic = 0x31525243;  // "CRR1"
constexpr uint32_t kMaxCount = 1u << 24;       // no field of a sane batch is this long

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
    for (const T& x : v) put(x);
  }
  void put_str(const std::string& s) {
    put<uint32_t>(uint32_t(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void put_top(const std::vector<std::pair<int32_t, float>>& top) {
    put<uint32_t>(uint32_t(top.size()));
    for (const auto& [id, lp] : top) put(id), put(lp);
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  Reader(std::span<const uint8_t> in, const char* what) : in_(in), what_(what) {}
  template <class T>
  bool get(T& v, const char* field) {
    if (in_.size() - pos_ < sizeof(T)) return fail(field);
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
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
  bool get_str(std::string& s, const char* field) {
    uint32_t n;
    if (!count(n, field, 1)) return false;
    s.assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  bool get_top(std::vector<std::pair<int32_t, float>>& top, const char* field) {
    uint32_t n;
    if (!count(n, field, 8)) return false;
    top.resize(n);
    for (auto& [id, lp] : top)
      if (!get(id, field) || !get(lp, field)) return false;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }
  Status status() const {
    return Status::error(std::string("malformed ") + what_ + ": field '" + failed_field_ +
                         "' runs past the end of the " + std::to_string(in_.size()) + "-byte message");
  }

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

}  // namespace

std::vector<SeqSlice> MicroBatch::slices() const {
  std::vector<SeqSlice> out;
  out.reserve(seqs.size());
  for (const SeqWork& s : seqs) out.push_back(s.slice);
  return out;
}

int64_t MicroBatch::total_tokens() const {
  int64_t n = 0;
  for (const SeqWork& s : seqs) n += s.slice.num_tokens;
  return n;
}

std::vector<uint8_t> encode(const MicroBatch& b) {
  Writer w;
  w.put(kBatchMagic);
  w.put(b.batch_id), w.put(b.pipeline), w.put(b.epoch);
  w.put<uint8_t>(uint8_t(b.activation_dtype));
  w.put<uint32_t>(uint32_t(b.seqs.size()));
  for (const SeqWork& s : b.seqs) {
    w.put(s.slice.seq_id), w.put(s.slice.start_pos), w.put(s.slice.num_tokens);
    w.put(s.prompt_len);
    w.put<uint8_t>(uint8_t((s.sample ? 1 : 0) | (s.prompt_logprobs ? 2 : 0)));
    w.put(s.lookahead_token), w.put(s.top_logprobs), w.put(s.sample_index);
    const SamplingParams& p = s.sampling;
    w.put(p.temperature), w.put(int32_t(p.top_k)), w.put(p.top_p), w.put(p.repetition_penalty);
    w.put(p.presence_penalty), w.put(p.frequency_penalty), w.put(int32_t(p.min_tokens));
    w.put(p.seed);
    w.put_vec(p.stop_token_ids);
    w.put_top(p.logit_bias);
  }
  w.put_vec(b.token_ids);
  w.put<uint32_t>(uint32_t(b.forks.size()));
  for (const SeqFork& f : b.forks) w.put(f.parent), w.put(f.child), w.put(f.num_tokens);
  w.put_vec(b.free_seq_ids);
  return w.take();
}

Expected<MicroBatch> decode_microbatch(std::span<const uint8_t> bytes) {
  Reader r(bytes, "micro-batch");
  MicroBatch b;
  uint32_t magic = 0, n = 0;
  uint8_t act_dtype = 0;
  if (!r.get(magic, "magic")) return r.status();
  if (magic != kBatchMagic) return Status::error("malformed micro-batch: bad magic word (not a Conveyor micro-batch, or another version)");
  if (!r.get(b.batch_id, "batch_id") || !r.get(b.pipeline, "pipeline") || !r.get(b.epoch, "epoch") ||
      !r.get(act_dtype, "activation_dtype") || !r.count(n, "seqs", 40))
    return r.status();
  b.activation_dtype = DType(act_dtype);
  if (!is_activation_dtype(b.activation_dtype))
    return Status::error("malformed micro-batch: activation dtype " + std::to_string(act_dtype) +
                         " is not F32, F16 or BF16");
  b.seqs.resize(n);
  for (SeqWork& s : b.seqs) {
    uint8_t flags = 0;
    int32_t top_k = 0, min_tokens = 0;
    SamplingParams& p = s.sampling;
    if (!r.get(s.slice.seq_id, "seq_id") || !r.get(s.slice.start_pos, "start_pos") ||
        !r.get(s.slice.num_tokens, "num_tokens") || !r.get(s.prompt_len, "prompt_len") ||
        !r.get(flags, "flags") || !r.get(s.lookahead_token, "lookahead_token") ||
        !r.get(s.top_logprobs, "top_logprobs") || !r.get(s.sample_index, "sample_index") ||
        !r.get(p.temperature, "temperature") || !r.get(top_k, "top_k") || !r.get(p.top_p, "top_p") ||
        !r.get(p.repetition_penalty, "repetition_penalty") ||
        !r.get(p.presence_penalty, "presence_penalty") ||
        !r.get(p.frequency_penalty, "frequency_penalty") || !r.get(min_tokens, "min_tokens") ||
        !r.get(p.seed, "seed") || !r.get_vec(p.stop_token_ids, "stop_token_ids") ||
        !r.get_top(p.logit_bias, "logit_bias"))
      return r.status();
    s.sample = flags & 1;
    s.prompt_logprobs = flags & 2;
    p.top_k = top_k;
    p.min_tokens = min_tokens;
  }
  uint32_t num_forks = 0;
  if (!r.get_vec(b.token_ids, "token_ids") || !r.count(num_forks, "forks", 20)) return r.status();
  b.forks.resize(num_forks);
  for (SeqFork& f : b.forks)
    if (!r.get(f.parent, "forks") || !r.get(f.child, "forks") || !r.get(f.num_tokens, "forks")) return r.status();
  if (!r.get_vec(b.free_seq_ids, "free_seq_ids")) return r.status();
  if (!r.done()) return Status::error("malformed micro-batch: trailing bytes after free_seq_ids");
  int64_t total = 0;
  for (const SeqWork& s : b.seqs) {
    if (s.slice.num_tokens <= 0 || s.slice.start_pos < 0)
      return Status::error("malformed micro-batch: sequence " + std::to_string(s.slice.seq_id) +
                           " has start_pos " + std::to_string(s.slice.start_pos) + " and num_tokens " +
                           std::to_string(s.slice.num_tokens));
    total += s.slice.num_tokens;
  }
  if (total != int64_t(b.token_ids.size()))
    return Status::error("malformed micro-batch: slices cover " + std::to_string(total) + " tokens but " +
                         std::to_string(b.token_ids.size()) + " token ids were sent");
  return b;
}

std::vector<uint8_t> encode(const BatchResult& res) {
  Writer w;
  w.put(kResultMagic);
  w.put(res.batch_id), w.put(res.pipeline), w.put(res.epoch), w.put(res.busy_seconds);
  w.put_str(res.error);
  w.put<uint32_t>(uint32_t(res.seqs.size()));
  for (const SeqResult& s : res.seqs) {
    w.put(s.seq_id), w.put(s.token), w.put(s.logprob);
    w.put_top(s.top);
    w.put_vec(s.prompt_logprobs);
    w.put<uint32_t>(uint32_t(s.prompt_top.size()));
    for (const auto& t : s.prompt_top) w.put_top(t);
  }
  return w.take();
}

Expected<BatchResult> decode_batch_result(std::span<const uint8_t> bytes) {
  Reader r(bytes, "batch result");
  BatchResult res;
  uint32_t magic = 0, n = 0;
  if (!r.get(magic, "magic")) return r.status();
  if (magic != kResultMagic) return Status::error("malformed batch result: bad magic word");
  if (!r.get(res.batch_id, "batch_id") || !r.get(res.pipeline, "pipeline") || !r.get(res.epoch, "epoch") ||
      !r.get(res.busy_seconds, "busy_seconds") || !r.get_str(res.error, "error") ||
      !r.count(n, "seqs", 16))
    return r.status();
  res.seqs.resize(n);
  for (SeqResult& s : res.seqs) {
    uint32_t m = 0;
    if (!r.get(s.seq_id, "seq_id") || !r.get(s.token, "token") || !r.get(s.logprob, "logprob") ||
        !r.get_top(s.top, "top") || !r.get_vec(s.prompt_logprobs, "prompt_logprobs") ||
        !r.count(m, "prompt_top", 4))
      return r.status();
    s.prompt_top.resize(m);
    for (auto& t : s.prompt_top)
      if (!r.get_top(t, "prompt_top")) return r.status();
  }
  if (!r.done()) return Status::error("malformed batch result: trailing bytes");
  return res;
}

Status validate(const MicroBatch& b, const ModelConfig& config) {
  for (const SeqWork& s : b.seqs) {
    const std::string who = "sequence " + std::to_string(s.slice.seq_id);
    if (int64_t(s.slice.start_pos) + s.slice.num_tokens > config.n_positions)
      return Status::error(who + " runs to position " + std::to_string(s.slice.start_pos + s.slice.num_tokens) +
                           ", beyond n_positions " + std::to_string(config.n_positions));
    if (s.top_logprobs < 0 || s.top_logprobs > 20)
      return Status::error(who + ": top_logprobs " + std::to_string(s.top_logprobs) + " is outside 0..20");
    if (s.lookahead_token >= config.vocab_size || s.lookahead_token < -1)
      return Status::error(who + ": lookahead token " + std::to_string(s.lookahead_token) + " is out of range");
    if (Status st = validate_sampling_params(s.sampling, config.vocab_size); !st.ok())
      return Status::error(who + ": " + st.message());
  }
  for (const SeqFork& f : b.forks) {
    if (f.parent == f.child)
      return Status::error("fork of sequence " + std::to_string(f.parent) + " into itself");
    if (f.num_tokens < 1 || f.num_tokens > config.n_positions)
      return Status::error("fork of sequence " + std::to_string(f.parent) + " into " + std::to_string(f.child) +
                           ": num_tokens " + std::to_string(f.num_tokens) + " is outside 1.." +
                           std::to_string(config.n_positions));
  }
  for (int32_t id : b.token_ids)
    if (id < 0 || id >= config.vocab_size)
      return Status::error("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                           std::to_string(config.vocab_size) + ")");
  return ok_status();
}

}  // namespace conveyor

#include "protocol/batch_result.h"

#include "protocol/wire_io.h"

namespace conveyor {
namespace {

constexpr uint32_t kResultMagic = 0x31525243;  // "CRR1"
constexpr size_t kMinSeqResultBytes = 8 + 4 + 4 + 4 + 4 + 4;  // ids, token, logprob and three empty counts

void put_seq(wire::Writer& w, const SeqResult& s) {
  w.put(s.seq_id), w.put(s.token), w.put(s.logprob);
  w.put_pairs(s.top);
  w.put_vec(s.prompt_logprobs);
  w.put<uint32_t>(uint32_t(s.prompt_top.size()));
  for (const auto& t : s.prompt_top) w.put_pairs(t);
}

bool get_seq(wire::Reader& r, SeqResult& s) {
  uint32_t m = 0;
  if (!r.get(s.seq_id, "seq_id") || !r.get(s.token, "token") || !r.get(s.logprob, "logprob") ||
      !r.get_pairs(s.top, "top") || !r.get_vec(s.prompt_logprobs, "prompt_logprobs") ||
      !r.count(m, "prompt_top", 4))
    return false;
  s.prompt_top.resize(m);
  for (auto& t : s.prompt_top)
    if (!r.get_pairs(t, "prompt_top")) return false;
  return true;
}

}  // namespace

std::vector<uint8_t> encode(const BatchResult& res) {
  wire::Writer w;
  w.put(kResultMagic);
  w.put(res.batch_id), w.put(res.pipeline), w.put(res.epoch), w.put(res.busy_seconds);
  w.put_str(res.error);
  w.put<uint32_t>(uint32_t(res.seqs.size()));
  for (const SeqResult& s : res.seqs) put_seq(w, s);
  return w.take();
}

Expected<BatchResult> decode_batch_result(std::span<const uint8_t> bytes) {
  wire::Reader r(bytes, "batch result");
  BatchResult res;
  uint32_t magic = 0, n = 0;
  if (!r.get(magic, "magic")) return r.status();
  if (magic != kResultMagic) return r.error("bad magic word (not a Conveyor batch result, or another version)");
  if (!r.get(res.batch_id, "batch_id") || !r.get(res.pipeline, "pipeline") || !r.get(res.epoch, "epoch") ||
      !r.get(res.busy_seconds, "busy_seconds") || !r.get_str(res.error, "error") ||
      !r.count(n, "seqs", kMinSeqResultBytes))
    return r.status();
  res.seqs.resize(n);
  for (SeqResult& s : res.seqs)
    if (!get_seq(r, s)) return r.status();
  if (!r.done()) return r.error("trailing bytes after the last sequence");
  return res;
}

}  // namespace conveyor

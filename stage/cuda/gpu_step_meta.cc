// A GpuStage step's metadata (gpu_step_meta.h): its layout and contents, the double-buffered
// host staging it is written into, the checks a micro-batch passes before anything changes,
// and the K/V pages reserved for it.
#include <algorithm>
#include <cstring>
#include <unordered_set>
#include <vector>

#include "stage/cuda/gpu_stage.h"

namespace conveyor::cuda {

StepMeta step_meta_layout(int32_t* base, int64_t T, int64_t S, int64_t max_pages) {
  StepMeta m;
  m.ids = base;
  m.pos = m.ids + T;
  m.token_row = m.pos + T;
  m.q_begin = m.token_row + T;
  m.q_len = m.q_begin + S;
  m.kv_len = m.q_len + S;
  m.last_row = m.kv_len + S;
  m.tables = m.last_row + S;
  m.ints = 3 * T + 4 * S + S * max_pages;
  return m;
}

void fill_seq_meta(const StepMeta& h, std::span<const SeqSlice> slices, int64_t padded_seqs, const KvCache* kv,
                   int64_t max_pages) {
  int64_t row = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const SeqSlice& s = slices[i];
    h.q_begin[i] = int32_t(row);
    h.q_len[i] = s.num_tokens;
    h.kv_len[i] = s.start_pos + s.num_tokens;
    h.last_row[i] = int32_t(row + s.num_tokens - 1);
    for (int32_t j = 0; j < s.num_tokens; ++j, ++row) {
      h.pos[row] = s.start_pos + j;
      h.token_row[row] = int32_t(i);
    }
    if (kv && kv->contains(s.seq_id)) {
      const std::span<const int32_t> pages = kv->pages(s.seq_id);
      std::memcpy(h.tables + int64_t(i) * max_pages, pages.data(),
                  std::min<size_t>(pages.size(), size_t(max_pages)) * sizeof(int32_t));
    }
  }
  for (int64_t i = int64_t(slices.size()); i < padded_seqs; ++i) {
    h.q_begin[i] = int32_t(i);
    h.q_len[i] = 0;
    h.kv_len[i] = 0;
    h.last_row[i] = int32_t(i);
    h.pos[i] = 0;  // decode padding: one token row per sequence slot
    h.token_row[i] = -1;
    h.ids[i] = 0;
  }
}

// Two staging slots alternate, so the host fills one while the other's copy may still run.
int32_t* GpuStage::begin_meta() {
  meta_slot_ ^= 1;
  CUDA_CHECK(cudaEventSynchronize(meta_sent_[meta_slot_]));  // its last copy has left the buffer
  return meta_host_[meta_slot_].as<int32_t>();
}

void GpuStage::send_meta(const StepMeta& host_view) {
  CUDA_CHECK(cudaMemcpyAsync(meta_dev_.get(), host_view.ids, size_t(host_view.ints) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(meta_sent_[meta_slot_], stream_));
}

StepMeta GpuStage::device_meta(int64_t tokens, int64_t seqs) const {
  return step_meta_layout(meta_dev_.as<int32_t>(), tokens, seqs, max_pages_);
}

Status GpuStage::check_slices(std::span<const SeqSlice> slices, bool need_cached_match) const {
  const int64_t P = config_.n_positions;
  if (slices.empty()) return Status::error(options_.name + ": empty micro-batch");
  if (int64_t(slices.size()) > max_step_seqs_)
    return Status::error(options_.name + ": " + std::to_string(slices.size()) + " sequences in one micro-batch, at most " +
                         std::to_string(max_step_seqs_));
  std::unordered_set<uint64_t> seen;
  int64_t total = 0;
  for (const SeqSlice& s : slices) {
    if (s.num_tokens <= 0)
      return Status::error(seq_name(s.seq_id) + ": slice has " + std::to_string(s.num_tokens) + " tokens");
    if (s.start_pos < 0 || int64_t(s.start_pos) + s.num_tokens > P)
      return Status::error(seq_name(s.seq_id) + ": positions " + std::to_string(s.start_pos) + ".." +
                           std::to_string(int64_t(s.start_pos) + s.num_tokens - 1) + " exceed the model's context of " +
                           std::to_string(P) + " positions");
    if (!seen.insert(s.seq_id).second) return Status::error(seq_name(s.seq_id) + " appears twice in one micro-batch");
    if (need_cached_match) {
      const int64_t cached = cached_tokens(s.seq_id);
      if (s.start_pos != std::max<int64_t>(cached, 0))
        return Status::error(seq_name(s.seq_id) + ": slice starts at position " + std::to_string(s.start_pos) +
                             " but the stage has " + std::to_string(std::max<int64_t>(cached, 0)) + " tokens cached for it");
    }
    total += s.num_tokens;
  }
  if (total > max_rows_)
    return Status::error(options_.name + ": " + std::to_string(total) + " tokens in one micro-batch, at most " +
                         std::to_string(max_rows_));
  return ok_status();
}

// Pages for every slice's positions; on failure the sequences this call added are released,
// so nothing changed for the caller.
Status GpuStage::reserve(std::span<const SeqSlice> slices) {
  if (!kv_) return ok_status();
  std::vector<uint64_t> fresh;
  for (const SeqSlice& s : slices) {
    const bool is_new = !kv_->contains(s.seq_id);
    Status st = kv_->reserve(s.seq_id, int64_t(s.start_pos) + s.num_tokens);
    if (st.ok()) st = kv_->prepare_write(s.seq_id, s.start_pos, stream_);  // copy-on-write
    if (!st.ok()) {
      for (uint64_t id : fresh) kv_->release(id);
      return Status::error(options_.name + ": " + st.message());
    }
    if (is_new) fresh.push_back(s.seq_id);
  }
  return ok_status();
}

}  // namespace conveyor::cuda

// A GpuStage step's metadata (gpu_step_meta.h): its layout and contents, and the
// double-buffered host staging it is written into.
#include "stage/cuda/gpu_step_meta.h"

#include <algorithm>
#include <cstring>
#include <utility>

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

StepMetaStaging::StepMetaStaging(int64_t max_rows, int64_t max_seqs, int64_t max_pages, const std::string& owner)
    : max_pages_(max_pages) {
  const int64_t meta_ints = step_meta_capacity(max_rows, max_seqs, max_pages);
  dev_ = device_alloc(size_t(meta_ints) * sizeof(int32_t), owner, "step metadata");
  try {
    for (int i = 0; i < 2; ++i) {
      host_[i] = PinnedBuffer(size_t(meta_ints) * sizeof(int32_t), owner + " step metadata");
      std::memset(host_[i].get(), 0, host_[i].bytes());
      CUDA_CHECK(cudaEventCreateWithFlags(&sent_[i], cudaEventDisableTiming));
    }
  } catch (...) {
    destroy_events();
    throw;
  }
}

StepMetaStaging::~StepMetaStaging() { destroy_events(); }

void StepMetaStaging::destroy_events() {
  for (cudaEvent_t& e : sent_)
    if (e) cudaEventDestroy(std::exchange(e, nullptr));
}

// Two staging slots alternate, so the host fills one while the other's copy may still run.
int32_t* StepMetaStaging::begin() {
  slot_ ^= 1;
  CUDA_CHECK(cudaEventSynchronize(sent_[slot_]));  // its last copy has left the buffer
  return host_[slot_].as<int32_t>();
}

void StepMetaStaging::send(const StepMeta& host_view, cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(dev_.get(), host_view.ids, size_t(host_view.ints) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaEventRecord(sent_[slot_], stream));
}

StepMeta StepMetaStaging::device(int64_t tokens, int64_t seqs) const {
  return step_meta_layout(dev_.as<int32_t>(), tokens, seqs, max_pages_);
}

}  // namespace conveyor::cuda

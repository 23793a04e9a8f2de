// The metadata of one GpuStage step: one block of int32 that the host fills in pinned memory
// and copies to the device in one transfer (StepMetaStaging); every kernel of the step reads
// its rows from it.
//
// Layout for T token rows, S sequences and max_pages block-table entries per sequence:
//   ids[T] pos[T] token_row[T] | q_begin[S] q_len[S] kv_len[S] last_row[S] | tables[S x max_pages]
// The same offsets serve the host staging block and the device block (StepMeta over either
// base). Padded sequences (decode graphs' buckets) have q_len 0 and kv_len 0: no kernel
// attends for them, and their token_row is -1.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>

#include "common/seq_slice.h"
#include "kernels/cuda/check.h"
#include "stage/cuda/kv_cache.h"

namespace conveyor::cuda {

struct StepMeta {
  int32_t *ids, *pos, *token_row;                  // per token row
  int32_t *q_begin, *q_len, *kv_len, *last_row;    // per sequence: first row, rows, cached + new, last row
  int32_t* tables;                                 // per sequence: max_pages K/V page ids
  int64_t ints;                                    // int32 entries in use: 3 T + 4 S + S x max_pages
};

// The views of a block at `base` for `tokens` rows and `seqs` sequences.
StepMeta step_meta_layout(int32_t* base, int64_t tokens, int64_t seqs, int64_t max_pages);

// Entries of the largest block: what the host and device buffers hold.
inline int64_t step_meta_capacity(int64_t max_rows, int64_t max_seqs, int64_t max_pages) {
  return 3 * max_rows + 4 * max_seqs + max_seqs * max_pages;
}

// Fills the per-sequence and per-token entries of host block `h` for `slices` (rows in slice
// order), then sequences [slices.size(), padded_seqs) as padding. Block tables come from `kv`
// for the sequences it holds (embed() runs before the pages are reserved); kv may be null.
void fill_seq_meta(const StepMeta& h, std::span<const SeqSlice> slices, int64_t padded_seqs, const KvCache* kv,
                   int64_t max_pages);

// Where a step's metadata is staged: the device block every kernel of the step reads (at a
// fixed address, so a decode graph's replays read each new step's) and two pinned host slots
// that alternate, so the host fills one while the other's copy may still run; an event per
// slot says when its copy has left it. Sized for the largest block.
class StepMetaStaging {
 public:
  // Allocates the blocks (CUDA faults throw; `owner` names the stage in their messages).
  StepMetaStaging(int64_t max_rows, int64_t max_seqs, int64_t max_pages, const std::string& owner);
  ~StepMetaStaging();
  StepMetaStaging(const StepMetaStaging&) = delete;
  StepMetaStaging& operator=(const StepMetaStaging&) = delete;

  int32_t* begin();                                           // waits until the next slot is free, returns it
  void send(const StepMeta& host_view, cudaStream_t stream);  // one copy host -> device
  StepMeta device(int64_t tokens, int64_t seqs) const;        // the device block's views
  size_t device_bytes() const { return dev_.bytes(); }

 private:
  void destroy_events();

  int64_t max_pages_;
  DeviceBuffer dev_;
  PinnedBuffer host_[2];
  cudaEvent_t sent_[2] = {nullptr, nullptr};
  int slot_ = 0;
};

// How errors name a sequence.
inline std::string seq_name(uint64_t id) { return "sequence " + std::to_string(id); }

}  // namespace conveyor::cuda

// Reading a stage's tensor pieces (stage_checkpoint.h) through a ring of buffers: several
// threads gather the next pieces from the mapped checkpoint while the calling thread hands
// each filled buffer on, in piece order. A GPU stage's direct load gives it page-locked
// buffers and hands them to DMA copies (stage/cuda/gpu_weight_load.h); the weight-load
// benchmark gives it plain memory to time the read alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/stage_checkpoint.h"

namespace conveyor {

struct PieceRing {
  std::vector<std::byte*> slots;  // the buffers, each slot_bytes long
  uint64_t slot_bytes = 0;
  PieceRead read = PieceRead::Pread;  // how whole-row pieces are copied (gather)
  // On a reader thread, before slot `slot` takes its next piece: returns once the consumer's
  // use of the previous one (a DMA copy in flight) is over. Optional.
  std::function<Status(size_t slot)> wait_free;
  // On the calling thread, for each piece in order, once its bytes are in `slot`.
  std::function<Status(size_t piece, size_t slot)> consume;
};

// Reads every piece through `ring` with up to `threads` reader threads. A piece larger than a
// slot is refused before anything is read (the error names the tensor). The first error (from
// a read, wait_free or consume) stops the readers at their next piece and is returned.
Status read_pieces(std::span<const TensorPiece> pieces, int threads, const PieceRing& ring);

}  // namespace conveyor

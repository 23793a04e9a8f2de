// read_pieces (piece_reader.h). Piece i goes to slot i % S. A reader takes the next piece, waits
// until the consumer has handed on piece i - S (the slot's last one) and the slot is free, then
// gathers; the consumer waits for piece i's bytes. Readers take pieces in order and each waits
// only on smaller pieces, so no wait is ever on a piece nobody has taken.
#include "model/piece_reader.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace conveyor {

Status read_pieces(std::span<const TensorPiece> pieces, int threads, const PieceRing& ring) {
  const size_t n = pieces.size(), S = ring.slots.size();
  if (S == 0 || threads < 1) return Status::error("read_pieces: no buffers or no threads");
  for (const TensorPiece& p : pieces)
    if (p.bytes() > ring.slot_bytes)
      return Status::error(p.source->ref.file->path() + ": tensor \"" + p.source->name + "\": a piece of " +
                           std::to_string(p.bytes()) + " bytes (one row of its part is " +
                           std::to_string(p.row_bytes()) + ") does not fit the " + std::to_string(ring.slot_bytes) +
                           "-byte load buffers");
  std::mutex mu;
  std::condition_variable cv;
  std::vector<char> filled(n, 0);
  size_t consumed = 0;
  bool stop = false;
  Status error;
  auto fail = [&](const Status& s) {  // under mu
    if (error) error = s;
    stop = true;
    cv.notify_all();
  };
  std::atomic<size_t> next{0};
  auto reader = [&] {
    for (size_t i; (i = next++) < n;) {
      {
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return stop || consumed + S > i; });
        if (stop) return;
      }
      if (i >= S && ring.wait_free)
        if (Status s = ring.wait_free(i % S); !s) {
          std::lock_guard lk(mu);
          return fail(s);
        }
      const Status read = gather(pieces[i], ring.slots[i % S], ring.read);
      std::lock_guard lk(mu);
      if (!read) return fail(read);
      filled[i] = 1;
      cv.notify_all();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min<int>(threads, int(std::max<size_t>(n, 1))); ++t) pool.emplace_back(reader);
  for (size_t i = 0; i < n; ++i) {
    {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return stop || filled[i]; });
      if (stop) break;
    }
    Status s = ring.consume(i, i % S);
    std::lock_guard lk(mu);
    if (!s) {
      fail(s);
      break;
    }
    consumed = i + 1;
    cv.notify_all();
  }
  for (std::thread& t : pool) t.join();
  return error;
}

}  // namespace conveyor

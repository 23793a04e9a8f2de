// GpuWeights::load (gpu_weights.h): a stage's weights straight from the checkpoint's bytes.
//
// The weight table and the layout say where each tensor goes (plan_weight_layout); this rank's
// part of it is read by its TpSlice (model/tp_shard.h) in pieces of whole rows
// (model/stage_checkpoint.h). Reader threads gather the next pieces into a ring of page-locked
// slots (model/piece_reader.h) while this thread copies each filled slot to the GPU on the
// stage's stream and converts it there, in the order upload() converts host fp32:
//   stored F16/BF16 -> fp32 (convert_to_float, exact) -> the stage's dtype,
// vectors and stage tensors element for element (convert_from_float), layer matrices [K, N]
// transposed into [N, K] a block of K rows at a time (convert_transpose_from_float), and for
// int8 and FP8 transposed whole into a scratch matrix of the dtype, then quantised by rows.
// The fp32 values on the device are the host fp32 upload() copies, and every later step is
// the same kernel on the same values, so the device bytes equal upload()'s.
//
// A slot is reused when the event recorded after its copy has completed; the pieces' fp32 and
// raw buffers on the device are reused in stream order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "model/piece_reader.h"
#include "stage/cuda/dtype_dispatch.h"
#include "stage/cuda/gpu_weights.h"
#include "stage/cuda/guard.h"

namespace conveyor::cuda {
namespace {

// Where a piece goes on the device.
struct PieceTarget {
  void* dst = nullptr;
  float* scales = nullptr;  // int8 / FP8 layer matrices
  bool matrix = false;      // a layer matrix: [K, N] on the host, [N, K] on the device
  int64_t K = 0, N = 0;     // a matrix's [in, out] part; else N = the elements of one row
};

// cudaEvent_t, owned; created without timing (only completion is asked).
class Event {
 public:
  Event() { CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// The pieces of every tensor this rank holds (stage_pieces: the weight table's walk), each
// with its place in the allocation.
struct LoadPlan {
  std::vector<TensorPiece> pieces;
  std::vector<PieceTarget> targets;  // one per piece
  int64_t bytes = 0;
  int64_t widest_matrix = 0;  // elements of the largest layer matrix (the int8 / FP8 scratch)
};

Expected<LoadPlan> plan_load(const GpuWeights& w, const StageCheckpoint& c, const GpuStageShape& shape,
                             uint64_t max_bytes) {
  const ModelConfig &a = c.config, &b = shape.config;
  if (a.n_layer != b.n_layer || a.n_embd != b.n_embd || a.n_head != b.n_head || a.n_inner != b.n_inner ||
      a.vocab_size != b.vocab_size || a.n_positions != b.n_positions || c.layer_begin != shape.layer_begin ||
      c.layer_end != shape.layer_end)
    return Status::error(shape.options.name + ": the checkpoint was opened for layers [" +
                         std::to_string(c.layer_begin) + ", " + std::to_string(c.layer_end) +
                         ") of another model shape than the stage's");
  auto holds = [&](StageTensor t) { return w.ref(t).held() && !(t == StageTensor::LmHead && w.head_is_wte()); };
  auto pieces = stage_pieces(c, shape.shard, holds, max_bytes);
  if (!pieces) return pieces.status();
  const bool byte_matrices = shape.options.int8_weights || shape.options.fp8;
  LoadPlan plan;
  plan.pieces = std::move(pieces).value();
  for (const TensorPiece& p : plan.pieces) {
    PieceTarget t;
    if (p.layer >= 0) {
      const GpuLayer d = w.layer(p.layer);
      const LayerTensor id = LayerTensor(p.tensor);
      const TensorRef& r = d.ref(id);
      t = {d.at(id), byte_matrices ? d.scales(id) : nullptr, layer_tensor(id).matrix(), r.shape.rows, r.shape.cols};
      if (t.matrix) plan.widest_matrix = std::max(plan.widest_matrix, t.K * t.N);
    } else {
      const StageTensor id = StageTensor(p.tensor);
      t = {w.at(id), nullptr, false, 0, w.ref(id).shape.cols};
    }
    if (p.row_bytes() / dtype_bytes(p.source->dtype()) != uint64_t(t.N))  // the table and the layout disagree
      return Status::error(shape.options.name + ": " + p.source->name + ": a row of " +
                           std::to_string(p.row_bytes() / dtype_bytes(p.source->dtype())) +
                           " values for a part of " + std::to_string(t.N) + " columns");
    plan.targets.push_back(t);
    plan.bytes += int64_t(p.bytes());
  }
  return plan;
}

// One piece, on the device: its stored bytes to fp32 in `f32` (through `raw` unless stored as
// fp32), then converted into its place. Called in piece order on one stream.
template <class T>
void convert_piece(const TensorPiece& p, const PieceTarget& t, const std::byte* pinned, const DeviceBuffer& raw,
                   const DeviceBuffer& f32, const DeviceBuffer& matrix_rows, const GpuStageOptions& options,
                   cudaStream_t stream) {
  const DType stored = p.source->dtype();
  const int64_t elems = int64_t(p.bytes() / dtype_bytes(stored));
  float* values = f32.as<float>();
  if (stored == DType::F32) {
    CUDA_CHECK(cudaMemcpyAsync(values, pinned, p.bytes(), cudaMemcpyHostToDevice, stream));
  } else {
    CUDA_CHECK(cudaMemcpyAsync(raw.get(), pinned, p.bytes(), cudaMemcpyHostToDevice, stream));
    if (stored == DType::F16) convert_to_float<__half>(values, raw.as<__half>(), elems, stream);
    else convert_to_float<__nv_bfloat16>(values, raw.as<__nv_bfloat16>(), elems, stream);
  }
  if (!t.matrix) {  // rows of the part, element for element
    convert_from_float<T>(static_cast<T*>(t.dst) + p.first_row * t.N, values, elems, stream);
    return;
  }
  // Host rows [first_row, first_row + rows) of [K, N] are columns of the device's [N, K].
  T* out = t.scales ? matrix_rows.as<T>() : static_cast<T*>(t.dst);
  convert_transpose_from_float<T>(out + p.first_row, values, p.rows, t.N, t.K, stream);
  if (t.scales && p.last) quantize_matrix_rows<T>(options, t.dst, t.scales, 0, out, t.N, t.K, stream);
}

}  // namespace

Status GpuWeights::load(const StageCheckpoint& checkpoint, const GpuStageShape& shape, const DirectLoadOptions& o,
                        cudaStream_t stream, const LoadProgress& progress) {
  DeviceGuard on(shape.device);
  const std::string& name = shape.options.name;
  if (o.threads < 1 || o.slots < 1 || o.slot_bytes < 4096)
    return Status::error(name + ": a direct load needs a thread, a slot and slots of 4 KiB or more");
  auto plan = plan_load(*this, checkpoint, shape, o.slot_bytes);
  if (!plan) return plan.status();
  zero_vocab_padding(stream);
  // The device side: a piece's stored bytes, its fp32 (twice the bytes of a 16-bit piece),
  // and for int8 / FP8 one whole matrix of the dtype to quantise from.
  const bool byte_matrices = shape.options.int8_weights || shape.options.fp8;
  DeviceBuffer raw = device_alloc(o.slot_bytes, name, "weight load pieces");
  DeviceBuffer f32 = device_alloc(2 * o.slot_bytes, name, "weight load fp32 pieces");
  DeviceBuffer matrix_rows = byte_matrices ? device_alloc(size_t(plan->widest_matrix) * dtype_bytes(shape.options.dtype),
                                                          name, "weight load matrix to quantise")
                                           : DeviceBuffer();
  std::vector<PinnedBuffer> slots;
  std::vector<Event> copied(size_t(o.slots));
  PieceRing ring;
  ring.slot_bytes = o.slot_bytes;
  ring.read = o.read;
  for (int i = 0; i < o.slots; ++i) {
    slots.emplace_back(o.slot_bytes, name + " weight load buffer");
    ring.slots.push_back(slots.back().as<std::byte>());
  }
  const int device = shape.device;
  ring.wait_free = [&](size_t slot) {
    if (cudaError_t e = cudaEventSynchronize(copied[slot].get()); e != cudaSuccess)
      return Status::error(name + ": weight load: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) +
                           " (device " + std::to_string(device) + ")");
    return ok_status();
  };
  int64_t done = 0;
  Status status;
  with_dtype(shape.options.dtype, [&](auto tag) {
    using T = decltype(tag);
    ring.consume = [&](size_t i, size_t slot) {
      return guard(name, [&] {  // a CUDA fault must not unwind past the reader threads
        const TensorPiece& p = plan->pieces[i];
        convert_piece<T>(p, plan->targets[i], ring.slots[slot], raw, f32, matrix_rows,
                         shape.options, stream);
        CUDA_CHECK(cudaEventRecord(copied[slot].get(), stream));
        done += int64_t(p.bytes());
        if (progress) progress(done, plan->bytes);
        return ok_status();
      });
    };
    status = read_pieces(plan->pieces, o.threads, ring);
  });
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before the scratch and slots go
  return status;
}

}  // namespace conveyor::cuda

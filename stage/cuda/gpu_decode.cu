// GpuStage::decode: a step of one new token per sequence, replayed from a CUDA graph per
// batch-size bucket (1, 2, 4, ..., 128, then multiples of 64 up to kMaxGraphRows = 512). The graph's kernels read everything that
// changes between steps (token ids, positions, block tables, lengths) from the step metadata
// block at a fixed device address, so one capture serves every later step of its bucket; the
// rows past the batch are padding that no kernel attends for.
#include <cstring>
#include <string>

#include "stage/cuda/gpu_stage.h"
#include "stage/cuda/guard.h"

namespace conveyor::cuda {
namespace {

// Ends a capture left unfinished (the step failed: a Status, or a CUDA fault unwinding to
// decode()'s guard) and drops what it recorded, so the stream is usable again.
struct UnfinishedCapture {
  cudaStream_t stream;
  ~UnfinishedCapture() {
    if (!stream) return;
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial) cudaGraphDestroy(partial);
  }
};

}  // namespace

int64_t GpuStage::bucket_for(int64_t rows) {
  if (rows > 128) return (rows + 63) / 64 * 64;  // 192, 256, ...: at most 63 padding rows
  int64_t b = 1;
  while (b < rows) b *= 2;
  return b;
}

int64_t GpuStage::decode_rows(int64_t seqs) const {
  return options_.cuda_graphs && seqs <= kMaxGraphRows ? bucket_for(seqs) : seqs;
}

Status GpuStage::decode(std::span<const SeqSlice> slices, const int32_t* token_ids, std::span<const SampleRow> sampling,
                        int32_t* tokens, float* logprobs) {
  return guard(options_.name, [&]() -> Status {
    DeviceGuard on(device_);
    if (Status s = check_slices(slices, true); !s) return s;
    const int64_t S = int64_t(slices.size());
    for (const SeqSlice& s : slices)
      if (s.num_tokens != 1)
        return Status::error(seq_name(s.seq_id) + ": decode takes one token per sequence, got " +
                             std::to_string(s.num_tokens));
    if (has_embedding()) {
      if (token_ids == nullptr) return Status::error(options_.name + ": decode on the first stage needs token ids");
      for (int64_t i = 0; i < S; ++i)
        if (token_ids[i] < 0 || token_ids[i] >= config_.vocab_size)
          return Status::error(seq_name(slices[size_t(i)].seq_id) + ": token id " + std::to_string(token_ids[i]) +
                               " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
    }
    bool full = false;
    if (holds_head()) {
      if (int64_t(sampling.size()) != S || tokens == nullptr)
        return Status::error(options_.name +
                             ": decode on the last stage needs one sampling row per sequence and `tokens`");
      for (const SampleRow& r : sampling) {
        if (r.params == nullptr) return Status::error(options_.name + ": a sample row has no parameters");
        full = full || GpuSampler::needs_sampler(*r.params, r.generated.size());
      }
    }
    if (Status s = reserve(slices); !s) return s;

    const bool graph = options_.cuda_graphs && S <= kMaxGraphRows;
    const int64_t rows = decode_rows(S);
    int32_t* host = begin_meta();
    const StepMeta h = step_meta_layout(host, rows, rows, max_pages_);
    fill_seq_meta(h, slices, rows, kv_.get(), max_pages_);
    if (has_embedding()) std::memcpy(h.ids, token_ids, size_t(S) * sizeof(int32_t));
    send_meta(h);
    if (Status s = run_decode_step(device_meta(rows, rows), rows, graph); !s) return s;
    for (const SeqSlice& s : slices) lengths_[s.seq_id] = s.start_pos + 1;
    last_logit_rows_ = -1;

    if (holds_head()) choose_tokens(sampling, full, true, tokens, logprobs);  // the step left the argmax
    return ok_status();
  });
}

Status GpuStage::run_decode_step(const StepMeta& m, int64_t rows, bool graph) {
  if (!graph) return decode_step(m, rows);
  if (auto it = graphs_.find(rows); it != graphs_.end()) {
    CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
    return ok_status();
  }
  // First use of this bucket: run the step eagerly (which also plans every GEMM shape outside
  // capture), then capture the same step and keep its executable graph.
  if (Status s = decode_step(m, rows); !s) return s;
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  UnfinishedCapture unfinished{stream_};
  if (Status s = decode_step(m, rows); !s) return s;
  unfinished.stream = nullptr;
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  CUDA_CHECK(e);
  graphs_[rows] = exec;
  return ok_status();
}

}  // namespace conveyor::cuda

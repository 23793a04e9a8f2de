// load_stage_weights: one pipeline stage's tensors from a HuggingFace GPT-2 checkpoint, found
// and checked by open_stage_checkpoint (stage_checkpoint.h), converted to fp32 on the host.
// (random_stage_weights lives in random_weights.cc.)
#include "model/weights.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/stage_checkpoint.h"

namespace conveyor {
namespace {

// One tensor the stage needs: where the checkpoint keeps it and where its fp32 values go.
struct TensorJob {
  const TensorSource* source = nullptr;
  std::vector<float>* out = nullptr;
};

// out.resize(n), asking for transparent huge pages first: page faults on fresh memory,
// one per 4 KB page, otherwise cost more than the conversion itself.
void allocate_f32(std::vector<float>& out, size_t n) {
  out.clear();
  out.reserve(n);  // allocates, touches nothing
  const size_t bytes = n * sizeof(float);
  constexpr size_t kHugePage = size_t(2) << 20;
  if (bytes >= kHugePage) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data());
    const uintptr_t aligned = (begin + 4095) & ~uintptr_t(4095);  // madvise needs a page-aligned start
    (void)::madvise(reinterpret_cast<void*>(aligned), begin + bytes - aligned, MADV_HUGEPAGE);  // advisory
  }
  out.resize(n);
}

// Converts the tensors to fp32, several at once (up to kLoadThreads threads take the next
// tensor in turn): reading the mapping, faulting in the fresh fp32 pages and converting all
// scale with threads, and one thread got ~1 GB/s of checkpoint. The first error stops the
// others at their next tensor. Returns the bytes of tensor data read (storage dtype);
// `progress` is called under a lock, so one call at a time.
Expected<int64_t> convert_all(const std::vector<TensorJob>& jobs, const LoadProgress& progress) {
  constexpr unsigned kLoadThreads = 8;
  int64_t total = 0;
  for (const TensorJob& job : jobs) total += int64_t(job.source->bytes());
  std::atomic<size_t> next{0};
  std::mutex mu;
  int64_t bytes_read = 0;
  std::string error;
  auto work = [&] {
    for (size_t i; (i = next++) < jobs.size();) {
      if (i + 1 < jobs.size()) jobs[i + 1].source->ref.file->prefetch(*jobs[i + 1].source->ref.info);  // readahead
      const TensorJob& job = jobs[i];
      const SafetensorsFile& file = *job.source->ref.file;
      const TensorInfo& info = *job.source->ref.info;
      allocate_f32(*job.out, size_t(info.num_elements()));
      file.populate(info);
      const auto bytes = file.data(info);
      Status s = convert_to_f32(info.dtype, bytes.data(), job.out->size(), job.out->data());
      file.release(info);
      std::lock_guard lk(mu);
      if (!s) {
        if (error.empty()) error = file.path() + ": tensor \"" + job.source->name + "\": " + s.message();
        next = jobs.size();
        return;
      }
      bytes_read += int64_t(info.size_bytes);
      if (progress) progress(bytes_read, total);
    }
  };
  const unsigned threads =
      unsigned(std::min<size_t>({kLoadThreads, std::max(1u, std::thread::hardware_concurrency()), jobs.size()}));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (!error.empty()) return Status::error(error);
  return bytes_read;
}

}  // namespace

Expected<StageWeights> load_stage_weights(const std::string& model_dir, int64_t layer_begin,
                                          int64_t layer_end, const LoadProgress& progress) {
  auto config = load_model_config(model_dir);
  if (!config) return config.status();
  return load_stage_weights(model_dir, *config, layer_begin, layer_end, progress);
}

Expected<StageWeights> load_stage_weights(const std::string& model_dir, const ModelConfig& config,
                                          int64_t layer_begin, int64_t layer_end,
                                          const LoadProgress& progress) {
  // Every tensor found and checked before any data is read, so a bad checkpoint fails fast
  // instead of after gigabytes of conversion.
  auto ckpt = open_stage_checkpoint(model_dir, config, layer_begin, layer_end);
  if (!ckpt) return ckpt.status();
  StageWeights w;
  w.config = config;
  w.layer_begin = layer_begin;
  w.layer_end = layer_end;
  w.layers.resize(size_t(layer_end - layer_begin));  // sized first: jobs point into it
  std::vector<TensorJob> jobs;
  for (const StageTensorSpec& spec : kStageTensors)
    if (const auto& source = ckpt->stage[size_t(spec.id)]) jobs.push_back({&*source, &(w.*spec.field)});
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (const LayerTensorSpec& spec : kLayerTensors)
      jobs.push_back({&ckpt->layers[l][size_t(spec.id)], &(w.layers[l].*spec.field)});
  auto bytes_read = convert_all(jobs, progress);
  if (!bytes_read) return bytes_read.status();
  w.checkpoint_bytes_read = *bytes_read;
  return w;
}

}  // namespace conveyor

// load_stage_weights: one pipeline stage's tensors from a HuggingFace GPT-2 checkpoint.
// (random_stage_weights lives in random_weights.cc.)
//
// Names: "transformer.h.N.attn.c_attn.weight" etc.; the original OpenAI uploads drop the
// "transformer." prefix, so every name is tried with it first and then without. Buffers
// such as attn.bias / attn.masked_bias are never asked for, so they are ignored.
#include "model/weights.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/safetensors.h"

namespace conveyor {
namespace {

// One tensor the stage needs: where it goes, the shape the config implies, and (after
// resolve) where it lives in the checkpoint.
struct TensorJob {
  std::string name;               // HF name without the "transformer." prefix, or "lm_head.weight"
  std::vector<int64_t> shape;     // expected, in elements
  std::string shape_meaning;      // "[n_embd, 3*n_embd]": for the mismatch message
  std::vector<float>* out = nullptr;
  TensorRef ref;
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

class StageLoader {
 public:
  explicit StageLoader(Checkpoint& ckpt) : ckpt_(ckpt) {}

  void add(std::string name, std::vector<int64_t> shape, std::string meaning, std::vector<float>& out) {
    jobs_.push_back({std::move(name), std::move(shape), std::move(meaning), &out, {}});
  }

  // Phase 1, before any tensor data is read: every tensor exists and has the right shape
  // and dtype, so a bad checkpoint fails fast instead of after gigabytes of conversion.
  Status resolve() {
    for (TensorJob& job : jobs_) {
      const std::string prefixed = "transformer." + job.name;
      const bool top_level = job.name.rfind("lm_head.", 0) == 0;
      std::string name = job.name;
      if (!top_level && ckpt_.contains(prefixed)) {
        name = prefixed;
      } else if (!ckpt_.contains(job.name)) {
        return Status::error(ckpt_.dir() + ": tensor \"" + (top_level ? job.name : prefixed) +
                             "\" not found in checkpoint" +
                             (top_level ? std::string() : " (also tried \"" + job.name + "\")"));
      }
      auto ref = ckpt_.find(name);
      if (!ref) return ref.status();
      const TensorInfo& info = *ref->info;
      if (info.shape != job.shape)
        return Status::error(ref->file->path() + ": tensor \"" + name + "\" has shape " + shape_string(info.shape) +
                             ", but the model config implies " + shape_string(job.shape) + " " + job.shape_meaning);
      if (info.dtype != DType::F32 && info.dtype != DType::F16 && info.dtype != DType::BF16)
        return Status::error(ref->file->path() + ": tensor \"" + name + "\" is stored as " +
                             std::string(dtype_name(info.dtype)) + "; weights must be F32, F16 or BF16");
      job.name = std::move(name);
      job.ref = *ref;
    }
    return ok_status();
  }

  // Phase 2: convert the tensors to fp32, several at once (up to kLoadThreads threads
  // take the next tensor in turn): reading the mapping, faulting in the fresh fp32 pages
  // and converting all scale with threads, and one thread got ~1 GB/s of checkpoint. The
  // first error stops the others at their next tensor. Returns the bytes of tensor data
  // read (storage dtype); `progress` is called under a lock, so one call at a time.
  Expected<int64_t> convert(const LoadProgress& progress) {
    constexpr unsigned kLoadThreads = 8;
    int64_t total = 0;
    for (const TensorJob& job : jobs_) total += int64_t(job.ref.info->size_bytes);
    std::atomic<size_t> next{0};
    std::mutex mu;
    int64_t bytes_read = 0;
    std::string error;
    auto work = [&] {
      for (size_t i; (i = next++) < jobs_.size();) {
        if (i + 1 < jobs_.size()) jobs_[i + 1].ref.file->prefetch(*jobs_[i + 1].ref.info);  // readahead
        const TensorJob& job = jobs_[i];
        const TensorInfo& info = *job.ref.info;
        allocate_f32(*job.out, size_t(info.num_elements()));
        job.ref.file->populate(info);
        const auto bytes = job.ref.file->data(info);
        Status s = convert_to_f32(info.dtype, bytes.data(), job.out->size(), job.out->data());
        job.ref.file->release(info);
        std::lock_guard lk(mu);
        if (!s) {
          if (error.empty()) error = job.ref.file->path() + ": tensor \"" + job.name + "\": " + s.message();
          next = jobs_.size();
          return;
        }
        bytes_read += int64_t(info.size_bytes);
        if (progress) progress(bytes_read, total);
      }
    };
    const unsigned threads =
        unsigned(std::min<size_t>({kLoadThreads, std::max(1u, std::thread::hardware_concurrency()), jobs_.size()}));
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
    if (!error.empty()) return Status::error(error);
    return bytes_read;
  }

 private:
  Checkpoint& ckpt_;
  std::vector<TensorJob> jobs_;
};

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
  if (!(0 <= layer_begin && layer_begin < layer_end && layer_end <= config.n_layer))
    return Status::error(model_dir + ": layer range [" + std::to_string(layer_begin) + ", " +
                         std::to_string(layer_end) + ") is invalid for a model with n_layer=" +
                         std::to_string(config.n_layer) + " (need 0 <= begin < end <= n_layer)");
  auto ckpt = Checkpoint::open(model_dir);
  if (!ckpt) return ckpt.status();

  StageWeights w;
  w.config = config;
  w.layer_begin = layer_begin;
  w.layer_end = layer_end;
  w.layers.resize(size_t(layer_end - layer_begin));  // sized first: jobs point into it

  StageLoader loader(*ckpt);
  // The head is untied only when the config says so and the checkpoint has one; otherwise
  // the last stage multiplies by wte (HF ties them when lm_head.weight is absent).
  const bool untied_head = w.has_head() && !config.tie_word_embeddings && ckpt->contains("lm_head.weight");
  for (const StageTensorSpec& spec : kStageTensors) {
    bool needed = spec.held_by == HeldBy::FirstStage ? w.has_embedding() : w.has_head();
    if (spec.id == StageTensor::Wte) needed = w.has_embedding() || (w.has_head() && !untied_head);
    if (spec.id == StageTensor::LmHead) needed = untied_head;
    if (!needed) continue;
    auto dims = [&](StageDim d) -> std::pair<int64_t, std::string> {
      switch (d) {
        case StageDim::Vocab: return {config.vocab_size, "vocab_size"};
        case StageDim::Positions: return {config.n_positions, "n_positions"};
        case StageDim::Embd: return {config.n_embd, "n_embd"};
        case StageDim::One: return {1, "1"};
      }
      return {0, "?"};
    };
    const auto [rows, row_name] = dims(spec.rows);
    const auto [cols, col_name] = dims(spec.cols);
    if (spec.rows == StageDim::One)
      loader.add(spec.hf_name, {cols}, "[" + col_name + "]", w.*spec.field);
    else
      loader.add(spec.hf_name, {rows, cols}, "[" + row_name + ", " + col_name + "]", w.*spec.field);
  }
  for (int64_t l = layer_begin; l < layer_end; ++l) {
    LayerWeights& lw = w.layers[size_t(l - layer_begin)];
    for (const LayerTensorSpec& spec : kLayerTensors) {
      const TensorShape shape = layer_tensor_shape(spec, config);
      std::vector<int64_t> dims = spec.matrix() ? std::vector<int64_t>{shape.rows, shape.cols}
                                                : std::vector<int64_t>{shape.cols};
      loader.add(layer_tensor_name(l, spec), std::move(dims), layer_tensor_dims(spec), lw.*spec.field);
    }
  }

  if (Status s = loader.resolve(); !s) return s;
  auto bytes_read = loader.convert(progress);
  if (!bytes_read) return bytes_read.status();
  w.checkpoint_bytes_read = *bytes_read;
  return w;
}

}  // namespace conveyor

#include "stage/cuda/tp_stage.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <utility>

#include <spdlog/spdlog.h>

#include "stage/cuda/guard.h"

namespace conveyor::cuda {

namespace {

// The sticky fault `device`'s context holds, if any. cudaGetLastError clears what failed last
// on this thread unless it was sticky; a sticky fault then comes back from any call that
// touches the context, as from the event made here (which waits for nothing).
Status sticky_fault(int device) {
  const Status s = guard("GPU " + std::to_string(device), [&] {
    DeviceGuard on(device);
    (void)cudaGetLastError();
    cudaEvent_t event = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventDestroy(event));
    return ok_status();
  });
  if (s) return s;
  return Status::error(s.message() + "; CUDA keeps this fault until the process exits");
}

}  // namespace

Status TpStage::health() const {
  if (!broken_.empty()) return Status::error(broken_);
  for (size_t r = 0; r < devices_.size(); ++r)
    if (Status s = sticky_fault(devices_[r]); !s)
      return Status::error(name_ + ": rank " + std::to_string(r) + " on " + s.message());
  return ok_status();
}

template <class F>
Status TpStage::on_ranks(F&& fn) {
  if (!broken_.empty()) return Status::error(broken_);
  std::vector<Status> status(ranks_.size());
  threads_->run([&](int r) {
    status[size_t(r)] = guard("", [&] {
      DeviceGuard on(devices_[size_t(r)]);
      return fn(r);
    });
  });
  size_t failed = 0, first = status.size();
  for (size_t r = 0; r < status.size(); ++r)
    if (!status[r]) failed++, first = std::min(first, r);
  if (failed == 0) return ok_status();
  if (failed < status.size()) {
    // The ranks that went on may have queued all-reduces the failed rank never will: their
    // kernels wait for it on the GPU, and the next synchronisation there (a free, a copy back)
    // waits for them. Said now, before anything can block, and no call runs again.
    broken_ = name_ + ": rank " + std::to_string(first) + " failed a call (" + status[first].message() + ") that " +
              std::to_string(status.size() - failed) + " of the " + std::to_string(status.size()) +
              " ranks completed; their all-reduces no longer pair up, so the stage takes no more calls";
    spdlog::error("{}", broken_);
  }
  return status[first];
}

template <class Make>
Expected<std::unique_ptr<TpStage>> TpStage::build(const ModelConfig& config, const std::vector<int>& devices,
                                                  const GpuStageOptions& options, Make&& make) {
  const int R = int(devices.size());
  if (R < 1 || R > 8)
    return Status::error(options.name + ": tensor parallel over " + std::to_string(R) + " GPUs (1 to 8)");
  std::unique_ptr<TpStage> t(new TpStage());
  t->name_ = options.name;
  t->devices_ = devices;
  if (R > 1) {
    const int64_t rows = GpuStage::activation_rows(options);
    auto ar = TpAllReduce::create(devices, size_t(rows * config.n_embd) * dtype_bytes(options.dtype),
                                  options.all_reduce_push_max_bytes);
    if (!ar) return Status::error(options.name + ": " + ar.error());
    t->all_reduce_ = std::move(ar).value();
  }
  t->ranks_.resize(size_t(R));
  t->threads_ = std::make_unique<TpGroup>(R);
  auto make_rank = [&](int r) {
    GpuStageOptions o = options;
    o.tp_rank = r;
    o.tp_ranks = R;
    o.all_reduce = t->all_reduce_.get();
    if (R > 1) o.name = options.name + " rank " + std::to_string(r);
    auto stage = make(o);
    if (!stage) return stage.status();
    t->ranks_[size_t(r)] = std::move(stage).value();
    return ok_status();
  };
  // Ranks sharing a GPU are built one after the other: each sizes its K/V cache from the
  // memory the ones before left free.
  const bool shared = !distinct_gpus(devices);
  Status built;
  for (int r = 0; shared && r < R && built; ++r)
    built = guard("", [&] {
      DeviceGuard on(devices[size_t(r)]);
      return make_rank(r);
    });
  if (!shared) built = t->on_ranks(make_rank);
  if (!built) return built;
  if (R > 1 && t->lead().layer_end() > t->lead().layer_begin()) {
    int64_t pages = INT64_MAX;
    for (const auto& s : t->ranks_) pages = std::min(pages, s->kv_capacity_tokens() / kPageTokens);
    for (const auto& s : t->ranks_)
      if (Status st = s->shrink_kv_cache(pages); !st) return st;
  }
  return t;
}

Expected<std::unique_ptr<TpStage>> TpStage::create(const StageWeights& weights, const std::vector<int>& devices,
                                                   const GpuStageOptions& options) {
  return build(weights.config, devices, options,
               [&](const GpuStageOptions& o) { return GpuStage::create(weights, o); });
}

namespace {

// The ranks' load progress as one figure: bytes done summed over the ranks, over their totals
// (a rank that has not started yet counts as large as the largest that has).
class RankProgress {
 public:
  RankProgress(int ranks, LoadProgress out) : done_(size_t(ranks)), total_(size_t(ranks)), out_(std::move(out)) {}
  LoadProgress of(int rank) {
    if (!out_) return {};
    return [this, rank](int64_t done, int64_t total) {
      std::lock_guard lk(mu_);
      done_[size_t(rank)] = done;
      total_[size_t(rank)] = total;
      const int64_t largest = *std::max_element(total_.begin(), total_.end());
      int64_t sum_done = 0, sum_total = 0;
      for (size_t r = 0; r < done_.size(); ++r) {
        sum_done += done_[r];
        sum_total += total_[r] > 0 ? total_[r] : largest;
      }
      out_(sum_done, sum_total);
    };
  }

 private:
  std::mutex mu_;
  std::vector<int64_t> done_, total_;
  LoadProgress out_;
};

}  // namespace

Expected<std::unique_ptr<TpStage>> TpStage::create(const StageCheckpoint& checkpoint, const std::vector<int>& devices,
                                                   const GpuStageOptions& options, const DirectLoadOptions& load,
                                                   const LoadProgress& progress) {
  RankProgress ranks(int(devices.size()), progress);
  return build(checkpoint.config, devices, options, [&](const GpuStageOptions& o) {
    return GpuStage::create(checkpoint, o, load, ranks.of(o.tp_rank));
  });
}

Expected<std::unique_ptr<TpStage>> TpStage::create_synthetic(const ModelConfig& config, int64_t layer_begin,
                                                             int64_t layer_end, uint64_t seed,
                                                             const std::vector<int>& devices,
                                                             const GpuStageOptions& options) {
  return build(config, devices, options, [&](const GpuStageOptions& o) {
    return GpuStage::create_synthetic(config, layer_begin, layer_end, seed, o);
  });
}

TpStage::~TpStage() {
  threads_.reset();  // no call in flight: the ranks' threads end before their stages go
  for (size_t r = 0; r < ranks_.size(); ++r) {
    DeviceGuard on(devices_[r]);
    ranks_[r].reset();
  }
}

Status TpStage::embed(std::span<const SeqSlice> slices, const int32_t* token_ids) {
  return on_ranks([&](int r) { return rank(r).embed(slices, token_ids); });
}

Status TpStage::plan_products(int64_t rows, bool with_head) {
  if (ranks_.size() < 2) return ok_status();  // no peer ever waits for a lone rank
  bool planned = true;
  for (size_t r = 0; r < ranks_.size(); ++r) planned = planned && ranks_[r]->products_planned(rows, with_head);
  if (planned) return ok_status();
  return on_ranks([&](int r) { return rank(r).plan_products(rows, with_head); });
}

Expected<std::string> TpStage::warm_up(int64_t max_seqs, int64_t max_rows) {
  const auto t0 = std::chrono::steady_clock::now();
  max_rows = std::min(max_rows, max_tokens());
  // Every plan bucket (Gemm::plan_bucket) a step can reach, timed at its largest row count.
  std::vector<int64_t> rows;
  for (int64_t t = 1; t <= max_rows; t = Gemm::plan_bucket(t) + 1)
    rows.push_back(std::min(Gemm::plan_bucket(t), max_rows));
  for (int64_t t : rows)
    if (Status s = on_ranks([&](int r) { return rank(r).plan_products(t, true); }); !s) return s;
  size_t graphs = 0;
  for (int64_t seqs = 1; lead().cuda_graphs() && seqs <= std::min(max_seqs, kMaxGraphRows);) {
    if (Status s = on_ranks([&](int r) { return rank(r).capture_decode_graph(seqs); }); !s) return s;
    ++graphs;
    seqs = lead().decode_rows(seqs) + 1;  // the next bucket's first size
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char took[32];
  std::snprintf(took, sizeof took, "%.2f s", secs);
  return "products planned for " + std::to_string(rows.size()) + " row counts up to " + std::to_string(max_rows) +
         ", decode graphs of " + std::to_string(graphs) + " batch sizes captured, in " + took;
}

Status TpStage::forward(std::span<const SeqSlice> slices) {
  int64_t rows = 0;
  for (const SeqSlice& s : slices) rows += std::max<int64_t>(s.num_tokens, 0);
  if (Status s = plan_products(rows, false); !s) return s;
  return on_ranks([&](int r) { return rank(r).forward(slices); });
}

Status TpStage::logits(std::span<const SeqSlice> slices, bool all_positions, float* out) {
  return lead().logits(slices, all_positions, out);
}

Status TpStage::sample(std::span<const SampleRow> rows, int32_t* tokens, float* logprobs) {
  return lead().sample(rows, tokens, logprobs);
}

Status TpStage::decode(std::span<const SeqSlice> slices, const int32_t* token_ids, std::span<const SampleRow> sampling,
                       int32_t* tokens, float* logprobs) {
  // Rank 0 alone takes the sampling rows: refused there after the others had started, the
  // step would leave them waiting in its all-reduces.
  if (Status s = lead().check_decode(slices, token_ids, sampling, tokens); !s) return s;
  if (Status s = plan_products(lead().decode_rows(int64_t(slices.size())), true); !s) return s;
  return on_ranks([&](int r) {
    return r == 0 ? rank(r).decode(slices, token_ids, sampling, tokens, logprobs)
                  : rank(r).decode(slices, token_ids, {}, nullptr);
  });
}

Status TpStage::upload_hidden(const void* src, DType dtype, int64_t num_tokens) {
  return on_ranks([&](int r) { return rank(r).upload_hidden(src, dtype, num_tokens); });
}

Status TpStage::download_hidden(void* dst, DType dtype, int64_t num_tokens) {
  return lead().download_hidden(dst, dtype, num_tokens);
}

Status TpStage::fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens) {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (Status s = ranks_[r]->fork_sequence(parent, child, num_tokens); !s) {
      for (size_t done = 0; done < r; ++done) ranks_[done]->free_sequence(child);
      return s;
    }
  }
  return ok_status();
}

void TpStage::free_sequence(uint64_t seq_id) {
  for (auto& s : ranks_) s->free_sequence(seq_id);
}

void TpStage::clear() {
  for (auto& s : ranks_) s->clear();
}

int64_t TpStage::kv_bytes_per_token() const {
  int64_t n = 0;
  for (const auto& s : ranks_) n += s->kv_bytes_per_token();
  return n;
}

int64_t TpStage::weight_bytes() const {
  int64_t n = 0;
  for (const auto& s : ranks_) n += s->weight_bytes();
  return n;
}

std::string TpStage::memory_report() const {
  std::ostringstream os;
  for (size_t r = 0; r < ranks_.size(); ++r) os << (r ? "\n" : "") << ranks_[r]->memory_report();
  return os.str();
}

}  // namespace conveyor::cuda

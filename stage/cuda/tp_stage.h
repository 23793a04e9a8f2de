// TpStage: one pipeline stage run tensor parallel over the GPUs of this process, Megatron
// style (DESIGN.md, "Inside a stage"): one GpuStage per GPU holding its TpShard of every
// layer, one thread per GPU (common/tp_group.h; the caller drives rank 0), and the
// TpAllReduce that joins the ranks' partial projections twice per layer.
//
// Every call runs the same GpuStage call on every rank at once: each rank embeds the same
// tokens (the embedding is replicated), runs its shard of the layers, and meets the others
// in the all-reduces inside the step (captured in each rank's own CUDA graph for decode).
// The residual stream is the same bits on every rank after each all-reduce, so rank 0
// alone reads it back, computes the logits (it alone holds the LM head) and samples.
//
// The ranks must make the same all-reduce calls in the same order, so they must take the
// same decisions: every check a call makes depends only on its arguments and on state the
// ranks share (cached lengths, K/V pages: every rank gets the smallest rank's capacity).
//
// With one GPU it is a plain GpuStage (no threads, no all-reduce). Ranks may also share a
// GPU (tests on one-GPU machines): the all-reduce then runs the custom kernel at every size.
//
// Errors: every call returns Status or Expected. The ranks' calls return theirs (GpuStage
// guards its own entries); the rank threads' own CUDA calls (making the rank's GPU current)
// go through guard() in on_ranks, the one place a fault is caught here. A call that fails on
// some ranks only is logged when it returns, and the stage refuses every call after it: the
// ranks that went on may wait in an all-reduce for one that never comes.
//
// Not thread-safe: one caller at a time (the stage worker's engine thread).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tp_group.h"
#include "stage/cuda/gpu_stage.h"
#include "stage/cuda/tp_all_reduce.h"

namespace conveyor::cuda {

class TpStage {
 public:
  // The stage's layers over `devices` (rank r on devices[r]), loading each rank's shard of
  // `weights`. options.tp_* are set here. Fails on shapes, memory, NCCL.
  static Expected<std::unique_ptr<TpStage>> create(const StageWeights& weights, const std::vector<int>& devices,
                                                   const GpuStageOptions& options);
  // Each rank loading its own part straight from the checkpoint (GpuStage::create from a
  // StageCheckpoint), ranks on distinct GPUs at once. `progress`: the ranks' bytes summed.
  static Expected<std::unique_ptr<TpStage>> create(const StageCheckpoint& checkpoint, const std::vector<int>& devices,
                                                   const GpuStageOptions& options, const DirectLoadOptions& load = {},
                                                   const LoadProgress& progress = {});
  // Synthetic weights (GpuStage::create_synthetic), each rank drawing its own shard.
  static Expected<std::unique_ptr<TpStage>> create_synthetic(const ModelConfig& config, int64_t layer_begin,
                                                             int64_t layer_end, uint64_t seed,
                                                             const std::vector<int>& devices,
                                                             const GpuStageOptions& options);
  ~TpStage();
  TpStage(const TpStage&) = delete;
  TpStage& operator=(const TpStage&) = delete;

  int ranks() const { return int(ranks_.size()); }
  GpuStage& rank(int r) { return *ranks_[size_t(r)]; }
  GpuStage& lead() { return *ranks_[0]; }
  const GpuStage& lead() const { return *ranks_[0]; }
  const std::vector<int>& devices() const { return devices_; }
  bool uses_nccl() const { return all_reduce_ && all_reduce_->uses_nccl(); }

  const ModelConfig& config() const { return lead().config(); }
  const std::string& name() const { return name_; }
  bool has_embedding() const { return lead().has_embedding(); }
  bool has_head() const { return lead().has_head(); }
  int64_t max_tokens() const { return lead().max_tokens(); }
  int64_t max_seqs() const { return lead().max_seqs(); }

  // GpuStage's calls, on every rank (logits and sample: rank 0, which holds the head).
  Status embed(std::span<const SeqSlice> slices, const int32_t* token_ids);
  Status forward(std::span<const SeqSlice> slices);
  Status logits(std::span<const SeqSlice> slices, bool all_positions, float* out);
  Status sample(std::span<const SampleRow> rows, int32_t* tokens, float* logprobs = nullptr);
  Status decode(std::span<const SeqSlice> slices, const int32_t* token_ids, std::span<const SampleRow> sampling,
                int32_t* tokens, float* logprobs = nullptr);
  // Before serving: plans the products of every row count whose plan bucket (gemm.h) a step of
  // at most `max_rows` rows can start, with the LM head, and captures the decode graph of
  // every bucket up to `max_seqs` sequences, on every rank. Otherwise the first step of each
  // new size does it while requests wait (a capture of gpt3-6.7b's 32 layers took 40-110 ms
  // on an H100, a plan about 10 ms a product). Returns what it did, for the log.
  Expected<std::string> warm_up(int64_t max_seqs, int64_t max_rows);
  // GpuStage::upload_hidden / download_hidden: to every rank, from rank 0.
  Status upload_hidden(const void* src, DType dtype, int64_t num_tokens);
  Status download_hidden(void* dst, DType dtype, int64_t num_tokens);
  Status upload_hidden(const float* host, int64_t num_tokens) { return upload_hidden(host, DType::F32, num_tokens); }
  Status download_hidden(float* host, int64_t num_tokens) { return download_hidden(host, DType::F32, num_tokens); }
  // On every rank; a rank that fails undoes the ranks before it.
  Status fork_sequence(uint64_t parent, uint64_t child, int64_t num_tokens);
  void free_sequence(uint64_t seq_id);
  void clear();

  int64_t num_sequences() const { return lead().num_sequences(); }
  int64_t kv_capacity_tokens() const { return lead().kv_capacity_tokens(); }
  int64_t kv_free_tokens() const { return lead().kv_free_tokens(); }
  int64_t kv_bytes_per_token() const;  // over all ranks
  int64_t weight_bytes() const;        // over all ranks
  // Bytes the busiest rank (rank 0: its shard and the LM head) reads in one decode step:
  // what bounds the step from below.
  int64_t decode_weight_bytes() const { return lead().decode_weight_bytes(); }
  std::string memory_report() const;  // one line per rank

  // Ok while the stage can run calls. Otherwise why it never will again in this process: its
  // ranks' all-reduces out of step (broken_), or a GPU whose CUDA context holds a sticky fault
  // (an illegal address, a trap, an uncorrectable ECC error: CUDA returns it from every later
  // call until the process exits). Does not wait for the GPUs. A call refused by its checks
  // leaves the stage healthy.
  Status health() const;

 private:
  TpStage() = default;
  // make(options of rank r) -> Expected<std::unique_ptr<GpuStage>>, on rank r's GPU.
  template <class Make>
  static Expected<std::unique_ptr<TpStage>> build(const ModelConfig& config, const std::vector<int>& devices,
                                                  const GpuStageOptions& options, Make&& make);
  // GpuStage::plan_products on every rank (all join before the step that follows runs), when
  // some rank has not planned these rows yet.
  Status plan_products(int64_t rows, bool with_head);
  // fn(rank) -> Status on every rank's thread with its GPU current; the first failure (in rank
  // order) is returned. A call that fails on some ranks and not on others leaves the ranks'
  // all-reduce calls out of step: it is logged at once and every later call fails (broken_).
  template <class F>
  Status on_ranks(F&& fn);

  std::string name_;
  std::vector<int> devices_;
  std::unique_ptr<TpAllReduce> all_reduce_;  // null with one rank
  std::vector<std::unique_ptr<GpuStage>> ranks_;
  std::unique_ptr<TpGroup> threads_;
  std::string broken_;  // why no call runs any more (on_ranks); empty while the ranks agree
};

}  // namespace conveyor::cuda

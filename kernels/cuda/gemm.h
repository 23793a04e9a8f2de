// Matrix products for the GPU stage: out[T, N] = in[T, K] @ W + bias, fp32 accumulation,
// with W stored either as [K, N] (HF Conv1D, the layout kernels/cpu uses) or [N, K]
// (nn.Linear; the GPU stage stores every weight this way, and the LM head is [V, C]).
//
// Each distinct problem (layout, types, T, K, N, bias, activation, pointer alignment) is
// planned once: cuBLASLt's heuristic proposes up to kMaxCandidates algorithms, each is timed
// on the caller's own buffers and stream, and the fastest is cached. Token counts share a
// timed choice within a bucket (T exact up to 8, then (8, 16], (16, 32], ... powers of two):
// a serving stage sees nearly every T as prefill chunks join decode batches, and timing each
// cost ~10 ms a shape; the first T of a bucket is timed, the others take its choice where
// cuBLASLt accepts it for their own T (cublasLtMatmulAlgoCheck), else are timed themselves. For the [N, K] layout
// with T <= 8 the candidates also include our GEMV kernel (gemv.cu: one warp per output row,
// 16-byte streaming loads, epilogue fused), which is what batch-1 decode runs at the
// memory-bandwidth limit. Planning synchronises the stream, so it must happen outside graph
// capture; a shape first seen while the stream is capturing takes the heuristic's first
// choice untimed (GpuStage plans every shape before it captures).
//
// run_int8 is the int8 weight-only twin for the [N, K] layout (quant.h): weights int8 with one
// fp32 scale per row, planned the same way among our own kernels (an int8 GEMV for T <= 8 and
// tensor-core tiles of several sizes; quant.cu).
//
// run_fp8 is the FP8 (E4M3) twin for Hopper (fp8.h): weights E4M3 [N, K] with one fp32 scale
// per row, activations quantised per row at each call (a dynamic scale per token), the unscaled
// product on cuBLASLt's FP8 tensor cores into fp32, then our epilogue kernel applies both scale
// vectors, the bias and the activation (fp8_gemm.cc, fp8.h).
//
// A Gemm owns a cuBLASLt handle and a workspace and is used by one thread on one device,
// one stream at a time (the workspace is shared by all its calls). In deterministic mode (the
// default, below) a row's result is bitwise independent of T; with it off, the algorithm,
// hence the summation order, may change with T.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/kernel_options.h"
#include "common/model_config.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/fp8.h"

namespace conveyor::cuda {

enum class WeightLayout : uint8_t { KN, NK };
// The values are the activation codes the kernels take (dtype.cuh activate()).
enum class GemmAct : uint8_t { None = 0, GeluTanh = 1, GeluErf = 2 };

inline GemmAct gemm_act(Activation a) {
  return a == Activation::GeluNew ? GemmAct::GeluTanh : GemmAct::GeluErf;
}

class Gemm {
 public:
  static constexpr int kMaxCandidates = 8;
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;
  // The bucket of token counts that share a timed plan, named by its largest count: exact up
  // to 8 (the GEMV's range), then powers of two. The first call of a bucket times; the others
  // take its choice where cuBLASLt accepts it for their own T.
  static int64_t plan_bucket(int64_t T);

  // On the current device. `options` (common/kernel_options.h) are what a daemon read at
  // start-up; the defaults are the stage's usual mode. Throws conveyor::Error naming a forced
  // K split or an L2 prefetch the kernels do not have.
  explicit Gemm(const GemmOptions& options = {});
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // out = act(in @ W + bias). T is __half or __nv_bfloat16; OutT is T or float. bias
  // (length N, type T) may be null. All pointers device; asynchronous on `stream`.
  template <class T, class OutT>
  void run(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
           WeightLayout layout, GemmAct act, cudaStream_t stream);

  // Int8 weight-only product: out[t, n] = act(scales[n] * sum_k in[t, k] w[n, k] + bias[n]), w
  // [N, K] int8 and scales [N] fp32 as quantize_rows_int8 (quant.h) makes them, fp32
  // accumulation. T is __half or __nv_bfloat16; OutT is T or float, either with bias (length N,
  // type T, may be null) and activation. All pointers device. The first call of a shape
  // outside graph capture times the int8 kernels that suit it (detail::int8_candidates) and
  // keeps the fastest; a shape first seen while capturing takes detail::int8_default_kernel
  // untimed. Every call is kernel launches on `stream` only (no allocation): capturable.
  // Throws conveyor::Error for a null out, in, w or scales, or T_, K, N <= 0.
  template <class T, class OutT>
  void run_int8(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int64_t T_,
                int64_t K, int64_t N, GemmAct act, cudaStream_t stream);

  // FP8 product: out[t, n] = act(sa[t] * w_scales[n] * sum_k qa[t, k] w[n, k] + bias[n]), where
  // qa, sa are in's rows quantised to E4M3 (quantize_rows_fp8) into the FP8 workspace; w [N, K]
  // E4M3 and w_scales [N] as quantize_rows_fp8 makes them. T is __half or __nv_bfloat16; out,
  // in and bias (may be null) are T. Needs K % 16 == 0 and N % 16 == 0 (cuBLASLt's FP8 layout
  // rules), 16-byte aligned in, w and out. cuBLASLt computes the unscaled sums (E4M3 x E4M3,
  // fp32 accumulation, times 2^-e out in fp16, into the FP8 workspace: fp8_sum_exponent);
  // fp8_scale_epilogue then writes out. In deterministic mode every T of a (K, N) shape sums in the order of one anchor
  // algorithm, the first the heuristic proposes for kFp8AnchorRows rows that runs without a
  // split along K and accepts every T; each T bucket times the anchor and the unsplit
  // proposals whose sums equal its bit for bit on the call's rows: a row's bits then depend on
  // that row alone (its scale is its own, its sums run in one order whatever the batch, the
  // epilogue is per element). Fast mode times the
  // heuristic's proposals per T bucket, split-K included. Every call after a shape's first is
  // launches only (capturable). Throws conveyor::Error naming the bad argument, or when
  // cuBLASLt offers no FP8 algorithm for the problem. GemmOptions::fp8_fast_accum turns
  // on cuBLASLt's fast FP8 accumulation (no periodic promotion to fp32: faster, less exact;
  // still the same bits for every T, but not the default's bits).
  // in_q (optional): in's rows already quantised (layernorm_forward's fp8 rows: exactly
  // quantize_rows_fp8 of in), read instead of quantising in again; in is then never read and
  // may be null.
  // defer (optional; no activation): the epilogue is left to the kernel after the product
  // (add_bias_residual_layernorm's x_sums, attention_decode_paged's qkv_sums), which reads the
  // sums where *defer says (Fp8Sums, fp8.h, the bias with them) before the next FP8 product
  // on this Gemm: one kernel and one pass over the output fewer. Only a call whose rows fit
  // one block of the workspace defers; any other writes out as usual and sets *defer empty,
  // so the caller's next kernel reads out.
  template <class T>
  void run_fp8(T* out, const T* in, const uint8_t* w, const float* w_scales, const T* bias, int64_t T_, int64_t K,
               int64_t N, GemmAct act, cudaStream_t stream, Fp8Rows in_q = {}, Fp8Sums* defer = nullptr);
  // FC1 then FC2 of an MLP in FP8: out = FC2(act(FC1(in) + bias1)), FC2 without its bias (the
  // layer adds it with the residual). The same bits as run_fp8 twice (FC1 into a T row, then
  // FC2 of it), without that row in memory: FC1's epilogue quantises it for FC2 in the same
  // kernel (fp8_epilogue_quantize). in [T, K], w1 [I, K], w2 [N, I]; needs
  // fp8_mlp_supported(I), else throws. Its workspace: fp8_mlp_workspace_bytes. in_q, defer
  // (FC2's epilogue): as run_fp8's.
  template <class T>
  void run_fp8_mlp(T* out, const T* in, const uint8_t* w1, const float* w1_scales, const T* bias1, GemmAct act,
                   const uint8_t* w2, const float* w2_scales, int64_t T_, int64_t K, int64_t I, int64_t N,
                   cudaStream_t stream, Fp8Rows in_q = {}, Fp8Sums* defer = nullptr);
  static size_t fp8_mlp_workspace_bytes(int64_t rows, int64_t K, int64_t I, int64_t N);
  static bool fp8_mlp_supported(int64_t I);
  // Whether run_fp8_mlp is faster than run_fp8 twice for T_ rows: above 64 (one block a row
  // quantises FC1's outputs; at one row that block took longer than the epilogue's 16 and the
  // quantiser's one: gpt3-6.7b's FP8 step 3.73 -> 3.78 ms; at 512 rows 17.14 -> 16.98, H100).
  static bool fp8_mlp_pays(int64_t T_, int64_t I) { return T_ > 64 && fp8_mlp_supported(I); }
  // Whether deferring an epilogue (run_fp8's `defer`) pays for T_ rows: above 64. At fewer
  // rows the epilogue is a kernel launched early (programmatic dependent launch) during which
  // the next kernel gets ready, and taking it away was slower: gpt3-6.7b's FP8 step at batch 1
  // 2.975 -> 3.03 ms with the LayerNorm reading the sums (H200, 2026-11-28).
  static bool fp8_defer_pays(int64_t T_) { return T_ > 64; }
  // The memory run_fp8 works in: the activations quantised (K bytes and a scale a row) and
  // cuBLASLt's fp16 sums (2 N bytes a row). fp8_workspace_bytes(rows, K, N) holds `rows` rows
  // of one product; calls of more rows than it holds run in blocks of rows (the same bits in
  // deterministic mode). Without one, the Gemm allocates its own at a call outside graph
  // capture that needs more. The caller owns the buffer.
  void set_fp8_workspace(void* workspace, size_t bytes);
  static size_t fp8_workspace_bytes(int64_t rows, int64_t K, int64_t N);
  // Whether this device runs run_fp8 correctly: FP8 tensor cores (compute capability 8.9 or
  // newer), a cuBLASLt FP8 algorithm for a small product (without a split along K in
  // deterministic mode), and that product's checked result: an error that says why not.
  Status fp8_supported();
  static constexpr int64_t kFp8AnchorRows = 256;

  // Deterministic mode (GemmOptions::deterministic, on by default, or set_deterministic): a
  // row's result is the same bits whatever T, its place among the rows, or the kernel Gemm
  // picks. run() with the [N, K] layout takes the sequential order (gemm_sequential.cc: K in
  // increasing 16-element tensor-core steps from zero, as cuBLASLt's kernels without a split
  // along K sum; those kernels and the sequential GEMV, each admitted by its bits on a probe,
  // timed per T bucket) for every shape where a canonical unsplit cuBLASLt algorithm exists,
  // else the fixed-order tiles (fixed_gemm.h: chains that depend on K alone). run_int8()
  // takes the fixed-order tiles, or with GemmOptions::int8_sequential_order the same
  // sequential order over the dequantised matrix T(q * s) (the dequantisation workspace
  // below, or gemv_seq_int8 in registers for T <= 64): prefill at cuBLASLt's speed, decode
  // slower than the tiles. set_sequential_order(false), or GemmOptions::sequential_order
  // off, keeps every shape on the tiles. Off: the fastest of cuBLASLt, the GEMV and the
  // int8 kernels, whose order follows T. The [K, N] layout always takes cuBLASLt (the stage
  // never uses it). A shape's route is settled at its first call, which must come outside
  // graph capture (GpuStage plans every shape eagerly before it captures).
  void set_deterministic(bool on) { options_.deterministic = on; }
  void set_sequential_order(bool on) { options_.sequential_order = on; }
  void set_int8_sequential_order(bool on) { options_.int8_sequential_order = on; }
  bool deterministic() const { return options_.deterministic; }
  const GemmOptions& options() const { return options_; }

  // Lets run_int8 also weigh, for T > 8, dequantising the weight into `workspace` (at least
  // N x K elements of T) and then run(): cuBLASLt's tensor cores at full rate, for 3 extra
  // bytes moved per weight, which wins in prefill. The caller owns the buffer (allocated at
  // load, before the K/V cache takes the rest).
  void set_dequant_workspace(void* workspace, size_t bytes) { dequant_ = workspace, dequant_bytes_ = bytes; }

  // Off: every new shape takes the heuristic's first choice (or the GEMV for T <= 8, [N, K])
  // without timing. GemmOptions::tuning is its start.
  void set_tuning(bool on) { options_.tuning = on; }
  size_t planned_shapes() const { return plans_.size(); }
  // One line per plan: the shape, the choice and its time (for benchmark logs).
  std::string describe_plans() const;

  // The calling thread's Gemm for the current device, created on first use.
  static Gemm& thread_default();

 private:
  struct Key {
    int layout, in_type, out_type, has_bias, act, align;  // layout: WeightLayout, or kInt8Layout
    int64_t T, K, N;
    auto tie() const { return std::tie(layout, in_type, out_type, has_bias, act, align, T, K, N); }
    bool operator<(const Key& o) const { return tie() < o.tie(); }
  };
  struct Plan;
  static Key bucket_of(Key key);  // `key` with T replaced by its bucket's

  Plan& plan_for(const Key& key, const void* out, const void* in, const void* w, const void* bias,
                 cudaStream_t stream);
  // The plan of `key` among our own kernels: candidates_of() lists them (asked only when
  // `key` has no plan yet: every call of a planned shape passes here), launch(k) runs
  // candidate k (a detail::Int8Kernel or detail::FixedTile) on the caller's buffers;
  // untimed_choice when nothing is timed. dequant: the int8 dequantise-then-run() path
  // (kDequantChoice) is a candidate too.
  Plan& plan_kernels(const Key& key, const std::function<std::vector<int>()>& candidates_of, int untimed_choice,
                     bool dequant, const std::function<void(int)>& launch, cudaStream_t stream);
  // The fixed-order tiles for W = T or int8_t (scales then required).
  template <class T, class W, class OutT>
  void run_fixed(OutT* out, const T* in, const W* w, const float* scales, const T* bias, int64_t T_, int64_t K,
                 int64_t N, GemmAct act, cudaStream_t stream);
  // The sequential-order products (gemm_sequential.cc): false when the shape keeps the
  // fixed-order tiles. SeqFamily: a shape's settled route and admitted algorithms; SeqPlan: a
  // T's choice; SeqState: both maps.
  template <class T, class OutT>
  bool run_sequential(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
                      GemmAct act, cudaStream_t stream);
  // Int8 weights in that order (dequantised in the producer): false when the shape keeps the
  // fixed-order tiles (no dequantisation workspace for it, or no canonical algorithm).
  template <class T, class OutT>
  bool run_sequential_int8(OutT* out, const T* in, const int8_t* q, const float* scales, const T* bias, int64_t T_,
                           int64_t K, int64_t N, GemmAct act, cudaStream_t stream);
  enum class SeqInt8 : int;  // gemm_sequential.cc
  template <class T, class OutT>
  SeqInt8 seq_int8_family(const Key& family, const int8_t* q, const float* scales, const T* bias,
                          cudaStream_t stream);
  struct SeqFamily;
  struct SeqPlan;
  struct SeqState;
  struct SeqStateDeleter {
    void operator()(SeqState* s) const;
  };
  template <class T, class OutT>
  SeqFamily& seq_family(const Key& family, const T* w, const T* bias, cudaStream_t stream);
  int seq_admit(SeqFamily& f, const cublasLtMatmulAlgo_t& algo, const void* w, const void* bias, cudaStream_t stream);
  std::string describe_seq_plans() const;
  // run_fp8's state (fp8_gemm.cc): its plans, the fixed algorithm of each shape, the workspace.
  struct Fp8State;
  struct Fp8StateDeleter {
    void operator()(Fp8State* s) const;
  };
  Fp8State& fp8_state();
  std::string describe_fp8_plans() const;
  void check_device() const;  // throws when the current device is not the Gemm's
  // Milliseconds per call of fn (which returns false when it failed: then -1) on `stream`: one
  // warm-up, then 2 to 10 repetitions, about a millisecond in all.
  float time_ms(cudaStream_t stream, const std::function<bool()>& fn);
  void execute_gemv_for_timing(const Key& key, void* out, const void* in, const void* w,
                               const void* bias, cudaStream_t stream);

  int device_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  DeviceBuffer workspace_;
  cudaEvent_t ev_start_ = nullptr, ev_stop_ = nullptr;
  GemmOptions options_;
  void* dequant_ = nullptr;
  size_t dequant_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  std::map<Key, const Plan*> timed_buckets_;  // key with T = its bucket -> the bucket's timed plan
  std::unique_ptr<Fp8State, Fp8StateDeleter> fp8_;
  std::unique_ptr<SeqState, SeqStateDeleter> seq_;
};

}  // namespace conveyor::cuda

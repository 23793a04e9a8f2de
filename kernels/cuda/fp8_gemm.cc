// Gemm::run_fp8 (gemm.h): FP8 E4M3 products on cuBLASLt, for Hopper.
//
// The problem in cuBLASLt's column-major terms (the only FP8 layout Hopper runs is "TN"):
//   D (N x T, ld N; row-major sums [T, N], fp16) = 2^-e op(A) (N x K) * B (K x T), with
//   A = the weight, E4M3 K x N (ld K; row-major [N, K]), transposed;
//   B = the activations quantised per row, E4M3 K x T (ld K; row-major [T, K]).
// Hopper's cuBLASLt has no per-row scale vectors for FP8 (the "outer vector" scale mode is not
// offered on compute capability 9.0), so A's and B's scales stay at their default, the scalar
// 1. D is fp16 with alpha = 2^-e, e = fp8_sum_exponent(K) (fp8.h): the unscaled sums reach
// 448^2 K, which 2^-e keeps within fp16, and fp16 sums are half the bytes that fp32 ones were
// for cuBLASLt to write and the epilogue to read. fp8_scale_epilogue (fp8.cu) then writes
// out[t, n] = act(D[n, t] 2^e * sa[t] * sw[n] + bias[n]) in T. The sums live in the FP8
// workspace beside the quantised activations:
//   [sums: rows x N fp16][quantised rows: rows x K bytes][row scales: rows fp32]
// each part at a 256-byte boundary, for the block of rows one cuBLASLt call covers.
//
// Why a row's bits do not depend on the batch (deterministic mode). A row's scale is computed
// from that row alone, and the epilogue is per element. Its sums: every T of a (K, N) shape
// runs the same cuBLASLt algorithm (one kernel, tile, stage count, cluster shape and swizzle),
// taken once per shape from the heuristic's proposals for kFp8AnchorRows rows, with any split
// along K taken off (split-K sums partial products in an order that follows the grid),
// skipping any that some T in the probe set cannot run or whose first call fails. Within one
// such kernel every output element is one CTA's K loop in the same order, whichever tile the
// element lands in and however many tiles there are; the choice itself depends only on the
// shape, the device kind and the cuBLAS version, never on what this process ran before (no
// timing), so a spare worker picks the same: the anchor. Each T bucket then times the
// anchor and the unsplit proposals for that T whose sums equal the anchor's bit for bit on
// the call's own rows (every unsplit FP8 algorithm gave the same bits on the H100:
// conveyor-bench-gemm-order), so the timing picks speed, never an order. The GPU test
// (tests/kernels/cuda/test_fp8.cc) checks every row for T = 1..299 at three row offsets.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lt_descriptors.h"

namespace conveyor::cuda {
namespace {

constexpr int kFp8Layout = 5;  // Key::layout of run_fp8's plans (gemm.cc uses 0..4)
constexpr int kHeuristicResults = 32;
// Deterministic mode times up to this many algorithms with the anchor's bits. With fp16 sums
// the heuristic's first eight for gpt3-6.7b's QKV at T = 64 held none under 80 us, where a
// later proposal takes 24 (H100, 2026-11-27).
constexpr int kFp8DetCandidates = 16;

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Token counts the fixed algorithm of a shape must accept (cublasLtMatmulAlgoCheck) before it
// is chosen: every count the stage runs lies between these, and a kernel that takes 1, 17, 255
// and 4096 rows does not refuse the ones between for the row count's sake.
constexpr int64_t kProbeRows[] = {1, 2, 3, 8, 17, 64, 100, 255, 256, 512, 1024, 4096, 16384};

}  // namespace

// A descriptor and the three layouts of one problem (T rows): scales left at 1, no epilogue,
// fp16 sums (D, and C with beta = 0).
struct Fp8Problem : LtDescriptors {
  Fp8Problem(int64_t T_, int64_t K, int64_t N, bool fast_accum) {
    lt_describe(*this, CUDA_R_8F_E4M3, CUDA_R_16F, T_, K, N, true, false);
    const int8_t fast = fast_accum ? 1 : 0;
    CUDA_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
};

struct Gemm::Fp8State {
  struct Plan {
    std::unique_ptr<Fp8Problem> problem;
    cublasLtMatmulAlgo_t algo{};
    std::string choice;
    float ms = -1.f;
  };
  struct Anchor {  // a shape's fixed algorithm (deterministic mode)
    cublasLtMatmulAlgo_t algo{};
    std::string choice;
  };
  void* workspace = nullptr;  // the sums, the quantised activations, their scales (above)
  size_t workspace_bytes = 0;
  DeviceBuffer owned;  // the Gemm's own, when the caller gave none
  std::map<Key, std::unique_ptr<Plan>> plans;
  std::map<Key, Anchor> anchors;              // key with T = 0
  std::map<Key, const Plan*> timed_buckets;  // fast mode: key with T = its bucket -> the timed plan
  std::map<Key, const Plan*> det_buckets;    // deterministic mode: the same, among the anchor's class

  struct Call;
  int64_t reserve_rows(int64_t T_, size_t need, size_t row_bytes, const std::function<int64_t(size_t)>& fits,
                       bool capturing, const char* what, const std::function<std::string()>& shape);

  // A product's plan key (T set per plan): the cuBLASLt problem does not depend on the bias,
  // the activation or out (the epilogue is ours), so one plan serves all of them.
  template <class T>
  static Key key_for(const uint8_t* w, int64_t K, int64_t N) {
    Key key{};
    key.layout = kFp8Layout;
    key.in_type = int(lt_data_type<T>());
    key.out_type = int(CUDA_R_16F);
    key.align = lt_alignment(w);
    key.K = K, key.N = N;
    return key;
  }
};

void Gemm::Fp8StateDeleter::operator()(Fp8State* s) const { delete s; }

Gemm::Fp8State& Gemm::fp8_state() {
  if (!fp8_) fp8_.reset(new Fp8State);
  return *fp8_;
}

size_t Gemm::fp8_workspace_bytes(int64_t rows, int64_t K, int64_t N) {
  if (rows <= 0 || K <= 0 || N <= 0) return 0;
  return size_t(256 + align_up(rows * N * 2, 256) + align_up(rows * K, 256) + rows * 4);
}

size_t Gemm::fp8_mlp_workspace_bytes(int64_t rows, int64_t K, int64_t I, int64_t N) {
  if (rows <= 0 || K <= 0 || I <= 0 || N <= 0) return 0;
  return size_t(256 + align_up(rows * std::max(I, N) * 2, 256) + align_up(rows * K, 256) + align_up(rows * 4, 256) +
                align_up(rows * I, 256) + rows * 4);
}

bool Gemm::fp8_mlp_supported(int64_t I) { return I > 0 && I <= fp8_epilogue_quantize_max_n(); }

void Gemm::set_fp8_workspace(void* workspace, size_t bytes) {
  Fp8State& s = fp8_state();
  s.workspace = workspace, s.workspace_bytes = bytes;
  s.owned = DeviceBuffer();
}

std::string Gemm::describe_fp8_plans() const {
  if (!fp8_) return "";
  std::ostringstream os;
  for (const auto& [k, p] : fp8_->plans) {
    os << "NK fp8 " << (k.in_type == CUDA_R_16F ? "f16" : "bf16") << " T=" << k.T << " K=" << k.K << " N=" << k.N
       << ": " << p->choice;
    if (p->ms >= 0) os << " " << p->ms * 1000.f << " us";
    os << "\n";
  }
  return os.str();
}

namespace {

std::string shape_text(int64_t T_, int64_t K, int64_t N) {
  return "T=" + std::to_string(T_) + " K=" + std::to_string(K) + " N=" + std::to_string(N);
}

// Throws unless run_fp8 can run the problem: no null pointer (in may be null where its rows
// come quantised, rows_given: the product reads in_q instead), T, K and N in range, cuBLASLt's
// FP8 multiples of 16 and 16-byte alignment.
void check_fp8_arguments(const void* out, const void* in, const void* w, const void* w_scales, int64_t T_, int64_t K,
                         int64_t N, bool rows_given) {
  std::string missing;
  auto need = [&](const void* p, const char* name) {
    if (p == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  need(out, "out");
  if (!rows_given) need(in, "in");
  need(w, "w");
  need(w_scales, "w_scales");
  if (!missing.empty()) throw Error("fp8 gemm: null pointer (" + missing + ")");
  if (T_ <= 0 || K <= 0 || N <= 0 || T_ > (int64_t(1) << 30) || K > (int64_t(1) << 30) || N > (int64_t(1) << 30))
    throw Error("fp8 gemm: T, K and N must be positive and below 2^30 (" + shape_text(T_, K, N) + ")");
  if (K % 16 != 0 || N % 16 != 0)
    throw Error("fp8 gemm: K and N must be multiples of 16 for cuBLASLt's FP8 products (" + shape_text(T_, K, N) + ")");
  if (lt_alignment(out) < 16 || lt_alignment(w) < 16 || (in != nullptr && lt_alignment(in) < 16))
    throw Error("fp8 gemm: out, in and w must be 16-byte aligned");
}

// The most rows whose FP8 workspace fits in `bytes`.
int64_t rows_fitting(size_t bytes, int64_t K, int64_t N) {
  int64_t r = int64_t(bytes / size_t(K + 4 + 2 * N));
  while (r > 0 && Gemm::fp8_workspace_bytes(r, K, N) > bytes) --r;
  return r;
}

// The same for run_fp8_mlp's workspace.
int64_t mlp_rows_fitting(size_t bytes, int64_t K, int64_t I, int64_t N) {
  int64_t r = int64_t(bytes / size_t(2 * std::max(I, N) + K + I + 8));
  while (r > 0 && Gemm::fp8_mlp_workspace_bytes(r, K, I, N) > bytes) --r;
  return r;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// The parts of the FP8 workspace (layout at the top of this file) for `rows` rows.
struct Fp8WorkspaceParts {
  __half* sums;  // rows x N fp16 (times 2^-e)
  uint8_t* qa;  // rows x K E4M3
  float* sa;    // rows fp32 row scales
};

Fp8WorkspaceParts carve_fp8_workspace(void* workspace, int64_t rows, int64_t K, int64_t N) {
  auto* base = reinterpret_cast<uint8_t*>(align_up(int64_t(reinterpret_cast<uintptr_t>(workspace)), 256));
  auto* sums = reinterpret_cast<__half*>(base);
  uint8_t* qa = base + align_up(rows * N * 2, 256);
  float* sa = reinterpret_cast<float*>(qa + align_up(rows * K, 256));
  return {sums, qa, sa};
}

// run_fp8_mlp's workspace: [sums: rows x max(I, N) fp16, FC1's then FC2's][FC1's rows: rows
// x K E4M3][their scales: rows fp32][FC2's rows: rows x I E4M3][their scales: rows fp32].
struct Fp8MlpParts {
  __half* sums;
  uint8_t* q1;
  float* s1;
  uint8_t* q2;
  float* s2;
};

Fp8MlpParts carve_fp8_mlp_workspace(void* workspace, int64_t rows, int64_t K, int64_t I, int64_t N) {
  auto* base = reinterpret_cast<uint8_t*>(align_up(int64_t(reinterpret_cast<uintptr_t>(workspace)), 256));
  Fp8MlpParts p{};
  p.sums = reinterpret_cast<__half*>(base);
  p.q1 = base + align_up(rows * std::max(I, N) * 2, 256);
  p.s1 = reinterpret_cast<float*>(p.q1 + align_up(rows * K, 256));
  p.q2 = reinterpret_cast<uint8_t*>(p.s1) + align_up(rows * 4, 256);
  p.s2 = reinterpret_cast<float*>(p.q2 + align_up(rows * I, 256));
  return p;
}

// A caller's quantised rows (in_q) need their scales too, and 16-byte aligned bytes (cuBLASLt's B).
void check_quantised_input(Fp8Rows in_q) {
  if (!in_q) return;
  if (in_q.scales == nullptr) throw Error("fp8 gemm: quantised input rows without their scales");
  if (lt_alignment(in_q.q) < 16) throw Error("fp8 gemm: quantised input rows must be 16-byte aligned");
}

// Rows [r0, r0 + rows) of the product's input in FP8: the caller's (in_q, quantised already),
// or `in`'s quantised now into the workspace's q and s.
template <class T>
Fp8Rows quantised_rows(Fp8Rows in_q, uint8_t* q, float* s, const T* in, int64_t r0, int64_t rows, int64_t K,
                       cudaStream_t stream) {
  if (in_q) return {in_q.q + r0 * K, in_q.scales + r0};
  quantize_rows_fp8<T>(q, s, in + r0 * K, rows, K, stream);
  return {q, s};
}

}  // namespace

// One run_fp8 call: its problem (key, with T set per plan), where its sums and quantised rows
// live, and the choice of the plan for each block of rows.
struct Gemm::Fp8State::Call {
  Gemm& gemm;
  Fp8State& s;
  Key key;
  bool capturing;
  int64_t rows_per_call;
  const uint8_t* w;
  const uint8_t* qa;
  __half* sums;
  cudaStream_t stream;
  float alpha = std::ldexp(1.f, -fp8_sum_exponent(key.K));  // 2^-e: the sums within fp16 (fp8.h)

  uint64_t ws() const { return gemm.workspace_.bytes(); }

  cublasStatus_t matmul(const Fp8Problem& p, const cublasLtMatmulAlgo_t& algo) const {
    const float beta = 0.f;
    return cublasLtMatmul(gemm.lt_, p.desc, &alpha, w, p.a, qa, p.b, &beta, sums, p.d, sums, p.d, &algo,
                          gemm.workspace_.get(), gemm.workspace_.bytes(), stream);
  }

  // One call of `algo` on this call's first rows (already quantised), outside graph capture:
  // cuBLASLt may accept an algorithm in the heuristic and refuse it in the call. Its sums are
  // overwritten by the real call that follows.
  bool trial(const cublasLtMatmulAlgo_t& algo) const {
    if (capturing) return true;
    Fp8Problem p(rows_per_call, key.K, key.N, gemm.options_.fp8_fast_accum);
    return lt_accepts(gemm.lt_, p, algo, ws()) && matmul(p, algo) == CUBLAS_STATUS_SUCCESS;
  }

  const Plan& keep(const Key& k, std::unique_ptr<Plan> plan) { return *s.plans.emplace(k, std::move(plan)).first->second; }

  // Whether `algo` takes every T of kProbeRows.
  bool accepts_every_probe(const cublasLtMatmulAlgo_t& algo) const {
    for (int64_t t : kProbeRows) {
      Fp8Problem pt(t, key.K, key.N, gemm.options_.fp8_fast_accum);
      if (!lt_accepts(gemm.lt_, pt, algo, ws())) return false;
    }
    return true;
  }

  // Deterministic mode: the shape's fixed algorithm (chosen once, without timing).
  const Anchor& anchor() {
    const int64_t K = key.K, N = key.N;
    Key ak = key;
    ak.T = 0;
    if (auto it = s.anchors.find(ak); it != s.anchors.end()) return it->second;
    Fp8Problem p(kFp8AnchorRows, K, N, gemm.options_.fp8_fast_accum);
    const auto results = lt_proposals(gemm.lt_, p, key.align, ws(), kHeuristicResults);
    for (const auto& r : results) {
      cublasLtMatmulAlgo_t algo = r.algo;
      // The same kernel without the split, if cuBLASLt takes it.
      if (lt_splits_k(algo) && !lt_unsplit(algo)) continue;
      if (!accepts_every_probe(algo) || !trial(algo)) continue;
      Anchor a{algo, lt_algo_name(algo) + " (fixed for every T)"};
      return s.anchors.emplace(ak, a).first->second;
    }
    const std::string shape = "K=" + std::to_string(K) + " N=" + std::to_string(N) +
                              " (E4M3 x E4M3 -> fp16 sums, T=" + std::to_string(kFp8AnchorRows) + ")";
    if (results.empty()) throw Error("fp8 gemm: cuBLASLt proposes no FP8 algorithm for " + shape);
    throw Error("fp8 gemm: none of the " + std::to_string(results.size()) + " FP8 algorithms cuBLASLt proposes for " +
                shape + " runs without a split along K, accepts every T from 1 to " +
                std::to_string(kProbeRows[std::size(kProbeRows) - 1]) + " and completes a first call");
  }

  // The plan for `rows` rows, made the first time.
  const Plan& plan(int64_t rows) {
    Key k = key;
    k.T = rows;
    if (auto it = s.plans.find(k); it != s.plans.end()) return *it->second;
    auto plan = std::make_unique<Plan>();
    plan->problem = std::make_unique<Fp8Problem>(rows, key.K, key.N, gemm.options_.fp8_fast_accum);
    return gemm.options_.deterministic ? deterministic_plan(k, std::move(plan)) : fast_plan(k, std::move(plan));
  }

  // Another T of k's bucket was timed (`timed`): its algorithm, if cuBLASLt takes it here.
  bool reuse_bucket_plan(const std::map<Key, const Plan*>& timed, const Key& bk, Plan& plan) const {
    auto it = timed.find(bk);
    if (it == timed.end() || !lt_accepts(gemm.lt_, *plan.problem, it->second->algo, ws())) return false;
    plan.algo = it->second->algo;
    plan.choice = "as its bucket's timed plan (" + it->second->choice + ")";
    return true;
  }

  // Deterministic mode: the anchor, or an algorithm that gives its bits.
  const Plan& deterministic_plan(const Key& k, std::unique_ptr<Plan> plan) {
    const Anchor& a = anchor();
    if (!lt_accepts(gemm.lt_, *plan->problem, a.algo, ws()))
      throw Error("fp8 gemm: the fixed algorithm of K=" + std::to_string(key.K) + " N=" + std::to_string(key.N) +
                  " refuses T=" + std::to_string(k.T));
    plan->algo = a.algo;
    plan->choice = a.choice;
    // Another T of this bucket was timed: its algorithm, if cuBLASLt takes it here (it gave
    // the anchor's bits there; unsplit FP8 algorithms are one class, docs/PERFORMANCE.md).
    Key bk = bucket_of(k);
    if (reuse_bucket_plan(s.det_buckets, bk, *plan)) return keep(k, std::move(plan));
    if (!gemm.options_.tuning || capturing) return keep(k, std::move(plan));
    const std::vector<cublasLtMatmulAlgo_t> held = anchor_class(*plan->problem, k.T, a.algo);
    float best = -1.f;
    for (const cublasLtMatmulAlgo_t& algo : held) {
      const float ms = gemm.time_ms(stream, [&] { return matmul(*plan->problem, algo) == CUBLAS_STATUS_SUCCESS; });
      if (ms >= 0 && (best < 0 || ms < best)) best = ms, plan->algo = algo;
    }
    plan->ms = best;
    plan->choice = lt_algo_name(plan->algo) + " (timed among " + std::to_string(held.size()) +
                   " with the anchor's bits; anchor " + lt_algo_name(a.algo) + ")";
    const Plan& chosen = keep(k, std::move(plan));
    s.det_buckets.emplace(bk, &chosen);
    return chosen;
  }

  // The anchor and the unsplit proposals for problem `p` (`rows` rows) that give this call's
  // rows the anchor's sums bit for bit (the sums of every row, on the caller's own quantised
  // rows): the algorithms deterministic mode times.
  std::vector<cublasLtMatmulAlgo_t> anchor_class(const Fp8Problem& p, int64_t rows,
                                                 const cublasLtMatmulAlgo_t& anchor_algo) const {
    const size_t sum_bytes = size_t(rows * key.N) * sizeof(__half);
    std::vector<unsigned char> want(sum_bytes), got(sum_bytes);
    CUDA_CHECK(matmul(p, anchor_algo));
    CUDA_CHECK(cudaMemcpyAsync(want.data(), sums, sum_bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<cublasLtMatmulAlgo_t> held{anchor_algo};
    for (const auto& r : lt_proposals(gemm.lt_, p, key.align, ws(), kHeuristicResults)) {
      cublasLtMatmulAlgo_t algo = r.algo;
      if (held.size() >= size_t(kFp8DetCandidates)) break;
      if ((lt_splits_k(algo) && !lt_unsplit(algo)) || !lt_accepts(gemm.lt_, p, algo, ws())) continue;
      if (matmul(p, algo) != CUBLAS_STATUS_SUCCESS) continue;
      CUDA_CHECK(cudaMemcpyAsync(got.data(), sums, sum_bytes, cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      if (std::memcmp(got.data(), want.data(), sum_bytes) == 0) held.push_back(algo);
    }
    return held;
  }

  // Fast mode: the bucket's timed algorithm, else the heuristic's proposals timed.
  const Plan& fast_plan(const Key& k, std::unique_ptr<Plan> plan) {
    const int64_t rows = k.T;
    Key bk = bucket_of(k);
    if (reuse_bucket_plan(s.timed_buckets, bk, *plan)) return keep(k, std::move(plan));
    const auto results = lt_proposals(gemm.lt_, *plan->problem, key.align, ws(), kHeuristicResults);
    if (results.empty())
      throw Error("fp8 gemm: cuBLASLt offers no FP8 algorithm (E4M3 x E4M3 -> fp16) for " +
                  shape_text(rows, key.K, key.N));
    if (!gemm.options_.tuning || capturing || results.size() == 1) {
      plan->algo = results[0].algo;
      plan->choice = lt_algo_name(results[0].algo) + " (heuristic #0, untimed)";
      return keep(k, std::move(plan));
    }
    // Timed on the caller's buffers: the activations are quantised already (run_fp8).
    float best = -1.f;
    size_t best_i = 0;
    for (size_t i = 0; i < results.size() && i < size_t(kMaxCandidates); ++i) {
      const float ms =
          gemm.time_ms(stream, [&] { return matmul(*plan->problem, results[i].algo) == CUBLAS_STATUS_SUCCESS; });
      if (ms >= 0 && (best < 0 || ms < best)) best = ms, best_i = i;
    }
    if (best < 0) throw Error("fp8 gemm: every cuBLASLt candidate failed for " + shape_text(rows, key.K, key.N));
    plan->algo = results[best_i].algo;
    plan->ms = best;
    plan->choice =
        lt_algo_name(plan->algo) + " (#" + std::to_string(best_i) + " of " + std::to_string(results.size()) + ")";
    const Plan& chosen = keep(k, std::move(plan));
    s.timed_buckets.emplace(bk, &chosen);
    return chosen;
  }
};

namespace {
// Where a deferred epilogue's sums are and how to scale them (Fp8Sums): the call's one block.
Fp8Sums deferred_sums(const __half* sums, int e, const float* row_scales, const float* col_scales,
                      const void* bias) {
  return {.sums = sums,
          .unscale = std::ldexp(1.f, e),
          .row_scales = row_scales,
          .col_scales = col_scales,
          .bias = bias};
}
}  // namespace

// The FP8 workspace for a call of T_ rows (`need` bytes; `fits(bytes)`: the rows that many
// bytes hold): the Gemm's own is (re)allocated when there is none, or when it is too small
// and the stream is not being captured. Returns the rows one block of the call takes (at
// most T_); throws, naming `what` and its shape (`shape()`; a row: row_bytes), when not one fits.
int64_t Gemm::Fp8State::reserve_rows(int64_t T_, size_t need, size_t row_bytes,
                                     const std::function<int64_t(size_t)>& fits, bool capturing, const char* what,
                                     const std::function<std::string()>& shape) {
  if (workspace == nullptr || (owned.get() != nullptr && workspace_bytes < need && !capturing)) {
    if (capturing) throw Error("fp8 gemm: no FP8 workspace, and none can be allocated during graph capture");
    owned = DeviceBuffer();
    owned = device_alloc(std::max(need, size_t(4) << 20), "gemm", "FP8 workspace");
    workspace = owned.get(), workspace_bytes = owned.bytes();
  }
  const int64_t rows = std::min(T_, fits(workspace_bytes));
  if (rows <= 0)
    throw Error(std::string(what) + ": the FP8 workspace (" + std::to_string(workspace_bytes) +
                " bytes) cannot hold a row of " + shape() + " (" + std::to_string(row_bytes) + " bytes)");
  return rows;
}

template <class T>
void Gemm::run_fp8(T* out, const T* in, const uint8_t* w, const float* w_scales, const T* bias, int64_t T_, int64_t K,
                   int64_t N, GemmAct act, cudaStream_t stream, Fp8Rows in_q, Fp8Sums* defer) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "T is __half or __nv_bfloat16");
  check_fp8_arguments(out, in, w, w_scales, T_, K, N, bool(in_q));
  check_quantised_input(in_q);
  if (defer && act != GemmAct::None)
    throw Error("fp8 gemm: a deferred epilogue applies the scales and the bias only (no activation)");
  if (defer) *defer = {};
  check_device();
  Fp8State& s = fp8_state();

  // The workspace (layout at the top of this file), sized for rows_per_call rows.
  const bool capturing = stream_capturing(stream);
  const int64_t rows_per_call =
      s.reserve_rows(T_, fp8_workspace_bytes(T_, K, N), fp8_workspace_bytes(1, K, N),
                     [&](size_t bytes) { return rows_fitting(bytes, K, N); }, capturing, "fp8 gemm",
                     [&] { return "K=" + std::to_string(K) + " N=" + std::to_string(N); });
  const Fp8WorkspaceParts parts = carve_fp8_workspace(s.workspace, rows_per_call, K, N);

  const int e = fp8_sum_exponent(K);  // the epilogue's 2^e (the Call's alpha is 2^-e)
  const Key key = Fp8State::key_for<T>(w, K, N);
  Fp8State::Call call{.gemm = *this, .s = s, .key = key, .capturing = capturing, .rows_per_call = rows_per_call,
                      .w = w, .qa = parts.qa, .sums = parts.sums, .stream = stream};

  for (int64_t r0 = 0; r0 < T_; r0 += rows_per_call) {
    const int64_t rows = std::min(rows_per_call, T_ - r0);
    const Fp8Rows a = quantised_rows<T>(in_q, parts.qa, parts.sa, in, r0, rows, K, stream);
    call.qa = a.q;
    const Fp8State::Plan& plan = call.plan(rows);
    CUDA_CHECK(call.matmul(*plan.problem, plan.algo));
    if (defer && rows == T_) *defer = deferred_sums(parts.sums, e, a.scales, w_scales, bias);
    else fp8_scale_epilogue<T>(out + r0 * N, parts.sums, e, a.scales, w_scales, bias, rows, N, int(act), stream);
  }
}

template void Gemm::run_fp8<__half>(__half*, const __half*, const uint8_t*, const float*, const __half*, int64_t,
                                    int64_t, int64_t, GemmAct, cudaStream_t, Fp8Rows, Fp8Sums*);
template void Gemm::run_fp8<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const uint8_t*, const float*,
                                           const __nv_bfloat16*, int64_t, int64_t, int64_t, GemmAct, cudaStream_t,
                                           Fp8Rows, Fp8Sums*);

template <class T>
void Gemm::run_fp8_mlp(T* out, const T* in, const uint8_t* w1, const float* w1_scales, const T* bias1, GemmAct act,
                       const uint8_t* w2, const float* w2_scales, int64_t T_, int64_t K, int64_t I, int64_t N,
                       cudaStream_t stream, Fp8Rows in_q, Fp8Sums* defer) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "T is __half or __nv_bfloat16");
  check_fp8_arguments(out, in, w1, w1_scales, T_, K, I, bool(in_q));
  check_fp8_arguments(out, nullptr, w2, w2_scales, T_, I, N, true);  // FC2's rows are FC1's, quantised
  check_quantised_input(in_q);
  if (defer) *defer = {};
  if (!fp8_mlp_supported(I))
    throw Error("fp8 mlp: FC1's rows of " + std::to_string(I) + " are longer than one block quantises (" +
                std::to_string(fp8_epilogue_quantize_max_n()) + "): run the two products with run_fp8");
  check_device();
  Fp8State& s = fp8_state();
  const bool capturing = stream_capturing(stream);
  const int64_t rows_per_call =
      s.reserve_rows(T_, fp8_mlp_workspace_bytes(T_, K, I, N), fp8_mlp_workspace_bytes(1, K, I, N),
                     [&](size_t bytes) { return mlp_rows_fitting(bytes, K, I, N); }, capturing, "fp8 mlp",
                     [&] { return "K=" + std::to_string(K) + " I=" + std::to_string(I) + " N=" + std::to_string(N); });
  const Fp8MlpParts parts = carve_fp8_mlp_workspace(s.workspace, rows_per_call, K, I, N);
  const int e1 = fp8_sum_exponent(K), e2 = fp8_sum_exponent(I);
  Fp8State::Call fc1{.gemm = *this, .s = s, .key = Fp8State::key_for<T>(w1, K, I), .capturing = capturing,
                     .rows_per_call = rows_per_call, .w = w1, .qa = parts.q1, .sums = parts.sums, .stream = stream};
  Fp8State::Call fc2{.gemm = *this, .s = s, .key = Fp8State::key_for<T>(w2, I, N), .capturing = capturing,
                     .rows_per_call = rows_per_call, .w = w2, .qa = parts.q2, .sums = parts.sums, .stream = stream};
  for (int64_t r0 = 0; r0 < T_; r0 += rows_per_call) {
    const int64_t rows = std::min(rows_per_call, T_ - r0);
    const Fp8Rows a = quantised_rows<T>(in_q, parts.q1, parts.s1, in, r0, rows, K, stream);
    fc1.qa = a.q;
    const Fp8State::Plan& p1 = fc1.plan(rows);
    CUDA_CHECK(fc1.matmul(*p1.problem, p1.algo));
    fp8_epilogue_quantize<T>(parts.q2, parts.s2, parts.sums, e1, a.scales, w1_scales, bias1, rows, I, int(act),
                             stream);
    const Fp8State::Plan& p2 = fc2.plan(rows);
    CUDA_CHECK(fc2.matmul(*p2.problem, p2.algo));
    if (defer && rows == T_) *defer = deferred_sums(parts.sums, e2, parts.s2, w2_scales, nullptr);
    else fp8_scale_epilogue<T>(out + r0 * N, parts.sums, e2, parts.s2, w2_scales, nullptr, rows, N, 0, stream);
  }
}

template void Gemm::run_fp8_mlp<__half>(__half*, const __half*, const uint8_t*, const float*, const __half*, GemmAct,
                                        const uint8_t*, const float*, int64_t, int64_t, int64_t, int64_t,
                                        cudaStream_t, Fp8Rows, Fp8Sums*);
template void Gemm::run_fp8_mlp<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const uint8_t*, const float*,
                                               const __nv_bfloat16*, GemmAct, const uint8_t*, const float*, int64_t,
                                               int64_t, int64_t, int64_t, cudaStream_t, Fp8Rows, Fp8Sums*);

Status Gemm::fp8_supported() {
  if (Status st = fp8_device_check(device_); !st) return st;
  // A small product through run_fp8 itself, checked: cuBLASLt may accept the descriptor and
  // refuse the call, or return wrong sums; the epilogue must apply both scales.
  // in[t, k] = t + 1 and w[n, k] = 2 quantise to 448 with scales (t + 1) / 448 and 2 / 448:
  // out[t, n] = 2 (t + 1) K exactly, up to the scales' roundings; then with a bias of 1 and the
  // tanh GeLU, which are the identity's +1 at these sizes.
  constexpr int64_t T_ = 16, K = 64, N = 32;
  try {
    DeviceBuffer in = device_alloc(size_t(T_ * K) * sizeof(__half), "gemm", "FP8 check input");
    DeviceBuffer wh = device_alloc(size_t(N * K) * sizeof(__half), "gemm", "FP8 check weight");
    DeviceBuffer w8 = device_alloc(size_t(N * K), "gemm", "FP8 check weight bytes");
    DeviceBuffer ws = device_alloc(size_t(N) * sizeof(float), "gemm", "FP8 check scales");
    DeviceBuffer out = device_alloc(size_t(T_ * N) * sizeof(__half), "gemm", "FP8 check output");
    DeviceBuffer bias = device_alloc(size_t(N) * sizeof(__half), "gemm", "FP8 check bias");
    const std::vector<__half> hb(size_t(N), __float2half(1.f));
    CUDA_CHECK(cudaMemcpy(bias.get(), hb.data(), hb.size() * sizeof(__half), cudaMemcpyHostToDevice));
    std::vector<__half> hin(size_t(T_ * K)), hw(size_t(N * K), __float2half(2.f));
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t k = 0; k < K; ++k) hin[size_t(t * K + k)] = __float2half(float(t + 1));
    CUDA_CHECK(cudaMemcpy(in.get(), hin.data(), hin.size() * sizeof(__half), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(wh.get(), hw.data(), hw.size() * sizeof(__half), cudaMemcpyHostToDevice));
    quantize_rows_fp8<__half>(w8.as<uint8_t>(), ws.as<float>(), wh.as<__half>(), N, K, nullptr);
    for (auto [with_bias, act] : {std::pair{false, GemmAct::None}, {true, GemmAct::None}, {true, GemmAct::GeluTanh}}) {
      run_fp8<__half>(out.as<__half>(), in.as<__half>(), w8.as<uint8_t>(), ws.as<float>(),
                      with_bias ? bias.as<__half>() : nullptr, T_, K, N, act, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<__half> got(size_t(T_ * N));
      CUDA_CHECK(cudaMemcpy(got.data(), out.get(), got.size() * sizeof(__half), cudaMemcpyDeviceToHost));
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t n = 0; n < N; ++n) {
          const float want = 2.f * float(t + 1) * float(K) + (with_bias ? 1.f : 0.f);
          const float v = __half2float(got[size_t(t * N + n)]);
          if (!(std::fabs(v - want) <= 1e-2f * want))
            return Status::error("fp8: the FP8 product (cuBLASLt E4M3 -> fp16, then the scaling epilogue) is wrong on "
                                 "device " + std::to_string(device_) + " (" + (with_bias ? "bias, " : "") +
                                 (act == GemmAct::None ? "" : "GeLU, ") + "row " + std::to_string(t) + ": " +
                                 std::to_string(v) + ", expected " + std::to_string(want) + ")");
        }
    }
  } catch (const Error& e) {
    return Status::error(std::string("fp8: ") + e.what());
  }
  return ok_status();
}

}  // namespace conveyor::cuda

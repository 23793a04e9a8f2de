#include "kernels/cuda/gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <bit>
#include <sstream>
#include <type_traits>
#include <vector>

#include "kernels/cuda/fixed_gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/lt_descriptors.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"

namespace conveyor::cuda {
namespace {

const char* type_name(int t) {
  switch (t) {
    case CUDA_R_16F: return "f16";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_32F: return "f32";
    default: return "?";
  }
}

// Key::layout of the plans beyond WeightLayout's KN and NK (cuBLASLt or the GEMV): the int8
// weight-only kernels, and the fixed-order tiles (fixed_gemm.h) with T or int8 weights.
constexpr int kInt8Layout = 2;
constexpr int kFixedLayout = 3;
constexpr int kFixedInt8Layout = 4;

const char* layout_name(int layout) {
  switch (layout) {
    case int(WeightLayout::KN): return "KN";
    case int(WeightLayout::NK): return "NK";
    case kInt8Layout: return "NK int8";
    case kFixedLayout: return "NK fixed-order";
    default: return "NK int8 fixed-order";
  }
}

}  // namespace

struct Gemm::Plan : LtDescriptors {  // the cuBLASLt descriptors when cuBLASLt runs it
  bool use_gemv = false;
  int kernel = -1;             // int8 plans: the detail::Int8Kernel; fixed-order: the FixedTile
  bool bias_epilogue = false;  // cuBLASLt adds the bias (no activation)
  cublasLtMatmulAlgo_t algo{};
  float ms = -1.f;  // measured time of the choice; -1: untimed
  std::string choice;

  // Untimed: the GEMV for tiny T (it is built for that case), else the heuristic's first.
  void choose_untimed(const std::vector<cublasLtMatmulHeuristicResult_t>& results, bool gemv_ok, int64_t T) {
    if (gemv_ok && (results.empty() || T <= 4)) {
      use_gemv = true;
      choice = "gemv (untimed)";
    } else {
      algo = results[0].algo;
      choice = "cublasLt heuristic #0 (untimed)";
    }
  }

  // Times each of `results` (and the GEMV when gemv_ok) on the caller's buffers and keeps the
  // fastest. `out` is overwritten; the caller's run follows.
  void choose_timed(Gemm& g, const Key& key, const std::vector<cublasLtMatmulHeuristicResult_t>& results,
                    bool gemv_ok, const void* out, const void* in, const void* w, const void* bias,
                    cudaStream_t stream);
};

namespace {

// The forced GEMV splits and the prefetch pick kernel instances and offsets; anything else
// would be silently ignored or overflow, so it is refused.
void check_options(const GemmOptions& o) {
  if (!is_one_of(o.gemv_k_split, kGemvKSplits))
    throw Error("Gemm: gemv_k_split " + std::to_string(o.gemv_k_split) + " (0: chosen by N, or 1, 2, 4)");
  if (!is_one_of(o.int8_gemv_k_split, kInt8GemvKSplits))
    throw Error("Gemm: int8_gemv_k_split " + std::to_string(o.int8_gemv_k_split) +
                " (0: chosen by shape, or 1, 2, 4, 8)");
  if (o.gemv_l2_prefetch_bytes < 0 || o.gemv_l2_prefetch_bytes > kMaxGemvL2PrefetchBytes)
    throw Error("Gemm: gemv_l2_prefetch_bytes " + std::to_string(o.gemv_l2_prefetch_bytes) + " (0 to " +
                std::to_string(kMaxGemvL2PrefetchBytes) + ")");
}

}  // namespace

Gemm::Gemm(const GemmOptions& options) : options_(options) {
  check_options(options_);
  CUDA_CHECK(cudaGetDevice(&device_));
  CUDA_CHECK(cublasLtCreate(&lt_));
  workspace_ = device_alloc(kWorkspaceBytes, "gemm", "cuBLASLt workspace");
  CUDA_CHECK(cudaEventCreate(&ev_start_));
  CUDA_CHECK(cudaEventCreate(&ev_stop_));
}

Gemm::~Gemm() {
  plans_.clear();
  fp8_.reset();
  seq_.reset();
  if (ev_stop_) cudaEventDestroy(ev_stop_);
  if (ev_start_) cudaEventDestroy(ev_start_);
  if (lt_) cublasLtDestroy(lt_);
}

Gemm& Gemm::thread_default() {
  thread_local std::map<int, std::unique_ptr<Gemm>> per_device;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  auto& g = per_device[device];
  if (!g) g = std::make_unique<Gemm>();
  return *g;
}

std::string Gemm::describe_plans() const {
  std::ostringstream os;
  for (const auto& [k, p] : plans_) {
    os << layout_name(k.layout) << " " << type_name(k.in_type) << "->"
       << type_name(k.out_type) << " T=" << k.T << " K=" << k.K << " N=" << k.N
       << (k.has_bias ? " bias" : "") << (k.act ? " gelu" : "") << ": " << p->choice;
    if (p->ms >= 0) os << " " << p->ms * 1000.f << " us";
    os << "\n";
  }
  os << describe_seq_plans();
  os << describe_fp8_plans();
  return os.str();
}

int64_t Gemm::plan_bucket(int64_t T) { return T <= 8 ? T : int64_t(std::bit_ceil(uint64_t(T))); }

Gemm::Key Gemm::bucket_of(Key key) {
  key.T = plan_bucket(key.T);
  return key;
}

Gemm::Plan& Gemm::plan_for(const Key& key, const void* out, const void* in, const void* w,
                           const void* bias, cudaStream_t stream) {
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;

  auto plan = std::make_unique<Plan>();
  const auto in_type = cudaDataType_t(key.in_type), out_type = cudaDataType_t(key.out_type);
  const bool nk = key.layout == int(WeightLayout::NK);
  plan->bias_epilogue = key.has_bias && key.act == int(GemmAct::None);

  lt_describe(*plan, in_type, out_type, key.T, key.K, key.N, nk, plan->bias_epilogue);
  if (plan->bias_epilogue)
    CUDA_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));

  // Another T of this bucket was timed: its algorithm, if cuBLASLt takes it for this T.
  if (auto it = timed_buckets_.find(bucket_of(key)); it != timed_buckets_.end() && !it->second->use_gemv) {
    if (lt_accepts(lt_, *plan, it->second->algo, workspace_.bytes())) {
      plan->algo = it->second->algo;
      plan->choice = "as its bucket's timed plan (" + it->second->choice + ")";
      return *plans_.emplace(key, std::move(plan)).first->second;
    }
  }

  const std::vector<cublasLtMatmulHeuristicResult_t> results =
      lt_proposals(lt_, *plan, key.align, workspace_.bytes(), kMaxCandidates);
  const int found = int(results.size());

  const bool gemv_ok = nk && detail::gemv_nk_supported(key.T, key.K, key.N, in, w);
  if (found == 0 && !gemv_ok)
    throw Error("gemm: cuBLASLt has no algorithm for " + std::string(nk ? "NK" : "KN") + " " +
                type_name(key.in_type) + " T=" + std::to_string(key.T) + " K=" + std::to_string(key.K) +
                " N=" + std::to_string(key.N));

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool timed = options_.tuning && capture == cudaStreamCaptureStatusNone && (found + int(gemv_ok)) > 1;

  if (!timed) {
    plan->choose_untimed(results, gemv_ok, key.T);
    return *plans_.emplace(key, std::move(plan)).first->second;
  }
  plan->choose_timed(*this, key, results, gemv_ok, out, in, w, bias, stream);
  Plan& chosen = *plans_.emplace(key, std::move(plan)).first->second;
  timed_buckets_.emplace(bucket_of(key), &chosen);
  return chosen;
}

void Gemm::Plan::choose_timed(Gemm& g, const Key& key, const std::vector<cublasLtMatmulHeuristicResult_t>& results,
                              bool gemv_ok, const void* out, const void* in, const void* w, const void* bias,
                              cudaStream_t stream) {
  auto time_it = [&](const std::function<bool()>& fn) { return g.time_ms(stream, fn); };
  const int found = int(results.size());
  float best = -1.f;
  int best_index = -2;  // -1: gemv, >= 0: heuristic result
  const float alpha = 1.f, beta = 0.f;
  for (int i = 0; i < found; ++i) {
    const float elapsed = time_it([&] {
      const cublasStatus_t s = cublasLtMatmul(g.lt_, desc, &alpha, w, a, in, b, &beta, out, d,
                                              const_cast<void*>(out), d, &results[i].algo, g.workspace_.get(),
                                              g.workspace_.bytes(), stream);
      return s == CUBLAS_STATUS_SUCCESS;
    });
    if (elapsed >= 0 && (best < 0 || elapsed < best)) best = elapsed, best_index = i;
  }
  if (gemv_ok) {
    const float elapsed = time_it([&] {
      g.execute_gemv_for_timing(key, const_cast<void*>(out), in, w, bias, stream);
      return true;
    });
    if (best < 0 || elapsed < best) best = elapsed, best_index = -1;
  }
  if (best_index == -2) throw Error("gemm: every cuBLASLt candidate failed for T=" + std::to_string(key.T));
  ms = best;
  if (best_index == -1) {
    use_gemv = true;
    choice = "gemv";
  } else {
    algo = results[best_index].algo;
    choice = "cublasLt #" + std::to_string(best_index) + " of " + std::to_string(found);
  }
}

void Gemm::check_device() const {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != device_)
    throw Error("gemm: a Gemm made on device " + std::to_string(device_) + " used on device " + std::to_string(dev));
}

float Gemm::time_ms(cudaStream_t stream, const std::function<bool()>& fn) {
  CUDA_CHECK(cudaEventRecord(ev_start_, stream));
  if (!fn()) return -1.f;
  CUDA_CHECK(cudaEventRecord(ev_stop_, stream));
  CUDA_CHECK(cudaEventSynchronize(ev_stop_));
  float ms = 0.f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, ev_start_, ev_stop_));
  const int reps = std::clamp(int(1.0f / std::max(ms, 1e-4f)), 2, 10);
  CUDA_CHECK(cudaEventRecord(ev_start_, stream));
  for (int i = 0; i < reps; ++i)
    if (!fn()) return -1.f;
  CUDA_CHECK(cudaEventRecord(ev_stop_, stream));
  CUDA_CHECK(cudaEventSynchronize(ev_stop_));
  CUDA_CHECK(cudaEventElapsedTime(&ms, ev_start_, ev_stop_));
  return ms / float(reps);
}

void Gemm::execute_gemv_for_timing(const Key& key, void* out, const void* in, const void* w,
                                   const void* bias, cudaStream_t stream) {
  const auto act = GemmAct(key.act);
  if (key.in_type == CUDA_R_16F) {
    if (key.out_type == CUDA_R_32F)
      detail::gemv_nk(static_cast<float*>(out), static_cast<const __half*>(in), static_cast<const __half*>(w),
                      static_cast<const __half*>(bias), key.T, key.K, key.N, act, stream, options_.gemv_k_split,
                      options_.gemv_l2_prefetch_bytes);
    else
      detail::gemv_nk(static_cast<__half*>(out), static_cast<const __half*>(in), static_cast<const __half*>(w),
                      static_cast<const __half*>(bias), key.T, key.K, key.N, act, stream, options_.gemv_k_split,
                      options_.gemv_l2_prefetch_bytes);
  } else {
    using B = __nv_bfloat16;
    if (key.out_type == CUDA_R_32F)
      detail::gemv_nk(static_cast<float*>(out), static_cast<const B*>(in), static_cast<const B*>(w),
                      static_cast<const B*>(bias), key.T, key.K, key.N, act, stream, options_.gemv_k_split,
                      options_.gemv_l2_prefetch_bytes);
    else
      detail::gemv_nk(static_cast<B*>(out), static_cast<const B*>(in), static_cast<const B*>(w),
                      static_cast<const B*>(bias), key.T, key.K, key.N, act, stream, options_.gemv_k_split,
                      options_.gemv_l2_prefetch_bytes);
  }
}

template <class T, class OutT>
void Gemm::run(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
               WeightLayout layout, GemmAct act, cudaStream_t stream) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  static_assert(std::is_same_v<OutT, T> || std::is_same_v<OutT, float>);
  if (T_ <= 0 || N <= 0) return;
  if (K <= 0) throw Error("gemm: K must be positive");
  if constexpr (std::is_same_v<OutT, float>) {
    if (bias != nullptr || act != GemmAct::None)
      throw Error("gemm: fp32 output supports neither bias nor activation");
  }
  check_device();
  if (options_.deterministic && layout == WeightLayout::NK) {
    if (!options_.sequential_order || !run_sequential<T, OutT>(out, in, w, bias, T_, K, N, act, stream))
      run_fixed<T, T, OutT>(out, in, w, nullptr, bias, T_, K, N, act, stream);
    return;
  }

  Key key{};
  key.layout = int(layout);
  key.in_type = int(lt_data_type<T>());
  key.out_type = int(lt_data_type<OutT>());
  key.has_bias = bias != nullptr;
  key.act = int(act);
  key.align = std::min({lt_alignment(out), lt_alignment(in), lt_alignment(w), lt_alignment(bias)});
  key.T = T_, key.K = K, key.N = N;
  const Plan& plan = plan_for(key, out, in, w, bias, stream);

  if (plan.use_gemv) {
    detail::gemv_nk(out, in, w, bias, T_, K, N, act, stream, options_.gemv_k_split, options_.gemv_l2_prefetch_bytes);
    return;
  }
  if (plan.bias_epilogue)
    CUDA_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  const float alpha = 1.f, beta = 0.f;
  CUDA_CHECK(cublasLtMatmul(lt_, plan.desc, &alpha, w, plan.a, in, plan.b, &beta, out, plan.d, out, plan.d,
                            &plan.algo, workspace_.get(), workspace_.bytes(), stream));
  if constexpr (!std::is_same_v<OutT, float>) {
    if (act != GemmAct::None)
      add_bias_gelu<T>(out, bias, T_, N, act == GemmAct::GeluTanh ? Activation::GeluNew : Activation::Gelu, stream);
  }
}

template void Gemm::run<__half, __half>(__half*, const __half*, const __half*, const __half*, int64_t, int64_t,
                                        int64_t, WeightLayout, GemmAct, cudaStream_t);
template void Gemm::run<__half, float>(float*, const __half*, const __half*, const __half*, int64_t, int64_t,
                                       int64_t, WeightLayout, GemmAct, cudaStream_t);
template void Gemm::run<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*,
                                                      const __nv_bfloat16*, const __nv_bfloat16*, int64_t,
                                                      int64_t, int64_t, WeightLayout, GemmAct, cudaStream_t);
template void Gemm::run<__nv_bfloat16, float>(float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                              const __nv_bfloat16*, int64_t, int64_t, int64_t, WeightLayout,
                                              GemmAct, cudaStream_t);

// ---- int8 weight-only ----

// The int8 plan choice beyond detail::Int8Kernel's: dequantise the weight, then run().
constexpr int kDequantChoice = detail::kInt8Kernels;

std::string kernel_choice_name(int layout, int k) {
  if (layout == kFixedLayout || layout == kFixedInt8Layout) return detail::fixed_tile_name(detail::FixedTile(k));
  return k == kDequantChoice ? "dequant+cublasLt" : detail::int8_kernel_name(detail::Int8Kernel(k));
}

Gemm::Plan& Gemm::plan_kernels(const Key& key, const std::function<std::vector<int>()>& candidates_of,
                                int untimed_choice, bool dequant, const std::function<void(int)>& launch,
                                cudaStream_t stream) {
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  std::vector<int> candidates = candidates_of();
  auto plan = std::make_unique<Plan>();
  // Another T of this bucket was timed: its choice, if it is one for this T too.
  if (auto it = timed_buckets_.find(bucket_of(key)); it != timed_buckets_.end()) {
    const int k = it->second->kernel;
    if ((k == kDequantChoice && dequant) || std::find(candidates.begin(), candidates.end(), k) != candidates.end()) {
      plan->kernel = k;
      plan->choice = "as its bucket's timed plan (" + it->second->choice + ")";
      return *plans_.emplace(key, std::move(plan)).first->second;
    }
  }

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool untimed = !options_.tuning || capture != cudaStreamCaptureStatusNone;
  if (dequant && !untimed) candidates.push_back(kDequantChoice);
  if (untimed || candidates.size() == 1) {
    const int k = candidates.size() == 1 ? candidates[0] : untimed_choice;
    plan->kernel = k;
    plan->choice = kernel_choice_name(key.layout, k) + " (untimed)";
    return *plans_.emplace(key, std::move(plan)).first->second;
  }
  if (dequant) launch(kDequantChoice);  // plans run()'s GEMM (its own timing) before this timing starts
  float best = -1.f;
  for (int k : candidates) {
    const float ms = time_ms(stream, [&] {
      launch(k);
      return true;
    });
    if (ms >= 0 && (best < 0 || ms < best)) best = ms, plan->kernel = k;
  }
  plan->ms = best;
  plan->choice = kernel_choice_name(key.layout, plan->kernel) + " of " + std::to_string(candidates.size());
  Plan& chosen = *plans_.emplace(key, std::move(plan)).first->second;
  timed_buckets_.emplace(bucket_of(key), &chosen);
  return chosen;
}

template <class T, class W, class OutT>
void Gemm::run_fixed(OutT* out, const T* in, const W* w, const float* scales, const T* bias, int64_t T_, int64_t K,
                     int64_t N, GemmAct act, cudaStream_t stream) {
  Key key{};
  key.layout = std::is_same_v<W, int8_t> ? kFixedInt8Layout : kFixedLayout;
  key.in_type = int(lt_data_type<T>());
  key.out_type = int(lt_data_type<OutT>());
  key.has_bias = bias != nullptr;
  key.act = int(act);
  key.align = std::min(lt_alignment(in), lt_alignment(w));
  key.T = T_, key.K = K, key.N = N;
  // Split products write their chains into the (otherwise cuBLASLt's) workspace, so rows go
  // in blocks that fit it; rows are independent, so the blocks change no bits.
  const int64_t per_row = detail::fixed_chain_floats(1, K, N);
  const int64_t rows_per_call =
      per_row > 0 ? std::max<int64_t>(1, int64_t(workspace_.bytes() / sizeof(float)) / per_row) : T_;
  auto launch = [&](int k) {
    for (int64_t r0 = 0; r0 < T_; r0 += rows_per_call) {
      const int64_t rows = std::min(rows_per_call, T_ - r0);
      detail::fixed_matmul<T, W, OutT>(detail::FixedTile(k), out + r0 * N, in + r0 * K, w, scales, bias, rows, K, N,
                                       act, stream, per_row > 0 ? workspace_.as<float>() : nullptr);
    }
  };
  auto candidates = [&] {
    std::vector<int> v;
    for (detail::FixedTile k : detail::fixed_tile_candidates(T_, K, N)) v.push_back(int(k));
    return v;
  };
  const Plan& plan = plan_kernels(key, candidates, int(detail::fixed_default_tile(T_, K, N)), false, launch, stream);
  launch(plan.kernel);
}

template <class T, class OutT>
void Gemm::run_int8(OutT* out, const T* in, const int8_t* w, const float* scales, const T* bias, int64_t T_,
                    int64_t K, int64_t N, GemmAct act, cudaStream_t stream) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "T is __half or __nv_bfloat16");
  static_assert(std::is_same_v<OutT, T> || std::is_same_v<OutT, float>, "OutT is T or float");
  detail::int8_check_args(out, in, w, scales, T_, K, N);
  check_device();
  if (options_.deterministic) {
    if (!options_.sequential_order || !options_.int8_sequential_order ||
        !run_sequential_int8<T, OutT>(out, in, w, scales, bias, T_, K, N, act, stream))
      run_fixed<T, int8_t, OutT>(out, in, w, scales, bias, T_, K, N, act, stream);
    return;
  }

  Key key{};
  key.layout = kInt8Layout;
  key.in_type = int(lt_data_type<T>());
  key.out_type = int(lt_data_type<OutT>());
  key.has_bias = bias != nullptr;
  key.act = int(act);
  key.align = std::min(lt_alignment(in), lt_alignment(w));  // what the kernels' choice depends on
  key.T = T_, key.K = K, key.N = N;
  T* dequant = static_cast<T*>(dequant_);
  const bool can_dequant = dequant && T_ > detail::kGemvMaxTokens && size_t(N * K) * sizeof(T) <= dequant_bytes_;
  auto launch = [&](int k) {
    if (k == kDequantChoice) {
      dequantize_rows_int8<T>(dequant, w, scales, N, K, stream);
      run<T, OutT>(out, in, dequant, bias, T_, K, N, WeightLayout::NK, act, stream);
      return;
    }
    detail::int8_matmul<T, OutT>(detail::Int8Kernel(k), out, in, w, scales, bias, T_, K, N, act, stream,
                                 options_.int8_gemv_k_split);
  };
  auto candidates = [&] {
    std::vector<int> v;
    for (detail::Int8Kernel k : detail::int8_candidates(T_, K, N, in, w)) v.push_back(int(k));
    return v;
  };
  const Plan& plan =
      plan_kernels(key, candidates, int(detail::int8_default_kernel(T_, K, N, in, w)), can_dequant, launch, stream);
  launch(plan.kernel);
}

template void Gemm::run_int8<__half, __half>(__half*, const __half*, const int8_t*, const float*, const __half*,
                                             int64_t, int64_t, int64_t, GemmAct, cudaStream_t);
template void Gemm::run_int8<__half, float>(float*, const __half*, const int8_t*, const float*, const __half*,
                                            int64_t, int64_t, int64_t, GemmAct, cudaStream_t);
template void Gemm::run_int8<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const int8_t*,
                                                           const float*, const __nv_bfloat16*, int64_t, int64_t,
                                                           int64_t, GemmAct, cudaStream_t);
template void Gemm::run_int8<__nv_bfloat16, float>(float*, const __nv_bfloat16*, const int8_t*, const float*,
                                                   const __nv_bfloat16*, int64_t, int64_t, int64_t, GemmAct,
                                                   cudaStream_t);

// ---- the ops.h twins that go through the thread's default Gemm ----

template <class T>
void matmul_forward(T* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
                    cudaStream_t stream) {
  Gemm::thread_default().run<T, T>(out, in, w, bias, T_, K, N, WeightLayout::KN, GemmAct::None, stream);
}

template <class T>
void lm_head_forward(float* logits, const T* in, const T* head, int64_t T_, int64_t C, int64_t V,
                     cudaStream_t stream) {
  Gemm::thread_default().run<T, float>(logits, in, head, nullptr, T_, C, V, WeightLayout::NK, GemmAct::None,
                                       stream);
}

template void matmul_forward<__half>(__half*, const __half*, const __half*, const __half*, int64_t, int64_t,
                                     int64_t, cudaStream_t);
template void matmul_forward<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                                            const __nv_bfloat16*, int64_t, int64_t, int64_t, cudaStream_t);
template void lm_head_forward<__half>(float*, const __half*, const __half*, int64_t, int64_t, int64_t,
                                      cudaStream_t);
template void lm_head_forward<__nv_bfloat16>(float*, const __nv_bfloat16*, const __nv_bfloat16*, int64_t,
                                             int64_t, int64_t, cudaStream_t);

}  // namespace conveyor::cuda

// Gemm's deterministic products in the sequential order (gemm.h, "Deterministic mode").
//
// The order: every output element is acc = 0, then acc += W[n, k0:k0+16] . in[t, k0:k0+16]
// for k0 = 0, 16, 32, ... in increasing order on the tensor cores (one 16-deep MMA a step,
// fp32), then the epilogue. cuBLASLt's kernels without a split along K sum in that order
// whatever their tile; the sequential GEMV (gemv_seq.cu) does too, with mma.sync. Neither
// is taken on faith: what decides is bits.
//
// A family (types, bias, activation, alignment, K, N) is settled once, at its first call
// outside graph capture, from the shape alone (no timing, so a spare worker settles the same):
//   - its canonical algorithm: the first the heuristic proposes for kSeqAnchorRows rows that
//     runs without a split along K, takes 1, kSeqProbeRows and kSeqAnchorRows rows, and gives
//     row 0 the same bits alone as among kSeqProbeRows rows of a fixed random input (the
//     probe, synthetic.h);
//   - the sequential GEMV (gemv.h) joins when its kSeqProbeRows rows of the probe equal the
//     canonical's bit for bit.
// Without a canonical algorithm the family keeps the fixed-order tiles (fixed_gemm.h) for
// every T. Each T bucket then times, on the caller's own buffers, the canonical algorithm,
// the heuristic's unsplit proposals for that T that give the probe the canonical's bits
// (members), and the GEMV for T <= 8: any of them gives a row the same bits, so the timing
// picks speed, never an order. conveyor-bench-gemm-order measured the premise (unsplit
// algorithms keep a row's bits for T up to 4,096) on every product of gpt2-xl, gpt3-6.7b
// and GPT-3 175B shards; docs/PERFORMANCE.md has the table.
//
// Admission is by the probe's rows alone (no check at the planned T: a second check there,
// synchronising mid-step, hung the tensor-parallel suite whose two ranks share one GPU while
// the other rank's all-reduce waited). That unsplit kernels keep a row's bits at every T is
// the measured premise above; the bitwise suites hold every plan to it.
//
// Epilogues as the fast path: a bias alone is cuBLASLt's bias epilogue; an activation (with
// or without a bias) is add_bias_gelu after the product.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/lt_descriptors.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/synthetic.h"

namespace conveyor::cuda {
namespace {

constexpr int kSeqLayout = 6;      // Key::layout of these plans (gemm.cc uses 0..4, fp8_gemm.cc 5)
constexpr int kSeqInt8Layout = 7;  // run_sequential_int8's
constexpr int64_t kSeqAnchorRows = 256;
constexpr int64_t kSeqProbeRows = 8;
constexpr int kSeqProposals = 32;

size_t type_bytes(int t) { return t == CUDA_R_32F ? 4 : 2; }

using ConfigKey = std::array<int64_t, 8>;
ConfigKey config_key(const cublasLtMatmulAlgo_t& a) {
  return {lt_algo_config<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID), lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
          lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
          lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
          lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
          lt_algo_config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
          lt_algo_config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
          lt_algo_config<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)};
}

}  // namespace

// out (col-major N x T) = W^T (W: col-major K x N, i.e. [N, K] row-major)
// * in (col-major K x T), fp32 compute; the bias epilogue when `bias_epilogue`.
struct SeqProblem : LtDescriptors {
  bool bias_epilogue = false;
  SeqProblem(int in_type, int out_type, int64_t T_, int64_t K, int64_t N, bool with_bias_epilogue)
      : bias_epilogue(with_bias_epilogue) {
    lt_describe(*this, cudaDataType_t(in_type), cudaDataType_t(out_type), T_, K, N, true, bias_epilogue);
  }
};

namespace {

// One product of `p` with `algo` on `stream`: out = in W^T (+ bias, by the epilogue).
bool seq_matmul(cublasLtHandle_t lt, const SeqProblem& p, const cublasLtMatmulAlgo_t& algo, const void* w,
                const void* bias, const void* in, void* out, const DeviceBuffer& workspace, cudaStream_t stream) {
  if (p.bias_epilogue)
    CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  const float alpha = 1.f, beta = 0.f;
  return cublasLtMatmul(lt, p.desc, &alpha, w, p.a, in, p.b, &beta, out, p.d, out, p.d, &algo, workspace.get(),
                        workspace.bytes(), stream) == CUBLAS_STATUS_SUCCESS;
}

}  // namespace

// SeqPlan::member of the sequential GEMV (cuBLASLt's members are 0, 1, ...).
constexpr int kGemv = -1;

struct Gemm::SeqFamily {
  bool usable = false;
  std::string why;     // why not, when the fixed-order tiles keep it
  bool gemv = false;   // the sequential GEMV has the canonical's bits
  std::vector<cublasLtMatmulAlgo_t> members;  // members[0]: the canonical algorithm
  std::vector<ConfigKey> member_keys, rejected_keys;
  std::unique_ptr<SeqProblem> probe;  // kSeqProbeRows rows
  size_t row_bytes = 0;               // of a row of the output
  DeviceBuffer probe_in, probe_ref, probe_out;
};

struct Gemm::SeqPlan {
  std::unique_ptr<SeqProblem> problem;  // T rows
  int member = 0;                       // index into the family's members, or kGemv
  float ms = -1.f;
  std::string choice;
};

// How an int8 family (run_sequential_int8) runs: not at all (the fixed-order tiles keep it),
// always through the dequantised matrix, or also through gemv_seq_int8 for T <= 64.
enum class Gemm::SeqInt8 : int { Tiles, Dequantised, AlsoGemv };

struct Gemm::SeqState {
  std::map<Key, SeqFamily> families;  // key with T = 0
  std::map<Key, std::unique_ptr<SeqPlan>> plans;
  std::map<Key, const SeqPlan*> timed_buckets;  // key with T = its bucket
  std::map<Key, SeqInt8> int8_families;         // int8 keys with T = 0
  std::map<Key, bool> int8_gemv_plans;          // int8 keys with T: the GEMV (else the dequantised matrix)

  template <class T, class OutT>
  struct Call;
};

void Gemm::SeqStateDeleter::operator()(SeqState* s) const { delete s; }

namespace {

// Whether `rows` rows (row_bytes each, contiguous) of a and b are the same bits; synchronises.
bool same_rows(const void* a, const void* b, int64_t rows, size_t row_bytes, cudaStream_t stream) {
  const size_t n = size_t(rows) * row_bytes;
  std::vector<unsigned char> ha(n), hb(n);
  CUDA_CHECK(cudaMemcpyAsync(ha.data(), a, n, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(hb.data(), b, n, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return std::memcmp(ha.data(), hb.data(), n) == 0;
}

}  // namespace

std::string Gemm::describe_seq_plans() const {
  if (!seq_) return "";
  std::ostringstream os;
  for (const auto& [k, f] : seq_->families) {
    os << "NK sequential-order family K=" << k.K << " N=" << k.N << (k.has_bias ? " bias" : "") << (k.act ? " gelu" : "")
       << ": ";
    if (!f.usable) os << "fixed-order tiles (" << f.why << ")";
    else
      os << "canonical " << lt_algo_name(f.members[0]) << ", " << f.members.size() << " members, " << f.rejected_keys.size() << " rejected, GEMV "
         << (f.gemv ? "joins" : "has other bits");
    os << "\n";
  }
  for (const auto& [k, p] : seq_->plans) {
    os << "NK sequential-order T=" << k.T << " K=" << k.K << " N=" << k.N << (k.has_bias ? " bias" : "")
       << (k.act ? " gelu" : "") << ": " << p->choice;
    if (p->ms >= 0) os << " " << p->ms * 1000.f << " us";
    os << "\n";
  }
  return os.str();
}

// The family's one-time settlement (top of this file); `w` and `bias` are the caller's.
template <class T, class OutT>
Gemm::SeqFamily& Gemm::seq_family(const Key& fk, const T* w, const T* bias, cudaStream_t stream) {
  if (!seq_) seq_.reset(new SeqState);
  if (auto it = seq_->families.find(fk); it != seq_->families.end()) return it->second;
  SeqFamily& f = seq_->families[fk];
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    f.why = "first seen during graph capture";
    return f;
  }
  const int64_t K = fk.K, N = fk.N, P = kSeqProbeRows;
  // Rows that are not 16-byte aligned take cuBLASLt's older kernels, and the configurations
  // admitted by the probe there (algorithms 23 and 11, on an H200) did not all give a row the
  // same bits at every T (test_cuda_determinism, K = 100, 2026-11-26). The premise was
  // measured on aligned rows (every model's K is a multiple of 64).
  if (K % 8 != 0 || fk.align < 16) {
    f.why = "rows or pointers not 16-byte aligned (K % 8 != 0)";
    return f;
  }
  const bool bias_epi = fk.has_bias && fk.act == int(GemmAct::None);
  const size_t ob = type_bytes(fk.out_type);
  f.row_bytes = size_t(N) * ob;
  const uint64_t ws = workspace_.bytes();
  SeqProblem anchor(fk.in_type, fk.out_type, kSeqAnchorRows, K, N, bias_epi);
  SeqProblem one(fk.in_type, fk.out_type, 1, K, N, bias_epi);
  f.probe = std::make_unique<SeqProblem>(fk.in_type, fk.out_type, P, K, N, bias_epi);
  f.probe_in = device_alloc(size_t(P * K) * sizeof(T), "gemm", "sequential-order probe input");
  f.probe_ref = device_alloc(size_t(P) * f.row_bytes, "gemm", "sequential-order probe output");
  f.probe_out = device_alloc(size_t(P) * f.row_bytes, "gemm", "sequential-order probe output");
  fill_normal<T>(f.probe_in.as<T>(), P * K, 0.f, 1.f, 0x5e9u, uint64_t(K), stream);

  auto matmul = [&](const SeqProblem& p, const cublasLtMatmulAlgo_t& algo, void* out) {
    return seq_matmul(lt_, p, algo, w, bias, f.probe_in.get(), out, workspace_, stream);
  };
  const auto proposals = lt_proposals(lt_, anchor, fk.align, ws, kSeqProposals);
  for (const auto& r : proposals) {
    cublasLtMatmulAlgo_t algo = r.algo;
    if (lt_splits_k(algo) && !lt_unsplit(algo)) continue;
    if (!lt_accepts(lt_, anchor, algo, ws) || !lt_accepts(lt_, *f.probe, algo, ws) || !lt_accepts(lt_, one, algo, ws))
      continue;
    if (!matmul(*f.probe, algo, f.probe_ref.get()) || !matmul(one, algo, f.probe_out.get())) continue;
    if (!same_rows(f.probe_ref.get(), f.probe_out.get(), 1, f.row_bytes, stream)) continue;
    f.members.push_back(algo);
    f.member_keys.push_back(config_key(algo));
    break;
  }
  if (f.members.empty()) {
    f.why = "none of cuBLASLt's " + std::to_string(proposals.size()) +
            " proposals runs unsplit with a row's bits the same alone and among " + std::to_string(P);
    f.probe_in = DeviceBuffer(), f.probe_ref = DeviceBuffer(), f.probe_out = DeviceBuffer();
    return f;
  }
  // The GEMV: its probe rows against the canonical's, with the activation the real calls take.
  if (detail::gemv_seq_supported(P, K, N, f.probe_in.get(), w)) {
    if constexpr (!std::is_same_v<OutT, float>) {
      if (fk.act != int(GemmAct::None))
        add_bias_gelu<T>(f.probe_ref.as<T>(), bias, P, N,
                         fk.act == int(GemmAct::GeluTanh) ? Activation::GeluNew : Activation::Gelu, stream);
    }
    detail::gemv_seq<T, OutT>(f.probe_out.as<OutT>(), f.probe_in.as<T>(), w, bias, P, K, N, GemmAct(fk.act), stream);
    f.gemv = same_rows(f.probe_ref.get(), f.probe_out.get(), P, f.row_bytes, stream);
    // The reference again without the activation: members are held to cuBLASLt's own output.
    if (fk.act != int(GemmAct::None) && !matmul(*f.probe, f.members[0], f.probe_ref.get()))
      throw Error("gemm: the canonical sequential-order algorithm failed its second probe call");
  }
  f.usable = true;
  return f;
}

// Index of `algo` among the family's members, admitting it when its probe rows have the
// canonical's bits; -1 when they do not (or cuBLASLt refuses it for the probe).
int Gemm::seq_admit(SeqFamily& f, const cublasLtMatmulAlgo_t& algo, const void* w, const void* bias,
                    cudaStream_t stream) {
  const ConfigKey key = config_key(algo);
  for (size_t i = 0; i < f.member_keys.size(); ++i)
    if (f.member_keys[i] == key) return int(i);
  for (const ConfigKey& r : f.rejected_keys)
    if (r == key) return -1;
  const bool same = lt_accepts(lt_, *f.probe, algo, workspace_.bytes()) &&
                    seq_matmul(lt_, *f.probe, algo, w, bias, f.probe_in.get(), f.probe_out.get(), workspace_, stream) &&
                    same_rows(f.probe_ref.get(), f.probe_out.get(), kSeqProbeRows, f.row_bytes, stream);
  if (!same) {
    f.rejected_keys.push_back(key);
    return -1;
  }
  f.members.push_back(algo);
  f.member_keys.push_back(key);
  return int(f.members.size()) - 1;
}

// One run_sequential call: the caller's buffers and shape, and its family's members.
template <class T, class OutT>
struct Gemm::SeqState::Call {
  Gemm& gemm;
  SeqFamily& f;
  OutT* out;
  const T* in;
  const T* w;
  const T* bias;
  int64_t T_, K, N;
  GemmAct act;
  cudaStream_t stream;

  // Runs plan `p`: the sequential GEMV, or a member with the activation after it.
  bool launch(const SeqPlan& p) const {
    if (p.member == kGemv) {
      detail::gemv_seq<T, OutT>(out, in, w, bias, T_, K, N, act, stream);
      return true;
    }
    if (!seq_matmul(gemm.lt_, *p.problem, f.members[size_t(p.member)], w, bias, in, out, gemm.workspace_, stream))
      return false;
    if constexpr (!std::is_same_v<OutT, float>) {
      if (act != GemmAct::None)
        add_bias_gelu<T>(out, bias, T_, N, act == GemmAct::GeluTanh ? Activation::GeluNew : Activation::Gelu, stream);
    }
    return true;
  }

  std::string name(int m) const {
    return m == kGemv ? std::string("sequential GEMV") : lt_algo_name(f.members[size_t(m)]) + (m == 0 ? " (canonical)" : "");
  }

  // The plan for `key` (this call's T), made the first time.
  std::unique_ptr<SeqPlan> make_plan(const Key& key, bool gemv_ok, bool capturing) const {
    const uint64_t ws = gemm.workspace_.bytes();
    auto plan = std::make_unique<SeqPlan>();
    const bool bias_epi = key.has_bias && act == GemmAct::None;
    plan->problem = std::make_unique<SeqProblem>(key.in_type, key.out_type, T_, K, N, bias_epi);
    const bool timed = gemm.options_.tuning && !capturing;
    // Another T of this bucket was timed: its choice, if it runs this T.
    if (auto b = gemm.seq_->timed_buckets.find(bucket_of(key)); b != gemm.seq_->timed_buckets.end()) {
      const int m = b->second->member;
      if ((m == kGemv && gemv_ok) || (m >= 0 && lt_accepts(gemm.lt_, *plan->problem, f.members[size_t(m)], ws))) {
        plan->member = m;
        plan->choice = "as its bucket's timed plan (" + b->second->choice + ")";
      }
    }
    if (plan->choice.empty()) choose(*plan, candidates(*plan->problem, key.align, gemv_ok, timed), timed);
    return plan;
  }

  // The members (and kGemv) that run problem `p` with the canonical's bits; when `timed`, the
  // unsplit proposals for `p` are probed and admitted to the family first.
  std::vector<int> candidates(const SeqProblem& p, int align, bool gemv_ok, bool timed) const {
    const uint64_t ws = gemm.workspace_.bytes();
    std::vector<int> candidates;  // member indices, kGemv
    if (gemv_ok) candidates.push_back(kGemv);
    if (lt_accepts(gemm.lt_, p, f.members[0], ws)) candidates.push_back(0);
    if (timed) {
      for (const auto& r : lt_proposals(gemm.lt_, p, align, ws, kSeqProposals)) {
        cublasLtMatmulAlgo_t algo = r.algo;
        if (lt_splits_k(algo) && !lt_unsplit(algo)) continue;
        if (!lt_accepts(gemm.lt_, p, algo, ws)) continue;
        const int m = gemm.seq_admit(f, algo, w, bias, stream);
        if (m >= 0 && std::find(candidates.begin(), candidates.end(), m) == candidates.end()) candidates.push_back(m);
      }
    }
    if (candidates.empty())
      throw Error("gemm: no sequential-order plan runs T=" + std::to_string(T_) + " K=" + std::to_string(K) +
                  " N=" + std::to_string(N) + " (the canonical algorithm refuses it)");
    return candidates;
  }

  // Sets plan's member: the first candidate untimed, else the fastest on the caller's buffers.
  void choose(SeqPlan& plan, const std::vector<int>& candidates, bool timed) const {
    SeqPlan trial;
    trial.problem = std::move(plan.problem);
    if (!timed || candidates.size() == 1) {
      plan.member = candidates[0];
      plan.choice = name(candidates[0]) + " (untimed)";
    } else {
      float best = -1.f;
      for (int m : candidates) {
        trial.member = m;
        const float ms = gemm.time_ms(stream, [&] { return launch(trial); });
        if (ms >= 0 && (best < 0 || ms < best)) best = ms, plan.member = m;
      }
      if (best < 0) throw Error("gemm: every sequential-order candidate failed for T=" + std::to_string(T_));
      plan.ms = best;
      plan.choice = name(plan.member) + " of " + std::to_string(candidates.size());
    }
    plan.problem = std::move(trial.problem);
  }
};

template <class T, class OutT>
bool Gemm::run_sequential(OutT* out, const T* in, const T* w, const T* bias, int64_t T_, int64_t K, int64_t N,
                          GemmAct act, cudaStream_t stream) {
  Key key{};
  key.layout = kSeqLayout;
  key.in_type = int(lt_data_type<T>());
  key.out_type = int(lt_data_type<OutT>());
  key.has_bias = bias != nullptr;
  key.act = int(act);
  key.align = std::min({lt_alignment(out), lt_alignment(in), lt_alignment(w), lt_alignment(bias)});
  key.K = K, key.N = N;
  SeqFamily& f = seq_family<T, OutT>(key, w, bias, stream);
  if (!f.usable) return false;
  key.T = T_;
  const bool gemv_ok = f.gemv && detail::gemv_seq_supported(T_, K, N, in, w);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  const SeqState::Call<T, OutT> call{.gemm = *this, .f = f, .out = out, .in = in, .w = w, .bias = bias,
                                     .T_ = T_, .K = K, .N = N, .act = act, .stream = stream};

  auto it = seq_->plans.find(key);
  if (it == seq_->plans.end()) {
    std::unique_ptr<SeqPlan> plan = call.make_plan(key, gemv_ok, capturing);
    const bool timed_plan = plan->ms >= 0;
    it = seq_->plans.emplace(key, std::move(plan)).first;
    if (timed_plan) seq_->timed_buckets.emplace(bucket_of(key), it->second.get());
  }
  if (!call.launch(*it->second))
    throw Error("gemm: cuBLASLt failed a planned sequential-order product T=" + std::to_string(T_) +
                " K=" + std::to_string(K) + " N=" + std::to_string(N));
  return true;
}

// Int8 weights in the sequential order (gemm.h, "Deterministic mode"): "dequantise in the
// producer". The matrix T(q * s) is the fp16/bf16 product's weight: T > 64 dequantises it
// into the dequantisation workspace and runs run_sequential over it; T <= 64 may run
// gemv_seq_int8, which reads only the int8 bytes and makes the same values in registers. The
// GEMV joins a family when its probe rows equal the canonical algorithm's over the same
// dequantised matrix, bit for bit; for 8 < T <= 64 the two routes are timed (T <= 8 is the
// GEMV's: half the bytes of either).
template <class T, class OutT>
Gemm::SeqInt8 Gemm::seq_int8_family(const Key& ik, const int8_t* q, const float* scales, const T* bias,
                                     cudaStream_t stream) {
  if (auto it = seq_->int8_families.find(ik); it != seq_->int8_families.end()) return it->second;
  T* dequant = static_cast<T*>(dequant_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return seq_->int8_families[ik] = SeqInt8::Tiles;
  dequantize_rows_int8<T>(dequant, q, scales, ik.N, ik.K, stream);
  Key fk = ik;
  fk.layout = kSeqLayout;
  fk.align = std::min(ik.align, lt_alignment(dequant));
  SeqFamily& f = seq_family<T, OutT>(fk, dequant, bias, stream);
  if (!f.usable) return seq_->int8_families[ik] = SeqInt8::Tiles;
  const int64_t P = kSeqProbeRows;
  if (!detail::gemv_seq_int8_supported(P, ik.K, ik.N, f.probe_in.get(), q))
    return seq_->int8_families[ik] = SeqInt8::Dequantised;
  DeviceBuffer ref = device_alloc(size_t(P) * f.row_bytes, "gemm", "int8 sequential-order probe output");
  DeviceBuffer got = device_alloc(size_t(P) * f.row_bytes, "gemm", "int8 sequential-order probe output");
  SeqPlan canonical;
  canonical.problem = std::make_unique<SeqProblem>(fk.in_type, fk.out_type, P, ik.K, ik.N,
                                                   ik.has_bias && ik.act == int(GemmAct::None));
  const SeqState::Call<T, OutT> call{.gemm = *this, .f = f, .out = ref.as<OutT>(), .in = f.probe_in.as<T>(),
                                     .w = dequant, .bias = bias, .T_ = P, .K = ik.K, .N = ik.N,
                                     .act = GemmAct(ik.act), .stream = stream};
  if (!call.launch(canonical))
    throw Error("gemm: the canonical sequential-order algorithm failed the int8 probe");
  detail::gemv_seq_int8<T, OutT>(got.as<OutT>(), f.probe_in.as<T>(), q, scales, bias, P, ik.K, ik.N,
                                 GemmAct(ik.act), stream);
  const bool same = same_rows(ref.get(), got.get(), P, f.row_bytes, stream);
  return seq_->int8_families[ik] = same ? SeqInt8::AlsoGemv : SeqInt8::Dequantised;
}

template <class T, class OutT>
bool Gemm::run_sequential_int8(OutT* out, const T* in, const int8_t* q, const float* scales, const T* bias,
                               int64_t T_, int64_t K, int64_t N, GemmAct act, cudaStream_t stream) {
  T* dequant = static_cast<T*>(dequant_);
  if (dequant == nullptr || size_t(N * K) * sizeof(T) > dequant_bytes_) return false;
  if (!seq_) seq_.reset(new SeqState);
  Key key{};
  key.layout = kSeqInt8Layout;
  key.in_type = int(lt_data_type<T>());
  key.out_type = int(lt_data_type<OutT>());
  key.has_bias = bias != nullptr;
  key.act = int(act);
  key.align = std::min({lt_alignment(out), lt_alignment(in), lt_alignment(bias)});
  key.K = K, key.N = N;
  const SeqInt8 route = seq_int8_family<T, OutT>(key, q, scales, bias, stream);
  if (route == SeqInt8::Tiles) return false;
  auto through_dequantised = [&] {
    dequantize_rows_int8<T>(dequant, q, scales, N, K, stream);
    if (!run_sequential<T, OutT>(out, in, dequant, bias, T_, K, N, act, stream))
      throw Error("gemm: the int8 sequential-order family lost its canonical algorithm");
    return true;
  };
  auto through_gemv = [&] {
    detail::gemv_seq_int8<T, OutT>(out, in, q, scales, bias, T_, K, N, act, stream);
    return true;
  };
  if (route != SeqInt8::AlsoGemv || !detail::gemv_seq_int8_supported(T_, K, N, in, q)) return through_dequantised();
  if (T_ <= detail::kGemvMaxTokens) return through_gemv();
  key.T = T_;
  auto it = seq_->int8_gemv_plans.find(key);
  if (it == seq_->int8_gemv_plans.end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    bool gemv = true;
    if (options_.tuning && capture == cudaStreamCaptureStatusNone) {
      const float dequantised_ms = time_ms(stream, through_dequantised), gemv_ms = time_ms(stream, through_gemv);
      gemv = gemv_ms >= 0 && (dequantised_ms < 0 || gemv_ms <= dequantised_ms);
    }
    it = seq_->int8_gemv_plans.emplace(key, gemv).first;
  }
  return it->second ? through_gemv() : through_dequantised();
}

#define CONVEYOR_SEQ(T, OutT)                                                                                       \
  template bool Gemm::run_sequential<T, OutT>(OutT*, const T*, const T*, const T*, int64_t, int64_t, int64_t, GemmAct, \
                                              cudaStream_t);                                                 \
  template bool Gemm::run_sequential_int8<T, OutT>(OutT*, const T*, const int8_t*, const float*, const T*, int64_t, \
                                                   int64_t, int64_t, GemmAct, cudaStream_t);
CONVEYOR_SEQ(__half, __half)
CONVEYOR_SEQ(__half, float)
CONVEYOR_SEQ(__nv_bfloat16, __nv_bfloat16)
CONVEYOR_SEQ(__nv_bfloat16, float)
#undef CONVEYOR_SEQ

}  // namespace conveyor::cuda

// Which cuBLASLt algorithms keep a row's bits whatever the token count T, and what holding
// one order costs (issue 30's first, cheap route: pin one algorithm per (K, N)).
//
// For each product shape out[T, N] = in[T, K] W[N, K]^T (the layout the GPU stage stores),
// the program gathers every algorithm configuration cuBLASLt's heuristic proposes for T in
// {1, 16, 64, 256, 1024, 4096} (up to 32 each, with the same 32 MiB workspace Gemm gives it),
// plus each one's variant without a split along K. For each configuration it then runs every
// T of --ts on the first T rows of one input and compares rows 0, T/2 and T-1 with the same
// rows of its run at the largest T: equal bits everywhere make it "row-invariant". Row-
// invariant configurations whose largest-T outputs are the same bits (a few rows hashed) form
// a class: any member of a class may run any T and a row keeps its bits. Each configuration
// is timed at every T (weights rotated through copies so they come from HBM, as in a step).
// Beside them: the Gemm's deterministic plans (the sequential order, gemm_sequential.cc, and
// the fixed-order tiles, fixed_gemm.h), its fast plan, and the sequential-order GEMV alone.
//
//   conveyor-bench-gemm-order [--dtype f16|f16-f32|bf16|fp8] [--shapes gpt2-xl,gpt3-6.7b,gpt3-175b-tp8,...]
//                             [--ts 1,2,3,...] [--verbose]
//
// Prints, per shape: each class's best time per T against the fastest configuration of any
// kind at that T (ratio = fastest / class best), and the class with the highest worst ratio.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <tuple>
#include <string>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/options.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/lt_descriptors.h"
#include "kernels/cuda/synthetic.h"

namespace {

using namespace conveyor;
using namespace conveyor::cuda;

struct Shape {
  std::string name;
  int64_t K, N;
};

// The products of one layer of a named model, sharded `tp` ways (QKV and FC by columns,
// projection and FC2 by rows), as the GPU stage runs them.
std::vector<Shape> layer_shapes(const std::string& model, int64_t C, int64_t tp) {
  const std::string p = model + (tp > 1 ? "-tp" + std::to_string(tp) : "");
  return {{p + " qkv", C, 3 * C / tp}, {p + " proj", C / tp, C}, {p + " fc", C, 4 * C / tp}, {p + " fc2", 4 * C / tp, C}};
}

std::vector<Shape> shapes_named(const std::string& list) {
  std::vector<Shape> out;
  std::stringstream ss(list);
  std::string s;
  while (std::getline(ss, s, ',')) {
    std::vector<Shape> add;
    if (s == "gpt2-xl") add = layer_shapes(s, 1600, 1);
    else if (s == "gpt3-6.7b") add = layer_shapes(s, 4096, 1);
    else if (s == "gpt3-6.7b-tp2") add = layer_shapes("gpt3-6.7b", 4096, 2);
    else if (s == "gpt3-175b-tp2") add = layer_shapes("gpt3-175b", 12288, 2);
    else if (s == "gpt3-175b-tp8") add = layer_shapes("gpt3-175b", 12288, 8);
    else if (unsigned long long k = 0, n = 0; std::sscanf(s.c_str(), "%llux%llu", &k, &n) == 2)
      add = {{s, int64_t(k), int64_t(n)}};
    else throw Error("unknown shape '" + s + "' (gpt2-xl, gpt3-6.7b, gpt3-6.7b-tp2, gpt3-175b-tp2, gpt3-175b-tp8, KxN)");
    out.insert(out.end(), add.begin(), add.end());
  }
  return out;
}

std::vector<int64_t> numbers(const std::string& list) {
  std::vector<int64_t> v;
  std::stringstream ss(list);
  std::string s;
  while (std::getline(ss, s, ',')) v.push_back(std::stoll(s));
  if (v.empty()) throw Error("empty list");
  std::sort(v.begin(), v.end());
  return v;
}

// The configuration attributes that name one algorithm.
struct Config {
  int32_t id = 0, splitk = 1;
  uint32_t tile = 0, stages = 0, reduction = 0, swizzle = 0, custom = 0;
  uint16_t inner = 0, cluster = 0;
  auto tie() const { return std::tie(id, splitk, tile, stages, reduction, swizzle, custom, inner, cluster); }
  bool operator<(const Config& o) const { return tie() < o.tie(); }
  std::string name() const {
    char b[128];
    std::snprintf(b, sizeof b, "id%d tile%u st%u sk%d red%u sw%u c%u in%u cl%u", id, tile, stages, splitk, reduction,
                  swizzle, custom, unsigned(inner), unsigned(cluster));
    return b;
  }
};

Config config_of(const cublasLtMatmulAlgo_t& a) {
  Config c;
  c.id = lt_algo_config<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID);
  c.tile = lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID);
  c.splitk = lt_algo_config<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  c.reduction = lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  c.swizzle = lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  c.custom = lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
  c.stages = lt_algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID);
  c.inner = lt_algo_config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID);
  c.cluster = lt_algo_config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  return c;
}

uint64_t hash_bytes(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

struct Problem {
  cudaDataType_t ab, out;
  size_t ab_bytes, out_bytes;
};

// Calls f(input tag, output tag) with the element types of an fp16/bf16 problem.
template <class F>
void with_types(const Problem& pr, F&& f) {
  const bool f32_out = pr.out == CUDA_R_32F;
  if (pr.ab == CUDA_R_16F) f32_out ? f(__half{}, float{}) : f(__half{}, __half{});
  else f32_out ? f(__nv_bfloat16{}, float{}) : f(__nv_bfloat16{}, __nv_bfloat16{});
}

class Probe {
 public:
  Probe(cublasLtHandle_t lt, const Problem& pr, const Shape& s, cudaStream_t stream)
      : lt_(lt), pr_(pr), s_(s), stream_(stream) {
    workspace_ = device_alloc(Gemm::kWorkspaceBytes, "bench", "workspace");
    CUDA_CHECK(cudaEventCreate(&e0_));
    CUDA_CHECK(cudaEventCreate(&e1_));
  }
  ~Probe() {
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
  }

  // The product of T rows, described as Gemm describes its [N, K] products.
  const LtDescriptors& problem(int64_t T) {
    auto& p = problems_[T];
    if (!p) {
      p = std::make_unique<LtDescriptors>();
      lt_describe(*p, pr_.ab, pr_.out, T, s_.K, s_.N, true, false);
    }
    return *p;
  }

  // The heuristic's proposals for T rows (operands 256-byte aligned, as cudaMalloc gives them).
  std::vector<cublasLtMatmulAlgo_t> heuristic(int64_t T, int count) {
    std::vector<cublasLtMatmulAlgo_t> out;
    for (const auto& r : lt_proposals(lt_, problem(T), 256, workspace_.bytes(), count)) out.push_back(r.algo);
    return out;
  }

  bool accepts(const cublasLtMatmulAlgo_t& algo, int64_t T) {
    return lt_accepts(lt_, problem(T), algo, workspace_.bytes());
  }

  bool run(const cublasLtMatmulAlgo_t& algo, void* out, const void* in, const void* w, int64_t T) {
    const LtDescriptors& p = problem(T);
    const float alpha = 1.f, beta = 0.f;
    return cublasLtMatmul(lt_, p.desc, &alpha, w, p.a, in, p.b, &beta, out, p.d, out, p.d, &algo, workspace_.get(),
                          workspace_.bytes(), stream_) == CUBLAS_STATUS_SUCCESS;
  }

  // Microseconds per call of fn(rep) (fn returns false on failure: then -1).
  double time_us(const std::function<bool(int)>& fn) {
    if (!fn(0)) return -1;
    CUDA_CHECK(cudaEventRecord(e0_, stream_));
    if (!fn(1)) return -1;
    CUDA_CHECK(cudaEventRecord(e1_, stream_));
    CUDA_CHECK(cudaEventSynchronize(e1_));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0_, e1_));
    const int reps = std::clamp(int(3.0f / std::max(ms, 1e-3f)), 3, 40);
    CUDA_CHECK(cudaEventRecord(e0_, stream_));
    for (int i = 0; i < reps; ++i)
      if (!fn(i + 2)) return -1;
    CUDA_CHECK(cudaEventRecord(e1_, stream_));
    CUDA_CHECK(cudaEventSynchronize(e1_));
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0_, e1_));
    return double(ms) * 1e3 / reps;
  }

 private:
  cublasLtHandle_t lt_;
  Problem pr_;
  Shape s_;
  cudaStream_t stream_;
  std::map<int64_t, std::unique_ptr<LtDescriptors>> problems_;  // T -> its descriptors
  DeviceBuffer workspace_;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
};

struct Candidate {
  cublasLtMatmulAlgo_t algo;
  Config config;
  std::map<int64_t, double> us;  // -1: cuBLASLt refused T
  bool invariant = true;
  int64_t t_ref = 0;            // the largest T it runs: its rows are compared with this run's
  uint64_t signature = 0;       // hash of a few rows at t_ref (meaningful among equal t_ref)
  std::map<int64_t, uint64_t> ref_rows;  // row -> hash at t_ref
  int cls = -1;
};

int run(int argc, char** argv) {
  std::string dtype = "f16", shape_list = "gpt2-xl,gpt3-6.7b,gpt3-175b-tp8";
  std::string ts_list = "1,2,3,5,8,13,16,17,31,64,100,256,257,1000,1024,4096";
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--verbose") { verbose = true; continue; }
    if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", k.c_str()); return 2; }
    if (k == "--dtype") dtype = argv[++i];
    else if (k == "--shapes") shape_list = argv[++i];
    else if (k == "--ts") ts_list = argv[++i];
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  Problem pr{};
  if (dtype == "f16") pr = {CUDA_R_16F, CUDA_R_16F, 2, 2};
  else if (dtype == "bf16") pr = {CUDA_R_16BF, CUDA_R_16BF, 2, 2};
  else if (dtype == "f16-f32") pr = {CUDA_R_16F, CUDA_R_32F, 2, 4};  // the LM head: fp32 logits
  else if (dtype == "fp8") pr = {CUDA_R_8F_E4M3, CUDA_R_32F, 1, 4};
  else { std::fprintf(stderr, "--dtype is f16, f16-f32, bf16 or fp8\n"); return 2; }
  const std::vector<int64_t> ts = numbers(ts_list);
  const int64_t t_max = ts.back();
  const std::vector<int64_t> heuristic_ts = {1, 16, 64, 256, 1024, 4096};
  const std::vector<int64_t> headline_ts = {1, 16, 64, 256, 1024, 4096};

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int lt_version = int(cublasLtGetVersion());
  std::printf("# %s, cuBLASLt %d, %s, T up to %" PRId64 "\n", prop.name, lt_version, dtype.c_str(), t_max);
  cublasLtHandle_t lt = nullptr;
  CUDA_CHECK(cublasLtCreate(&lt));

  for (const Shape& s : shapes_named(shape_list)) {
    // Inputs: normal(0, 1) activations, normal(0, 1/sqrt(K)) weights; FP8 takes them
    // quantised per row, as run_fp8 does.
    const size_t w_bytes = size_t(s.N * s.K) * pr.ab_bytes;
    const int copies = int(std::clamp<size_t>((size_t(256) << 20) / w_bytes + 1, 1, 8));
    std::vector<DeviceBuffer> w(static_cast<size_t>(copies));
    DeviceBuffer x = device_alloc(size_t(t_max * s.K) * pr.ab_bytes, "bench", "x");
    {
      DeviceBuffer tmp = device_alloc(size_t(std::max(t_max, s.N) * s.K) * 2, "bench", "staging");
      DeviceBuffer scales = device_alloc(size_t(std::max(t_max, s.N)) * 4, "bench", "scales");
      auto make = [&](void* dst, int64_t rows, float sd, uint64_t id) {
        if (pr.ab == CUDA_R_16BF) return fill_normal<__nv_bfloat16>(static_cast<__nv_bfloat16*>(dst), rows * s.K, 0.f, sd, 11, id, stream);
        if (pr.ab == CUDA_R_16F) return fill_normal<__half>(static_cast<__half*>(dst), rows * s.K, 0.f, sd, 11, id, stream);
        fill_normal<__half>(tmp.as<__half>(), rows * s.K, 0.f, sd, 11, id, stream);
        quantize_rows_fp8<__half>(static_cast<uint8_t*>(dst), scales.as<float>(), tmp.as<__half>(), rows, s.K, stream);
      };
      for (int c = 0; c < copies; ++c) {
        w[size_t(c)] = device_alloc(w_bytes, "bench", "w");
        make(w[size_t(c)].get(), s.N, 1.f / std::sqrt(float(s.K)), uint64_t(100 + c));
      }
      make(x.get(), t_max, 1.f, 1);
      CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    DeviceBuffer out = device_alloc(size_t(t_max * s.N) * pr.out_bytes, "bench", "out");
    const size_t row_bytes = size_t(s.N) * pr.out_bytes;
    std::vector<unsigned char> row(row_bytes);
    auto row_hash = [&](int64_t r) {
      CUDA_CHECK(cudaMemcpy(row.data(), out.as<unsigned char>() + size_t(r) * row_bytes, row_bytes,
                            cudaMemcpyDeviceToHost));
      return hash_bytes(row.data(), row_bytes);
    };

    Probe probe(lt, pr, s, stream);
    // Every configuration the heuristic proposes, and each one without its split along K.
    std::map<Config, Candidate> found;
    for (int64_t T : heuristic_ts) {
      if (T > t_max) continue;
      for (cublasLtMatmulAlgo_t a : probe.heuristic(T, 32)) {
        std::vector<cublasLtMatmulAlgo_t> variants{a};
        if (config_of(a).splitk > 1) {
          cublasLtMatmulAlgo_t b = a;
          const int32_t one = 1;
          const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
          CUDA_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one));
          CUDA_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof none));
          variants.push_back(b);
        }
        for (const auto& v : variants) {
          const Config c = config_of(v);
          if (!found.count(c)) { Candidate cand; cand.algo = v; cand.config = c; found[c] = cand; }
        }
      }
    }

    for (auto& [c, cand] : found) {
      // Reference: the largest T it accepts; then each T's rows 0, T/2, T-1 against it.
      for (auto it = ts.rbegin(); it != ts.rend(); ++it)
        if (probe.accepts(cand.algo, *it)) { cand.t_ref = *it; break; }
      if (cand.t_ref == 0) { cand.invariant = false; continue; }
      if (!probe.run(cand.algo, out.get(), x.get(), w[0].get(), cand.t_ref)) { cand.invariant = false; continue; }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      std::map<int64_t, uint64_t>& ref_rows = cand.ref_rows;
      for (int64_t T : ts)
        if (T <= cand.t_ref)
          for (int64_t r : {int64_t(0), T / 2, T - 1}) ref_rows.emplace(r, 0);
      for (auto& [r, h] : ref_rows) h = row_hash(r);
      cand.signature = 0;
      for (auto& [r, h] : ref_rows) cand.signature = hash_bytes(&h, sizeof h, cand.signature ^ uint64_t(r));
      for (int64_t T : ts) {
        if (!probe.accepts(cand.algo, T)) { cand.us[T] = -1; continue; }
        if (T < cand.t_ref) {
          CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, size_t(T) * row_bytes, stream));
          if (!probe.run(cand.algo, out.get(), x.get(), w[0].get(), T)) { cand.us[T] = -1; continue; }
          CUDA_CHECK(cudaStreamSynchronize(stream));
          for (int64_t r : {int64_t(0), T / 2, T - 1})
            if (row_hash(r) != ref_rows.at(r)) cand.invariant = false;
        }
        cand.us[T] = probe.time_us([&](int rep) {
          return probe.run(cand.algo, out.get(), x.get(), w[size_t(rep % copies)].get(), T);
        });
      }
    }

    // Classes: row-invariant configurations with one reference T and equal signatures.
    std::map<std::pair<int64_t, uint64_t>, int> classes;
    std::vector<std::vector<const Candidate*>> members;
    for (auto& [c, cand] : found) {
      if (!cand.invariant) continue;
      auto [it, added] = classes.emplace(std::make_pair(cand.t_ref, cand.signature), int(members.size()));
      if (added) members.emplace_back();
      cand.cls = it->second;
      members[size_t(cand.cls)].push_back(&cand);
    }

    // Gemm's plans today, on the same buffers (fp16/bf16 only): deterministic and fast.
    std::map<int64_t, double> det_us, fixed_us, fast_us;
    if (pr.ab != CUDA_R_8F_E4M3) {
      for (int mode : {0, 1, 2}) {  // deterministic (sequential order), deterministic (fixed-order tiles), fast
        Gemm g(process_options().kernels.gemm);  // the environment's tuning, GEMV splits; modes below
        g.set_deterministic(mode < 2);
        g.set_sequential_order(mode == 0);
        for (int64_t T : ts) {
          auto call = [&](int rep) {
            with_types(pr, [&](auto in_tag, auto out_tag) {
              using T_ = decltype(in_tag);
              using O = decltype(out_tag);
              g.run<T_, O>(out.as<O>(), x.as<T_>(), static_cast<const T_*>(w[size_t(rep % copies)].get()), nullptr, T,
                           s.K, s.N, WeightLayout::NK, GemmAct::None, stream);
            });
            return true;
          };
          (mode == 0 ? det_us : mode == 1 ? fixed_us : fast_us)[T] = probe.time_us(call);
        }
      }
    }

    // The sequential-order GEMV (fp16/bf16, T <= 8): its times, and the class whose bits it has.
    std::map<int64_t, double> seq_us;
    std::string seq_match;
    if (pr.ab != CUDA_R_8F_E4M3) {
      for (int64_t T : ts) {
        if (T > detail::kGemvMaxTokens) continue;
        auto call = [&](int rep) {
          with_types(pr, [&](auto in_tag, auto out_tag) {
            using T_ = decltype(in_tag);
            using O = decltype(out_tag);
            detail::gemv_seq<T_, O>(out.as<O>(), x.as<T_>(), static_cast<const T_*>(w[size_t(rep % copies)].get()),
                                    nullptr, T, s.K, s.N, GemmAct::None, stream);
          });
          return true;
        };
        call(0);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<int> matches;
        std::map<int64_t, uint64_t> mine;
        for (int64_t r : {int64_t(0), T / 2, T - 1}) mine[r] = row_hash(r);
        for (size_t k = 0; k < members.size(); ++k) {
          bool same = true;
          for (auto [r, h] : mine) {
            auto it = members[k].front()->ref_rows.find(r);
            same = same && it != members[k].front()->ref_rows.end() && it->second == h;
          }
          if (same) matches.push_back(int(k));
        }
        seq_match += " T=" + std::to_string(T) + ":";
        if (matches.empty()) seq_match += "none";
        for (int k : matches) seq_match += " class " + std::to_string(k);
        seq_us[T] = probe.time_us(call);
      }
    }

    std::printf("\n## %s: K=%" PRId64 " N=%" PRId64 ", %zu configurations, %zu row-invariant classes\n",
                s.name.c_str(), s.K, s.N, found.size(), members.size());
    std::printf("%-44s", "us per call at T =");
    for (int64_t T : ts) std::printf(" %7" PRId64, T);
    std::printf("\n");
    auto print_row = [&](const std::string& label, const std::map<int64_t, double>& us) {
      std::printf("%-44s", label.c_str());
      for (int64_t T : ts) {
        auto it = us.find(T);
        if (it == us.end() || it->second < 0) std::printf(" %7s", "-");
        else std::printf(" %7.1f", it->second);
      }
      std::printf("\n");
    };
    std::map<int64_t, double> fastest;
    for (auto& [c, cand] : found)
      for (auto [T, us] : cand.us)
        if (us >= 0 && (!fastest.count(T) || us < fastest[T])) fastest[T] = us;
    print_row("fastest configuration (any order)", fastest);
    if (!fast_us.empty()) print_row("Gemm fast plan", fast_us);
    if (!det_us.empty()) print_row("Gemm deterministic (sequential order)", det_us);
    if (!fixed_us.empty()) print_row("Gemm deterministic (fixed-order tiles)", fixed_us);
    if (!seq_us.empty()) print_row("sequential-order GEMV", seq_us);
    int best_cls = -1;
    double best_worst = 0;
    for (size_t k = 0; k < members.size(); ++k) {
      std::map<int64_t, double> best;
      for (const Candidate* m : members[k])
        for (auto [T, us] : m->us)
          if (us >= 0 && (!best.count(T) || us < best[T])) best[T] = us;
      double worst = 1e9;
      for (int64_t T : headline_ts)
        if (fastest.count(T)) worst = std::min(worst, best.count(T) ? fastest[T] / best[T] : 0.0);
      const Candidate* first = members[k].front();
      char label[160];
      std::snprintf(label, sizeof label, "class %zu (%zu: sk%d red%u ...) worst %.2f", k, members[k].size(),
                    first->config.splitk, first->config.reduction, worst);
      print_row(label, best);
      if (worst > best_worst) best_worst = worst, best_cls = int(k);
      if (verbose)
        for (const Candidate* m : members[k]) print_row("    " + m->config.name(), m->us);
    }
    size_t variant = 0;
    for (auto& [c, cand] : found) variant += cand.invariant ? 0 : 1;
    std::printf("not row-invariant: %zu configurations", variant);
    if (verbose) {
      std::printf("\n");
      for (auto& [c, cand] : found)
        if (!cand.invariant) print_row("    " + c.name(), cand.us);
    } else {
      std::printf(" (--verbose lists them)\n");
    }
    if (!seq_match.empty()) std::printf("sequential-order GEMV has the bits of:%s\n", seq_match.c_str());
    std::printf("best class for %s: %d, worst ratio to the fastest over T in {1,16,64,256,1024,4096}: %.2f\n",
                s.name.c_str(), best_cls, best_worst);
    std::fflush(stdout);
  }
  cublasLtDestroy(lt);
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The environment's options (common/options.h), as a worker applies them: CONVEYOR_PDL,
  // CONVEYOR_GEMV_KSPLIT, ... for measurements.
  conveyor::cuda::set_pdl(conveyor::process_options().kernels.pdl);
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

#else
int main() {
  std::fprintf(stderr, "conveyor-bench-gemm-order: built without the CUDA backend\n");
  return 1;
}
#endif

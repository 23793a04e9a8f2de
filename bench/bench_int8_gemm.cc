// Int8 weight-only matrix products (Gemm::run_int8, kernels/cuda/quant.h) against the fp16
// product the GPU stage runs today (Gemm::run on [N, K] weights: cuBLASLt or the fp16 GEMV,
// whichever its timing picked), in the same run, for GPT weight shapes (K, N) and token
// counts T. Both products add a bias, no activation. Every call is timed on its own with CUDA
// events after a 256 MiB write that evicts L2, so the weights come from HBM as in a decode
// step; the median of --reps timed calls follows a warm-up call that also plans the shape.
//
// Printed per (K, N, T): both times in µs, fp16 / int8 (above 1: int8 is faster), the int8
// weight bandwidth (N K bytes + 4 N of scales over the int8 time) and that as a share of the
// device-to-device copy bandwidth measured in the same run (bench/gpu_bandwidth.h, reads +
// writes: the practical HBM limit). --kernels adds one line per int8 kernel Gemm considered
// for the shape, each timed the same way. --fp8 adds FP8 weights and activations
// (Gemm::run_fp8, kernels/cuda/fp8.h; Hopper): its time (the activations' quantisation
// included), fp16 / fp8, and its TFLOPS (2 T K N over its time; dense FP8 peak: H100 SXM ~1979).
// --fast turns deterministic mode off (gemm.h), so fp16 runs cuBLASLt, not the fixed-order
// tiles, and FP8 times cuBLASLt's proposals per T. --both adds the int8 product of a second
// Gemm in fast mode, and det / fast (issue 30's side by side: above 1, deterministic is
// slower). The plans Gemm made are listed at the end.
//
//   conveyor-bench-int8-gemm [--reps 50] [--tokens 1,8,32,128,2048] [--bf16] [--kernels] [--fp8] [--fast] [--both]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "bench/count_list.h"
#include "bench/gpu_bandwidth.h"
#include "common/options.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/synthetic.h"

namespace {

using namespace conveyor;
using namespace conveyor::cuda;

struct Shape {
  int64_t K, N;
};
const Shape kShapes[] = {{4096, 12288}, {4096, 4096},   {4096, 16384},  {16384, 4096},
                         {12288, 36864}, {12288, 12288}, {12288, 49152}, {49152, 12288}};

struct Timer {
  cudaStream_t stream = nullptr;
  DeviceBuffer flush;  // written before each timed call: evicts L2
  cudaEvent_t start = nullptr, stop = nullptr;
  int reps = 50;

  Timer() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    flush = device_alloc(size_t(256) << 20, "bench", "L2 flush buffer");
  }
  ~Timer() {
    cudaEventDestroy(stop);
    cudaEventDestroy(start);
    cudaStreamDestroy(stream);
  }
  // Median µs of fn() over `reps` calls, each after an L2 flush; one untimed call first.
  double median_us(const std::function<void()>& fn) {
    fn();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<double> us;
    for (int r = 0; r < reps; ++r) {
      CUDA_CHECK(cudaMemsetAsync(flush.get(), r & 0xff, flush.bytes(), stream));
      CUDA_CHECK(cudaEventRecord(start, stream));
      fn();
      CUDA_CHECK(cudaEventRecord(stop, stream));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      us.push_back(double(ms) * 1e3);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }
};

template <class T>
int bench(Timer& timer, const std::vector<int64_t>& tokens, bool per_kernel, bool fp8, bool fast, bool both) {
  const char* type = std::is_same_v<T, __half> ? "fp16" : "bf16";
  const double copy_bw = measure_copy_bandwidth();
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("# %s, %s activations and weights vs int8 weights; device copy bandwidth %.0f GB/s; median of %d\n",
              prop.name, type, copy_bw * 1e-9, timer.reps);
  std::printf("%7s %7s %6s %8s us %11s %5s/int8 %11s %7s", "K", "N", "T", type, "int8 us", type, "int8 GB/s",
              "%copy");
  if (fp8) std::printf(" %11s %5s/fp8 %11s", "fp8 us", type, "fp8 TFLOPS");
  if (both) std::printf(" %13s %9s", "int8 fast us", "det/fast");
  std::printf("\n");
  Gemm gemm(process_options().kernels.gemm);  // the environment's tuning and GEMV splits
  gemm.set_deterministic(!fast);
  Gemm fast_gemm(process_options().kernels.gemm);
  fast_gemm.set_deterministic(false);
  if (fp8)
    if (Status st = gemm.fp8_supported(); !st) throw Error(st.message());
  const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const cudaStream_t s = timer.stream;
  for (const Shape& sh : kShapes) {
    const int64_t K = sh.K, N = sh.N;
    DeviceBuffer w = device_alloc(size_t(N * K) * sizeof(T), "bench", "fp16/bf16 weights");
    DeviceBuffer q = device_alloc(size_t(N * K), "bench", "int8 weights");
    DeviceBuffer scales = device_alloc(size_t(N) * 4, "bench", "scales");
    DeviceBuffer bias = device_alloc(size_t(N) * sizeof(T), "bench", "bias");
    DeviceBuffer in = device_alloc(size_t(max_t * K) * sizeof(T), "bench", "activations");
    DeviceBuffer out = device_alloc(size_t(max_t * N) * sizeof(T), "bench", "output");
    // As the GPU stage does: run_int8 may dequantise into this and run the fp16 GEMM (prefill).
    DeviceBuffer dequant = device_alloc(size_t(N * K) * sizeof(T), "bench", "dequantisation workspace");
    gemm.set_dequant_workspace(dequant.get(), dequant.bytes());
    fast_gemm.set_dequant_workspace(dequant.get(), dequant.bytes());
    fill_normal<T>(w.as<T>(), N * K, 0.f, 0.02f, 7, uint64_t(K * 100003 + N), s);
    fill_normal<T>(bias.as<T>(), N, 0.f, 0.1f, 7, 1, s);
    fill_normal<T>(in.as<T>(), max_t * K, 0.f, 1.f, 7, 2, s);
    quantize_rows_int8<T>(q.as<int8_t>(), scales.as<float>(), w.as<T>(), N, K, s);
    DeviceBuffer w8, scales8;
    if (fp8) {
      w8 = device_alloc(size_t(N * K), "bench", "FP8 weights");
      scales8 = device_alloc(size_t(N) * 4, "bench", "FP8 scales");
      quantize_rows_fp8<T>(w8.as<uint8_t>(), scales8.as<float>(), w.as<T>(), N, K, s);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    const double int8_bytes = double(N) * double(K) + 4.0 * double(N);
    for (int64_t t : tokens) {
      const double wide_us = timer.median_us([&] {
        gemm.run<T, T>(out.as<T>(), in.as<T>(), w.as<T>(), bias.as<T>(), t, K, N, WeightLayout::NK, GemmAct::None, s);
      });
      const double int8_us = timer.median_us([&] {
        gemm.run_int8<T, T>(out.as<T>(), in.as<T>(), q.as<int8_t>(), scales.as<float>(), bias.as<T>(), t, K, N,
                            GemmAct::None, s);
      });
      const double gbps = int8_bytes / (int8_us * 1e-6) * 1e-9;
      std::printf("%7lld %7lld %6lld %11.2f %11.2f %10.2f %11.0f %6.0f%%", (long long)K, (long long)N,
                  (long long)t, wide_us, int8_us, wide_us / int8_us, gbps, 100.0 * gbps * 1e9 / copy_bw);
      if (fp8) {
        const double fp8_us = timer.median_us([&] {
          gemm.run_fp8<T>(out.as<T>(), in.as<T>(), w8.as<uint8_t>(), scales8.as<float>(), bias.as<T>(), t, K, N,
                          GemmAct::None, s);
        });
        std::printf(" %11.2f %9.2f %11.1f", fp8_us, wide_us / fp8_us, 2.0 * double(t) * K * N / (fp8_us * 1e-6) * 1e-12);
      }
      if (both) {
        const double fast_us = timer.median_us([&] {
          fast_gemm.run_int8<T, T>(out.as<T>(), in.as<T>(), q.as<int8_t>(), scales.as<float>(), bias.as<T>(), t, K,
                                   N, GemmAct::None, s);
        });
        std::printf(" %13.2f %9.2f", fast_us, int8_us / fast_us);
      }
      std::printf("\n");
      std::fflush(stdout);
      if (per_kernel) {
        for (detail::Int8Kernel k : detail::int8_candidates(t, K, N, in.get(), q.get())) {
          const double us = timer.median_us([&] {
            detail::int8_matmul<T, T>(k, out.as<T>(), in.as<T>(), q.as<int8_t>(), scales.as<float>(), bias.as<T>(),
                                      t, K, N, GemmAct::None, s);
          });
          std::printf("%30s %-11s %9.2f us %8.0f GB/s\n", "", detail::int8_kernel_name(k), us,
                      int8_bytes / (us * 1e-6) * 1e-9);
        }
      }
    }
  }
  std::printf("\n%s", gemm.describe_plans().c_str());
  if (both) std::printf("\nfast mode:\n%s", fast_gemm.describe_plans().c_str());
  return 0;
}

int run(int argc, char** argv) {
  std::vector<int64_t> tokens = {1, 8, 32, 128, 2048};
  bool bf16 = false, per_kernel = false, fp8 = false, fast = false, both = false;
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--tokens" && i + 1 < argc) tokens = parse_count_list(argv[++i]);
    else if (a == "--bf16") bf16 = true;
    else if (a == "--kernels") per_kernel = true;
    else if (a == "--fp8") fp8 = true;
    else if (a == "--fast") fast = true;
    else if (a == "--both") both = true;
    else {
      std::fprintf(stderr, "unknown option %s (see the top of bench/bench_int8_gemm.cc)\n", a.c_str());
      return 2;
    }
  }
  if (reps < 1 || tokens.empty()) {
    std::fprintf(stderr, "--reps >= 1 and --tokens a comma-separated list of positive counts\n");
    return 2;
  }
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess || have == 0) {
    std::printf("conveyor-bench-int8-gemm: no CUDA device on this host, nothing measured\n");
    return 0;
  }
  Timer timer;
  timer.reps = reps;
  return bf16 ? bench<__nv_bfloat16>(timer, tokens, per_kernel, fp8, fast, both)
              : bench<__half>(timer, tokens, per_kernel, fp8, fast, both);
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
  std::printf("conveyor-bench-int8-gemm: built without the CUDA backend, nothing measured\n");
  return 0;
}
#endif

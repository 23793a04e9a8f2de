// All-reduce of fp16 sums over the GPUs of this machine: the custom kernel (push, one-shot and
// two-shot, kernels/cuda/custom_all_reduce.h) against NCCL, in the same run, for message
// sizes from --min to --max bytes (doubling). Each method's calls are captured in one CUDA
// graph per GPU (--iters calls) so host launch costs do not count; a graph is replayed
// --repeats times and the median per-call time is reported, with the bus bandwidth as
// nccl-tests defines it (bytes / time x 2 (R - 1) / R). The last two columns are the same
// calls launched one by one from the host (no graph), as an eager caller sees them.
//
//   conveyor-bench-all-reduce [--gpus N] [--min 2048] [--max 67108864] [--iters 50] [--repeats 7]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if defined(CONVEYOR_HAVE_CUDA) && defined(CONVEYOR_HAVE_NCCL)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/custom_all_reduce.h"

using namespace conveyor;
using namespace conveyor::cuda;

namespace {

#define NCCL_CHECK(call)                                                                                  \
  do {                                                                                                    \
    const ncclResult_t r_ = (call);                                                                       \
    if (r_ != ncclSuccess) {                                                                              \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, ncclGetErrorString(r_), __FILE__, __LINE__); \
      std::exit(1);                                                                                       \
    }                                                                                                     \
  } while (0)

struct Gpu {
  int device = 0;
  cudaStream_t stream = nullptr;
  DeviceBuffer data;
  ncclComm_t comm = nullptr;
};

void sync_all(std::vector<Gpu>& gpus) {
  for (Gpu& g : gpus) {
    DeviceGuard on(g.device);
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
  }
}

// Captures `iters` calls of `call(rank)` per GPU, one graph each (all captures open at
// once, so NCCL's grouped calls across GPUs can be recorded), replays them `repeats` times
// and returns the median microseconds per call (timed on GPU 0, after a warm-up replay).
double time_graphs(std::vector<Gpu>& gpus, int iters, int repeats, const std::function<void()>& one_call_all_ranks) {
  std::vector<cudaGraphExec_t> execs(gpus.size());
  for (Gpu& g : gpus) {
    DeviceGuard on(g.device);
    CUDA_CHECK(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeRelaxed));
  }
  for (int i = 0; i < iters; ++i) one_call_all_ranks();
  for (size_t r = 0; r < gpus.size(); ++r) {
    DeviceGuard on(gpus[r].device);
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamEndCapture(gpus[r].stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&execs[r], graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
  auto launch_all = [&] {
    for (size_t r = 0; r < gpus.size(); ++r) {
      DeviceGuard on(gpus[r].device);
      CUDA_CHECK(cudaGraphLaunch(execs[r], gpus[r].stream));
    }
  };
  launch_all();
  sync_all(gpus);
  std::vector<double> us;
  DeviceGuard on0(gpus[0].device);
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int k = 0; k < repeats; ++k) {
    {
      DeviceGuard on(gpus[0].device);
      CUDA_CHECK(cudaEventRecord(start, gpus[0].stream));
    }
    launch_all();
    {
      DeviceGuard on(gpus[0].device);
      CUDA_CHECK(cudaEventRecord(stop, gpus[0].stream));
    }
    sync_all(gpus);
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(double(ms) * 1000.0 / iters);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  for (size_t r = 0; r < gpus.size(); ++r) {
    DeviceGuard on(gpus[r].device);
    CUDA_CHECK(cudaGraphExecDestroy(execs[r]));
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// `iters` calls launched eagerly from this thread, `repeats` times; the median per call.
double time_eager(std::vector<Gpu>& gpus, int iters, int repeats, const std::function<void()>& one_call_all_ranks) {
  for (int i = 0; i < 5; ++i) one_call_all_ranks();
  sync_all(gpus);
  std::vector<double> us;
  for (int k = 0; k < repeats; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) one_call_all_ranks();
    sync_all(gpus);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int n_gpus = 0, iters = 50, repeats = 7;
  size_t min_bytes = 2048, max_bytes = size_t(64) << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--gpus") n_gpus = std::atoi(argv[i + 1]);
    else if (a == "--min") min_bytes = size_t(std::atoll(argv[i + 1]));
    else if (a == "--max") max_bytes = size_t(std::atoll(argv[i + 1]));
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s (see the top of bench/bench_all_reduce.cc)\n", a.c_str());
      return 2;
    }
  }
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess) have = 0;
  if (n_gpus == 0) n_gpus = have;
  if (n_gpus < 2 || n_gpus > have) {
    std::fprintf(stderr, "needs 2 or more GPUs (asked %d, have %d)\n", n_gpus, have);
    return 1;
  }
  if (iters < 1 || repeats < 1 || min_bytes < 2 || max_bytes < min_bytes) {
    std::fprintf(stderr, "--iters, --repeats >= 1 and 2 <= --min <= --max\n");
    return 2;
  }
  std::vector<int> devices;
  for (int d = 0; d < n_gpus; ++d) devices.push_back(d);
  // The push call up to 4 MiB, past its default crossover (measured_push_max), to show where it is.
  const size_t push_max = std::min(max_bytes, size_t(4) << 20);
  auto ar = CustomAllReduce::create(devices, max_bytes, push_max);
  if (!ar) {
    std::fprintf(stderr, "%s\n", ar.error().c_str());
    return 1;
  }
  std::vector<Gpu> gpus(static_cast<size_t>(n_gpus));
  std::vector<ncclComm_t> comms(static_cast<size_t>(n_gpus));
  NCCL_CHECK(ncclCommInitAll(comms.data(), n_gpus, devices.data()));
  for (int r = 0; r < n_gpus; ++r) {
    Gpu& g = gpus[size_t(r)];
    g.device = r;
    g.comm = comms[size_t(r)];
    DeviceGuard on(r);
    CUDA_CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    g.data = device_alloc(max_bytes, "bench", "message");
    CUDA_CHECK(cudaMemset(g.data.get(), 0, max_bytes));  // zeros: sums stay finite however often they run
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int nccl_version = 0;
  NCCL_CHECK(ncclGetVersion(&nccl_version));
  std::printf("# %d x %s, NCCL %d, fp16 sum, %d calls per graph, median of %d replays; busbw = bytes/t x 2(R-1)/R\n",
              n_gpus, prop.name, nccl_version, iters, repeats);
  std::printf("%10s %12s %12s %12s %12s %10s %10s %12s %12s %12s %12s\n", "bytes", "push us", "one-shot us",
              "two-shot us", "nccl us",
              "auto/nccl", "best/nccl", "auto GB/s", "nccl GB/s", "eager auto", "eager nccl");
  const double bus = 2.0 * (n_gpus - 1) / n_gpus;
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const size_t count = bytes / 2;
    auto custom = [&](CustomAllReduce::Algo algo) {
      return time_graphs(gpus, iters, repeats, [&] {
        for (int r = 0; r < n_gpus; ++r) {
          Status s = (*ar)->all_reduce(r, gpus[size_t(r)].data.as<__half>(), count, gpus[size_t(r)].stream, algo);
          if (!s) {
            std::fprintf(stderr, "%s\n", s.message().c_str());
            std::exit(1);
          }
        }
      });
    };
    const bool pushes = bytes <= push_max;
    const double push = pushes ? custom(CustomAllReduce::Algo::Push) : std::nan("");
    const double one = custom(CustomAllReduce::Algo::OneShot), two = custom(CustomAllReduce::Algo::TwoShot);
    auto nccl_call = [&] {
      NCCL_CHECK(ncclGroupStart());
      for (int r = 0; r < n_gpus; ++r) {
        Gpu& g = gpus[size_t(r)];
        DeviceGuard on(g.device);
        NCCL_CHECK(ncclAllReduce(g.data.get(), g.data.get(), count, ncclFloat16, ncclSum, g.comm, g.stream));
      }
      NCCL_CHECK(ncclGroupEnd());
    };
    const double nccl = time_graphs(gpus, iters, repeats, nccl_call);
    using Algo = CustomAllReduce::Algo;
    const Algo chosen = CustomAllReduce::auto_algo(n_gpus, bytes, CustomAllReduce::measured_push_max(n_gpus));
    const double automatic = chosen == Algo::Push ? push : chosen == Algo::OneShot ? one : two;
    const double best = std::min(pushes ? push : one, std::min(one, two));
    const double eager_custom = time_eager(gpus, iters, repeats, [&] {
      for (int r = 0; r < n_gpus; ++r)
        if (!(*ar)->all_reduce(r, gpus[size_t(r)].data.as<__half>(), count, gpus[size_t(r)].stream)) std::exit(1);
    });
    const double eager_nccl = time_eager(gpus, iters, repeats, nccl_call);
    std::printf("%10zu %12.2f %12.2f %12.2f %12.2f %10.2f %10.2f %12.1f %12.1f %12.2f %12.2f\n", bytes, push, one, two,
                nccl, automatic / nccl, best / nccl, double(bytes) / automatic * 1e-3 * bus,
                double(bytes) / nccl * 1e-3 * bus, eager_custom, eager_nccl);
    std::fflush(stdout);
  }
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  for (Gpu& g : gpus) {
    DeviceGuard on(g.device);
    cudaStreamDestroy(g.stream);
    g.data.reset();
  }
  return 0;
}

#else
int main() {
  std::fprintf(stderr, "conveyor-bench-all-reduce: built without CUDA and NCCL\n");
  return 1;
}
#endif

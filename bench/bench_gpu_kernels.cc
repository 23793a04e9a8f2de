// Where a decode step's time goes, kernel by kernel: each kernel of one layer's decode step
// (batch --batch, fp16) is launched once per layer of --shape on that layer's own buffers
// (so weights come from HBM, not L2, as in the real step), the n_layer launches are
// captured in one CUDA graph, and the graph is replayed; µs per launch is the median
// replay over n_layer. Printed beside each: the bytes it must move and that over the
// device-to-device copy bandwidth measured in the same run (its floor). A kernel writing one
// element gives the cost of one dependent launch inside a graph.
//
//   conveyor-bench-gpu-kernels [--shape gpt2-xl|gpt3-6.7b|L,C,H] [--batch 1] [--context 192]
//
// Compare "sum per layer x n_layer" with conveyor-bench-gpu-decode's ms/token.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>

#include "common/model_config.h"
#include "common/options.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/paged_kv.h"
#include "stage/cuda/kv_cache.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/synthetic.h"
#include "bench/gpu_bandwidth.h"
#include "bench/graph_timer.h"

namespace {

using namespace conveyor;
using namespace conveyor::cuda;

int run(int argc, char** argv) {
  std::string shape = "gpt2-xl";
  int64_t batch = 1, context = 192;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", k.c_str()); return 2; }
    if (k == "--shape") shape = argv[++i];
    else if (k == "--batch") batch = std::atol(argv[++i]);
    else if (k == "--context") context = std::atol(argv[++i]);
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  auto named = named_model_shape(shape);
  if (!named) { std::fprintf(stderr, "%s\n", named.error().c_str()); return 2; }
  const ModelConfig c = *named;
  const int n = int(c.n_layer);
  const int64_t C = c.n_embd, I = c.n_inner > 0 ? c.n_inner : 4 * C, H = c.n_head, D = c.head_dim();
  using T = half;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  const double bw = measure_copy_bandwidth();
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %s batch %ld fp16, context %ld; copy bandwidth %.0f GB/s (read + write); %d launches per graph\n",
              prop.name, shape.c_str(), batch, context, bw * 1e-9, n);

  auto alloc = [&](int64_t elems, const char* what) {
    DeviceBuffer b = device_alloc(size_t(elems) * sizeof(T), "bench", what);
    fill_normal<T>(b.as<T>(), elems, 0.f, 0.02f, 7, uint64_t(elems), stream);
    return b;
  };
  struct Layer { DeviceBuffer qkv_w, qkv_b, proj_w, proj_b, fc_w, fc_b, fc2_w, fc2_b, g, b; };
  std::vector<Layer> L(static_cast<size_t>(n));
  for (Layer& l : L) {
    l.qkv_w = alloc(3 * C * C, "qkv"), l.qkv_b = alloc(3 * C, "qkv bias"), l.proj_w = alloc(C * C, "proj");
    l.proj_b = alloc(C, "proj bias"), l.fc_w = alloc(I * C, "fc"), l.fc_b = alloc(I, "fc bias");
    l.fc2_w = alloc(C * I, "fc2"), l.fc2_b = alloc(C, "fc2 bias"), l.g = alloc(C, "ln gain"), l.b = alloc(C, "ln bias");
  }
  DeviceBuffer x = alloc(batch * std::max(3 * C, I), "x"), y = alloc(batch * std::max(3 * C, I), "y"),
               hid = alloc(batch * C, "hidden"), ln = alloc(batch * C, "ln");

  // A paged K/V cache holding `context` positions of `batch` sequences in every layer.
  const int64_t pages_per_seq = (context + kPageTokens - 1) / kPageTokens;
  auto made = KvCache::create("bench", n, H, D, DType::F16, batch * pages_per_seq);
  if (!made) {
    std::fprintf(stderr, "%s\n", made.error().c_str());
    return 1;
  }
  KvCache& kv = **made;
  std::vector<int32_t> tables(static_cast<size_t>(batch * pages_per_seq)), lens(static_cast<size_t>(batch), int32_t(context));
  for (int64_t s = 0; s < batch; ++s) {
    if (!kv.reserve(uint64_t(s), context)) return 1;
    const auto& p = kv.pages(uint64_t(s));
    std::copy(p.begin(), p.end(), tables.begin() + s * pages_per_seq);
  }
  DeviceBuffer tables_d = device_alloc(tables.size() * 4, "bench", "block tables"),
               lens_d = device_alloc(lens.size() * 4, "bench", "kv lens");
  CUDA_CHECK(cudaMemcpy(tables_d.get(), tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(lens_d.get(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const int splits = decode_splits_for(batch, H, context, prop.multiProcessorCount);
  DeviceBuffer partial = device_alloc(size_t(decode_partial_floats(batch, H, D, context)) * 4, "bench", "partial");
  DeviceBuffer counters = device_alloc(size_t(batch * H) * 4, "bench", "counters");
  CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  DecodeWorkspace ws{partial.as<float>(), counters.as<int32_t>(), int64_t(partial.bytes() / 4), batch * H, context};

  Gemm gemm(process_options().kernels.gemm);  // the environment's, as a worker's
  GraphTimer t{stream};
  const double eb = sizeof(T);
  struct Row { const char* what; double us, bytes; };
  std::vector<Row> rows;
  auto gemv = [&](const char* what, int64_t K, int64_t N, DeviceBuffer Layer::*w, DeviceBuffer Layer::*b, GemmAct act) {
    const double us = t.time(n, [&](int l) {
      gemm.run<T, T>(y.as<T>(), x.as<T>(), (L[size_t(l)].*w).as<T>(), (L[size_t(l)].*b).as<T>(), batch, K, N,
                     WeightLayout::NK, act, stream);
    });
    rows.push_back({what, us, eb * double(K * N + N + batch * (K + N))});
  };
  gemv("QKV (C -> 3C, bias)", C, 3 * C, &Layer::qkv_w, &Layer::qkv_b, GemmAct::None);
  rows.push_back({"attention decode (paged K/V)",
                  t.time(n, [&](int l) {
                    attention_decode_paged<T>(y.as<T>(), x.as<T>(), kv.layer(l, tables_d.as<int32_t>(), int32_t(pages_per_seq)),
                                              lens_d.as<int32_t>(), batch, H, D, splits, ws, stream);
                  }),
                  eb * double(2 * batch * context * C + 4 * batch * C)});
  gemv("projection (C -> C)", C, C, &Layer::proj_w, &Layer::proj_b, GemmAct::None);
  rows.push_back({"add bias + residual + LayerNorm",
                  t.time(n, [&](int l) {
                    add_bias_residual_layernorm<T>(hid.as<T>(), ln.as<T>(), x.as<T>(), L[size_t(l)].proj_b.as<T>(),
                                                   L[size_t(l)].g.as<T>(), L[size_t(l)].b.as<T>(), batch, C, 1e-5f, stream);
                  }),
                  eb * double(5 * batch * C + 3 * C)});
  gemv("FC (C -> I, bias + GeLU)", C, I, &Layer::fc_w, &Layer::fc_b, GemmAct::GeluTanh);
  gemv("FC2 (I -> C)", I, C, &Layer::fc2_w, &Layer::fc2_b, GemmAct::None);
  rows.push_back({"add bias + residual + next LayerNorm", rows[3].us, rows[3].bytes});
  const double empty = t.time(n, [&](int) { fill_constant<T>(ln.as<T>(), 1, 0.f, stream); });

  std::printf("%-38s %9s %10s %9s %7s\n", "kernel", "us", "MB moved", "floor us", "floor%");
  double sum = 0, floor_sum = 0;
  for (const Row& r : rows) {
    const double floor_us = r.bytes / bw * 1e6;  // as bench-gpu-decode: bytes over the copy rate
    std::printf("%-38s %9.2f %10.2f %9.2f %6.0f%%\n", r.what, r.us, r.bytes * 1e-6, floor_us, 100 * floor_us / r.us);
    sum += r.us, floor_sum += floor_us;
  }
  std::printf("%-38s %9.2f %10s %9.2f %6.0f%%\n", "sum per layer", sum, "", floor_sum, 100 * floor_sum / sum);
  std::printf("%-38s %9.2f\n", "one-element kernel (a dependent launch)", empty);
  std::printf("x %d layers: %.3f ms of kernels per decode step (floor %.3f ms); launches alone %.3f ms\n", n,
              sum * n * 1e-3, floor_sum * n * 1e-3, empty * 7 * n * 1e-3);
  std::printf("\n%s", gemm.describe_plans().c_str());
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
  std::fprintf(stderr, "conveyor-bench-gpu-kernels: built without the CUDA backend\n");
  return 1;
}
#endif

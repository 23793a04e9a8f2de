// Attention over the paged K/V cache, order by order: the tile order (tensor cores, taken
// for head sizes it covers, both modes' decode and prefill), the CUDA-core order it
// replaced, the flash kernel (fast mode's prefill before, not in decode's order), and the
// tile order over an FP8 (E4M3) K/V cache. fp16, the head shape of --shape; each launch reads its own layer's K/V (enough
// layers that the set is far above L2), captured in a CUDA graph and replayed (median).
//
//   conveyor-bench-attention [--shape gpt3-6.7b|gpt2-xl|L,C,H] [--only decode|prefill|overlap]
//                            [--batches 1,8,...] [--contexts 128,256,...]   (decode's rows)
//
// Decode: batch x context, every row at that context; the floor is the K/V bytes over the
// device-to-device copy rate measured in the same run (as conveyor-bench-gpu-kernels).
// Prefill: sequences x prompt, causal; TFLOPS counts 4 x head_dim flops per (query row,
// position it sees, head).
// Overlap (Hopper, not in the default run): whether the decode attention's memory stream and
// an FP8 product's tensor cores run side by side. For each decode row: the FP8 decode
// attention alone, FC1 in FP8 (batch rows, C -> 4C, Gemm::run_fp8 with its quantiser and
// epilogue) alone, and both in one graph on two streams (forked and joined by events); then
// FC1 through cuBLASLt planned for all, half and a quarter of the SMs (its SM-count target),
// alone and launched first on a high-priority stream beside the attention: SMs shared out
// between the two. us a pair; "saved" is what the best pair gains over running them one after
// the other.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>

#include "bench/count_list.h"
#include "bench/gpu_bandwidth.h"
#include "bench/graph_timer.h"
#include "common/model_config.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lt_descriptors.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/synthetic.h"
#include "stage/cuda/kv_cache.h"

namespace {

using namespace conveyor;
using namespace conveyor::cuda;
using T = half;

// `seqs` sequences of `len` positions in each of `layers` layers of a fresh cache (random
// K/V), with their block tables and lengths on the device.
struct Setup {
  std::unique_ptr<KvCache> kv;
  DeviceBuffer tables, lens;
  int32_t max_pages = 0;
  int layers = 0;
  Setup(int64_t seqs, int64_t len, int64_t H, int64_t D, int64_t budget_bytes, cudaStream_t stream, bool fp8 = false) {
    const int64_t per_layer = seqs * len * H * D * 2 * (fp8 ? 1 : int64_t(sizeof(T)));
    layers = int(std::clamp<int64_t>((int64_t(512) << 20) / std::max<int64_t>(per_layer, 1), 1, 32));
    while (layers > 1 && per_layer * layers > budget_bytes) --layers;
    max_pages = int32_t((len + kPageTokens - 1) / kPageTokens);
    auto made = KvCache::create("bench", layers, H, D, DType::F16, seqs * max_pages, fp8);
    if (!made) throw Error(made.error());
    kv = std::move(*made);
    std::vector<int32_t> t(static_cast<size_t>(seqs * max_pages)), l(static_cast<size_t>(seqs), static_cast<int32_t>(len));
    for (int64_t s = 0; s < seqs; ++s) {
      if (Status st = kv->reserve(uint64_t(s), len); !st) throw Error(st.message());
      const auto& p = kv->pages(uint64_t(s));
      std::copy(p.begin(), p.end(), t.begin() + s * max_pages);
    }
    if (fp8)  // every byte 0x38: E4M3 1.0, and scales of 4.4e-5
      CUDA_CHECK(cudaMemsetAsync(kv->layer(0, nullptr, 0).k, 0x38, size_t(kv->bytes()), stream));
    else
      fill_normal<T>(static_cast<T*>(kv->layer(0, nullptr, 0).k), kv->bytes() / int64_t(sizeof(T)), 0.f, 1.f, 11, 1,
                     stream);
    tables = device_alloc(t.size() * 4, "bench", "block tables");
    lens = device_alloc(l.size() * 4, "bench", "lengths");
    CUDA_CHECK(cudaMemcpy(tables.get(), t.data(), t.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(lens.get(), l.data(), l.size() * 4, cudaMemcpyHostToDevice));
  }
  KvLayerView layer(int l) const { return kv->layer(l, tables.as<int32_t>(), max_pages); }
};

DeviceBuffer random(int64_t elems, cudaStream_t stream) {
  DeviceBuffer b = device_alloc(size_t(elems) * sizeof(T), "bench", "activations");
  fill_normal<T>(b.as<T>(), elems, 0.f, 1.f, 5, uint64_t(elems), stream);
  return b;
}

void decode_table(const ModelConfig& c, double bw, int sms, const std::vector<int64_t>& batches,
                  const std::vector<int64_t>& contexts, cudaStream_t stream) {
  const int64_t H = c.n_head, D = c.head_dim(), C = H * D;
  GraphTimer timer{stream};
  std::printf("\n## decode: %ld heads x %ld, fp16 K/V\n", H, D);
  std::printf("%6s %8s %10s %10s %9s %8s %8s %8s %9s %9s %7s\n", "batch", "context", "tiles us", "cores us", "floor us",
              "tiles%", "cores%", "cores/t", "fp8 us", "fp8 flr%", "t/fp8");
  for (int64_t batch : batches)
    for (int64_t ctx : contexts) {
      const int64_t kv_bytes = batch * ctx * C * 2 * int64_t(sizeof(T));
      if (kv_bytes > (int64_t(24) << 30)) continue;
      Setup st(batch, ctx, H, D, int64_t(40) << 30, stream);
      DeviceBuffer qkv = random(batch * 3 * C, stream), out = random(batch * C, stream);
      const int64_t floats = std::max(decode_partial_floats(batch, H, D, ctx), tile_partial_floats(batch, H, D, ctx));
      DeviceBuffer partial = device_alloc(size_t(floats) * 4, "bench", "partial");
      DeviceBuffer counters = device_alloc(size_t(batch * H) * 4, "bench", "counters");
      CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
      const DecodeWorkspace ws{partial.as<float>(), counters.as<int32_t>(), int64_t(partial.bytes() / 4), batch * H, ctx};
      const int splits = decode_splits_for(batch, H, ctx, sms);
      const double tiles = timer.time(st.layers, [&](int l) {
        attention_decode_tiles<T>(out.as<T>(), qkv.as<T>(), st.layer(l), st.lens.as<int32_t>(), batch, H, D, ws, stream);
      });
      const double cores = timer.time(st.layers, [&](int l) {
        attention_decode_cores<T>(out.as<T>(), qkv.as<T>(), st.layer(l), st.lens.as<int32_t>(), batch, H, D, splits, ws,
                                  stream);
      });
      // FP8 K/V: bytes and a 4-byte scale per (position, head) of K and of V.
      Setup f8(batch, ctx, H, D, int64_t(40) << 30, stream, /*fp8=*/true);
      const double fp8 = timer.time(f8.layers, [&](int l) {
        attention_decode_tiles<T>(out.as<T>(), qkv.as<T>(), f8.layer(l), f8.lens.as<int32_t>(), batch, H, D, ws, stream);
      });
      const double floor_us = double(kv_bytes) / bw * 1e6;
      const double fp8_floor_us = double(batch * ctx * H * 2 * (D + 4)) / bw * 1e6;
      std::printf("%6ld %8ld %10.2f %10.2f %9.2f %7.0f%% %7.0f%% %8.2f %9.2f %8.0f%% %7.2f\n", batch, ctx, tiles, cores,
                  floor_us, 100 * floor_us / tiles, 100 * floor_us / cores, cores / tiles, fp8,
                  100 * fp8_floor_us / fp8, tiles / fp8);
    }
}

void prefill_table(const ModelConfig& c, cudaStream_t stream) {
  const int64_t H = c.n_head, D = c.head_dim(), C = H * D;
  GraphTimer timer{stream};
  std::printf("\n## prefill: %ld heads x %ld, fp16, causal, whole prompts\n", H, D);
  std::printf("%5s %7s %11s %11s %11s %8s %8s %8s %9s %9s %9s %7s\n", "seqs", "prompt", "tiles ms", "cores ms",
              "flash ms", "tiles TF", "cores TF", "flash TF", "cores/t", "flash/t", "fp8 ms", "fp8/t");
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{256, 128}, {64, 128}, {8, 512}, {4, 1024}, {1, 4096}, {1, 128}};
  for (const auto& [seqs, len] : shapes) {
    Setup st(seqs, len, H, D, int64_t(16) << 30, stream);
    DeviceBuffer qkv = random(seqs * len * 3 * C, stream), out = random(seqs * len * C, stream);
    std::vector<int32_t> qb(static_cast<size_t>(seqs)), ql(static_cast<size_t>(seqs), static_cast<int32_t>(len));
    for (int64_t s = 0; s < seqs; ++s) qb[size_t(s)] = int32_t(s * len);
    DeviceBuffer dqb = device_alloc(qb.size() * 4, "bench", "q begins"), dql = device_alloc(ql.size() * 4, "bench", "q lens");
    CUDA_CHECK(cudaMemcpy(dqb.get(), qb.data(), qb.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dql.get(), ql.data(), ql.size() * 4, cudaMemcpyHostToDevice));
    const SeqArrays seq{dqb.as<int32_t>(), dql.as<int32_t>(), st.lens.as<int32_t>(), seqs};
    auto time = [&](auto&& f) { return timer.time(st.layers, [&](int l) { f(st.layer(l)); }) * 1e-3; };
    const double tiles = time([&](const KvLayerView& v) {
      attention_context_tiles<T>(out.as<T>(), qkv.as<T>(), v, seq, len, H, D, stream);
    });
    const double cores = time([&](const KvLayerView& v) {
      attention_context_cores<T>(out.as<T>(), qkv.as<T>(), v, seq, len, H, D, stream);
    });
    const double flash = time([&](const KvLayerView& v) {
      attention_context_paged<T>(out.as<T>(), qkv.as<T>(), v, seq, len, H, D, stream);
    });
    Setup f8(seqs, len, H, D, int64_t(16) << 30, stream, /*fp8=*/true);
    const SeqArrays seq8{dqb.as<int32_t>(), dql.as<int32_t>(), f8.lens.as<int32_t>(), seqs};
    const double fp8 = timer.time(f8.layers, [&](int l) {
      attention_context_tiles<T>(out.as<T>(), qkv.as<T>(), f8.layer(l), seq8, len, H, D, stream);
    }) * 1e-3;
    const double flops = 4.0 * double(D) * double(H) * double(seqs) * double(len) * double(len + 1) / 2;
    auto tf = [&](double ms) { return flops / (ms * 1e-3) * 1e-12; };
    std::printf("%5ld %7ld %11.3f %11.3f %11.3f %8.1f %8.1f %8.1f %9.2f %9.2f %9.3f %7.2f\n", seqs, len, tiles, cores,
                flash, tf(tiles), tf(cores), tf(flash), cores / tiles, flash / tiles, fp8, fp8 / tiles);
  }
}

// FC1 in FP8 through cuBLASLt directly (bytes in, fp16 sums out, no epilogue), optionally
// told how many SMs to plan for (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET; 0: all): the product
// that would share the GPU with the decode attention of the other half of a batch.
struct LtFp8Product {
  cublasLtHandle_t lt = nullptr;
  LtDescriptors p;
  cublasLtMatmulAlgo_t algo{};
  DeviceBuffer workspace;
  bool ok = false;
  LtFp8Product(int64_t T_, int64_t K, int64_t N, int sms) {
    CUDA_CHECK(cublasLtCreate(&lt));
    lt_describe(p, CUDA_R_8F_E4M3, CUDA_R_16F, T_, K, N, true, false);
    if (sms > 0) {
      const int32_t target = sms;
      CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &target,
                                                  sizeof(target)));
    }
    workspace = device_alloc(size_t(32) << 20, "bench", "cuBLASLt workspace");
    const auto r = lt_proposals(lt, p, 16, workspace.bytes(), 1);
    if (!r.empty()) algo = r[0].algo, ok = true;
  }
  ~LtFp8Product() {
    if (lt) cublasLtDestroy(lt);
  }
  void run(void* d, const void* w, const void* x, cudaStream_t s) const {
    const float one = 1.f, zero = 0.f;
    CUDA_CHECK(cublasLtMatmul(lt, p.desc, &one, w, p.a, x, p.b, &zero, d, p.d, d, p.d, &algo, workspace.get(),
                                workspace.bytes(), s));
  }
};

void overlap_table(const ModelConfig& c, const std::vector<int64_t>& batches, const std::vector<int64_t>& contexts,
                   cudaStream_t stream) {
  const int64_t H = c.n_head, D = c.head_dim(), C = H * D, I = 4 * C;
  Gemm gemm;
  if (Status ok = gemm.fp8_supported(); !ok) {
    std::printf("\n## overlap: skipped (%s)\n", ok.message().c_str());
    return;
  }
  int lo = 0, hi = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t side, urgent;
  CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithPriority(&urgent, cudaStreamNonBlocking, hi));
  cudaEvent_t fork, join;
  CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  // FC1's weights: every byte E4M3 1.0, each row's scale 1/448 (the bytes' values do not
  // change the time).
  DeviceBuffer w = device_alloc(size_t(I * C), "bench", "FP8 weights");
  CUDA_CHECK(cudaMemsetAsync(w.get(), 0x38, w.bytes(), stream));
  const std::vector<float> hs(static_cast<size_t>(I), 1.f / 448.f);
  DeviceBuffer scales = device_alloc(hs.size() * 4, "bench", "FP8 weight scales");
  CUDA_CHECK(cudaMemcpy(scales.get(), hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  GraphTimer timer{stream};
  const int sms = sm_count();
  const int targets[] = {0, sms / 2, sms / 4};
  std::printf("\n## overlap: FP8 decode attention (%ld heads x %ld) beside FC1 in FP8 (%ld -> %ld), us a pair\n", H, D,
              C, I);
  std::printf("# attn: the attention alone; fc1: Gemm::run_fp8 alone; both: the two on two streams, attention\n"
              "# first; lt@N: FC1 through cuBLASLt planned for N SMs (all: %d), alone, and 'hi' launched first on a\n"
              "# high-priority stream with the attention after it; saved: the best pair against attn + fc1\n",
              sms);
  std::printf("%6s %8s %8s %8s %8s %8s", "batch", "context", "attn", "fc1", "sum", "both");
  for (int t : targets) std::printf("  lt@%-4d  hi@%-4d", t ? t : sms, t ? t : sms);
  std::printf(" %7s\n", "saved");
  for (int64_t batch : batches)
    for (int64_t ctx : contexts) {
      Setup f8(batch, ctx, H, D, int64_t(40) << 30, stream, /*fp8=*/true);
      DeviceBuffer qkv = random(batch * 3 * C, stream), out = random(batch * C, stream);
      DeviceBuffer x = random(batch * C, stream), y = random(batch * I, stream);
      DeviceBuffer xq = device_alloc(size_t(batch * C), "bench", "FP8 rows");
      CUDA_CHECK(cudaMemsetAsync(xq.get(), 0x38, xq.bytes(), stream));
      const int64_t floats = tile_partial_floats(batch, H, D, ctx);
      DeviceBuffer partial = device_alloc(size_t(floats) * 4, "bench", "partial");
      DeviceBuffer counters = device_alloc(size_t(batch * H) * 4, "bench", "counters");
      CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
      const DecodeWorkspace ws{partial.as<float>(), counters.as<int32_t>(), floats, batch * H, ctx};
      auto attention = [&](int l, cudaStream_t s) {
        attention_decode_tiles<T>(out.as<T>(), qkv.as<T>(), f8.layer(l), f8.lens.as<int32_t>(), batch, H, D, ws, s);
      };
      auto fc1 = [&](cudaStream_t s) {
        gemm.run_fp8<T>(y.as<T>(), x.as<T>(), w.as<uint8_t>(), scales.as<float>(), nullptr, batch, C, I, GemmAct::None, s);
      };
      // `first` on s1 then `second` on s2, forked from and joined to the timer's stream.
      auto pair = [&](cudaStream_t s1, const std::function<void(cudaStream_t)>& first, cudaStream_t s2,
                      const std::function<void(cudaStream_t)>& second) {
        CUDA_CHECK(cudaEventRecord(fork, stream));
        CUDA_CHECK(cudaStreamWaitEvent(s1, fork, 0));
        CUDA_CHECK(cudaStreamWaitEvent(s2, fork, 0));
        first(s1);
        second(s2);
        CUDA_CHECK(cudaEventRecord(join, s1));
        CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
        CUDA_CHECK(cudaEventRecord(join, s2));
        CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
      };
      const double a = timer.time(f8.layers, [&](int l) { attention(l, stream); });
      const double p = timer.time(f8.layers, [&](int) { fc1(stream); });
      const double both = timer.time(f8.layers, [&](int l) {
        pair(stream, [&](cudaStream_t s) { attention(l, s); }, side, fc1);
      });
      double best = both;
      std::printf("%6ld %8ld %8.1f %8.1f %8.1f %8.1f", batch, ctx, a, p, a + p, both);
      for (int t : targets) {
        LtFp8Product lt(batch, C, I, t);
        if (!lt.ok) {
          std::printf("  %6s  %6s", "-", "-");
          continue;
        }
        auto run_lt = [&](cudaStream_t s) { lt.run(y.get(), w.get(), xq.get(), s); };
        const double alone = timer.time(f8.layers, [&](int) { run_lt(stream); });
        const double hi_pair = timer.time(f8.layers, [&](int l) {
          pair(urgent, run_lt, side, [&](cudaStream_t s) { attention(l, s); });
        });
        best = std::min(best, hi_pair);
        std::printf("  %6.1f  %6.1f", alone, hi_pair);
      }
      std::printf(" %6.0f%%\n", 100 * (a + p - best) / (a + p));
    }
  CUDA_CHECK(cudaEventDestroy(fork));
  CUDA_CHECK(cudaEventDestroy(join));
  CUDA_CHECK(cudaStreamDestroy(urgent));
  CUDA_CHECK(cudaStreamDestroy(side));
}

int run(int argc, char** argv) {
  std::string shape = "gpt3-6.7b", only;
  std::vector<int64_t> batches = {1, 8, 16, 64, 256, 512}, contexts = {128, 256, 512, 1024, 4096};
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", k.c_str());
      return 2;
    }
    if (k == "--shape") shape = argv[++i];
    else if (k == "--only") only = argv[++i];
    else if (k == "--batches" || k == "--contexts") {
      std::vector<int64_t>& list = k == "--batches" ? batches : contexts;
      list = parse_count_list(argv[++i]);
      if (list.empty()) {
        std::fprintf(stderr, "%s takes positive counts separated by commas, not '%s'\n", k.c_str(), argv[i]);
        return 2;
      }
    }
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (!only.empty() && only != "decode" && only != "prefill" && only != "overlap") {
    std::fprintf(stderr, "--only takes decode, prefill or overlap, not '%s'\n", only.c_str());
    return 2;
  }
  auto named = named_model_shape(shape);
  if (!named) {
    std::fprintf(stderr, "%s\n", named.error().c_str());
    return 2;
  }
  if (!tile_order_head_dim(named->head_dim())) {
    std::fprintf(stderr, "head_dim %ld has no tile-order kernel\n", named->head_dim());
    return 2;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bw = measure_copy_bandwidth();
  std::printf("# %s, %s; copy bandwidth %.0f GB/s (read + write)\n", prop.name, shape.c_str(), bw * 1e-9);
  if (only.empty() || only == "decode") decode_table(*named, bw, prop.multiProcessorCount, batches, contexts, stream);
  if (only.empty() || only == "prefill") prefill_table(*named, stream);
  if (only == "overlap") overlap_table(*named, batches, contexts, stream);
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

#else
int main() {
  std::fprintf(stderr, "conveyor-bench-attention: built without the CUDA backend\n");
  return 1;
}
#endif

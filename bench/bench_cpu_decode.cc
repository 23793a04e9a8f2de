// CPU decode throughput of one CpuStage holding the whole model: tokens/s for decode
// steps of batch 1 and 8 (each sequence with a 32-token prompt already prefilled), on one
// thread's layers (tp 1) and tensor parallel over 2 (tp 2), plus the prefill rate and the
// cost of sample_next over a GPT-2 vocabulary.
//
//   conveyor-bench-cpu-decode [--model DIR] [--shape L,C,H|gpt2-xl] [benchmark flags]
//
// The model is DIR (a HF GPT-2 checkpoint), else $CONVEYOR_BENCH_MODEL, else random weights
// of --shape (default GPT-2 small: 12,768,12 with a 50257-token vocabulary).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/options.h"
#include "stage/cpu/cpu_stage.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/sampling.h"
#include "model/weights.h"

namespace {

using namespace conveyor;

std::string g_model_dir, g_shape = "12,768,12";
constexpr int32_t kPromptTokens = 32;
constexpr int32_t kMaxDecodeTokens = 224;  // re-prefill before the context grows further

// The stage at `tp` tensor-parallel ranks (built once per tp).
CpuStage& stage(int tp = 1) {
  static std::map<int, std::unique_ptr<CpuStage>> stages;
  std::unique_ptr<CpuStage>& st = stages[tp];
  if (st) return *st;
  st = [tp] {
    StageWeights w;
    if (!g_model_dir.empty()) {
      auto loaded = load_stage_weights(g_model_dir, 0, load_model_config(g_model_dir).value().n_layer);
      if (!loaded) {
        std::fprintf(stderr, "cannot load %s: %s\n", g_model_dir.c_str(), loaded.error().c_str());
        std::exit(1);
      }
      w = std::move(*loaded);
      std::fprintf(stderr, "model: %s\n", g_model_dir.c_str());
    } else {
      ModelConfig c = named_model_shape(g_shape).value();
      if (g_shape == "12,768,12") c.n_positions = 1024;
      std::fprintf(stderr, "model: random weights, n_layer=%ld n_embd=%ld n_head=%ld vocab=%ld\n", long(c.n_layer),
                   long(c.n_embd), long(c.n_head), long(c.vocab_size));
      w = random_stage_weights(c, 0, c.n_layer, 1);
    }
    auto made = CpuStage::create(std::move(w), tp);
    if (!made) {
      std::fprintf(stderr, "%s\n", made.error().c_str());
      std::exit(1);
    }
    return std::move(made).value();
  }();
  return *st;
}

// Prefills `batch` fresh sequences; returns their slices positioned for the first decode step.
std::vector<SeqSlice> prefill(CpuStage& st, int batch, std::vector<int32_t>& next_ids, std::vector<float>& hidden,
                              std::vector<float>& logits) {
  st.clear();
  const ModelConfig& c = st.config();
  std::mt19937 rng(7);
  std::vector<SeqSlice> slices;
  std::vector<int32_t> ids;
  for (int b = 0; b < batch; ++b) {
    slices.push_back({uint64_t(b), 0, kPromptTokens});
    for (int i = 0; i < kPromptTokens; ++i) ids.push_back(int32_t(rng() % uint32_t(c.vocab_size)));
  }
  hidden.resize(size_t(ids.size()) * size_t(c.n_embd));
  logits.resize(size_t(batch) * size_t(c.vocab_size));
  if (!st.embed(slices, ids.data(), hidden.data()) || !st.forward(slices, hidden.data()) ||
      !st.logits(slices, hidden.data(), false, logits.data()))
    std::abort();
  next_ids.resize(size_t(batch));
  for (int b = 0; b < batch; ++b) {
    next_ids[size_t(b)] = argmax_token({logits.data() + size_t(b) * size_t(c.vocab_size), size_t(c.vocab_size)});
    slices[size_t(b)] = {uint64_t(b), kPromptTokens, 1};
  }
  return slices;
}

void BM_Decode(benchmark::State& state) {
  CpuStage& st = stage(int(state.range(1)));
  const int batch = int(state.range(0));
  const int64_t V = st.config().vocab_size;
  std::vector<int32_t> ids;
  std::vector<float> hidden, logits;
  auto slices = prefill(st, batch, ids, hidden, logits);
  for (auto _ : state) {
    if (slices[0].start_pos >= kPromptTokens + kMaxDecodeTokens ||
        slices[0].start_pos >= st.config().n_positions) {
      state.PauseTiming();
      slices = prefill(st, batch, ids, hidden, logits);
      state.ResumeTiming();
    }
    if (!st.embed(slices, ids.data(), hidden.data()) || !st.forward(slices, hidden.data()) ||
        !st.logits(slices, hidden.data(), false, logits.data()))
      state.SkipWithError("stage call failed");
    for (int b = 0; b < batch; ++b) {
      ids[size_t(b)] = argmax_token({logits.data() + size_t(b) * size_t(V), size_t(V)});
      ++slices[size_t(b)].start_pos;
    }
  }
  state.counters["tokens/s"] = benchmark::Counter(double(state.iterations()) * batch, benchmark::Counter::kIsRate);
  st.clear();
}
BENCHMARK(BM_Decode)->ArgNames({"batch", "tp"})->ArgsProduct({{1, 8}, {1, 2}})->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_Prefill(benchmark::State& state) {
  CpuStage& st = stage();
  const int32_t n = int32_t(state.range(0));
  const ModelConfig& c = st.config();
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) ids[size_t(i)] = i % int32_t(c.vocab_size);
  std::vector<float> hidden(size_t(n) * size_t(c.n_embd)), logits(size_t(c.vocab_size));
  const std::vector<SeqSlice> slices = {{1, 0, n}};
  for (auto _ : state) {
    st.clear();
    if (!st.embed(slices, ids.data(), hidden.data()) || !st.forward(slices, hidden.data()) ||
        !st.logits(slices, hidden.data(), false, logits.data()))
      state.SkipWithError("stage call failed");
  }
  state.counters["tokens/s"] = benchmark::Counter(double(state.iterations()) * n, benchmark::Counter::kIsRate);
  st.clear();
}
BENCHMARK(BM_Prefill)->ArgName("tokens")->Arg(128)->UseRealTime()->Unit(benchmark::kMillisecond);

// sample_next over a GPT-2 vocabulary: the full sort (top_p) and the partial one (top_k).
void BM_SampleNext(benchmark::State& state) {
  const size_t V = 50257;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> raw(V), work(V);
  for (float& x : raw) x = nd(rng);
  SamplingParams p;
  p.seed = 1;
  if (state.range(0) == 0) p.top_p = 0.9f;
  else p.top_k = int(state.range(0));
  const std::vector<int32_t> prompt = {1, 2, 3};
  std::vector<int32_t> gen;
  for (auto _ : state) {
    work = raw;
    benchmark::DoNotOptimize(sample_next(work, p, prompt, gen, 0));
  }
}
BENCHMARK(BM_SampleNext)->ArgName("top_k")->Arg(0)->Arg(50)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  // CONVEYOR_CPU_THREADS (common/options.h), as a worker applies it, before the first op.
  if (conveyor::Status s = conveyor::cpu::set_threads(conveyor::process_options().kernels.cpu_threads); !s) {
    std::fprintf(stderr, "conveyor-bench-cpu-decode: %s\n", s.message().c_str());
    return 1;
  }
  if (const char* env = std::getenv("CONVEYOR_BENCH_MODEL")) g_model_dir = env;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) g_model_dir = argv[++i];
    else if (a.rfind("--model=", 0) == 0) g_model_dir = a.substr(8);
    else if (a == "--shape" && i + 1 < argc) g_shape = argv[++i];
    else if (a.rfind("--shape=", 0) == 0) g_shape = a.substr(8);
    else rest.push_back(argv[i]);
  }
  int rest_argc = int(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

// What one step of a GPU stage worker costs, by the kind of micro-batch the coordinator
// sends: the worker's own compute path (StageExecutor over a GpuStageBackend, random
// weights), without the network. A serving pipeline's micro-batches are mostly decode steps
// of the running sequences, joined now and then by a new request's prefill chunk:
//
//   decode         B sequences, one token each (the CUDA-graph path)
//   mixed P        the same B tokens plus N new sequences' first P prompt tokens each
//                  (--new-seqs N, default 1; the ordinary forward: a graph cannot take a
//                  prefill chunk)
//   mixed 1..64    P cycling 1..64, first pass (every new token count is a new GEMM
//                  shape: its plan is timed on first use) and second pass (all planned)
//
// Each step's time is the host's wall time of StageExecutor::run, the outgoing rows copied
// to page-locked memory included on a stage that hands on (what the worker counts as busy). The last stage samples with
// temperature 0.8 and top-k 40, as conveyor-bench-cluster's requests do (--greedy: argmax).
//
//   conveyor-bench-stage-step [--shape L,C,H] [--vocab V] [--stage whole|first|last]
//       [--batch B] [--prompt N] [--prefill P] [--new-seqs N] [--steps N] [--int8] [--fp8]
//       [--kv-dtype auto|fp8] [--kv-cache-gb G] [--no-graphs] [--greedy]
//
// A serving step at 512 clients of FP8 gpt3-6.7b, say: --shape gpt3-6.7b --fp8 --kv-dtype fp8
// --batch 448 --prompt 192 --prefill 128 --new-seqs 3 (what the worker's step trace reports
// under that load: 445 decode rows and 400 prompt rows a step).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#ifdef CONVEYOR_HAVE_CUDA
#include "common/dtype.h"
#include "common/model_config.h"
#include "stage/cuda/gpu_stage_backend.h"
#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "stage/stage_executor.h"
#include "model/weights.h"
#endif

#ifndef CONVEYOR_HAVE_CUDA
int main() {
  std::fprintf(stderr, "conveyor-bench-stage-step: built without the CUDA backend\n");
  return 0;
}
#else

namespace {

using namespace conveyor;
using Clock = std::chrono::steady_clock;

struct Bench {
  Bench(StageExecutor e, int64_t width, int32_t v) : ex(std::move(e)), C(width), vocab(v) {}
  StageExecutor ex;
  int64_t C;
  int32_t vocab;
  std::vector<std::byte> in;  // incoming activations of a non-first stage
  std::shared_ptr<std::byte[]> slot;
  size_t slot_bytes = 0;
  std::mt19937 rng{7};

  // One micro-batch through the stage; returns the host's wall time in ms.
  double step(MicroBatch& b) {
    const int64_t T = b.total_tokens();
    std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
    b.token_ids.resize(size_t(T));
    for (auto& t : b.token_ids) t = tok(rng);
    if (!ex.is_first()) {
      b.activation_dtype = DType::F16;
      in.resize(size_t(T * C) * 2);
      for (size_t i = 0; i < in.size(); i += 2) in[i] = std::byte(0), in[i + 1] = std::byte(0x20);  // small values
    }
    BatchResult r;
    const ActivationSink sink = [&](size_t n) -> Expected<std::span<std::byte>> {
      if (n > slot_bytes) slot = ex.backend().allocate_host(n), slot_bytes = n;
      if (!slot) return Status::error("no page-locked memory for " + std::to_string(n) + " bytes");
      return std::span<std::byte>(slot.get(), n);
    };
    const auto t0 = Clock::now();
    Status s = ex.run(b, in, sink, ex.is_last() ? &r : nullptr);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (!s) {
      std::fprintf(stderr, "step failed: %s\n", s.message().c_str());
      std::exit(1);
    }
    b.free_seq_ids.clear();
    return ms;
  }
};

bool g_greedy = false;  // --greedy

SeqStep work(uint64_t id, int32_t start, int32_t n) {
  SeqStep w;
  w.slice = {id, start, n};
  w.sample = true;
  return w;
}

// A sequence's state, sent with its first step (the last stage keeps it until the free).
Admission admission(uint64_t id, int32_t prompt_len) {
  Admission a{.seq_id = id, .state = {}};
  a.state.prompt_len = prompt_len;
  a.state.sampling.temperature = g_greedy ? 0.f : 0.8f;
  a.state.sampling.top_k = 40;
  a.state.sampling.seed = id;
  return a;
}

double mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); }

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "16,2048,16", stage = "whole";
  int64_t vocab = 4096;
  int batch = 64, prompt = 16, prefill = 8, new_seqs = 1, steps = 50;
  double kv_gb = 8;
  std::string kv_dtype = "auto";
  bool int8 = false, fp8 = false, no_graphs = false;
  CLI::App app{"conveyor-bench-stage-step: a GPU stage worker's step time by kind of micro-batch"};
  app.add_option("--shape", shape, "L,C,H: layers, width, heads");
  app.add_option("--vocab", vocab, "vocabulary size")->check(CLI::Range(2, 1 << 20));
  app.add_option("--stage", stage, "whole model, its first half or its last half")
      ->check(CLI::IsMember({"whole", "first", "last"}));
  app.add_option("--batch", batch, "decoding sequences per micro-batch")->check(CLI::Range(1, 1024));
  app.add_option("--prompt", prompt, "their prompt length")->check(CLI::Range(1, 4096));
  app.add_option("--prefill", prefill, "each new sequence's chunk in a mixed step")->check(CLI::Range(1, 4096));
  app.add_option("--new-seqs", new_seqs, "new sequences in a mixed step")->check(CLI::Range(1, 64));
  app.add_option("--kv-dtype", kv_dtype, "the K/V cache's type: the activations' (auto) or FP8 E4M3 (Hopper)")
      ->check(CLI::IsMember({"auto", "fp8"}));
  app.add_option("--kv-cache-gb", kv_gb, "cap on the K/V cache, GB")->check(CLI::Range(0.1, 1024.0));
  app.add_option("--steps", steps, "steps per kind")->check(CLI::Range(1, 10000));
  app.add_flag("--int8", int8, "int8 weight-only layer matrices");
  app.add_flag("--fp8", fp8, "FP8 E4M3 layer matrices and activations (Hopper)");
  app.add_flag("--greedy", g_greedy, "the last stage takes the argmax (default: temperature 0.8, top-k 40)");
  app.add_flag("--no-graphs", no_graphs, "decode steps launch their kernels one by one instead of replaying a graph");
  CLI11_PARSE(app, argc, argv);

  auto cfg = named_model_shape(shape);
  if (!cfg) {
    std::fprintf(stderr, "--shape: %s\n", cfg.error().c_str());
    return 2;
  }
  cfg->vocab_size = vocab;
  cfg->n_positions = std::max<int64_t>(cfg->n_positions, prompt + std::max(steps, 64) + 64);
  const int64_t L = cfg->n_layer;
  const int64_t b = stage == "last" ? L / 2 : 0, e = stage == "first" ? L / 2 : L;
  cuda::GpuStageOptions o;
  o.name = "bench stage";
  o.int8_weights = int8;
  o.fp8 = fp8;
  o.cuda_graphs = !no_graphs;
  o.kv_fp8 = kv_dtype == "fp8";
  o.kv_cache_max_bytes = int64_t(kv_gb * double(int64_t(1) << 30));
  o.max_seqs = std::max<int64_t>(o.max_seqs, batch + new_seqs);
  o.max_tokens = std::max<int64_t>(o.max_tokens, int64_t(batch) + int64_t(new_seqs) * prefill);
  auto backend = cuda::GpuStageBackend::create(random_stage_weights(*cfg, b, e, 1), {0}, o);
  if (!backend) {
    std::fprintf(stderr, "%s\n", backend.error().c_str());
    return 1;
  }
  Bench bench(StageExecutor(std::move(backend).value()), cfg->n_embd, int32_t(vocab));
  std::printf("# %s, layers [%ld, %ld) of %ld, width %ld, vocab %ld, %s weights, %s K/V%s; batch %d, prompt %d, %s\n",
              bench.ex.backend().describe().c_str(), long(b), long(e), long(L), long(cfg->n_embd), long(vocab),
              int8 ? "int8" : fp8 ? "FP8" : "fp16", o.kv_fp8 ? "FP8" : "fp16", no_graphs ? ", no graphs" : "", batch,
              prompt,
              g_greedy ? "greedy" : "temperature 0.8, top-k 40");

  // Every kind starts from the same state: B fresh sequences prefilled with `prompt` tokens
  // (the previous kind's are freed), so their contexts, which attention reads, match.
  std::vector<uint64_t> ids;
  std::vector<int32_t> len;
  uint64_t next_id = 1;
  std::vector<uint64_t> to_free;
  auto fresh = [&] {
    to_free.insert(to_free.end(), ids.begin(), ids.end());
    ids.clear(), len.assign(size_t(batch), prompt);
    for (int i = 0; i < batch; ++i) ids.push_back(next_id++);
    const int per_batch = std::max(1, int(o.max_tokens / prompt));
    for (int i = 0; i < batch; i += per_batch) {
      MicroBatch mb;
      mb.free_seq_ids.swap(to_free);
      std::vector<Admission> admitted;
      for (int j = i; j < std::min(batch, i + per_batch); ++j) {
        mb.seqs.push_back(work(ids[size_t(j)], 0, prompt));
        admitted.push_back(admission(ids[size_t(j)], prompt));
      }
      mb.admissions = encode_admissions(admitted);
      bench.step(mb);
    }
  };
  auto decode_batch = [&] {
    MicroBatch mb;
    mb.free_seq_ids.swap(to_free);
    for (int i = 0; i < batch; ++i) mb.seqs.push_back(work(ids[size_t(i)], len[size_t(i)]++, 1));
    return mb;
  };
  auto mixed_batch = [&](int p, int n) {  // plus n newcomers' first p tokens; freed in the next step
    MicroBatch mb = decode_batch();
    std::vector<Admission> admitted;
    for (int k = 0; k < n; ++k) {
      const uint64_t id = next_id++;
      mb.seqs.push_back(work(id, 0, p));
      admitted.push_back(admission(id, std::max(p, 64)));
      to_free.push_back(id);
    }
    mb.admissions = encode_admissions(admitted);
    return mb;
  };
  auto run = [&](const char* what, int n, auto&& make) {
    fresh();
    std::vector<double> t;
    for (int i = 0; i < n; ++i) {
      MicroBatch mb = make(i);
      t.push_back(bench.step(mb));
    }
    std::sort(t.begin(), t.end());
    std::printf("%-24s %8.3f ms mean %8.3f ms median %8.3f ms max  (%d steps)\n", what, mean(t), t[t.size() / 2],
                t.back(), n);
    return mean(t);
  };
  run("warm-up decode", 3, [&](int) { return decode_batch(); });
  run("warm-up mixed", 3, [&](int) { return mixed_batch(prefill, new_seqs); });
  const double d = run("decode", steps, [&](int) { return decode_batch(); });
  const std::string mixed_name =
      "mixed " + (new_seqs > 1 ? std::to_string(new_seqs) + " x " : std::string()) + std::to_string(prefill);
  const double m = run(mixed_name.c_str(), steps, [&](int) { return mixed_batch(prefill, new_seqs); });
  const double first = run("mixed 1..64, first pass", 64, [&](int i) { return mixed_batch(1 + i, 1); });
  const double second = run("mixed 1..64, second pass", 64, [&](int i) { return mixed_batch(1 + i, 1); });
  std::printf("mixed / decode: %.2fx; first pass / second pass: %.2fx\n", m / d, first / second);
  return 0;
}

#endif

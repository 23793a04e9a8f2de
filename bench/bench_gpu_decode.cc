// Decode benchmark of one stage holding a whole model with synthetic weights (drawn on
// the GPU), on one GPU or tensor parallel over --tp GPUs (TpStage): for each shape, prompt
// length and batch, prefill the prompts (chunks of at most --max-tokens tokens), then
// generate --new-tokens tokens greedily through the CUDA-graph decode path. Prints time to first token, ms per decode step ("ms/token": one token for
// every sequence of the batch), tokens/s over the batch, and for batch 1 the bandwidth
// floor: the bytes one decode step must read (weights) over the device-to-device copy
// bandwidth measured in the same run (bytes read + bytes written per second).
//
//   conveyor-bench-gpu-decode [--shapes gpt2-xl,gpt3-6.7b] [--batches 1,8,32,128]
//       [--prompts 128,1024] [--new-tokens 128] [--dtype f16|bf16] [--max-tokens 8192]
//       [--kv-fraction 0.9] [--no-graphs] [--tp N] [--csv FILE]
//
// --tp N runs the stage over GPUs 0..N-1 (ranks share GPUs where the machine has fewer:
// a correctness run only, its times mean nothing).
//
// Each configuration runs twice: a warm-up (GEMM plans timed, graphs captured) with a few
// decode steps, then the measured run. A configuration whose K/V cache does not fit is
// reported as skipped. The synthetic shapes' context is raised to prompt + new tokens where
// the named shape has less (gpt2-xl: 1024), so every row runs the same work.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_runtime.h>

#include "common/model_config.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/tp_stage.h"
#include "bench/gpu_bandwidth.h"
#endif

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int> split_ints(const std::string& s) {
  std::vector<int> out;
  for (const auto& x : split(s)) out.push_back(std::stoi(x));
  return out;
}

struct Args {
  std::vector<std::string> shapes = {"gpt2-xl", "gpt3-6.7b"};
  std::vector<int> batches = {1, 8, 32, 128};
  std::vector<int> prompts = {128, 1024};
  int new_tokens = 128;
  std::string dtype = "f16";
  int64_t max_tokens = 8192;
  double kv_fraction = 0.9;
  bool graphs = true;
  int tp = 1;
  std::string csv;
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: conveyor-bench-gpu-decode [--shapes S,..] [--batches N,..] [--prompts N,..] [--new-tokens N]\n"
               "       [--dtype f16|bf16] [--max-tokens N] [--kv-fraction F] [--no-graphs] [--tp N] [--csv FILE]\n");
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (k == "--shapes") a.shapes = split(val());
    else if (k == "--batches") a.batches = split_ints(val());
    else if (k == "--prompts") a.prompts = split_ints(val());
    else if (k == "--new-tokens") a.new_tokens = std::stoi(val());
    else if (k == "--dtype") a.dtype = val();
    else if (k == "--max-tokens") a.max_tokens = std::stoll(val());
    else if (k == "--kv-fraction") a.kv_fraction = std::stod(val());
    else if (k == "--no-graphs") a.graphs = false;
    else if (k == "--tp") a.tp = std::stoi(val());
    else if (k == "--csv") a.csv = val();
    else usage();
  }
  if (a.new_tokens < 2 || a.batches.empty() || a.prompts.empty() || a.shapes.empty() || a.tp < 1 || a.tp > 8) usage();
  return a;
}

}  // namespace

#ifndef CONVEYOR_HAVE_CUDA

int main(int argc, char** argv) {
  parse(argc, argv);
  std::printf("conveyor-bench-gpu-decode: built without the CUDA backend; nothing to measure\n");
  return 0;
}

#else

namespace {

using namespace conveyor;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}


struct Result {
  double ttft_ms = 0, ms_per_token = 0, p50_ms = 0;
  int steps = 0;
};

void check(const Status& s, const char* what) {
  if (!s.ok()) throw Error(std::string(what) + ": " + s.message());
}

// Prefill `batch` prompts of `prompt` tokens, then `decode_steps` greedy decode steps.
Result run_once(cuda::TpStage& stage, int batch, int prompt, int decode_steps, std::mt19937& rng) {
  const int64_t V = stage.config().vocab_size;
  stage.clear();
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
  for (auto& p : prompts) {
    p.resize(static_cast<size_t>(prompt));
    for (auto& t : p) t = int32_t(rng() % uint32_t(V));
  }
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<int32_t> next(static_cast<size_t>(batch), 0);

  // Prefill: pieces of at most max_tokens tokens, packed into micro-batches.
  struct Piece { int seq, start, len; };
  std::vector<Piece> pieces;
  for (int s = 0; s < batch; ++s)
    for (int start = 0; start < prompt; start += int(stage.max_tokens()))
      pieces.push_back({s, start, int(std::min<int64_t>(prompt - start, stage.max_tokens()))});
  Result r;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < pieces.size();) {
    std::vector<SeqSlice> slices;
    std::vector<int32_t> ids;
    std::vector<int> seqs;
    int64_t tokens = 0;
    while (i < pieces.size() && tokens + pieces[i].len <= stage.max_tokens() &&
           int64_t(slices.size()) < stage.max_seqs()) {
      const Piece& p = pieces[i++];
      slices.push_back({uint64_t(p.seq), p.start, p.len});
      const auto& src = prompts[static_cast<size_t>(p.seq)];
      ids.insert(ids.end(), src.begin() + p.start, src.begin() + p.start + p.len);
      seqs.push_back(p.start + p.len == prompt ? p.seq : -1);
      tokens += p.len;
    }
    check(stage.embed(slices, ids.data()), "embed");
    check(stage.forward(slices), "forward");
    check(stage.logits(slices, false, nullptr), "logits");
    std::vector<cuda::SampleRow> rows(slices.size(), cuda::SampleRow{&greedy, {}, {}, 0});
    std::vector<int32_t> out(slices.size());
    check(stage.sample(rows, out.data()), "sample");
    for (size_t k = 0; k < seqs.size(); ++k)
      if (seqs[k] >= 0) next[static_cast<size_t>(seqs[k])] = out[k];
  }
  r.ttft_ms = ms_since(t0);

  std::vector<cuda::SampleRow> rows(static_cast<size_t>(batch), cuda::SampleRow{&greedy, {}, {}, 0});
  std::vector<SeqSlice> slices(static_cast<size_t>(batch));
  std::vector<int32_t> out(static_cast<size_t>(batch));
  std::vector<double> times;
  for (int step = 0; step < decode_steps; ++step) {
    for (int s = 0; s < batch; ++s) slices[static_cast<size_t>(s)] = {uint64_t(s), prompt + step, 1};
    const auto ts = Clock::now();
    check(stage.decode(slices, next.data(), rows, out.data()), "decode");
    times.push_back(ms_since(ts));
    next = out;
  }
  r.steps = decode_steps;
  if (!times.empty()) {
    double sum = 0;
    for (double t : times) sum += t;
    r.ms_per_token = sum / double(times.size());
    std::nth_element(times.begin(), times.begin() + int64_t(times.size() / 2), times.end());
    r.p50_ms = times[times.size() / 2];
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("conveyor-bench-gpu-decode: no CUDA device; nothing to measure\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double bw = measure_copy_bandwidth();
    std::printf("# device: %s, %d SMs, %.1f GiB; device-to-device copy %.0f GB/s (read + write)\n", prop.name,
                prop.multiProcessorCount, double(prop.totalGlobalMem) / double(1 << 30), bw / 1e9);
    std::ofstream csv;
    if (!args.csv.empty()) {
      csv.open(args.csv);
      csv << "shape,dtype,tp,batch,prompt,new_tokens,ttft_ms,ms_per_token,p50_ms,tokens_per_s,floor_ms,fraction_of_floor\n";
    }
    std::vector<std::string> table;
    char line[512];
    std::snprintf(line, sizeof line, "%-10s %-5s %5s %6s %10s %9s %9s %10s %9s %8s", "shape", "dtype", "batch", "prompt",
                  "ttft_ms", "ms/token", "p50_ms", "tokens/s", "floor_ms", "floor%");
    table.push_back(line);
    std::mt19937 rng(1234);
    const int max_prompt = *std::max_element(args.prompts.begin(), args.prompts.end());
    const int max_batch = *std::max_element(args.batches.begin(), args.batches.end());
    for (const std::string& shape : args.shapes) {
      auto cfg_or = named_model_shape(shape);
      if (!cfg_or.ok()) throw Error(cfg_or.error());
      ModelConfig cfg = *cfg_or;
      cfg.n_positions = std::max<int64_t>(cfg.n_positions, max_prompt + args.new_tokens);
      cuda::GpuStageOptions o;
      o.dtype = args.dtype == "bf16" ? DType::BF16 : DType::F16;
      o.name = shape;
      o.max_tokens = args.max_tokens;
      o.max_seqs = std::max(max_batch, 1);
      o.kv_cache_fraction = args.kv_fraction;
      o.cuda_graphs = args.graphs;
      const auto t0 = Clock::now();
      std::vector<int> gpus;
      for (int r = 0; r < args.tp; ++r) gpus.push_back(r % devices);
      auto stage = cuda::TpStage::create_synthetic(cfg, 0, cfg.n_layer, 42, gpus, o);
      std::printf("# %s (n_positions %lld, tp %d%s): built in %.1f s; %s\n", shape.c_str(), (long long)cfg.n_positions,
                  args.tp, args.tp > devices ? ", ranks sharing GPUs: times not meaningful" : "", ms_since(t0) / 1e3,
                  stage->memory_report().c_str());
      const double floor_ms = double(stage->decode_weight_bytes()) / bw * 1e3;
      for (int prompt : args.prompts) {
        for (int batch : args.batches) {
          const int64_t pages_per_seq = (prompt + args.new_tokens + cuda::kPageTokens - 1) / cuda::kPageTokens;
          if (batch * pages_per_seq * cuda::kPageTokens > stage->kv_capacity_tokens()) {
            std::snprintf(line, sizeof line, "%-10s %-5s %5d %6d   skipped: the K/V cache holds %lld positions, %lld needed",
                          shape.c_str(), args.dtype.c_str(), batch, prompt, (long long)stage->kv_capacity_tokens(),
                          (long long)(batch * pages_per_seq * cuda::kPageTokens));
            table.push_back(line);
            std::printf("%s\n", line);
            continue;
          }
          run_once(*stage, batch, prompt, 3, rng);  // warm-up: plans, graphs
          const Result r = run_once(*stage, batch, prompt, args.new_tokens - 1, rng);
          const double tps = batch * 1e3 / r.ms_per_token;
          char floor_s[32] = "-", frac_s[32] = "-";
          if (batch == 1) {
            std::snprintf(floor_s, sizeof floor_s, "%.3f", floor_ms);
            std::snprintf(frac_s, sizeof frac_s, "%.1f%%", 100.0 * floor_ms / r.ms_per_token);
          }
          std::snprintf(line, sizeof line, "%-10s %-5s %5d %6d %10.2f %9.3f %9.3f %10.1f %9s %8s", shape.c_str(),
                        args.dtype.c_str(), batch, prompt, r.ttft_ms, r.ms_per_token, r.p50_ms, tps, floor_s, frac_s);
          table.push_back(line);
          std::printf("%s\n", line);
          std::fflush(stdout);
          if (csv.is_open())
            csv << shape << "," << args.dtype << "," << args.tp << "," << batch << "," << prompt << "," << args.new_tokens << "," << r.ttft_ms
                << "," << r.ms_per_token << "," << r.p50_ms << "," << tps << "," << (batch == 1 ? floor_ms : 0) << ","
                << (batch == 1 ? floor_ms / r.ms_per_token : 0) << "\n";
        }
      }
      if (std::getenv("CONVEYOR_BENCH_PLANS"))
        std::printf("# GEMM plans:\n%s", stage->lead().gemm().describe_plans().c_str());
    }
    std::printf("\n");
    for (const auto& l : table) std::printf("%s\n", l.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conveyor-bench-gpu-decode: %s\n", e.what());
    return 1;
  }
  return 0;
}

#endif  // CONVEYOR_HAVE_CUDA

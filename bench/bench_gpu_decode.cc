// Decode benchmark of a whole model with synthetic weights (drawn on the GPU): one stage on
// one GPU, tensor parallel over --tp GPUs (TpStage), and/or cut into --pp pipeline stages
// in this process (stage s on the next --tp GPUs; a stage hands its output rows to every
// rank of the next with a device-to-device copy, as GPU-direct transfers would, and the
// host waits for it). For each shape, prompt length and batch, prefill the prompts (chunks
// of at most --max-tokens tokens), then generate --new-tokens tokens greedily through the
// CUDA-graph decode path. Prints time to first token, ms per decode step ("ms/token": one
// token for every sequence of the batch), tokens/s over the batch, the whole request's
// latency (first token + the decode steps: what FasterTransformer's figures measure), and
// for batch 1 the bandwidth floor: the bytes one decode step must read (the busiest rank's
// weights, summed over the pipeline's stages) over the device-to-device copy bandwidth
// measured in the same run (bytes read + bytes written per second).
//
//   conveyor-bench-gpu-decode [--shapes gpt2-xl,gpt3-6.7b] [--batches 1,8,32,128]
//       [--prompts 128,1024] [--new-tokens 128] [--dtype f16|bf16] [--max-tokens 8192]
//       [--kv-fraction 0.9] [--no-graphs] [--tp N] [--pp N] [--weights dtype,int8,fp8] [--int8]
//       [--fp8] [--kv-dtype auto|fp8] [--ar-push-max BYTES] [--csv FILE] [--modes det,fast] [--sample]
//
// --sample: the decode steps sample every row with temperature 0.8 and top-k 40 (the requests
// of conveyor-bench-cluster without --greedy), so the step includes the GPU sampler; without
// it they take the argmax inside the step's graph.
// --kv-dtype fp8: every stage's K/V cache in E4M3 with a scale per position and head
// (GpuStageOptions::kv_fp8): half the bytes, so twice the sequences fit; its rows name the
// weights with "/kv8".
// --tp N runs each stage over N GPUs (ranks share GPUs where the machine has fewer than
// tp x pp: a correctness run only, its times mean nothing). --weights: the layer matrices in
// the stage's dtype, int8 weight-only (quant.h) and/or FP8 weights and activations (fp8.h,
// Hopper), each built in turn, the rows of int8 and fp8 showing the dtype's ms/token over
// theirs ("x dtype"); --int8 and --fp8 are --weights int8 and --weights fp8. --ar-push-max:
// tensor-parallel all-reduces up to BYTES take the push call (GpuStageOptions::
// all_reduce_push_max_bytes; 0: the one-shot pull of before, to compare). --modes: det
// (the default: fixed-order kernels, GpuStageOptions::deterministic) and/or fast (the fastest
// kernels of each shape, whose sums follow the batch); both run each configuration side by
// side, the stage built once per mode, and the fast rows show det's time over theirs.
//
// Each configuration runs twice: a warm-up (GEMM plans timed, graphs captured) with a few
// decode steps, then the measured run. A configuration whose K/V cache does not fit is
// reported as skipped. The synthetic shapes' context is raised to prompt + new tokens where
// the named shape has less (gpt2-xl: 1024), so every row runs the same work.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench/count_list.h"

#ifdef CONVEYOR_HAVE_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "common/model_config.h"
#include "common/options.h"
#include "kernels/cuda/check.h"
#include "stage/cuda/tp_stage.h"
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

// A flag's list of positive counts (bench/count_list.h); a bad list names the flag.
std::vector<int> counts(const char* flag, const std::string& s) {
  const std::vector<int64_t> v = parse_count_list(s.c_str());
  if (v.empty() || *std::max_element(v.begin(), v.end()) > INT32_MAX) {
    std::fprintf(stderr, "conveyor-bench-gpu-decode: %s takes a list of positive counts, not '%s'\n", flag, s.c_str());
    std::exit(2);
  }
  return {v.begin(), v.end()};
}

struct Args {
  std::vector<std::string> shapes = {"gpt2-xl", "gpt3-6.7b"};
  std::vector<int> batches = {1, 8, 32, 128};
  std::vector<int> prompts = {128, 1024};
  std::vector<int> new_tokens = {128};
  std::string dtype = "f16";
  int64_t max_tokens = 8192;
  double kv_fraction = 0.9;
  bool graphs = true;
  int tp = 1, pp = 1;
  long long ar_push_max = -1;  // -1: the stage's default
  std::vector<std::string> weights = {"dtype"};  // dtype, int8, fp8
  bool kv_fp8 = false;
  std::string csv;
  std::vector<std::string> modes = {"det"};
  bool sample = false;  // decode rows sampled (temperature 0.8, top-k 40) as conveyor-bench-cluster's requests
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: conveyor-bench-gpu-decode [--shapes S,..] [--batches N,..] [--prompts N,..] [--new-tokens N]\n"
               "       [--dtype f16|bf16] [--max-tokens N] [--kv-fraction F] [--no-graphs] [--tp N] [--pp N]\n"
               "       [--weights dtype,int8,fp8] [--int8] [--fp8] [--kv-dtype auto|fp8] [--ar-push-max BYTES]\n"
               "       [--csv FILE] [--modes det,fast] [--sample]\n");
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
    else if (k == "--batches") a.batches = counts("--batches", val());
    else if (k == "--prompts") a.prompts = counts("--prompts", val());
    else if (k == "--new-tokens") a.new_tokens = counts("--new-tokens", val());
    else if (k == "--dtype") a.dtype = val();
    else if (k == "--max-tokens") a.max_tokens = std::stoll(val());
    else if (k == "--kv-fraction") a.kv_fraction = std::stod(val());
    else if (k == "--no-graphs") a.graphs = false;
    else if (k == "--tp") a.tp = std::stoi(val());
    else if (k == "--pp") a.pp = std::stoi(val());
    else if (k == "--int8") a.weights = {"int8"};
    else if (k == "--fp8") a.weights = {"fp8"};
    else if (k == "--weights") a.weights = split(val());
    else if (k == "--kv-dtype") {
      const std::string v = val();
      if (v != "auto" && v != "fp8") usage();
      a.kv_fp8 = v == "fp8";
    }
    else if (k == "--ar-push-max") a.ar_push_max = std::stoll(val());
    else if (k == "--csv") a.csv = val();
    else if (k == "--modes") a.modes = split(val());
    else if (k == "--sample") a.sample = true;
    else usage();
  }
  if (a.new_tokens.empty() || *std::min_element(a.new_tokens.begin(), a.new_tokens.end()) < 2 || a.batches.empty() || a.prompts.empty() || a.shapes.empty() || a.tp < 1 || a.tp > 8 || a.pp < 1) usage();
  for (const std::string& m : a.modes)
    if (m != "det" && m != "fast") {
      std::fprintf(stderr, "conveyor-bench-gpu-decode: --modes takes det and/or fast, not '%s'\n", m.c_str());
      std::exit(2);
    }
  if (a.modes.empty() || a.weights.empty()) usage();
  for (const std::string& w : a.weights)
    if (w != "dtype" && w != "int8" && w != "fp8") {
      std::fprintf(stderr, "conveyor-bench-gpu-decode: --weights takes dtype, int8 and/or fp8, not '%s'\n", w.c_str());
      std::exit(2);
    }
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
  double ttft_ms = 0, ms_per_token = 0, p50_ms = 0, total_ms = 0;
  int steps = 0;
};

void check(const Status& s, const char* what) {
  if (!s.ok()) throw Error(std::string(what) + ": " + s.message());
}

// The model's layers as pipeline stages of this process, with TpStage's calls.
class Pipeline {
 public:
  explicit Pipeline(std::vector<std::unique_ptr<cuda::TpStage>> stages) : stages_(std::move(stages)) {}
  const ModelConfig& config() const { return stages_[0]->config(); }
  int64_t max_tokens() const { return stages_[0]->max_tokens(); }
  int64_t max_seqs() const { return stages_[0]->max_seqs(); }
  int64_t kv_capacity_tokens() const {
    int64_t n = INT64_MAX;
    for (const auto& s : stages_) n = std::min(n, s->kv_capacity_tokens());
    return n;
  }
  int64_t decode_weight_bytes() const {  // the stages run one after the other
    int64_t n = 0;
    for (const auto& s : stages_) n += s->decode_weight_bytes();
    return n;
  }
  std::string memory_report() const {
    std::string r;
    for (const auto& s : stages_) r += "\n#   " + s->memory_report();
    return r;
  }
  cuda::TpStage& last() { return *stages_.back(); }
  void clear() {
    for (auto& s : stages_) s->clear();
  }
  Status embed(std::span<const SeqSlice> slices, const int32_t* ids) { return stages_[0]->embed(slices, ids); }
  Status forward(std::span<const SeqSlice> slices) {
    for (size_t i = 0; i < stages_.size(); ++i) {
      if (Status s = stages_[i]->forward(slices); !s) return s;
      if (i + 1 < stages_.size()) hand_over(i, total_tokens(slices));
    }
    return ok_status();
  }
  Status logits(std::span<const SeqSlice> slices, bool all, float* out) { return last().logits(slices, all, out); }
  Status sample(std::span<const cuda::SampleRow> rows, int32_t* out) { return last().sample(rows, out); }
  Status decode(std::span<const SeqSlice> slices, const int32_t* ids, std::span<const cuda::SampleRow> rows,
                int32_t* out) {
    for (size_t i = 0; i < stages_.size(); ++i) {
      const bool is_last = i + 1 == stages_.size();
      if (Status s = stages_[i]->decode(slices, i == 0 ? ids : nullptr, is_last ? rows : std::span<const cuda::SampleRow>{},
                                        is_last ? out : nullptr);
          !s)
        return s;
      if (!is_last) hand_over(i, int64_t(slices.size()));
    }
    return ok_status();
  }

 private:
  // Stage i's output rows (rank 0's copy) into every rank of stage i + 1.
  void hand_over(size_t i, int64_t rows) {
    cuda::GpuStage& from = stages_[i]->lead();
    const size_t bytes = size_t(rows * config().n_embd) * dtype_bytes(from.dtype());
    for (int r = 0; r < stages_[i + 1]->ranks(); ++r) {
      cuda::GpuStage& to = stages_[i + 1]->rank(r);
      CUDA_CHECK(cudaMemcpyPeerAsync(to.hidden_device(), to.device(), from.hidden_device(), from.device(), bytes,
                                     from.stream()));
    }
    CUDA_CHECK(cudaStreamSynchronize(from.stream()));
  }
  std::vector<std::unique_ptr<cuda::TpStage>> stages_;
};

// Prefill `batch` prompts of `prompt` tokens, then `decode_steps` decode steps: greedy, or
// with `sample` temperature 0.8 and top-k 40, a seed a sequence (as conveyor-bench-cluster's
// requests without --greedy), so that the step includes the GPU sampler.
Result run_once(Pipeline& stage, int batch, int prompt, int decode_steps, bool sample, std::mt19937& rng) {
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

  std::vector<SamplingParams> sampled(static_cast<size_t>(batch));
  for (int s = 0; s < batch; ++s) {
    SamplingParams& p = sampled[static_cast<size_t>(s)];
    p.temperature = 0.8f, p.top_k = 40, p.seed = uint64_t(s);
  }
  std::vector<cuda::SampleRow> rows(static_cast<size_t>(batch), cuda::SampleRow{&greedy, {}, {}, 0});
  if (sample)
    for (int s = 0; s < batch; ++s) rows[static_cast<size_t>(s)].params = &sampled[static_cast<size_t>(s)];
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
  r.total_ms = r.ttft_ms;
  if (!times.empty()) {
    double sum = 0;
    for (double t : times) sum += t;
    r.total_ms += sum;
    r.ms_per_token = sum / double(times.size());
    std::nth_element(times.begin(), times.begin() + int64_t(times.size() / 2), times.end());
    r.p50_ms = times[times.size() / 2];
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  if (args.sample) std::printf("# decode steps sample every row: temperature 0.8, top-k 40, a seed a sequence\n");
  // CONVEYOR_PDL (common/options.h), as a worker applies it, before the first launch.
  cuda::set_pdl(process_options().kernels.pdl);
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
      csv << "shape,mode,dtype,weights,tp,pp,batch,prompt,new_tokens,ttft_ms,ms_per_token,p50_ms,tokens_per_s,floor_ms,"
             "fraction_of_floor,total_ms\n";
    }
    std::vector<std::string> table;
    char line[512];
    std::snprintf(line, sizeof line, "%-10s %-4s %-5s %5s %6s %5s %10s %9s %9s %10s %9s %8s %10s %8s %8s", "shape",
                  "mode", "dtype", "batch", "prompt", "new", "ttft_ms", "ms/token", "p50_ms", "tokens/s", "floor_ms",
                  "floor%", "total_ms", "det/fast", "x dtype");
    table.push_back(line);
    std::mt19937 rng(1234);
    const int max_prompt = *std::max_element(args.prompts.begin(), args.prompts.end());
    const int max_batch = *std::max_element(args.batches.begin(), args.batches.end());
    // (shape, weights, prompt, batch, new) -> det ms/token; (shape, mode, prompt, batch, new) -> the dtype's
    std::map<std::tuple<std::string, std::string, int, int, int>, double> det_ms, dtype_ms;
    for (const std::string& shape : args.shapes) {
     for (const std::string& weights : args.weights) {
     const bool int8 = weights == "int8", fp8 = weights == "fp8";
     const std::string wname = (weights == "dtype" ? args.dtype : weights) + (args.kv_fp8 ? "/kv8" : "");
     for (const std::string& mode : args.modes) {
      auto cfg_or = named_model_shape(shape);
      if (!cfg_or.ok()) throw Error(cfg_or.error());
      ModelConfig cfg = *cfg_or;
      const int max_new = *std::max_element(args.new_tokens.begin(), args.new_tokens.end());
      cfg.n_positions = std::max<int64_t>(cfg.n_positions, max_prompt + max_new);
      cuda::GpuStageOptions o;
      o.dtype = args.dtype == "bf16" ? DType::BF16 : DType::F16;
      o.name = shape;
      o.max_tokens = args.max_tokens;
      o.max_seqs = std::max(max_batch, 1);
      o.kv_cache_fraction = args.kv_fraction;
      o.cuda_graphs = args.graphs;
      o.int8_weights = int8;
      o.fp8 = fp8;
      o.kv_fp8 = args.kv_fp8;
      if (args.ar_push_max >= 0) o.all_reduce_push_max_bytes = size_t(args.ar_push_max);
      o.gemm = process_options().kernels.gemm;  // CONVEYOR_GEMM_ORDER and the rest
      o.deterministic = mode == "det";
      const auto t0 = Clock::now();
      std::vector<std::unique_ptr<cuda::TpStage>> stages;
      for (int s = 0; s < args.pp; ++s) {
        std::vector<int> gpus;
        for (int r = 0; r < args.tp; ++r) gpus.push_back((s * args.tp + r) % devices);
        o.name = shape + (args.pp > 1 ? " stage " + std::to_string(s) : "");
        auto built = cuda::TpStage::create_synthetic(cfg, cfg.n_layer * s / args.pp, cfg.n_layer * (s + 1) / args.pp, 42,
                                                     gpus, o);
        if (!built) throw Error(built.error());  // start-up: main reports it
        stages.push_back(std::move(built).value());
      }
      auto stage = std::make_unique<Pipeline>(std::move(stages));
      std::printf("# %s, %s (n_positions %lld, %s weights, tp %d, pp %d%s): built in %.1f s%s\n", shape.c_str(),
                  mode == "det" ? "deterministic" : "fast (not batch-invariant)", (long long)cfg.n_positions, wname.c_str(), args.tp, args.pp,
                  args.tp * args.pp > devices ? ", ranks sharing GPUs: times not meaningful" : "", ms_since(t0) / 1e3,
                  stage->memory_report().c_str());
      const double floor_ms = double(stage->decode_weight_bytes()) / bw * 1e3;
      for (int prompt : args.prompts) {
        for (int batch : args.batches) {
         for (int new_tokens : args.new_tokens) {
          const int64_t pages_per_seq = (prompt + new_tokens + cuda::kPageTokens - 1) / cuda::kPageTokens;
          if (batch * pages_per_seq * cuda::kPageTokens > stage->kv_capacity_tokens()) {
            std::snprintf(line, sizeof line, "%-10s %-4s %-5s %5d %6d %5d   skipped: the K/V cache holds %lld positions, %lld needed",
                          shape.c_str(), mode.c_str(), wname.c_str(), batch, prompt, new_tokens, (long long)stage->kv_capacity_tokens(),
                          (long long)(batch * pages_per_seq * cuda::kPageTokens));
            table.push_back(line);
            std::printf("%s\n", line);
            continue;
          }
          run_once(*stage, batch, prompt, 3, args.sample, rng);  // warm-up: plans, graphs
          // Only the measured run is profiled: `ncu --profile-from-start off` (or nsys's
          // cudaProfilerApi capture) leaves out the warm-up's plan timing and graph capture.
          CUDA_CHECK(cudaProfilerStart());
          const Result r = run_once(*stage, batch, prompt, new_tokens - 1, args.sample, rng);
          CUDA_CHECK(cudaProfilerStop());
          const double tps = batch * 1e3 / r.ms_per_token;
          char floor_s[32] = "-", frac_s[32] = "-";
          if (batch == 1) {
            std::snprintf(floor_s, sizeof floor_s, "%.3f", floor_ms);
            std::snprintf(frac_s, sizeof frac_s, "%.1f%%", 100.0 * floor_ms / r.ms_per_token);
          }
          const auto key = std::make_tuple(shape, weights, prompt, batch, new_tokens);
          const auto wkey = std::make_tuple(shape, mode, prompt, batch, new_tokens);
          char ratio_s[32] = "-", vs_dtype_s[32] = "-";
          if (mode == "det") det_ms[key] = r.ms_per_token;
          else if (auto it = det_ms.find(key); it != det_ms.end())
            std::snprintf(ratio_s, sizeof ratio_s, "%.3f", it->second / r.ms_per_token);
          if (weights == "dtype") dtype_ms[wkey] = r.ms_per_token;
          else if (auto it = dtype_ms.find(wkey); it != dtype_ms.end())
            std::snprintf(vs_dtype_s, sizeof vs_dtype_s, "%.3f", it->second / r.ms_per_token);
          std::snprintf(line, sizeof line, "%-10s %-4s %-5s %5d %6d %5d %10.2f %9.3f %9.3f %10.1f %9s %8s %10.1f %8s %8s",
                        shape.c_str(), mode.c_str(), wname.c_str(), batch, prompt, new_tokens, r.ttft_ms,
                        r.ms_per_token, r.p50_ms, tps, floor_s, frac_s, r.total_ms, ratio_s, vs_dtype_s);
          table.push_back(line);
          std::printf("%s\n", line);
          std::fflush(stdout);
          if (csv.is_open())
            csv << shape << "," << mode << "," << args.dtype << "," << wname << "," << args.tp << ","
                << args.pp << "," << batch << "," << prompt << "," << new_tokens << "," << r.ttft_ms
                << "," << r.ms_per_token << "," << r.p50_ms << "," << tps << "," << (batch == 1 ? floor_ms : 0) << ","
                << (batch == 1 ? floor_ms / r.ms_per_token : 0) << "," << r.total_ms << "\n";
         }
        }
      }
      if (std::getenv("CONVEYOR_BENCH_PLANS"))
        std::printf("# GEMM plans:\n%s", stage->last().lead().gemm().describe_plans().c_str());
     }
     }
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

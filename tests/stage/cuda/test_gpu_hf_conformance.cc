// HuggingFace conformance of the GPU path, in fp16 and bf16, on the fixtures of
// tests/hf_fixtures.h (made by transformers in float64 from the fp16 checkpoints).
// Each case runs with teacher forcing (the golden greedy token is fed at every step) twice:
//   - through embed/forward/logits: the prompt as one prefill (context attention), then one
//     token per step (decode attention); our log-probs of the golden top-5 must lie within
//     2e-2 of the golden ones in fp16 (6e-2 in bf16, see below), and our argmax must equal the golden greedy token at every
//     step whose golden top-2 gap exceeds 0.05;
//   - through decode(), the CUDA-graph step with greedy sampling on the GPU: the same
//     argmax condition.
// Every step with a gap <= 0.05 where we chose differently is printed as a note.
// Each runs on one GPU and, where the machine has two, tensor parallel over both (TpStage):
// the same bounds hold at tp 2 (the fixtures with two heads or more: a GPU rank holds at
// least one).
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuHfConformance, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "stage/cuda/tp_stage.h"
#include "kernels/cpu/sampling.h"
#include "model/weights.h"
#include "tests/hf_fixtures.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// bf16: the fixtures are fp16 checkpoints, and bf16 keeps 3 fewer mantissa bits. Rounding
// the weights to bf16 and computing everything else in fp32 on the CPU engine already
// moves log-probs by up to 0.026 on hd128_l6 (0.017-0.019 on the others; measured
// 2026-11-23), so 2e-2 is out of reach for any bf16 implementation; the bf16 kernels add
// bf16 activations on top (0.045 measured on hd128_l6, H100).
constexpr double kLogprobToleranceF16 = 2e-2;
constexpr double kLogprobToleranceBF16 = 6e-2;
constexpr double kDecisiveGap = 0.05;

struct Case {
  std::vector<int32_t> prompt, greedy;
  std::vector<std::vector<int32_t>> top_ids;
  std::vector<std::vector<double>> top_lps;
  double gap(size_t t) const { return top_lps[t].size() >= 2 ? top_lps[t][0] - top_lps[t][1] : INFINITY; }
};

std::vector<Case> load_cases(const fs::path& dir) {
  std::ifstream in(dir / "golden.json");
  const json g = json::parse(in);
  std::vector<Case> out;
  for (const json& c : g.at("cases"))
    out.push_back({c.at("prompt").get<std::vector<int32_t>>(), c.at("greedy").get<std::vector<int32_t>>(),
                   c.at("top5_ids").get<std::vector<std::vector<int32_t>>>(),
                   c.at("top5_logprobs").get<std::vector<std::vector<double>>>()});
  return out;
}

struct Report {
  int steps = 0, decisive = 0;
  double max_diff = 0;
  std::vector<std::string> problems, notes;
};

void check(const fs::path& dir, DType dtype, int tp, bool graph_path, Report& r) {
  auto cfg = load_model_config(dir.string());
  ASSERT_TRUE(cfg) << cfg.error();
  auto weights = load_stage_weights(dir.string(), 0, cfg->n_layer);
  ASSERT_TRUE(weights) << weights.error();
  cuda::GpuStageOptions o;
  o.dtype = dtype;
  o.name = dir.filename().string();
  o.max_tokens = cfg->n_positions;
  o.max_seqs = 8;
  o.kv_cache_max_bytes = int64_t(256) << 20;
  std::vector<int> devices;
  for (int k = 0; k < tp; ++k) devices.push_back(k);
  auto stage = cuda::TpStage::create(*weights, devices, o).value();
  const int64_t V = cfg->vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  SamplingParams greedy_params;  // temperature 0: argmax
  greedy_params.temperature = 0;
  uint64_t seq = 0;
  for (const Case& c : load_cases(dir)) {
    ++seq;
    const std::string where = dir.filename().string() + (dtype == DType::F16 ? " fp16" : " bf16") + " tp " +
                              std::to_string(tp) +
                              (graph_path ? " decode()" : " forward()") + " case " + std::to_string(seq - 1);
    std::vector<int32_t> feed = c.prompt;
    int32_t pos = 0;
    // Prefill all but the last prompt token on the graph path; decode() takes the rest.
    if (graph_path && feed.size() > 1) {
      const SeqSlice s{seq, 0, int32_t(feed.size() - 1)};
      ASSERT_TRUE(stage->embed({&s, 1}, feed.data()).ok());
      ASSERT_TRUE(stage->forward({&s, 1}).ok());
      pos = s.num_tokens;
      feed.erase(feed.begin(), feed.end() - 1);
    }
    std::vector<int32_t> generated;
    for (size_t t = 0; t < c.greedy.size(); ++t) {
      if (pos + int64_t(feed.size()) > cfg->n_positions) break;
      int32_t ours = -1;
      if (graph_path) {
        const SeqSlice s{seq, pos, 1};
        const cuda::SampleRow row{&greedy_params, c.prompt, generated, 0};
        const Status st = stage->decode({&s, 1}, feed.data(), {&row, 1}, &ours);
        ASSERT_TRUE(st.ok()) << where << ": " << st.message();
      } else {
        const SeqSlice s{seq, pos, int32_t(feed.size())};
        Status st = stage->embed({&s, 1}, feed.data());
        if (st) st = stage->forward({&s, 1});
        if (st) st = stage->logits({&s, 1}, false, logits.data());
        ASSERT_TRUE(st.ok()) << where << ": " << st.message();
        ours = argmax_token(logits);
        const double lse = log_sum_exp(logits);
        for (size_t j = 0; j < c.top_ids[t].size(); ++j) {
          const double d = std::abs(double(logits[size_t(c.top_ids[t][j])]) - lse - c.top_lps[t][j]);
          r.max_diff = std::max(r.max_diff, d);
          if (d > (dtype == DType::F16 ? kLogprobToleranceF16 : kLogprobToleranceBF16)) {
            std::ostringstream m;
            m << where << " step " << t << ": log-prob of token " << c.top_ids[t][j] << " off by " << d;
            r.problems.push_back(m.str());
          }
        }
      }
      pos += int32_t(feed.size());
      ++r.steps;
      if (ours != c.greedy[t]) {
        std::ostringstream m;
        m << where << " step " << t << ": chose " << ours << ", golden " << c.greedy[t] << " (golden top-2 gap "
          << c.gap(t) << ")";
        (c.gap(t) > kDecisiveGap ? r.problems : r.notes).push_back(m.str());
      }
      if (c.gap(t) > kDecisiveGap) ++r.decisive;
      generated.push_back(c.greedy[t]);
      feed.assign(1, c.greedy[t]);
    }
    stage->free_sequence(seq);
  }
}

using testing::have_gpu;

class GpuHfConformance : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(GpuHfConformance, GoldenFixtures) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  const auto [dtype, tp] = GetParam();
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  // Ranks sharing one GPU hung here in bf16 on an H100 (2026-11-24) while fp16 passed and
  // test_tp_stage passes both: the fixtures run tensor parallel on separate GPUs only.
  if (gpus < tp) GTEST_SKIP() << "tp " << tp << " needs " << tp << " GPUs; this machine has " << gpus;
  const auto dirs = testing::hf_fixture_dirs();
  ASSERT_FALSE(dirs.empty());
  int split = 0;
  for (const fs::path& dir : dirs) {
    auto cfg = load_model_config(dir.string());
    ASSERT_TRUE(cfg) << cfg.error();
    if (cfg->n_head < tp) {  // a GPU rank holds whole heads, at least one
      std::cout << "[note] " << dir.filename().string() << ": " << cfg->n_head << " head(s), not split over " << tp
                << " GPUs\n";
      continue;
    }
    ++split;
    for (bool graph : {false, true}) {
      Report r;
      check(dir, dtype, tp, graph, r);
      std::string all;
      for (size_t i = 0; i < r.problems.size() && i < 20; ++i) all += "  " + r.problems[i] + "\n";
      EXPECT_TRUE(r.problems.empty()) << r.problems.size() << " problems:\n" << all;
      EXPECT_GE(r.steps, 40) << dir;
      for (const std::string& n : r.notes) std::cout << "[note] " << n << " (tolerated: near-tie)\n";
      std::cout << "[fixture] " << dir.filename().string() << (dtype == DType::F16 ? " fp16" : " bf16") << " tp " << tp
                << (graph ? " decode()" : " forward()") << ": " << r.steps << " steps, " << r.decisive
                << " decisive, max |logprob diff| " << r.max_diff << ", " << r.notes.size() << " near-tie divergences\n";
    }
  }
  EXPECT_GE(split, 2) << "fixtures run at tp " << tp;
}

// What a quantised stage stores in fewer bits, and the bounds its log-probs are held to.
struct Quantised {
  const char* label;
  bool int8 = false, fp8 = false, kv_fp8 = false;
  double mean_bound, max_bound;  // of the top-5 |log-prob| error against fp16
};
// Int8 weight-only: per-channel scales, fp16 activations.
constexpr Quantised kInt8{.label = "int8", .int8 = true, .mean_bound = 0.05, .max_bound = 0.5};
// FP8: E4M3 weights with per-channel scales and activations with per-token scales.
constexpr Quantised kFp8{.label = "fp8", .fp8 = true, .mean_bound = 0.1, .max_bound = 1.0};
// FP8 K/V: the cache in E4M3 with a scale per position and head, weights and activations in fp16.
constexpr Quantised kKvFp8{.label = "kv-fp8", .kv_fp8 = true, .mean_bound = 0.1, .max_bound = 1.0};

// A quantised stage against fp16 on the same fixtures, both fed the golden tokens: how often
// the greedy choice agrees, and how far the log-probs of fp16's top 5 move. Bounds: every
// step where fp16's top-2 gap exceeds 0.5 agrees, and the mean and max log-prob errors stay
// under q's bounds; the figures are printed. FP8 skips the fixtures whose layer matrices are
// not multiples of 16, FP8 K/V those whose head size the tile order does not take.
void quantised_against_fp16(const Quantised& q) {
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  for (const fs::path& dir : testing::hf_fixture_dirs()) {
    auto cfg = load_model_config(dir.string());
    ASSERT_TRUE(cfg) << cfg.error();
    auto weights = load_stage_weights(dir.string(), 0, cfg->n_layer);
    ASSERT_TRUE(weights) << weights.error();
    for (int tp : {1, 2}) {
      if (cfg->n_head < tp || gpus < tp) continue;
      std::vector<int> devices;
      for (int k = 0; k < tp; ++k) devices.push_back(k);
      cuda::GpuStageOptions o;
      o.dtype = DType::F16;
      o.name = dir.filename().string();
      o.max_tokens = cfg->n_positions;
      o.max_seqs = 8;
      o.kv_cache_max_bytes = int64_t(128) << 20;
      auto fp16 = cuda::TpStage::create(*weights, devices, o).value();
      o.int8_weights = q.int8;
      o.fp8 = q.fp8;
      o.kv_fp8 = q.kv_fp8;
      auto quantised = cuda::TpStage::create(*weights, devices, o);
      const std::string refused = quantised ? "" : quantised.status().message();
      if ((q.fp8 && refused.find("multiples of 16") != std::string::npos) ||
          (q.kv_fp8 && refused.find("head size") != std::string::npos)) {
        std::cout << "[note] " << dir.filename().string() << ": " << quantised.status().message() << "\n";
        continue;
      }
      ASSERT_TRUE(quantised) << quantised.status().message();
      auto q_stage = std::move(quantised).value();
      const int64_t V = cfg->vocab_size;
      std::vector<float> a(size_t(V), 0.f), b(size_t(V), 0.f);
      int steps = 0, agree = 0, decisive = 0, decisive_agree = 0;
      double sum_diff = 0, max_diff = 0;
      int64_t diffs = 0;
      uint64_t seq = 0;
      for (const Case& c : load_cases(dir)) {
        ++seq;
        std::vector<int32_t> feed = c.prompt;
        int32_t pos = 0;
        for (size_t t = 0; t < c.greedy.size() && pos + int64_t(feed.size()) <= cfg->n_positions; ++t) {
          const SeqSlice sl{seq, pos, int32_t(feed.size())};
          for (auto [stage, out] : {std::pair{fp16.get(), &a}, std::pair{q_stage.get(), &b}}) {
            Status st = stage->embed({&sl, 1}, feed.data());
            if (st) st = stage->forward({&sl, 1});
            if (st) st = stage->logits({&sl, 1}, false, out->data());
            ASSERT_TRUE(st.ok()) << st.message();
          }
          const int32_t ta = argmax_token(a), tb = argmax_token(b);
          const double la = log_sum_exp(a), lb = log_sum_exp(b);
          std::vector<int32_t> order(static_cast<size_t>(V));
          for (int64_t i = 0; i < V; ++i) order[size_t(i)] = int32_t(i);
          std::partial_sort(order.begin(), order.begin() + 5, order.end(),
                            [&](int32_t x, int32_t y) { return a[size_t(x)] > a[size_t(y)]; });
          for (int j = 0; j < 5 && j < V; ++j) {
            const double d = std::abs((a[size_t(order[size_t(j)])] - la) - (b[size_t(order[size_t(j)])] - lb));
            sum_diff += d, max_diff = std::max(max_diff, d), ++diffs;
          }
          ++steps;
          agree += ta == tb;
          if (V > 1 && a[size_t(order[0])] - a[size_t(order[1])] > 0.5f) {
            ++decisive;
            decisive_agree += ta == tb;
            EXPECT_EQ(tb, ta) << dir.filename().string() << " tp " << tp << " case " << seq - 1 << " step " << t;
          }
          pos += int32_t(feed.size());
          feed.assign(1, c.greedy[t]);
        }
        fp16->free_sequence(seq);
        q_stage->free_sequence(seq);
      }
      const double mean = diffs ? sum_diff / double(diffs) : 0;
      std::cout << "[" << q.label << "] " << dir.filename().string() << " tp " << tp << ": greedy agreement " << agree << "/" << steps
                << " (" << 100.0 * agree / std::max(steps, 1) << "%), decisive " << decisive_agree << "/" << decisive
                << ", top-5 |logprob diff| mean " << mean << " max " << max_diff << "\n";
      EXPECT_GE(steps, 40);
      EXPECT_LT(mean, q.mean_bound) << dir;
      EXPECT_LT(max_diff, q.max_bound) << dir;
    }
  }
}

TEST(GpuHfConformance, Int8WeightsAgainstFp16) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  quantised_against_fp16(kInt8);
}

TEST(GpuHfConformance, Fp8AgainstFp16) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  if (Status s = cuda::Gemm().fp8_supported(); !s) GTEST_SKIP() << s.message();
  quantised_against_fp16(kFp8);
}

// FP8 K/V stays deterministic: per token at append, the tile order's fixed pieces.
TEST(GpuHfConformance, KvFp8AgainstFp16) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this host";
  quantised_against_fp16(kKvFp8);
}

INSTANTIATE_TEST_SUITE_P(DtypesAndTp, GpuHfConformance,
                         ::testing::Combine(::testing::Values(DType::F16, DType::BF16), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == DType::F16 ? "F16" : "BF16") + "_Tp" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace conveyor

#endif

// Conformance with HuggingFace transformers: for every fixture (tests/hf_fixtures.h), load
// the model, run each golden case with teacher forcing and compare:
//   - at each step t our argmax with golden greedy[t];
//   - our log-probs of the golden top5_ids[t] with top5_logprobs[t], |diff| <= 1e-3;
//   - then feed greedy[t] (the golden token), not ours, so one near-tie cannot derail the
//     rest of the case.
// A case passes when every log-prob is within tolerance and at least min(40, steps) steps
// have the identical argmax. golden.json = {"cases": [{"prompt": [ids], "greedy": [ids],
// "top5_ids": [[5 ids] per step], "top5_logprobs": [[5 floats] per step]}]}.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "model/checkpoint_writer.h"
#include "stage/cpu/cpu_stage.h"
#include "kernels/cpu/sampling.h"
#include "model/weights.h"
#include "tests/hf_fixtures.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kLogprobTolerance = 1e-3;
constexpr int kRequiredIdenticalSteps = 40;

struct CheckReport {
  int cases = 0;
  int steps = 0;
  double max_logprob_diff = 0;        // largest |ours - golden| over all compared log-probs
  std::vector<std::string> problems;  // empty: conformant
};

// Runs every case of the fixture in `dir` on a stage of `tp` tensor-parallel ranks;
// returns what disagreed.
CheckReport check_fixture(const fs::path& dir, int tp = 1) {
  CheckReport report;
  const std::string name = dir.filename().string();
  auto problem = [&](const std::string& what) { report.problems.push_back(name + ": " + what); };

  std::ifstream in(dir / "golden.json");
  json golden;
  try {
    golden = json::parse(in);
  } catch (const std::exception& e) {
    problem(std::string("golden.json does not parse: ") + e.what());
    return report;
  }
  auto cfg = load_model_config(dir.string());
  if (!cfg) {
    problem(cfg.error());
    return report;
  }
  auto weights = load_stage_weights(dir.string(), 0, cfg->n_layer);
  if (!weights) {
    problem(weights.error());
    return report;
  }
  auto stage = CpuStage::create(std::move(*weights), tp).value();
  const int64_t C = cfg->n_embd, V = cfg->vocab_size, P = cfg->n_positions;
  if (!golden.contains("cases") || !golden["cases"].is_array() || golden["cases"].empty()) {
    problem("golden.json has no cases");
    return report;
  }

  std::vector<float> hidden, logits(static_cast<size_t>(V));
  uint64_t seq_id = 0;
  for (const json& cs : golden["cases"]) {
    const size_t case_index = size_t(report.cases++);
    const std::string where = "case " + std::to_string(case_index);
    std::vector<int32_t> prompt, greedy;
    std::vector<std::vector<int32_t>> top_ids;
    std::vector<std::vector<double>> top_lps;
    try {
      prompt = cs.at("prompt").get<std::vector<int32_t>>();
      greedy = cs.at("greedy").get<std::vector<int32_t>>();
      top_ids = cs.at("top5_ids").get<std::vector<std::vector<int32_t>>>();
      top_lps = cs.at("top5_logprobs").get<std::vector<std::vector<double>>>();
    } catch (const std::exception& e) {
      problem(where + ": malformed: " + e.what());
      continue;
    }
    if (prompt.empty() || greedy.size() != top_ids.size() || greedy.size() != top_lps.size()) {
      problem(where + ": prompt empty or greedy/top5_ids/top5_logprobs lengths differ");
      continue;
    }
    const uint64_t seq = ++seq_id;
    // Prefill the prompt; then step t reads the logits for position prompt + t - 1 and
    // feeds greedy[t] at position prompt + t.
    std::vector<int32_t> feed = prompt;
    int32_t pos = 0;
    int identical = 0, steps = 0;
    std::string first_mismatch;
    for (size_t t = 0; t < greedy.size(); ++t) {
      const SeqSlice slice{seq, pos, int32_t(feed.size())};
      if (int64_t(pos) + slice.num_tokens > P) break;  // context full: the remaining steps cannot run
      hidden.resize(size_t(slice.num_tokens * C));
      Status s = stage->embed({&slice, 1}, feed.data(), hidden.data());
      if (s) s = stage->forward({&slice, 1}, hidden.data());
      if (s) s = stage->logits({&slice, 1}, hidden.data(), false, logits.data());
      if (!s) {
        problem(where + " step " + std::to_string(t) + ": " + s.message());
        break;
      }
      pos += slice.num_tokens;
      ++steps;
      const int32_t ours = argmax_token(logits);
      const double lse = log_sum_exp(logits);
      const double gap = top_lps[t].size() >= 2 ? top_lps[t][0] - top_lps[t][1] : NAN;
      if (ours == greedy[t]) {
        ++identical;
      } else if (first_mismatch.empty()) {
        std::ostringstream m;
        m << where << " step " << t << ": argmax " << ours << " (logprob " << double(logits[size_t(ours)]) - lse
          << ") but golden greedy " << greedy[t] << "; golden top-2 gap " << gap;
        first_mismatch = m.str();
      }
      for (size_t j = 0; j < top_ids[t].size() && j < top_lps[t].size(); ++j) {
        const int32_t id = top_ids[t][j];
        if (id < 0 || id >= V) {
          problem(where + " step " + std::to_string(t) + ": golden id " + std::to_string(id) + " outside vocabulary");
          continue;
        }
        const double mine = double(logits[size_t(id)]) - lse;
        report.max_logprob_diff = std::max(report.max_logprob_diff, std::abs(mine - top_lps[t][j]));
        if (std::abs(mine - top_lps[t][j]) > kLogprobTolerance) {
          std::ostringstream m;
          m << where << " step " << t << ": logprob of token " << id << " (golden rank " << j << ") is " << mine
            << ", golden " << top_lps[t][j] << " (diff " << mine - top_lps[t][j] << "); our argmax " << ours
            << ", golden greedy " << greedy[t] << ", golden top-2 gap " << gap;
          problem(m.str());
        }
      }
      feed.assign(1, greedy[t]);
    }
    stage->free_sequence(seq);
    report.steps += steps;
    const int required = std::min<int>(kRequiredIdenticalSteps, int(greedy.size()));
    if (identical < required)
      problem(where + ": " + std::to_string(identical) + " of " + std::to_string(steps) + " steps ran with the golden argmax (" +
              std::to_string(required) + " required); first mismatch: " + first_mismatch);
    else if (!first_mismatch.empty())
      std::cout << "[note] " << name << ": " << first_mismatch << " (tolerated: " << identical << " identical)\n";
  }
  return report;
}

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (size_t i = 0; i < lines.size() && i < 20; ++i) out += "  " + lines[i] + "\n";
  if (lines.size() > 20) out += "  ... and " + std::to_string(lines.size() - 20) + " more\n";
  return out;
}

TEST(HfConformance, GoldenFixtures) {
  const auto dirs = testing::hf_fixture_dirs();
  ASSERT_FALSE(dirs.empty()) << "no HF fixture found under " << CONVEYOR_SOURCE_DIR
                             << "/tests/data/hf_fixtures/ nor in $CONVEYOR_HF_FIXTURES";
  for (const fs::path& dir : dirs) {
    const CheckReport r = check_fixture(dir);
    EXPECT_TRUE(r.problems.empty()) << "fixture " << dir.string() << ":\n" << join(r.problems);
    EXPECT_GT(r.steps, 0) << "fixture " << dir.string() << " ran no step";
    std::cout << "[fixture] " << dir.filename().string() << ": " << r.cases << " cases, " << r.steps << " steps, max |logprob diff| "
              << r.max_logprob_diff << ", " << r.problems.size() << " problems\n";
  }
}

// Tensor parallel on 2 and 3 ranks (threads) meets the same bounds as one: the sharding
// (heads and MLP units split unevenly where they do not divide, ranks without a head) and
// the CPU all-reduce are right.
TEST(HfConformance, TensorParallelRanksMatchGolden) {
  const auto dirs = testing::hf_fixture_dirs();
  ASSERT_FALSE(dirs.empty());
  for (int tp : {2, 3})
    for (const fs::path& dir : dirs) {
      const CheckReport r = check_fixture(dir, tp);
      EXPECT_TRUE(r.problems.empty()) << "fixture " << dir.string() << " at tp " << tp << ":\n" << join(r.problems);
      EXPECT_GT(r.steps, 0);
      std::cout << "[fixture] " << dir.filename().string() << " tp " << tp << ": max |logprob diff| "
                << r.max_logprob_diff << "\n";
    }
}

// The checker itself, without HF: a checkpoint written here with random weights, a golden
// file made from this model's own outputs (must pass), then perturbed (must fail, and say
// where).
TEST(HfConformance, CheckerCatchesDisagreement) {
  ModelConfig c;
  c.n_layer = 2, c.n_embd = 32, c.n_head = 2, c.n_inner = 64, c.n_positions = 80, c.vocab_size = 300;
  const StageWeights w = random_stage_weights(c, 0, c.n_layer, 77);
  const fs::path dir = fs::temp_directory_path() / ("conveyor_hf_selftest_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ASSERT_TRUE(write_gpt2_checkpoint(dir.string(), c, w, DType::F32).ok());

  // Golden from our own stage, free-running greedy: case 0 has 45 steps, case 1 has 5.
  auto stage = CpuStage::create(w).value();
  json golden;
  golden["cases"] = json::array();
  for (uint64_t k = 0; k < 2; ++k) {
    std::vector<int32_t> prompt = {int32_t(3 + k), int32_t(100 + k), 7};
    json cs;
    cs["prompt"] = prompt;
    std::vector<int32_t> feed = prompt, greedy;
    std::vector<std::vector<int32_t>> ids;
    std::vector<std::vector<double>> lps;
    int32_t pos = 0;
    std::vector<float> hidden, logits(size_t(c.vocab_size));
    for (int t = 0; t < (k == 0 ? 45 : 5); ++t) {
      const SeqSlice sl{k + 1, pos, int32_t(feed.size())};
      hidden.resize(size_t(sl.num_tokens * c.n_embd));
      ASSERT_TRUE(stage->embed({&sl, 1}, feed.data(), hidden.data()).ok());
      ASSERT_TRUE(stage->forward({&sl, 1}, hidden.data()).ok());
      ASSERT_TRUE(stage->logits({&sl, 1}, hidden.data(), false, logits.data()).ok());
      pos += sl.num_tokens;
      const TokenLogprobs lp = token_logprobs(logits, 0, 5);
      greedy.push_back(lp.top[0].first);
      ids.emplace_back();
      lps.emplace_back();
      for (auto [id, v] : lp.top) ids.back().push_back(id), lps.back().push_back(v);
      feed.assign(1, greedy.back());
    }
    cs["greedy"] = greedy;
    cs["top5_ids"] = ids;
    cs["top5_logprobs"] = lps;
    golden["cases"].push_back(cs);
  }
  auto write_golden = [&](const json& g) { std::ofstream(dir / "golden.json") << g.dump(); };

  write_golden(golden);
  CheckReport r = check_fixture(dir);
  EXPECT_TRUE(r.problems.empty()) << join(r.problems);
  EXPECT_EQ(r.steps, 50);

  json bad = golden;  // one log-prob off by 5e-3: reported with case and step
  bad["cases"][0]["top5_logprobs"][12][2] = bad["cases"][0]["top5_logprobs"][12][2].get<double>() + 5e-3;
  write_golden(bad);
  r = check_fixture(dir);
  ASSERT_EQ(r.problems.size(), 1u) << join(r.problems);
  EXPECT_NE(r.problems[0].find("case 0 step 12"), std::string::npos) << r.problems[0];

  // A different golden token at the last step (never fed back): case 0 still has 44 of
  // 45 identical (>= 40, tolerated); case 1 has 4 of 5 (all 5 required).
  bad = golden;
  for (int k : {0, 1}) {
    json& g = bad["cases"][size_t(k)];
    const size_t last = g["greedy"].size() - 1;
    g["greedy"][last] = g["top5_ids"][last][4];
  }
  write_golden(bad);
  r = check_fixture(dir);
  ASSERT_EQ(r.problems.size(), 1u) << join(r.problems);
  EXPECT_NE(r.problems[0].find("case 1: 4 of 5 steps ran with the golden argmax (5 required); first mismatch: case 1 "
                               "step 4: argmax"),
            std::string::npos)
      << r.problems[0];
  EXPECT_NE(r.problems[0].find("golden top-2 gap"), std::string::npos) << r.problems[0];
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conveyor

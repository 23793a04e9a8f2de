// Beam search against HuggingFace transformers: for every HF fixture (tests/hf_fixtures.h),
// beam_golden.json (scripts/make_hf_beam_fixtures.py) holds the beams transformers'
// generate(num_beams=B, num_return_sequences=n, length_penalty, early_stopping,
// do_sample=False, max_new_tokens, eos_token_id) returned for several prompts and settings,
// each draw's decisions at least min_margin apart; tests/data/beam_golden/*.json hold the same
// for a trained model (the demo model, models/brown-gpt2), named by the file's "model". Each
// draw runs through the coordinator's scheduler and a CPU stage
// (tests/coordinator/inproc_pipeline.h), with the model's end-of-text id set to the draw's: the
// same sequences, best first, and the same sequence scores within what float32 arithmetic
// explains (log-probs within ~4e-6 of float64 on the fixtures: see HfConformance; here 1e-5 a
// token, scaled by the length penalty).
//
// A fixture without beam_golden.json, or tests/data/beam_golden without a .json, fails the test
// (make them with the script; see tests/README.md and tests/data/beam_golden/README.md).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/coordinator/inproc_pipeline.h"
#include "tests/hf_fixtures.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kLogprobTolerancePerToken = 1e-5;

EarlyStopping early_of(const json& v) {
  if (v.is_boolean()) return v.get<bool>() ? EarlyStopping::Stop : EarlyStopping::Heuristic;
  EXPECT_EQ(v, "never") << "early_stopping " << v.dump();
  return EarlyStopping::Never;
}

TEST(HfBeamConformance, GoldenBeams) {
  ASSERT_FALSE(testing::hf_fixture_dirs().empty()) << "no HF fixture found";
  const testing::BeamGoldens goldens = testing::beam_golden_files();
  for (const std::string& m : goldens.missing) ADD_FAILURE() << m;
  const std::string tokenizer = testing::source_dir() + "/models/brown-gpt2";  // text only; ids are compared
  for (const fs::path& file : goldens.files) {
    std::ifstream in(file);
    json golden;
    try {
      golden = json::parse(in);
    } catch (const std::exception& e) {
      ADD_FAILURE() << file.string() << " does not parse: " << e.what();
      continue;
    }
    ASSERT_TRUE(golden.contains("draws") && golden["draws"].is_array()) << file.string();
    // A fixture's golden lies in the fixture; another names its model folder (relative to the source root).
    fs::path dir = file.parent_path();
    if (golden.contains("model")) {
      ASSERT_TRUE(golden["model"].is_string()) << file.string() << ": \"model\" is not a string";
      dir = fs::path(testing::source_dir()) / golden["model"].get<std::string>();
      if (!fs::is_regular_file(dir / "config.json")) {
        ADD_FAILURE() << file.string() << ": \"model\" " << golden["model"].dump() << " is no model folder ("
                      << dir.string() << "/config.json is missing)";
        continue;
      }
    }
    EXPECT_GT(golden["draws"].size(), 0u) << file.string() << " keeps no draw";
    int checked = 0;
    double max_diff = 0;
    for (const json& d : golden["draws"]) {
      const std::vector<int32_t> prompt = d["prompt"].get<std::vector<int32_t>>();
      const int B = d["num_beams"], n = d["num_return_sequences"], M = d["max_new_tokens"];
      const float lp = d["length_penalty"].get<float>();
      const auto want = d["sequences"].get<std::vector<std::vector<int32_t>>>();
      const auto want_scores = d["scores"].get<std::vector<double>>();
      SCOPED_TRACE(dir.filename().string() + ": prompt of " + std::to_string(prompt.size()) + ", B " +
                   std::to_string(B) + ", n " + std::to_string(n) + ", lp " + std::to_string(lp) + ", early " +
                   d["early_stopping"].dump() + ", eos " + d["eos_token_id"].dump());
      ASSERT_EQ(want.size(), size_t(n));
      testing::InprocPipeline p(dir.string(), tokenizer);
      p.cfg.model.eos_token_id = d["eos_token_id"].get<int64_t>();
      auto r = std::make_shared<CompletionRequest>();
      r->prompts = {prompt};
      r->use_beam_search = true;
      r->best_of = B;
      r->n = n;
      r->max_tokens = M;
      r->length_penalty = lp;
      r->early_stopping = early_of(d["early_stopping"]);
      r->sampling.temperature = 0;
      testing::Collected c;
      ASSERT_TRUE(p.scheduler->submit(r, c.sink()).ok());
      p.run_until_idle();
      ASSERT_EQ(c.done, std::vector<std::string>{""});
      ASSERT_EQ(c.updates.size(), size_t(n));
      for (const ChoiceUpdate& u : c.updates) {
        ASSERT_LT(u.choice, size_t(n));
        std::vector<int32_t> tokens;
        double sum = 0;
        for (const TokenOut& t : u.tokens) tokens.push_back(t.id), sum += t.logprob;
        EXPECT_EQ(tokens, want[u.choice]) << "beam " << u.choice;
        const double len = double(tokens.size());
        const double score = sum / std::pow(len, double(lp));
        const double tolerance = kLogprobTolerancePerToken * len * std::max(1.0, std::pow(len, -double(lp)));
        EXPECT_NEAR(score, want_scores[u.choice], tolerance) << "beam " << u.choice;
        max_diff = std::max(max_diff, std::fabs(score - want_scores[u.choice]));
        const bool ended_on_eos = !tokens.empty() && tokens.back() == p.cfg.model.eos_token_id;
        EXPECT_EQ(u.finish_reason.value_or(""), ended_on_eos ? "stop" : "length");
      }
      ++checked;
    }
    std::cout << "[beam fixture] " << dir.filename().string() << ": " << checked << " draws ("
              << golden.value("skipped", json::array()).size() << " skipped as near-ties by the script), max |score diff| "
              << max_diff << "\n";
  }
}

}  // namespace
}  // namespace conveyor

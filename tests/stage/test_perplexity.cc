// The shipped demo model against the PyTorch figures its training script recorded
// (models/brown-gpt2/heldout.json): our tokenizer must give the same ids as the trainer's
// HuggingFace tokenizer, and our engine the same perplexity (relative difference < 1e-3).
#include <cmath>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "stage/engine.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

TEST(DemoModelPerplexity, MatchesPyTorch) {
  const std::string dir = testing::source_dir() + "/models/brown-gpt2";
  std::ifstream in(dir + "/heldout.json");
  ASSERT_TRUE(in) << "missing " << dir << "/heldout.json";
  const nlohmann::json held = nlohmann::json::parse(in);
  const auto expected_ids = held.at("token_ids").get<std::vector<int32_t>>();
  const size_t window = held.at("window").get<size_t>();

  Expected<Tokenizer> tok = Tokenizer::load(dir);
  ASSERT_TRUE(tok.ok()) << tok.error();
  const std::vector<int32_t> ids = tok->encode(held.at("text").get<std::string>());
  ASSERT_EQ(ids, expected_ids) << "our tokenizer disagrees with the one the model was trained with";

  Expected<StageWeights> w = load_stage_weights(dir, 0, 6);
  ASSERT_TRUE(w.ok()) << w.error();
  auto engine = Engine::create(std::move(w).value()).value();
  Expected<double> nll = engine->mean_nll(std::span<const int32_t>(ids.data(), window));
  ASSERT_TRUE(nll.ok()) << nll.error();
  const double ref_ppl = held.at("perplexity").get<double>();
  const double ppl = std::exp(*nll);
  EXPECT_LT(std::abs(ppl - ref_ppl) / ref_ppl, 1e-3) << "ours " << ppl << ", PyTorch " << ref_ppl;
  EXPECT_NEAR(*nll, held.at("mean_nll").get<double>(), 1e-3);
}

}  // namespace
}  // namespace conveyor

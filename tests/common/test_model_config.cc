// config.json parsing and the named synthetic shapes (common/model_config.h).
#include "common/model_config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace conveyor {
namespace {

using nlohmann::json;

json gpt2_small() {
  return {{"model_type", "gpt2"},     {"n_embd", 768},          {"n_head", 12},
          {"n_layer", 12},            {"n_positions", 1024},    {"vocab_size", 50257},
          {"n_inner", nullptr},       {"layer_norm_epsilon", 1e-5}, {"activation_function", "gelu_new"},
          {"eos_token_id", 50256},    {"tie_word_embeddings", true}};
}

Expected<ModelConfig> parse(const json& j) { return parse_model_config(j.dump(), "test/config.json"); }

// The error must name the source file and contain `needle`.
void expect_error(const json& j, const std::string& needle) {
  auto c = parse(j);
  ASSERT_FALSE(c.ok()) << j.dump();
  EXPECT_NE(c.error().find("test/config.json"), std::string::npos) << c.error();
  EXPECT_NE(c.error().find(needle), std::string::npos) << "want \"" << needle << "\" in: " << c.error();
}

TEST(ModelConfig, ParsesGpt2Small) {
  auto c = parse(gpt2_small());
  ASSERT_TRUE(c.ok()) << c.error();
  EXPECT_EQ(c->n_embd, 768);
  EXPECT_EQ(c->n_head, 12);
  EXPECT_EQ(c->head_dim(), 64);
  EXPECT_EQ(c->n_layer, 12);
  EXPECT_EQ(c->n_inner, 4 * 768);  // null means 4 * n_embd
  EXPECT_EQ(c->n_positions, 1024);
  EXPECT_EQ(c->vocab_size, 50257);
  EXPECT_FLOAT_EQ(c->layer_norm_epsilon, 1e-5f);
  EXPECT_EQ(c->activation, Activation::GeluNew);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_id, 50256);
}

TEST(ModelConfig, NInnerAbsentOrNullOrGiven) {
  json j = gpt2_small();
  j.erase("n_inner");
  EXPECT_EQ(parse(j)->n_inner, 3072);
  j["n_inner"] = 1000;
  EXPECT_EQ(parse(j)->n_inner, 1000);
  j["n_inner"] = "1000";
  expect_error(j, "n_inner");
}

TEST(ModelConfig, MissingRequiredKeysAreNamed) {
  for (const char* key : {"n_embd", "n_head", "n_layer", "n_positions", "vocab_size"}) {
    json j = gpt2_small();
    j.erase(key);
    expect_error(j, key);
    j[key] = nullptr;
    expect_error(j, key);
  }
}

TEST(ModelConfig, WrongTypesAreNamed) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"n_embd", "768"}, {"n_head", 12.5}, {"n_layer", true}, {"vocab_size", json::array({1})},
           {"layer_norm_epsilon", "1e-5"}, {"activation_function", 3}, {"tie_word_embeddings", "yes"}}) {
    json j = gpt2_small();
    j[key] = value;
    expect_error(j, key);
  }
}

TEST(ModelConfig, NonPositiveValuesRejected) {
  for (const char* key : {"n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner"}) {
    json j = gpt2_small();
    j[key] = 0;
    expect_error(j, key);
    j[key] = -4;
    expect_error(j, key);
  }
  json j = gpt2_small();
  j["layer_norm_epsilon"] = -1e-5;
  expect_error(j, "layer_norm_epsilon");
}

TEST(ModelConfig, Activations) {
  json j = gpt2_small();
  j["activation_function"] = "gelu";
  EXPECT_EQ(parse(j)->activation, Activation::Gelu);
  j["activation_function"] = "gelu_pytorch_tanh";
  EXPECT_EQ(parse(j)->activation, Activation::GeluNew);
  j["activation_function"] = "relu";
  expect_error(j, "relu");
}

TEST(ModelConfig, EmbdMustDivideByHeads) {
  json j = gpt2_small();
  j["n_head"] = 7;
  expect_error(j, "not divisible by n_head");
}

TEST(ModelConfig, NotJsonNotObjectOtherModelType) {
  auto c = parse_model_config("{\"n_embd\": ", "test/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().find("test/config.json"), std::string::npos);
  expect_error(json::array({1, 2}), "object");
  json j = gpt2_small();
  j["model_type"] = "llama";
  expect_error(j, "llama");
}

TEST(ModelConfig, UntiedAndNoEos) {
  json j = gpt2_small();
  j["tie_word_embeddings"] = false;
  j.erase("eos_token_id");
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error();
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_id, -1);
}

TEST(ModelConfig, LoadsFromDirectoryOrFileAndNamesMissingFile) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / "conveyor_model_config_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << gpt2_small().dump();
  auto from_dir = load_model_config(dir.string());
  ASSERT_TRUE(from_dir.ok()) << from_dir.error();
  EXPECT_EQ(from_dir->n_embd, 768);
  auto from_file = load_model_config((dir / "config.json").string());
  ASSERT_TRUE(from_file.ok()) << from_file.error();

  std::ofstream(dir / "config.json") << "{\"n_embd\": 768}";  // truncates: missing keys
  auto bad = load_model_config(dir.string());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find((dir / "config.json").string()), std::string::npos) << bad.error();
  EXPECT_NE(bad.error().find("n_head"), std::string::npos) << bad.error();

  auto missing = load_model_config((dir / "nope").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().find("nope"), std::string::npos) << missing.error();
  std::filesystem::remove_all(dir);
}

TEST(ModelConfig, ParsesHfFixtureConfig) {
  const auto path = std::filesystem::path(testing::source_dir()) / "tests/data/hf_fixtures/hd32_l2/config.json";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present";
  auto c = load_model_config(path.string());
  ASSERT_TRUE(c.ok()) << c.error();
  EXPECT_EQ(c->n_embd, 96);
  EXPECT_EQ(c->n_head, 3);
  EXPECT_EQ(c->n_inner, 300);
  EXPECT_EQ(c->n_layer, 2);
}

TEST(NamedModelShape, KnownNames) {
  auto xl = named_model_shape("gpt2-xl");
  ASSERT_TRUE(xl.ok());
  EXPECT_EQ(xl->n_layer, 48);
  EXPECT_EQ(xl->n_embd, 1600);
  EXPECT_EQ(xl->n_head, 25);
  EXPECT_EQ(xl->n_positions, 1024);
  EXPECT_EQ(xl->n_inner, 6400);
  auto big = named_model_shape("gpt3-175b");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->n_layer, 96);
  EXPECT_EQ(big->n_embd, 12288);
  EXPECT_EQ(big->head_dim(), 128);
  EXPECT_EQ(big->vocab_size, 50257);
  EXPECT_EQ(big->n_positions, 2048);
  EXPECT_EQ(named_model_shape("gpt3-6.7b")->n_embd, 4096);
  EXPECT_EQ(named_model_shape("gpt3-13b")->n_layer, 40);
}

TEST(NamedModelShape, Triples) {
  auto c = named_model_shape("3,64,4");
  ASSERT_TRUE(c.ok()) << c.error();
  EXPECT_EQ(c->n_layer, 3);
  EXPECT_EQ(c->n_embd, 64);
  EXPECT_EQ(c->n_head, 4);
  EXPECT_EQ(c->n_inner, 256);
  for (const char* bad : {"3,64,5", "3,64", "3,64,4,1", "3;64;4", "0,64,4", "3,-64,4", "3,64,4x", "gpt9", ""}) {
    auto r = named_model_shape(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.error().find(std::string("\"") + bad + "\""), std::string::npos) << r.error();
    }
  }
}


// Found by fuzz/fuzz_model_config (issue 28): a number too large for a double makes nlohmann
// throw out_of_range (not parse_error), which escaped parse_model_config and so
// load_model_config: a bad config.json threw out of the daemons' start instead of naming the file.
TEST(ModelConfig, NumberOverflowIsAnErrorNotAThrow) {
  Expected<ModelConfig> c = ModelConfig{};
  ASSERT_NO_THROW(c = parse_model_config(R"({"n_layer": 1e999})", "test/config.json"));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().find("test/config.json"), std::string::npos) << c.error();
  EXPECT_NE(c.error().find("not valid JSON"), std::string::npos) << c.error();
}

}  // namespace
}  // namespace conveyor

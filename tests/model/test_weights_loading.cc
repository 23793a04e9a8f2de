// load_stage_weights (model/weights.h) on checkpoints written by model/checkpoint_writer.h
// and on the HF-made fixtures: round trips in every storage dtype, single and sharded,
// with and without the "transformer." prefix; stage slicing; errors that name the tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "model/checkpoint_writer.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

ModelConfig small_config() {
  ModelConfig c;
  c.n_embd = 16, c.n_head = 2, c.n_layer = 3, c.n_inner = 40, c.n_positions = 12, c.vocab_size = 30;
  c.eos_token_id = 29;
  return c;
}

// Distinct, deterministic values per tensor (no dependence on random_stage_weights).
std::vector<float> fill(size_t n, float tag) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = tag + 0.001f * float(i % 997) - 0.37f * float(i % 5);
  return v;
}

StageWeights make_model(const ModelConfig& c, bool untied_head = false) {
  const size_t C = size_t(c.n_embd), I = size_t(c.n_inner), V = size_t(c.vocab_size), P = size_t(c.n_positions);
  StageWeights m;
  m.config = c;
  m.layer_begin = 0, m.layer_end = c.n_layer;
  m.wte = fill(V * C, 1), m.wpe = fill(P * C, 2), m.ln_f_g = fill(C, 3), m.ln_f_b = fill(C, 4);
  if (untied_head) m.lm_head = fill(V * C, 5);
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const float t = 10.f * float(l + 1);
    LayerWeights lw;
    lw.ln_1_g = fill(C, t + 1), lw.ln_1_b = fill(C, t + 2);
    lw.attn_qkv_w = fill(C * 3 * C, t + 3), lw.attn_qkv_b = fill(3 * C, t + 4);
    lw.attn_proj_w = fill(C * C, t + 5), lw.attn_proj_b = fill(C, t + 6);
    lw.ln_2_g = fill(C, t + 7), lw.ln_2_b = fill(C, t + 8);
    lw.mlp_fc_w = fill(C * I, t + 9), lw.mlp_fc_b = fill(I, t + 10);
    lw.mlp_proj_w = fill(I * C, t + 11), lw.mlp_proj_b = fill(C, t + 12);
    m.layers.push_back(std::move(lw));
  }
  return m;
}

// What a value reads back as after being stored in `storage`.
std::vector<float> stored(const std::vector<float>& v, DType storage) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = storage == DType::F32   ? v[i]
             : storage == DType::F16 ? fp16_to_float(float_to_fp16(v[i]))
                                     : bf16_to_float(float_to_bf16(v[i]));
  return out;
}

void expect_layer_eq(const LayerWeights& got, const LayerWeights& want, DType s, int64_t l) {
  SCOPED_TRACE("layer " + std::to_string(l));
  EXPECT_EQ(got.ln_1_g, stored(want.ln_1_g, s));
  EXPECT_EQ(got.ln_1_b, stored(want.ln_1_b, s));
  EXPECT_EQ(got.attn_qkv_w, stored(want.attn_qkv_w, s));
  EXPECT_EQ(got.attn_qkv_b, stored(want.attn_qkv_b, s));
  EXPECT_EQ(got.attn_proj_w, stored(want.attn_proj_w, s));
  EXPECT_EQ(got.attn_proj_b, stored(want.attn_proj_b, s));
  EXPECT_EQ(got.ln_2_g, stored(want.ln_2_g, s));
  EXPECT_EQ(got.ln_2_b, stored(want.ln_2_b, s));
  EXPECT_EQ(got.mlp_fc_w, stored(want.mlp_fc_w, s));
  EXPECT_EQ(got.mlp_fc_b, stored(want.mlp_fc_b, s));
  EXPECT_EQ(got.mlp_proj_w, stored(want.mlp_proj_w, s));
  EXPECT_EQ(got.mlp_proj_b, stored(want.mlp_proj_b, s));
}

// Bytes of one layer's 12 tensors in `storage`.
int64_t layer_bytes(const ModelConfig& c, DType s) {
  const int64_t C = c.n_embd, I = c.n_inner;
  return (4 * C + 3 * C * C + 3 * C + C * C + C + C * I + I + I * C + C) * int64_t(dtype_bytes(s));
}

class WeightsLoadingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("conveyor_wl_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }

  // Writes tensors (optionally edited) as a single-file checkpoint with config.json.
  void write_edited(const ModelConfig& c, const StageWeights& m, DType s,
                    const std::function<void(std::vector<NamedTensor>&)>& edit) {
    fs::create_directories(dir_);
    auto tensors = gpt2_named_tensors(c, m, s);
    ASSERT_TRUE(tensors.ok()) << tensors.error();
    edit(*tensors);
    ASSERT_TRUE(write_gpt2_config((dir_ / "config.json").string(), c).ok());
    ASSERT_TRUE(write_safetensors((dir_ / "model.safetensors").string(), *tensors).ok());
  }

  fs::path dir_;
};

struct RoundTripCase {
  DType storage;
  int num_shards;
  bool prefix;
};

class RoundTrip : public WeightsLoadingTest, public ::testing::WithParamInterface<RoundTripCase> {};

TEST_P(RoundTrip, FullModelAndEveryStageSplit) {
  const auto [s, shards, prefix] = GetParam();
  const ModelConfig c = small_config();
  const StageWeights m = make_model(c);
  ASSERT_TRUE(write_gpt2_checkpoint(dir(), c, m, s, shards, prefix ? "transformer." : "").ok());
  EXPECT_EQ(fs::exists(dir_ / "model.safetensors.index.json"), shards > 1);

  auto full = load_stage_weights(dir(), 0, c.n_layer);
  ASSERT_TRUE(full.ok()) << full.error();
  EXPECT_EQ(full->config.n_embd, c.n_embd);
  EXPECT_EQ(full->wte, stored(m.wte, s));
  EXPECT_EQ(full->wpe, stored(m.wpe, s));
  EXPECT_EQ(full->ln_f_g, stored(m.ln_f_g, s));
  EXPECT_EQ(full->ln_f_b, stored(m.ln_f_b, s));
  EXPECT_TRUE(full->lm_head.empty());
  EXPECT_EQ(&full->head_matrix(), &full->wte);
  ASSERT_EQ(full->layers.size(), 3u);
  for (int64_t l = 0; l < 3; ++l) expect_layer_eq(full->layers[size_t(l)], m.layers[size_t(l)], s, l);
  const int64_t B = int64_t(dtype_bytes(s)), C = c.n_embd;
  const int64_t embed_bytes = (c.vocab_size + c.n_positions) * C * B, final_bytes = 2 * C * B;
  EXPECT_EQ(full->checkpoint_bytes_read, embed_bytes + 3 * layer_bytes(c, s) + final_bytes);

  auto first = load_stage_weights(dir(), 0, 1);  // embedding, no head
  ASSERT_TRUE(first.ok()) << first.error();
  EXPECT_TRUE(first->has_embedding());
  EXPECT_FALSE(first->has_head());
  EXPECT_EQ(first->wte, stored(m.wte, s));
  EXPECT_FALSE(first->wpe.empty());
  EXPECT_TRUE(first->ln_f_g.empty());
  ASSERT_EQ(first->layers.size(), 1u);
  expect_layer_eq(first->layers[0], m.layers[0], s, 0);
  EXPECT_EQ(first->checkpoint_bytes_read, embed_bytes + layer_bytes(c, s));

  auto last = load_stage_weights(dir(), 1, 3);  // head tied to wte, no wpe
  ASSERT_TRUE(last.ok()) << last.error();
  EXPECT_EQ(last->layer_begin, 1);
  EXPECT_TRUE(last->wpe.empty());
  EXPECT_EQ(last->wte, stored(m.wte, s));
  EXPECT_EQ(last->ln_f_b, stored(m.ln_f_b, s));
  ASSERT_EQ(last->layers.size(), 2u);
  expect_layer_eq(last->layers[1], m.layers[2], s, 2);
  EXPECT_EQ(last->checkpoint_bytes_read, c.vocab_size * C * B + 2 * layer_bytes(c, s) + final_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, RoundTrip,
    ::testing::Values(RoundTripCase{DType::F32, 1, true}, RoundTripCase{DType::F16, 1, true},
                      RoundTripCase{DType::BF16, 1, true}, RoundTripCase{DType::F32, 3, true},
                      RoundTripCase{DType::F16, 3, true}, RoundTripCase{DType::BF16, 3, true},
                      RoundTripCase{DType::F16, 1, false}, RoundTripCase{DType::BF16, 3, false}),
    [](const auto& info) {
      return std::string(dtype_name(info.param.storage)) + "_" + std::to_string(info.param.num_shards) + "shard" +
             (info.param.prefix ? "_prefix" : "_noprefix");
    });

TEST_F(WeightsLoadingTest, MiddleStageNeedsOnlyItsShard) {
  const ModelConfig c = small_config();
  ASSERT_TRUE(write_gpt2_checkpoint(dir(), c, make_model(c), DType::F16, 3).ok());
  json index;
  std::ifstream(dir_ / "model.safetensors.index.json") >> index;
  std::set<std::string> all_shards, needed;
  for (const auto& [name, file] : index["weight_map"].items()) {
    all_shards.insert(file.get<std::string>());
    if (name.starts_with("transformer.h.1.")) needed.insert(file.get<std::string>());
  }
  ASSERT_EQ(all_shards.size(), 3u);
  ASSERT_EQ(needed.size(), 1u);  // a layer never straddles shards
  for (const auto& f : all_shards)
    if (!needed.count(f)) {
      ASSERT_TRUE(fs::remove(dir_ / f));
    }

  auto stage = load_stage_weights(dir(), 1, 2);
  ASSERT_TRUE(stage.ok()) << stage.error();
  EXPECT_EQ(stage->checkpoint_bytes_read, layer_bytes(c, DType::F16));
  EXPECT_TRUE(stage->wte.empty());
  EXPECT_TRUE(stage->ln_f_g.empty());

  auto first = load_stage_weights(dir(), 0, 1);  // needs a deleted shard: a clear error
  ASSERT_FALSE(first.ok());
  EXPECT_NE(first.error().find("No such file or directory"), std::string::npos) << first.error();
  EXPECT_NE(first.error().find("model-00001-of-00003.safetensors"), std::string::npos) << first.error();
}

TEST_F(WeightsLoadingTest, UntiedHead) {
  ModelConfig c = small_config();
  c.tie_word_embeddings = false;
  const StageWeights m = make_model(c, /*untied_head=*/true);
  ASSERT_TRUE(write_gpt2_checkpoint(dir(), c, m, DType::F32, 2).ok());
  auto last = load_stage_weights(dir(), 2, 3);
  ASSERT_TRUE(last.ok()) << last.error();
  EXPECT_EQ(last->lm_head, m.lm_head);
  EXPECT_TRUE(last->wte.empty());  // not the first stage and not tied: wte not read
  EXPECT_EQ(&last->head_matrix(), &last->lm_head);
  const int64_t C = c.n_embd;
  EXPECT_EQ(last->checkpoint_bytes_read, (c.vocab_size * C + layer_bytes(c, DType::F32) / 4 + 2 * C) * 4);

  // The same files with a config that says tied: lm_head.weight is ignored, wte is the head.
  c.tie_word_embeddings = true;
  auto tied = load_stage_weights(dir(), c, 2, 3);
  ASSERT_TRUE(tied.ok()) << tied.error();
  EXPECT_TRUE(tied->lm_head.empty());
  EXPECT_EQ(tied->head_matrix(), m.wte);
}

TEST_F(WeightsLoadingTest, UntiedConfigWithoutLmHeadFallsBackToWte) {
  ModelConfig c = small_config();
  c.tie_word_embeddings = false;
  const StageWeights m = make_model(c, /*untied_head=*/false);
  ASSERT_TRUE(write_gpt2_checkpoint(dir(), c, m, DType::F32, 1).ok());
  auto last = load_stage_weights(dir(), 2, 3);
  ASSERT_TRUE(last.ok()) << last.error();
  EXPECT_TRUE(last->lm_head.empty());
  EXPECT_EQ(last->head_matrix(), m.wte);
}

TEST_F(WeightsLoadingTest, ShapeMismatchNamesTensorAndExpectedShape) {
  const ModelConfig c = small_config();
  write_edited(c, make_model(c), DType::F32, [&](std::vector<NamedTensor>& ts) {
    for (auto& t : ts)  // transposed: same bytes, wrong layout (a torch Linear, not a Conv1D)
      if (t.name == "transformer.h.2.mlp.c_fc.weight") t.shape = {c.n_inner, c.n_embd};
  });
  auto r = load_stage_weights(dir(), 0, 3);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().find("\"transformer.h.2.mlp.c_fc.weight\""), std::string::npos) << r.error();
  EXPECT_NE(r.error().find("[40, 16]"), std::string::npos) << r.error();
  EXPECT_NE(r.error().find("[16, 40]"), std::string::npos) << r.error();
  EXPECT_NE(r.error().find("model.safetensors"), std::string::npos) << r.error();
  EXPECT_TRUE(load_stage_weights(dir(), 0, 2).ok());  // layer 2 not needed

  // A config that disagrees with the checkpoint: caught on the first tensor it covers.
  ModelConfig wider = c;
  wider.n_positions = 64;
  auto w = load_stage_weights(dir(), wider, 0, 1);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.error().find("\"transformer.wpe.weight\""), std::string::npos) << w.error();
}

TEST_F(WeightsLoadingTest, MissingTensorNamedWithDirectory) {
  const ModelConfig c = small_config();
  write_edited(c, make_model(c), DType::F16, [](std::vector<NamedTensor>& ts) {
    std::erase_if(ts, [](const NamedTensor& t) { return t.name == "transformer.h.1.ln_2.bias"; });
  });
  auto r = load_stage_weights(dir(), 1, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().find("\"transformer.h.1.ln_2.bias\""), std::string::npos) << r.error();
  EXPECT_NE(r.error().find(dir()), std::string::npos) << r.error();
  EXPECT_TRUE(load_stage_weights(dir(), 2, 3).ok());
}

TEST_F(WeightsLoadingTest, BuffersAreIgnoredAndNonFloatWeightsRejected) {
  const ModelConfig c = small_config();
  write_edited(c, make_model(c), DType::F32, [&](std::vector<NamedTensor>& ts) {
    const size_t P = size_t(c.n_positions);
    ts.push_back(NamedTensor{"transformer.h.0.attn.bias", DType::I8, {1, 1, c.n_positions, c.n_positions},
                             std::vector<std::byte>(P * P, std::byte{1})});
    ts.push_back(make_tensor("transformer.h.0.attn.masked_bias", {}, std::vector<float>{-1e4f}, DType::F32));
  });
  auto r = load_stage_weights(dir(), 0, 1);
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r->checkpoint_bytes_read, ((c.vocab_size + c.n_positions) * c.n_embd) * 4 + layer_bytes(c, DType::F32));

  write_edited(c, make_model(c), DType::F32, [&](std::vector<NamedTensor>& ts) {
    for (auto& t : ts)
      if (t.name == "transformer.ln_f.bias") t.dtype = DType::I32;  // same byte count
  });
  auto bad = load_stage_weights(dir(), 2, 3);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().find("\"transformer.ln_f.bias\""), std::string::npos) << bad.error();
  EXPECT_NE(bad.error().find("I32"), std::string::npos) << bad.error();
}

TEST_F(WeightsLoadingTest, LayerRangeValidated) {
  const ModelConfig c = small_config();
  ASSERT_TRUE(write_gpt2_checkpoint(dir(), c, make_model(c), DType::F32, 1).ok());
  for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{-1, 1}, {1, 1}, {2, 1}, {0, 4}, {3, 3}}) {
    auto r = load_stage_weights(dir(), b, e);
    ASSERT_FALSE(r.ok()) << b << "," << e;
    EXPECT_NE(r.error().find("layer range [" + std::to_string(b) + ", " + std::to_string(e) + ")"),
              std::string::npos) << r.error();
    EXPECT_NE(r.error().find("n_layer=3"), std::string::npos) << r.error();
  }
}

TEST_F(WeightsLoadingTest, MissingConfigOrCheckpoint) {
  auto none = load_stage_weights(dir(), 0, 1);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().find("config.json"), std::string::npos) << none.error();
  fs::create_directories(dir_);
  ASSERT_TRUE(write_gpt2_config((dir_ / "config.json").string(), small_config()).ok());
  auto no_weights = load_stage_weights(dir(), 0, 1);
  ASSERT_FALSE(no_weights.ok());
  EXPECT_NE(no_weights.error().find("model.safetensors"), std::string::npos) << no_weights.error();
}

TEST_F(WeightsLoadingTest, WriterRejectsPartialModelAndBadShardCount) {
  const ModelConfig c = small_config();
  StageWeights m = make_model(c);
  EXPECT_FALSE(write_gpt2_checkpoint(dir(), c, m, DType::F16, 6).ok());  // > n_layer + 2
  EXPECT_FALSE(write_gpt2_checkpoint(dir(), c, m, DType::F16, 0).ok());
  EXPECT_TRUE(write_gpt2_checkpoint(dir(), c, m, DType::F16, 5).ok());  // one group per shard
  EXPECT_TRUE(load_stage_weights(dir(), 0, 3).ok());
  m.layers[1].mlp_fc_b.pop_back();
  auto s = write_gpt2_checkpoint(dir(), c, m, DType::F16, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("h.1.mlp.c_fc.bias"), std::string::npos) << s.message();
}

TEST_F(WeightsLoadingTest, ConfigJsonRoundTrips) {
  ModelConfig c = small_config();
  c.activation = Activation::Gelu;
  c.tie_word_embeddings = false;
  c.layer_norm_epsilon = 1e-6f;
  fs::create_directories(dir_);
  ASSERT_TRUE(write_gpt2_config((dir_ / "config.json").string(), c).ok());
  auto back = load_model_config(dir());
  ASSERT_TRUE(back.ok()) << back.error();
  EXPECT_EQ(back->n_embd, c.n_embd);
  EXPECT_EQ(back->n_inner, c.n_inner);
  EXPECT_EQ(back->n_positions, c.n_positions);
  EXPECT_EQ(back->vocab_size, c.vocab_size);
  EXPECT_EQ(back->activation, Activation::Gelu);
  EXPECT_FALSE(back->tie_word_embeddings);
  EXPECT_EQ(back->layer_norm_epsilon, 1e-6f);
  EXPECT_EQ(back->eos_token_id, 29);
}

TEST_F(WeightsLoadingTest, RandomWeightsRoundTrip) {
  const ModelConfig c = small_config();
  const StageWeights m = random_stage_weights(c, 0, c.n_layer, 7);
  ASSERT_TRUE(write_gpt2_checkpoint(dir(), c, m, DType::BF16, 3).ok());
  auto r = load_stage_weights(dir(), 0, c.n_layer);
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r->wte, stored(m.wte, DType::BF16));
  expect_layer_eq(r->layers[2], m.layers[2], DType::BF16, 2);
}

// Checkpoints saved by HF transformers (tests/data/hf_fixtures, fp16).
TEST(HfFixtureLoading, EveryFixtureLoadsWholeAndByStage) {
  const fs::path root = fs::path(testing::source_dir()) / "tests/data/hf_fixtures";
  if (!fs::is_directory(root)) GTEST_SKIP() << root << " not present";
  int seen = 0;
  for (const auto& d : fs::directory_iterator(root)) {
    if (!fs::exists(d.path() / "model.safetensors")) continue;
    ++seen;
    SCOPED_TRACE(d.path().string());
    auto c = load_model_config(d.path().string());
    ASSERT_TRUE(c.ok()) << c.error();
    auto full = load_stage_weights(d.path().string(), 0, c->n_layer);
    ASSERT_TRUE(full.ok()) << full.error();
    auto file = SafetensorsFile::open((d.path() / "model.safetensors").string());
    ASSERT_TRUE(file.ok());
    int64_t weight_bytes = 0;  // every tensor but buffers such as attn.bias
    for (const auto& t : file->tensors())
      if (!t.name.ends_with(".attn.bias") && !t.name.ends_with(".attn.masked_bias") && t.name != "lm_head.weight")
        weight_bytes += int64_t(t.size_bytes);
    EXPECT_EQ(full->checkpoint_bytes_read, weight_bytes);
    EXPECT_EQ(full->wte.size(), size_t(c->vocab_size * c->n_embd));
    const TensorInfo* ln = file->find("transformer.h.0.ln_1.weight");
    ASSERT_NE(ln, nullptr);
    uint16_t first;
    std::memcpy(&first, file->data(*ln).data(), 2);
    EXPECT_EQ(full->layers[0].ln_1_g[0], fp16_to_float(first));
    if (c->n_layer > 1) {
      auto tail = load_stage_weights(d.path().string(), c->n_layer - 1, c->n_layer);
      ASSERT_TRUE(tail.ok()) << tail.error();
      EXPECT_EQ(tail->layers[0].mlp_proj_w, full->layers.back().mlp_proj_w);
    }
  }
  EXPECT_GT(seen, 0);
}

}  // namespace
}  // namespace conveyor

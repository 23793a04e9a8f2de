// load_stage_backend (stage/backend_factory.h), the worker's one load call: a CPU stage from a
// checkpoint directory with the bytes it read, and a bad checkpoint refused naming its file and
// tensor on either backend before any device is asked for (a GPU stage opens and checks the
// checkpoint first, so this runs without a GPU too).
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "model/checkpoint_writer.h"
#include "model/weights.h"
#include "stage/backend_factory.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;

ModelConfig small_model() {
  ModelConfig c;
  c.n_embd = 32, c.n_head = 4, c.n_layer = 3, c.n_inner = 64, c.n_positions = 16, c.vocab_size = 50;
  return c;
}

class LoadStageBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("conveyor_lsb_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

TEST_F(LoadStageBackend, CpuStageWithTheBytesItRead) {
  const ModelConfig c = small_model();
  ASSERT_TRUE(write_gpt2_checkpoint(dir_.string(), c, random_stage_weights(c, 0, c.n_layer, 3), DType::F16).ok());
  StageOptions o;
  o.backend = Backend::Cpu;
  int64_t progress_done = 0, progress_total = -1;
  auto loaded = load_stage_backend(dir_.string(), 1, 3, o, [&](int64_t done, int64_t total) {
    progress_done = done;
    progress_total = total;
  });
  ASSERT_TRUE(loaded.ok()) << loaded.error();
  auto weights = load_stage_weights(dir_.string(), 1, 3);
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(loaded->checkpoint_bytes, weights->checkpoint_bytes_read);
  EXPECT_EQ(progress_done, loaded->checkpoint_bytes);
  EXPECT_EQ(progress_total, loaded->checkpoint_bytes);
  EXPECT_FALSE(loaded->backend->has_embedding());
  EXPECT_TRUE(loaded->backend->has_head());
}

TEST_F(LoadStageBackend, BadCheckpointNamesFileAndTensorOnEitherBackend) {
  const ModelConfig c = small_model();
  auto tensors = gpt2_named_tensors(c, random_stage_weights(c, 0, c.n_layer, 3), DType::F32);
  ASSERT_TRUE(tensors.ok());
  auto write = [&](const std::vector<NamedTensor>& ts) {
    fs::create_directories(dir_);
    ASSERT_TRUE(write_gpt2_config((dir_ / "config.json").string(), c).ok());
    ASSERT_TRUE(write_safetensors((dir_ / "model.safetensors").string(), ts).ok());
  };
  std::vector<NamedTensor> missing = *tensors, wrong_dtype = *tensors;
  std::erase_if(missing, [](const NamedTensor& t) { return t.name == "transformer.h.2.attn.c_attn.bias"; });
  for (NamedTensor& t : wrong_dtype)
    if (t.name == "transformer.h.1.mlp.c_proj.weight") t.dtype = DType::I32;  // same byte count
  for (Backend backend : {Backend::Cpu, Backend::Cuda}) {
    StageOptions o;
    o.backend = backend;
    SCOPED_TRACE(std::string(backend_name(backend)));
    write(missing);
    auto a = load_stage_backend(dir_.string(), 1, 3, o);
    ASSERT_FALSE(a.ok());
    EXPECT_NE(a.error().find("\"transformer.h.2.attn.c_attn.bias\" not found"), std::string::npos) << a.error();
    EXPECT_NE(a.error().find(dir_.string()), std::string::npos) << a.error();
    write(wrong_dtype);
    auto b = load_stage_backend(dir_.string(), 0, 2, o);
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.error().find("model.safetensors: tensor \"transformer.h.1.mlp.c_proj.weight\" is stored as I32"),
              std::string::npos)
        << b.error();
  }
}

}  // namespace
}  // namespace conveyor

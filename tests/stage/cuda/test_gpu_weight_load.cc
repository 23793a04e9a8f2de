// The direct weight load (GpuWeights::load, a GpuStage or TpStage from a StageCheckpoint)
// against the fp32 path (load_stage_weights, then GpuWeights::upload): the same checkpoint on
// disk loaded both ways must leave the same bytes in every tensor and every int8 / FP8 scale of
// the weight allocation, for fp16, bf16, int8 and FP8 stages, checkpoints stored in fp32 and in
// fp16, one stage of the whole model and a two-stage split (the tied head on the last stage),
// at tp 1 and on each rank of tp 2 (ranks share GPU 0 where there is one). Small pieces and
// few slots make every tensor cross several pieces and every slot get reused.
//
// Skips cleanly when built without CUDA or run where no GPU is present.
#include <gtest/gtest.h>

#ifndef CONVEYOR_HAVE_CUDA

TEST(GpuWeightLoad, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }

#else

#include <cuda_runtime.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/fp8.h"
#include "model/checkpoint_writer.h"
#include "model/stage_checkpoint.h"
#include "model/weights.h"
#include "stage/cuda/tp_stage.h"
#include "tests/gpu_test_util.h"

namespace conveyor {
namespace {

namespace fs = std::filesystem;
using cuda::GpuStageOptions;
using cuda::GpuWeights;
using cuda::TpStage;
using testing::can_place;
using testing::devices_for;

ModelConfig config() {
  ModelConfig c;
  c.n_layer = 3;
  c.n_embd = 128;
  c.n_head = 4;     // head_dim 32; 2 heads a rank at tp 2
  c.n_inner = 512;  // FP8: every layer matrix of a rank a multiple of 16
  c.n_positions = 64;
  c.vocab_size = 1013;
  c.layer_norm_epsilon = 1e-5f;
  c.activation = Activation::GeluNew;
  c.tie_word_embeddings = true;
  return c;
}

enum class Format { F16, BF16, Int8, Fp8 };

GpuStageOptions options(Format f) {
  GpuStageOptions o;
  o.dtype = f == Format::BF16 ? DType::BF16 : DType::F16;
  o.int8_weights = f == Format::Int8;
  o.fp8 = f == Format::Fp8;
  o.name = "load-test";
  o.max_tokens = 64;
  o.max_seqs = 4;
  o.kv_cache_max_bytes = int64_t(8) << 20;
  return o;
}

// The allocation's bytes on the host.
std::vector<std::byte> download(const GpuWeights& w, int device) {
  cuda::DeviceGuard on(device);
  std::vector<std::byte> host(size_t(w.bytes()));
  CUDA_CHECK(cudaMemcpy(host.data(), w.data(), host.size(), cudaMemcpyDeviceToHost));
  return host;
}

// Every tensor's bytes and every scale of `a` and `b` (same layout), named at the first
// difference; the padding between tensors is never written and not compared, the zero rows
// of the vocabulary matrices are.
void expect_same_tensors(const GpuWeights& a, const GpuWeights& b, int device, const std::string& what) {
  ASSERT_EQ(a.bytes(), b.bytes()) << what;
  const std::vector<std::byte> x = download(a, device), y = download(b, device);
  auto same = [&](int64_t offset, int64_t bytes, const std::string& tensor) {
    if (offset < 0) return;
    EXPECT_EQ(0, std::memcmp(x.data() + offset, y.data() + offset, size_t(bytes))) << what << ": " << tensor;
  };
  const cuda::GpuWeightLayout& layout = a.layout();
  for (size_t l = 0; l < layout.layers.size(); ++l)
    for (const LayerTensorSpec& spec : kLayerTensors) {
      const cuda::TensorRef& r = layout.layers[l][size_t(spec.id)];
      same(r.offset, r.bytes, "layer " + std::to_string(l) + " " + spec.hf_name);
      same(r.scale_offset, r.shape.cols * int64_t(sizeof(float)), "layer " + std::to_string(l) + " " + spec.hf_name + " scales");
    }
  for (const StageTensorSpec& spec : kStageTensors) {
    const cuda::TensorRef& r = layout.stage[size_t(spec.id)];
    // With the zeros the stage reads after them (the vocabulary matrices' rows up to
    // head_rows, gpu_weights.h: the LM head runs over them).
    same(r.offset, r.bytes + r.zero_bytes, spec.hf_name);
  }
}

class GpuWeightLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::have_gpu()) GTEST_SKIP() << "no GPU";
    root_ = fs::temp_directory_path() / ("conveyor-gpu-weight-load-" + std::to_string(::getpid()));
    const ModelConfig c = config();
    const StageWeights w = random_stage_weights(c, 0, c.n_layer, 7);
    for (DType storage : {DType::F32, DType::F16}) {
      const std::string dir = (root_ / dtype_name(storage)).string();
      fs::create_directories(dir);
      ASSERT_TRUE(write_gpt2_checkpoint(dir, c, w, storage)) << dir;
    }
  }
  void TearDown() override {
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }

  // Both paths for layers [begin, end) of the checkpoint stored as `storage`, compared rank by rank.
  void compare(DType storage, Format format, int ranks, int64_t begin, int64_t end) {
    const ModelConfig c = config();
    const std::string dir = (root_ / dtype_name(storage)).string();
    const std::string what = std::string(dtype_name(storage)) + " checkpoint, format " + std::to_string(int(format)) +
                             ", tp " + std::to_string(ranks) + ", layers [" + std::to_string(begin) + ", " +
                             std::to_string(end) + ")";
    auto weights = load_stage_weights(dir, c, begin, end);
    ASSERT_TRUE(weights) << weights.error();
    auto old_path = TpStage::create(*weights, devices_for(ranks), options(format));
    ASSERT_TRUE(old_path) << what << ": " << old_path.error();
    auto ckpt = open_stage_checkpoint(dir, c, begin, end);
    ASSERT_TRUE(ckpt) << ckpt.error();
    // 4 KiB pieces, 2 slots, 3 readers: many pieces a tensor, every slot reused.
    auto direct = TpStage::create(*ckpt, devices_for(ranks), options(format), {3, 2, 4096});
    ASSERT_TRUE(direct) << what << ": " << direct.error();
    for (int r = 0; r < ranks; ++r)
      expect_same_tensors((*old_path)->rank(r).weights(), (*direct)->rank(r).weights(), devices_for(ranks)[size_t(r)],
                          what + ", rank " + std::to_string(r));
  }

  fs::path root_;
};

bool fp8_here() { return cuda::fp8_device_check(0).ok(); }

TEST_F(GpuWeightLoad, SameBytesAsTheFp32PathAtTp1) {
  for (DType storage : {DType::F32, DType::F16})
    for (Format f : {Format::F16, Format::BF16, Format::Int8, Format::Fp8}) {
      if (f == Format::Fp8 && !fp8_here()) continue;
      compare(storage, f, 1, 0, 3);  // one stage: embedding, layers, tied head
      compare(storage, f, 1, 0, 2);  // first stage
      compare(storage, f, 1, 2, 3);  // last stage: the tied head read from wte
    }
}

TEST_F(GpuWeightLoad, SameBytesAsTheFp32PathOnEachRankOfTp2) {
  if (!can_place(2)) GTEST_SKIP() << testing::kNoPlace;
  for (DType storage : {DType::F32, DType::F16})
    for (Format f : {Format::F16, Format::BF16, Format::Int8, Format::Fp8}) {
      if (f == Format::Fp8 && !fp8_here()) continue;
      compare(storage, f, 2, 0, 3);
      compare(storage, f, 2, 1, 3);
    }
}

}  // namespace
}  // namespace conveyor

#endif

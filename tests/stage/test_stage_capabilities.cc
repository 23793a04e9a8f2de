// What a stage backend says of itself before it holds a model (stage_capabilities) and what a
// model takes in its format (stage_footprint): the figures a worker's register and footprint
// carry, from which the coordinator plans and batches. One formula per fact: the CPU's
// footprint is the bytes its weights hold, the GPU's is the layout it allocates
// (plan_weight_layout), so the planner's bytes are the stage's own.
#include <gtest/gtest.h>

#include "model/tp_shard.h"
#include "model/weights.h"
#include "stage/backend_factory.h"
#include "stage/cpu/cpu_stage_backend.h"
#ifdef CONVEYOR_HAVE_CUDA
#include "stage/cuda/gpu_stage_backend.h"
#include "stage/cuda/gpu_weights.h"
#endif

namespace conveyor {
namespace {

ModelConfig small_model(bool tied = true) {
  ModelConfig c;
  c.n_embd = 64, c.n_head = 4, c.n_layer = 6, c.n_inner = 256, c.n_positions = 32, c.vocab_size = 100;
  c.tie_word_embeddings = tied;
  return c;
}

// The fp32 bytes a CPU stage of `tp` ranks holds for `w`: every tensor, plus each rank's
// copy of its slices of the split layer tensors (CpuStage's shards).
int64_t cpu_bytes(const StageWeights& w, int tp) {
  int64_t floats = int64_t(w.wte.size() + w.wpe.size() + w.ln_f_g.size() + w.ln_f_b.size() + w.lm_head.size());
  for (const LayerWeights& l : w.layers) {
    for (const LayerTensorSpec& spec : kLayerTensors) floats += int64_t((l.*spec.field).size());
    if (tp > 1)
      for (int r = 0; r < tp; ++r) {
        const LayerWeights s = shard_layer(l, w.config, TpShard::of(w.config, r, tp));
        for (const LayerTensorSpec& spec : kLayerTensors) floats += int64_t((s.*spec.field).size());
      }
  }
  return floats * int64_t(sizeof(float));
}

int64_t described(const StageFootprint& f, int64_t b, int64_t e, int64_t n_layer) {
  const bool first = b == 0, last = e == n_layer;
  return (e - b) * f.layer_bytes +
         (first && last ? f.embedding_and_head_bytes : (first ? f.embedding_bytes : 0) + (last ? f.head_bytes : 0));
}

TEST(StageCapabilities, CpuFootprintIsWhatItsWeightsHold) {
  for (bool tied : {true, false})
    for (int tp : {1, 2, 3}) {
      const ModelConfig c = small_model(tied);
      auto f = CpuStageBackend::footprint(c, tp);
      ASSERT_TRUE(f) << f.error();
      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 6}, {0, 2}, {2, 5}, {4, 6}}) {
        const StageWeights w = random_stage_weights(c, b, e, 1);
        EXPECT_EQ(described(*f, b, e, c.n_layer), cpu_bytes(w, tp))
            << "layers [" << b << ", " << e << ") tied " << tied << " tp " << tp;
      }
      EXPECT_EQ(f->kv_bytes_per_token_per_layer, 2 * c.n_embd * 4);
    }
  // A stage it cannot split says so.
  EXPECT_FALSE(CpuStageBackend::footprint(small_model(), 1000));
  ModelConfig bad = small_model();
  bad.n_head = 3;  // 64 is no multiple of 3
  EXPECT_FALSE(CpuStageBackend::footprint(bad, 1));
}

TEST(StageCapabilities, CpuStageFigures) {
  const StageCapabilities c = CpuStageBackend::capabilities(int64_t(8) << 30, int64_t(512) << 20);
  EXPECT_EQ(c.dtype, DType::F32);
  EXPECT_EQ(c.weight_format, "f32");
  EXPECT_EQ(c.weight_memory_bytes, (int64_t(8) << 30) - (int64_t(512) << 20));  // the host less its K/V budget
  EXPECT_EQ(c.max_rows_per_step, 0);
  EXPECT_EQ(c.max_sequences_per_step, 64);
  EXPECT_EQ(c.max_prompt_rows_per_step, 64);
  EXPECT_EQ(c.kv_page_tokens, 16);
  EXPECT_EQ(c.extra_in_flight, 1);
  EXPECT_EQ(CpuStageBackend::capabilities(0, 1).weight_memory_bytes, 0);  // unknown memory: no limit
  // Through the factory, as the worker asks.
  StageOptions o;
  o.backend = Backend::Cpu;
  o.tensor_parallel = 2;
  EXPECT_EQ(stage_capabilities(o).weight_format, "f32");
  auto f = stage_footprint(small_model(), o);
  ASSERT_TRUE(f) << f.error();
  EXPECT_EQ(f->layer_bytes, CpuStageBackend::footprint(small_model(), 2)->layer_bytes);
}

#ifdef CONVEYOR_HAVE_CUDA

// The GPU's footprint is its weight layout: any layer range of any rank count adds up to the
// allocation each rank makes (host arithmetic: no GPU needed).
TEST(StageCapabilities, GpuFootprintIsItsWeightLayout) {
  for (bool byte_matrices : {false, true})
    for (int ranks : {1, 2, 4}) {
      const ModelConfig c = small_model();
      cuda::GpuStageOptions o;
      o.dtype = DType::BF16;
      o.int8_weights = byte_matrices;
      auto f = cuda::GpuStageBackend::footprint(c, ranks, o);
      ASSERT_TRUE(f) << f.error();
      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 6}, {0, 2}, {2, 5}, {4, 6}}) {
        int64_t allocated = 0;
        for (int r = 0; r < ranks; ++r)
          allocated += cuda::plan_weight_layout(c, TpShard::of(c, r, ranks), e - b, b == 0, e == c.n_layer && r == 0,
                                                o.dtype, byte_matrices)
                           .bytes;
        EXPECT_EQ(described(*f, b, e, c.n_layer), allocated) << "[" << b << ", " << e << ") ranks " << ranks;
      }
      EXPECT_EQ(f->kv_bytes_per_token_per_layer, 2 * c.n_embd * 2);
    }
}

// An FP8 K/V cache says its bytes: per position and head, head_dim E4M3 bytes and an fp32
// scale for K and for V, about half of fp16's, so the planner and admission fit twice the
// positions. The CPU backend refuses it by name.
TEST(StageCapabilities, GpuFp8KvHalvesThePositionBytes) {
  const ModelConfig c = small_model();
  cuda::GpuStageOptions o;
  o.kv_fp8 = true;
  for (int ranks : {1, 2}) {
    auto f = cuda::GpuStageBackend::footprint(c, ranks, o);
    ASSERT_TRUE(f) << f.error();
    EXPECT_EQ(f->kv_bytes_per_token_per_layer, 2 * (c.n_embd + c.n_head * int64_t(sizeof(float))));
  }
  o.max_seqs = 512;  // as the worker builds its stage: twice the positions, twice the sequences a step
  EXPECT_EQ(cuda::GpuStageBackend::capabilities(o, int64_t(80) << 30).max_sequences_per_step, 512);
  StageOptions cpu;
  cpu.backend = Backend::Cpu;
  cpu.name = "cpu-stage";
  cpu.kv_fp8 = true;
  auto b = make_stage_backend(StageWeights{}, cpu);
  ASSERT_FALSE(b);
  EXPECT_NE(b.status().message().find("FP8 K/V cache needs the CUDA backend"), std::string::npos)
      << b.status().message();
}

// GPT-3 175B's middle layers are 1.81 GB each in fp16 (12 C^2 + 13 C parameters) and about
// half that with int8 matrices (12 C^2 bytes plus an fp32 scale per output channel and fp16
// vectors); the first stage adds the embeddings, which stay fp16. (The coordinator computed
// this once; the stage says it now.)
TEST(StageCapabilities, GpuInt8LayersTakeAboutHalf) {
  ModelConfig c;
  c.n_embd = 12288, c.n_head = 96, c.n_layer = 96, c.n_inner = 4 * 12288, c.n_positions = 256, c.vocab_size = 50257;
  const int64_t C = c.n_embd;
  cuda::GpuStageOptions o;
  const int64_t fp16 = cuda::GpuStageBackend::footprint(c, 1, o)->layer_bytes;
  o.int8_weights = true;
  auto int8 = cuda::GpuStageBackend::footprint(c, 1, o);
  ASSERT_TRUE(int8);
  EXPECT_EQ(fp16, (12 * C * C + 13 * C) * 2);
  EXPECT_EQ(int8->layer_bytes, 12 * C * C + 9 * C * 4 + 13 * C * 2);
  EXPECT_NEAR(double(int8->layer_bytes) / double(fp16), 0.5, 0.001);
  // wte's rows padded with zeros to head_rows (gpu_weights.h), then 256-byte boundaries.
  const int64_t wte_rows = cuda::head_rows(50257);
  EXPECT_EQ(wte_rows, 50304);
  EXPECT_GE(int8->embedding_bytes, (wte_rows + 256) * C * 2);
  EXPECT_LT(int8->embedding_bytes, (wte_rows + 256) * C * 2 + 2 * 256);
  o.max_seqs = 512;  // as the worker builds its stage (backend_factory.cc)
  const StageCapabilities caps = cuda::GpuStageBackend::capabilities(o, int64_t(80) << 30);
  EXPECT_EQ(caps.weight_format, "int8");
  EXPECT_EQ(caps.max_rows_per_step, 4096);
  EXPECT_EQ(caps.max_sequences_per_step, 256);
  EXPECT_EQ(caps.max_prompt_rows_per_step, 512);
  EXPECT_EQ(caps.kv_page_tokens, 16);
  EXPECT_EQ(caps.extra_in_flight, 0);
  EXPECT_EQ(caps.weight_memory_bytes, (int64_t(80) << 30) / 10 * 9);
  // Through the factory, as the worker asks (its memory is what this machine's GPU 0 has).
  StageOptions so;
  so.backend = Backend::Cuda;
  so.int8_weights = true;
  const StageCapabilities via = stage_capabilities(so);
  EXPECT_EQ(via.weight_format, "int8");
  EXPECT_EQ(via.max_sequences_per_step, 256);
  EXPECT_EQ(via.max_prompt_rows_per_step, 512);
  so.int8_weights = false, so.dtype = DType::BF16;
  EXPECT_EQ(stage_capabilities(so).weight_format, "bf16");
  // More GPUs than heads cannot split the model.
  EXPECT_FALSE(cuda::GpuStageBackend::footprint(small_model(), 8, o));
}

#endif

}  // namespace
}  // namespace conveyor

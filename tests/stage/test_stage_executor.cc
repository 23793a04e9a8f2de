// StageExecutor on the CPU backend and the micro-batch header it reads: a model split in two
// stages gives the one-stage model's tokens and log-probs, the activations crossing in any
// activation dtype the header names (a CPU stage converts fp16/bf16 rows, exactly), and a
// header or payload that does not fit the model is refused with an error naming it.
#include <gtest/gtest.h>

#include <cstring>

#include "model/microbatch.h"
#include "stage/cpu/cpu_stage_backend.h"
#include "stage/stage_executor.h"
#include "model/weights.h"
#include "tests/test_util.h"

namespace conveyor {
namespace {

std::string model_dir() { return testing::source_dir() + "/models/brown-gpt2"; }

StageExecutor stage(int64_t begin, int64_t end) {
  auto w = load_stage_weights(model_dir(), begin, end);
  EXPECT_TRUE(w) << w.error();
  return StageExecutor(CpuStageBackend::create(std::move(*w), 1, int64_t(64) << 20).value());
}

// Runs a non-last stage's batch and returns the activations it hands on, as the worker's
// send slot would receive them.
std::vector<std::byte> outgoing(StageExecutor& s, const MicroBatch& b, std::span<const std::byte> in = {}) {
  std::vector<std::byte> out;
  const ActivationSink sink = [&](size_t bytes) -> Expected<std::span<std::byte>> {
    out.resize(bytes);
    return std::span<std::byte>(out);
  };
  const Status st = s.run(b, in, sink, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

// A sink for a last stage, which hands nothing on.
const ActivationSink kNoSink = [](size_t) -> Expected<std::span<std::byte>> {
  return Status::error("the last stage hands nothing on");
};

MicroBatch prompt_batch() {
  MicroBatch b;
  b.batch_id = 7, b.pipeline = 1, b.epoch = 3;
  const std::vector<std::vector<int32_t>> prompts = {{464, 1578, 531}, {818, 262, 3329, 262, 1468}};
  uint64_t id = 1;
  for (const auto& p : prompts) {
    SeqWork w;
    w.slice = {id++, 0, int32_t(p.size())};
    w.prompt_len = int32_t(p.size());
    w.sample = true;
    w.top_logprobs = 2;
    w.sampling.temperature = 0;
    b.seqs.push_back(w);
    b.token_ids.insert(b.token_ids.end(), p.begin(), p.end());
  }
  return b;
}

TEST(MicroBatchWire, RoundTripsAndNamesWhatIsWrong) {
  MicroBatch b = prompt_batch();
  b.activation_dtype = DType::BF16;
  b.free_seq_ids = {9, 10};
  const std::vector<uint8_t> bytes = encode(b);
  auto back = decode_microbatch(bytes);
  ASSERT_TRUE(back) << back.error();
  EXPECT_EQ(back->activation_dtype, DType::BF16);
  EXPECT_EQ(back->batch_id, 7u);
  EXPECT_EQ(back->epoch, 3u);
  EXPECT_EQ(back->token_ids, b.token_ids);
  EXPECT_EQ(back->free_seq_ids, b.free_seq_ids);
  ASSERT_EQ(back->seqs.size(), 2u);
  EXPECT_EQ(back->seqs[1].slice.num_tokens, 5);

  std::vector<uint8_t> bad = bytes;
  bad[4 + 8 + 4 + 4] = uint8_t(DType::I32);  // the dtype byte, after magic, batch id, pipeline, epoch
  auto refused = decode_microbatch(bad);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().find("activation dtype"), std::string::npos) << refused.error();

  auto cut = decode_microbatch(std::span(bytes).first(bytes.size() - 3));
  ASSERT_FALSE(cut);
  EXPECT_NE(cut.error().find("free_seq_ids"), std::string::npos) << cut.error();
}

TEST(StageExecutor, TwoStagesGiveTheWholeModelsTokens) {
  StageExecutor whole = stage(0, 6), first = stage(0, 3), second = stage(3, 6);
  EXPECT_TRUE(first.is_first() && !first.is_last() && second.is_last());
  EXPECT_EQ(first.activation_dtype(), DType::F32);
  const MicroBatch b = prompt_batch();
  BatchResult want, got;
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &want).ok());
  const std::vector<std::byte> act = outgoing(first, b);
  EXPECT_EQ(act.size(), size_t(8 * 256 * 4));
  ASSERT_TRUE(second.run(b, act, kNoSink, &got).ok());
  ASSERT_EQ(got.seqs.size(), 2u);
  EXPECT_EQ(got.batch_id, 7u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got.seqs[i].token, want.seqs[i].token);
    EXPECT_FLOAT_EQ(got.seqs[i].logprob, want.seqs[i].logprob);
  }
}

// A GPU stage sends fp16 or bf16 rows: a CPU stage receiving them computes exactly what it
// computes from the same values sent as fp32.
TEST(StageExecutor, TakesHalfPrecisionActivations) {
  StageExecutor first = stage(0, 3);
  MicroBatch b = prompt_batch();
  const std::vector<std::byte> act = outgoing(first, b);
  const size_t n = act.size() / 4;
  std::vector<float> f(n);
  std::memcpy(f.data(), act.data(), act.size());
  for (DType t : {DType::F16, DType::BF16}) {
    std::vector<uint16_t> half(n);
    std::vector<float> rounded(n);
    for (size_t i = 0; i < n; ++i) {
      half[i] = t == DType::F16 ? float_to_fp16(f[i]) : float_to_bf16(f[i]);
      rounded[i] = t == DType::F16 ? fp16_to_float(half[i]) : bf16_to_float(half[i]);
    }
    StageExecutor a = stage(3, 6), c = stage(3, 6);
    BatchResult from_half, from_f32;
    b.activation_dtype = t;
    ASSERT_TRUE(a.run(b, std::as_bytes(std::span(half)), kNoSink, &from_half).ok());
    b.activation_dtype = DType::F32;
    ASSERT_TRUE(c.run(b, std::as_bytes(std::span(rounded)), kNoSink, &from_f32).ok());
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(from_half.seqs[i].token, from_f32.seqs[i].token) << dtype_name(t);
      EXPECT_EQ(from_half.seqs[i].logprob, from_f32.seqs[i].logprob) << dtype_name(t);
    }
  }
}

TEST(StageExecutor, RefusesActivationsThatDoNotFit) {
  StageExecutor second = stage(3, 6);
  MicroBatch b = prompt_batch();
  BatchResult r;
  std::vector<float> short_rows(7 * 256);  // the batch has 8 tokens
  Status s = second.run(b, std::as_bytes(std::span(short_rows)), kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("micro-batch 7"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("expected 8 tokens x 256"), std::string::npos) << s.message();
  EXPECT_EQ(second.backend().num_sequences(), 0);  // nothing cached: the batch can be replayed
  b.activation_dtype = DType::F16;  // the same bytes read as F16 hold 14 rows, not 8
  s = second.run(b, std::as_bytes(std::span(short_rows)), kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("F16"), std::string::npos) << s.message();
}

// A batch that only frees sequences still travels the pipeline: a middle stage hands on an
// empty payload (the frees ride in the header), and the last stage answers with no tokens.
TEST(StageExecutor, FreesOnlyBatchesTravelOn) {
  StageExecutor first = stage(0, 3), second = stage(3, 6);
  const MicroBatch b = prompt_batch();
  const std::vector<std::byte> act = outgoing(first, b);
  BatchResult r;
  ASSERT_TRUE(second.run(b, act, kNoSink, &r).ok());
  EXPECT_EQ(first.backend().num_sequences(), 2);
  EXPECT_EQ(second.backend().num_sequences(), 2);
  MicroBatch frees;
  frees.batch_id = 8;
  frees.free_seq_ids = {1, 2};
  bool asked = false;
  const ActivationSink sink = [&](size_t bytes) -> Expected<std::span<std::byte>> {
    asked = true;
    EXPECT_EQ(bytes, 0u);
    return std::span<std::byte>();
  };
  ASSERT_TRUE(first.run(frees, {}, sink, nullptr).ok());
  EXPECT_TRUE(asked);
  EXPECT_EQ(first.backend().num_sequences(), 0);
  ASSERT_TRUE(second.run(frees, {}, kNoSink, &r).ok());
  EXPECT_EQ(r.batch_id, 8u);
  EXPECT_TRUE(r.seqs.empty());
  EXPECT_EQ(second.backend().num_sequences(), 0);
}

// When the worker has nowhere to put the outgoing rows (no host memory for a send slot),
// the batch fails with that reason.
TEST(StageExecutor, ASinkWithNoRoomFailsTheBatch) {
  StageExecutor first = stage(0, 3);
  const ActivationSink full = [](size_t bytes) -> Expected<std::span<std::byte>> {
    return Status::error("no host memory for " + std::to_string(bytes) + " bytes of outgoing activations");
  };
  const Status s = first.run(prompt_batch(), {}, full, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no host memory for 8192 bytes"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace conveyor

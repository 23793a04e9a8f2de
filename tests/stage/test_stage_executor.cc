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

TEST(MicroBatchWire, LogitBiasRoundTripsAndIsChecked) {
  MicroBatch b = prompt_batch();
  b.seqs[1].sampling.logit_bias = {{13, -100.f}, {262, 2.5f}, {4095, 100.f}};
  const std::vector<uint8_t> bytes = encode(b);
  auto back = decode_microbatch(bytes);
  ASSERT_TRUE(back) << back.error();
  EXPECT_TRUE(back->seqs[0].sampling.logit_bias.empty());
  EXPECT_EQ(back->seqs[1].sampling.logit_bias, b.seqs[1].sampling.logit_bias);
  const ModelConfig config = load_model_config(model_dir()).value();
  EXPECT_TRUE(validate(*back, config).ok());
  // A count that runs past the message is refused by decode, naming the field.
  MicroBatch one;
  SeqWork w;
  w.slice = {1, 0, 1};
  w.sampling.logit_bias = {{1, 1.f}, {2, 2.f}};
  one.seqs.push_back(w);
  one.token_ids = {5};
  std::vector<uint8_t> cut = encode(one);
  const size_t tail = 4 + 4 + 4 + 4;  // token_ids (count + 1 id), forks (count), free_seq_ids (count)
  auto refused = decode_microbatch(std::span(cut).first(cut.size() - tail - 4));  // inside the last pair
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().find("logit_bias"), std::string::npos) << refused.error();
  // An id outside the vocabulary is refused by validate, naming the field.
  back->seqs[1].sampling.logit_bias = {{int32_t(config.vocab_size), 1.f}};
  const Status st = validate(*back, config);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("logit_bias"), std::string::npos) << st.message();
}

TEST(StageExecutor, LogitBiasChangesTheLastStagesChoice) {
  StageExecutor whole = stage(0, 6);
  MicroBatch b = prompt_batch();
  BatchResult plain, banned, favoured;
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &plain).ok());
  whole.drop_all();
  const int32_t greedy = plain.seqs[0].token;
  b.seqs[0].sampling.logit_bias = {{greedy, kLogitBiasBan}};
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &banned).ok());
  whole.drop_all();
  EXPECT_NE(banned.seqs[0].token, greedy);
  EXPECT_EQ(banned.seqs[0].token, plain.seqs[0].top[1].first);  // the runner-up
  EXPECT_EQ(banned.seqs[1].token, plain.seqs[1].token);         // the other sequence is untouched
  // Log-probs are of the raw distribution: the runner-up's log-prob is what it was.
  EXPECT_FLOAT_EQ(banned.seqs[0].logprob, plain.seqs[0].top[1].second);
  b.seqs[0].sampling.logit_bias = {{7, 100.f}};
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &favoured).ok());
  EXPECT_EQ(favoured.seqs[0].token, 7);
}

// One sequence's step: `tokens` from `start`, sampling greedy, its top-5 reported.
SeqWork seq_step(uint64_t id, int32_t start, int32_t n, int32_t prompt_len) {
  SeqWork w;
  w.slice = {id, start, n};
  w.prompt_len = prompt_len;
  w.sample = true;
  w.top_logprobs = 5;
  w.sampling.temperature = 0;
  return w;
}

TEST(MicroBatchWire, ForksRoundTripAndAreChecked) {
  MicroBatch b = prompt_batch();
  b.forks = {{1, 5, 3}, {2, 6, 1}};
  b.free_seq_ids = {1};
  auto back = decode_microbatch(encode(b));
  ASSERT_TRUE(back) << back.error();
  EXPECT_EQ(back->forks, b.forks);
  EXPECT_EQ(back->free_seq_ids, b.free_seq_ids);
  const ModelConfig config = load_model_config(model_dir()).value();
  EXPECT_TRUE(validate(*back, config).ok());
  const std::vector<uint8_t> bytes = encode(b);
  auto cut = decode_microbatch(std::span(bytes).first(bytes.size() - 4 - 8 - 10));  // inside the forks
  ASSERT_FALSE(cut);
  EXPECT_NE(cut.error().find("forks"), std::string::npos) << cut.error();
  back->forks = {{3, 3, 1}};
  EXPECT_NE(validate(*back, config).message().find("into itself"), std::string::npos);
  back->forks = {{3, 4, 0}};
  EXPECT_NE(validate(*back, config).message().find("num_tokens"), std::string::npos);
}

// A fork gives the child its parent's K/V prefix: decoding the children gives the same tokens
// and log-probs as sequences computed from scratch, bit for bit (the CPU stage is batch and
// chunk invariant); a parent freed by the same batch can be forked from; the K/V accounting
// counts what each sequence holds; and bad forks are refused naming what is wrong.
TEST(StageExecutor, ForkedSequencesDecodeAsIfComputedFromScratch) {
  StageExecutor ex = stage(0, 6), ref = stage(0, 6);
  const std::vector<int32_t> prompt = {464, 1578, 531, 818, 262, 3329, 262, 1468, 11, 290, 339, 1110, 13, 383, 2010,
                                       257, 1244, 318, 7, 42, 99};  // 21 tokens: one full page and a part
  MicroBatch first;
  first.seqs.push_back(seq_step(1, 0, int32_t(prompt.size()), int32_t(prompt.size())));
  first.token_ids = prompt;
  BatchResult r1;
  ASSERT_TRUE(ex.run(first, {}, kNoSink, &r1).ok());
  EXPECT_EQ(ex.backend().kv_used_tokens(), 21);

  // Children of 21, 16 and 9 tokens, each continuing with its own next token; the parent is
  // freed in the same batch.
  MicroBatch second;
  second.batch_id = 2;
  second.forks = {{1, 2, 21}, {1, 3, 16}, {1, 4, 9}};
  second.free_seq_ids = {1};
  const std::vector<std::pair<int32_t, int32_t>> next = {{21, r1.seqs[0].token}, {16, 77}, {9, 1000}};
  for (size_t i = 0; i < next.size(); ++i) {
    second.seqs.push_back(seq_step(2 + i, next[i].first, 1, int32_t(prompt.size())));
    second.token_ids.push_back(next[i].second);
  }
  BatchResult r2;
  const Status st = ex.run(second, {}, kNoSink, &r2);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(ex.backend().num_sequences(), 3);
  EXPECT_EQ(ex.backend().kv_used_tokens(), 22 + 17 + 10);
  ASSERT_EQ(r2.seqs.size(), 3u);
  for (size_t i = 0; i < next.size(); ++i) {
    std::vector<int32_t> whole(prompt.begin(), prompt.begin() + next[i].first);
    whole.push_back(next[i].second);
    MicroBatch scratch;
    scratch.seqs.push_back(seq_step(100 + i, 0, int32_t(whole.size()), int32_t(prompt.size())));
    scratch.token_ids = whole;
    BatchResult want;
    ASSERT_TRUE(ref.run(scratch, {}, kNoSink, &want).ok());
    EXPECT_EQ(r2.seqs[i].token, want.seqs[0].token) << "child " << i;
    EXPECT_EQ(r2.seqs[i].logprob, want.seqs[0].logprob) << "child " << i;
    EXPECT_EQ(r2.seqs[i].top, want.seqs[0].top) << "child " << i;
  }

  // Errors: an unknown parent, a child that exists, more tokens than the parent holds.
  auto refuse = [&](SeqFork f, const std::string& what) {
    MicroBatch b;
    b.batch_id = 9;
    b.forks = {f};
    BatchResult r;
    const Status s = ex.run(b, {}, kNoSink, &r);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  };
  refuse({1, 8, 3}, "sequence 1 is not cached");
  refuse({2, 3, 3}, "sequence 3 exists already");
  refuse({2, 8, 23}, "23 tokens of sequence 2, which has 22 cached");
  EXPECT_EQ(ex.backend().num_sequences(), 3);  // nothing changed
  for (uint64_t id : {2, 3, 4}) ex.free_sequence(id);
  EXPECT_EQ(ex.backend().kv_used_tokens(), 0);
}

TEST(StageExecutor, AForkNeedsRoomInTheBudget) {
  auto w = load_stage_weights(model_dir(), 0, 6);
  ASSERT_TRUE(w) << w.error();
  auto backend = CpuStageBackend::create(std::move(*w), 1, 0);
  ASSERT_TRUE(backend) << backend.error();
  const int64_t per_token = (*backend)->kv_bytes_per_token();
  auto w2 = load_stage_weights(model_dir(), 0, 6);
  StageExecutor ex(CpuStageBackend::create(std::move(*w2), 1, 12 * per_token).value());
  MicroBatch b;
  b.seqs.push_back(seq_step(1, 0, 8, 8));
  b.token_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  BatchResult r;
  ASSERT_TRUE(ex.run(b, {}, kNoSink, &r).ok());
  MicroBatch f;
  f.forks = {{1, 2, 4}};
  ASSERT_TRUE(ex.run(f, {}, kNoSink, &r).ok());  // 12 of 12
  f.forks = {{1, 3, 1}};
  const Status s = ex.run(f, {}, kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no K/V room to fork"), std::string::npos) << s.message();
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

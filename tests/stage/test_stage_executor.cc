// StageExecutor on the CPU backend and the micro-batch header it reads: a model split in two
// stages gives the one-stage model's tokens and log-probs, the activations crossing in any
// activation dtype the header names (a CPU stage converts fp16/bf16 rows, exactly), and a
// header or payload that does not fit the model is refused with an error naming it. The
// last stage keeps each sequence's request state from its admission (or its parent's fork)
// until the sequence is freed, and refuses a step of a sequence it holds no state for.
// (The wire format itself: tests/protocol/test_microbatch_wire.cc.)
#include <gtest/gtest.h>

#include <cstring>

#include "model/weights.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"
#include "stage/cpu/cpu_stage_backend.h"
#include "stage/stage_executor.h"
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

// A greedy sequence's state: its prompt's length, its top `top` alternatives reported.
SeqState greedy_state(int32_t prompt_len, int32_t top) {
  SeqState st;
  st.prompt_len = prompt_len;
  st.top_logprobs = top;
  st.sampling.temperature = 0;
  return st;
}

// Two prompts, each its first step, their states admitted with them (top 2 reported).
MicroBatch prompt_batch() {
  MicroBatch b;
  b.batch_id = 7, b.pipeline = 1, b.epoch = 3;
  const std::vector<std::vector<int32_t>> prompts = {{464, 1578, 531}, {818, 262, 3329, 262, 1468}};
  std::vector<Admission> admitted;
  uint64_t id = 1;
  for (const auto& p : prompts) {
    SeqStep w;
    w.slice = {id, 0, int32_t(p.size())};
    w.sample = true;
    w.prefill = true;
    b.seqs.push_back(w);
    b.token_ids.insert(b.token_ids.end(), p.begin(), p.end());
    admitted.push_back({id++, greedy_state(int32_t(p.size()), 2)});
  }
  b.admissions = encode_admissions(admitted);
  return b;
}

// `b` with its sequences' states replaced: sequence i + 1 gets states[i].
void readmit(MicroBatch& b, const std::vector<SeqState>& states) {
  std::vector<Admission> admitted;
  for (size_t i = 0; i < states.size(); ++i) admitted.push_back({i + 1, states[i]});
  b.admissions = encode_admissions(admitted);
}

TEST(StageExecutor, LogitBiasChangesTheLastStagesChoice) {
  StageExecutor whole = stage(0, 6);
  MicroBatch b = prompt_batch();
  BatchResult plain, banned, favoured;
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &plain).ok());
  whole.drop_all();  // states too: each run below admits its own
  const int32_t greedy = plain.seqs[0].token;
  std::vector<SeqState> states = {greedy_state(3, 2), greedy_state(5, 2)};
  states[0].sampling.logit_bias = {{greedy, kLogitBiasBan}};
  readmit(b, states);
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &banned).ok());
  whole.drop_all();
  EXPECT_NE(banned.seqs[0].token, greedy);
  EXPECT_EQ(banned.seqs[0].token, plain.seqs[0].top[1].first);  // the runner-up
  EXPECT_EQ(banned.seqs[1].token, plain.seqs[1].token);         // the other sequence is untouched
  // Log-probs are of the raw distribution: the runner-up's log-prob is what it was.
  EXPECT_FLOAT_EQ(banned.seqs[0].logprob, plain.seqs[0].top[1].second);
  states[0].sampling.logit_bias = {{7, 100.f}};
  readmit(b, states);
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &favoured).ok());
  EXPECT_EQ(favoured.seqs[0].token, 7);
}

// A step of a sequence whose state never reached the last stage fails, naming the sequence,
// before anything is computed or cached: it is never sampled with defaults. A stage that is
// not the last hands the admissions on unread, even bytes the last stage refuses.
TEST(StageExecutor, TheLastStageRefusesASequenceWithoutState) {
  StageExecutor whole = stage(0, 6), first = stage(0, 3), second = stage(3, 6);
  MicroBatch b = prompt_batch();
  b.admissions.clear();
  BatchResult r;
  Status s = whole.run(b, {}, kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("sequence 1 has no request state on the last stage"), std::string::npos) << s.message();
  EXPECT_EQ(whole.backend().num_sequences(), 0);

  b = prompt_batch();
  b.admissions.resize(b.admissions.size() - 2);  // cut short: the last stage cannot read it
  const std::vector<std::byte> act = outgoing(first, b);
  EXPECT_EQ(first.backend().num_sequences(), 2);
  s = second.run(b, act, kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("micro-batch 7: malformed admissions: field 'count' runs past the end"), std::string::npos)
      << s.message();
  EXPECT_EQ(second.backend().num_sequences(), 0);

  b = prompt_batch();
  readmit(b, {greedy_state(3, 2), greedy_state(5, 21)});
  s = whole.run(b, {}, kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the admission of sequence 2: top_logprobs 21 is outside 0..20"), std::string::npos)
      << s.message();
}

// A state stays until its sequence is freed: later steps need no admission, and a freed
// sequence's next step is refused.
TEST(StageExecutor, TheLastStageKeepsAStateUntilItsSequenceIsFreed) {
  StageExecutor whole = stage(0, 6);
  MicroBatch b = prompt_batch();
  BatchResult r1, r2, r3;
  ASSERT_TRUE(whole.run(b, {}, kNoSink, &r1).ok());
  MicroBatch next;
  next.batch_id = 8;
  next.seqs.push_back({.slice = {1, 3, 1}, .sample = true});
  next.token_ids = {r1.seqs[0].token};
  ASSERT_TRUE(whole.run(next, {}, kNoSink, &r2).ok());
  ASSERT_EQ(r2.seqs.size(), 1u);
  EXPECT_EQ(r2.seqs[0].top.size(), 2u);  // the admitted top_logprobs
  next.batch_id = 9;
  next.free_seq_ids = {1};
  next.seqs[0].slice.start_pos = 0;  // a fresh start of the freed sequence
  const Status s = whole.run(next, {}, kNoSink, &r3);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("sequence 1 has no request state"), std::string::npos) << s.message();
}

// A step ahead (SeqStep::own_token): the stage of a one-stage pipeline runs the slice on the
// token it sampled at that position, giving what the batch with that token would give, and a
// penalty-using sampler sees it in the history; a step ahead at a position the stage has not
// sampled, or on a stage that does not sample, is refused naming the sequence.
TEST(StageExecutor, AStepAheadRunsOnTheTokenTheStageSampled) {
  StageExecutor ahead = stage(0, 6), told = stage(0, 6);
  MicroBatch b = prompt_batch();
  BatchResult a1, t1;
  ASSERT_TRUE(ahead.run(b, {}, kNoSink, &a1).ok());
  ASSERT_TRUE(told.run(b, {}, kNoSink, &t1).ok());
  ASSERT_EQ(a1, t1);
  for (int step = 0; step < 3; ++step) {  // three steps ahead in a row
    MicroBatch own, sent;
    own.batch_id = sent.batch_id = uint64_t(8 + step);
    for (size_t i = 0; i < 2; ++i) {
      const int32_t pos = (i == 0 ? 3 : 5) + step;
      own.seqs.push_back({.slice = {i + 1, pos, 1}, .sample = true, .own_token = true});
      own.token_ids.push_back(kOwnTokenPlaceholder);
      sent.seqs.push_back({.slice = {i + 1, pos, 1}, .sample = true});
      sent.token_ids.push_back(t1.seqs[i].token);
    }
    BatchResult a2, t2;
    ASSERT_TRUE(ahead.run(own, {}, kNoSink, &a2).ok());
    ASSERT_TRUE(told.run(sent, {}, kNoSink, &t2).ok());
    EXPECT_EQ(a2, t2) << "step " << step;
    t1 = t2;
  }
  MicroBatch wrong;  // sequence 1 was last sampled for position 6, not 9
  wrong.batch_id = 20;
  wrong.seqs.push_back({.slice = {1, 9, 1}, .sample = true, .own_token = true});
  wrong.token_ids = {kOwnTokenPlaceholder};
  BatchResult r;
  Status s = ahead.run(wrong, {}, kNoSink, &r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("sequence 1 steps ahead at position 9"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("sampled one for position 6"), std::string::npos) << s.message();
  StageExecutor first = stage(0, 3);  // embeds but does not sample
  wrong.seqs[0].slice.start_pos = 0;
  std::vector<std::byte> out;
  const ActivationSink sink = [&](size_t bytes) -> Expected<std::span<std::byte>> {
    out.resize(bytes);
    return std::span<std::byte>(out);
  };
  s = first.run(wrong, {}, sink, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("only the stage of a one-stage pipeline"), std::string::npos) << s.message();
}

// One sequence's step: `tokens` from `start`, sampled.
SeqStep seq_step(uint64_t id, int32_t start, int32_t n) {
  SeqStep w;
  w.slice = {id, start, n};
  w.sample = true;
  return w;
}

// The admission of a greedy sequence reporting its top 5.
std::vector<uint8_t> admit_greedy(uint64_t id, int32_t prompt_len) {
  const Admission a{id, greedy_state(prompt_len, 5)};
  return encode_admissions(std::span(&a, 1));
}

// A fork gives the child its parent's K/V prefix, and on the last stage its state (no
// admission comes for the children): decoding the children gives the same tokens and
// log-probs as sequences computed from scratch, bit for bit (the CPU stage is batch and chunk
// invariant); a parent freed by the same batch can be forked from; the K/V accounting counts
// what each sequence holds; and bad forks are refused naming what is wrong.
TEST(StageExecutor, ForkedSequencesDecodeAsIfComputedFromScratch) {
  StageExecutor ex = stage(0, 6), ref = stage(0, 6);
  const std::vector<int32_t> prompt = {464, 1578, 531, 818, 262, 3329, 262, 1468, 11, 290, 339, 1110, 13, 383, 2010,
                                       257, 1244, 318, 7, 42, 99};  // 21 tokens: one full page and a part
  MicroBatch first;
  first.seqs.push_back(seq_step(1, 0, int32_t(prompt.size())));
  first.token_ids = prompt;
  first.admissions = admit_greedy(1, int32_t(prompt.size()));
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
    second.seqs.push_back(seq_step(2 + i, next[i].first, 1));
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
    scratch.seqs.push_back(seq_step(100 + i, 0, int32_t(whole.size())));
    scratch.token_ids = whole;
    scratch.admissions = admit_greedy(100 + i, int32_t(prompt.size()));
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
  b.seqs.push_back(seq_step(1, 0, 8));
  b.token_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  b.admissions = admit_greedy(1, 8);
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

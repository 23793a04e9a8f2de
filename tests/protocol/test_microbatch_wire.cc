// The data-plane messages on the wire: a small micro-batch (with an admission), its
// admissions section and a batch result are pinned byte for byte, so a change of the format
// is a deliberate one (bump the magic word); every message survives encode -> decode; and
// malformed bytes are an error naming the message and the field, never a read past the end.
#include <gtest/gtest.h>

#include <cctype>
#include <string>

#include "protocol/batch_result.h"
#include "protocol/microbatch.h"
#include "protocol/seq_state.h"

namespace conveyor {
namespace {

// "0a ff ..." -> bytes; spaces between bytes are for the reader.
std::vector<uint8_t> hex(const std::string& text) {
  std::vector<uint8_t> out;
  std::string digits;
  for (char c : text)
    if (std::isxdigit(static_cast<unsigned char>(c))) digits += c;
  for (size_t i = 0; i + 1 < digits.size(); i += 2) out.push_back(uint8_t(std::stoi(digits.substr(i, 2), nullptr, 16)));
  return out;
}

// Sequence 5's state: greedy-ish sampling with a stop id, a bias and a seed.
Admission small_admission() {
  Admission a;
  a.seq_id = 5;
  a.state.prompt_len = 2;
  a.state.top_logprobs = 1;
  a.state.sample_index = 3;
  a.state.sampling.temperature = 0.5f;
  a.state.sampling.top_k = 40;
  a.state.sampling.seed = 0x0102030405060708ull;
  a.state.sampling.stop_token_ids = {50256};
  a.state.sampling.logit_bias = {{13, -100.f}};
  return a;
}

const char* const kAdmissionsBytes =
    "01 00 00 00"                 // one admission
    "05 00 00 00 00 00 00 00"     // seq_id 5
    "02 00 00 00 01 00 00 00"     // prompt_len 2, top_logprobs 1
    "03 00 00 00 00 00 00 00"     // sample_index 3
    "00 00 00 3f 28 00 00 00"     // temperature 0.5, top_k 40
    "00 00 80 3f 00 00 80 3f"     // top_p 1, repetition_penalty 1
    "00 00 00 00 00 00 00 00"     // presence_penalty 0, frequency_penalty 0
    "00 00 00 00"                 // min_tokens 0
    "08 07 06 05 04 03 02 01"     // seed
    "01 00 00 00 50 c4 00 00"     // stop_token_ids: [50256]
    "01 00 00 00 0d 00 00 00 00 00 c8 c2";  // logit_bias: [(13, -100)]

// Sequence 5's first chunk (its admission with it) and sequence 6's step that scores a
// prompt token; a fork and a free.
MicroBatch small_batch() {
  MicroBatch b;
  b.batch_id = 7, b.pipeline = 1, b.epoch = 3;
  b.activation_dtype = DType::F16;
  b.seqs.push_back({.slice = {5, 0, 2}, .sample = true, .prefill = true});
  b.seqs.push_back({.slice = {6, 9, 1}, .prompt_logprobs = true, .prefill = true, .lookahead_token = 42});
  b.token_ids = {10, 11, 12};
  b.forks = {{5, 8, 2}};
  b.free_seq_ids = {4};
  const Admission a = small_admission();
  b.admissions = encode_admissions(std::span(&a, 1));
  return b;
}

std::string batch_bytes() {
  return std::string(
             "43 4d 42 34"               // magic "CMB4"
             "07 00 00 00 00 00 00 00"   // batch_id 7
             "01 00 00 00 03 00 00 00"   // pipeline 1, epoch 3
             "01"                        // activation dtype F16 (DType 1)
             "02 00 00 00"               // two sequences
             "05 00 00 00 00 00 00 00 00 00 00 00 02 00 00 00 05"  // 5: from 0, 2 tokens, sample + prefill
             "06 00 00 00 00 00 00 00 09 00 00 00 01 00 00 00 06"  // 6: from 9, 1 token, prompt_logprobs + prefill
             "2a 00 00 00"               //    its lookahead token 42
             "03 00 00 00 0a 00 00 00 0b 00 00 00 0c 00 00 00"     // token_ids [10, 11, 12]
             "01 00 00 00 05 00 00 00 00 00 00 00 08 00 00 00 00 00 00 00 02 00 00 00"  // fork 5 -> 8, 2 tokens
             "01 00 00 00 04 00 00 00 00 00 00 00"                 // free [4]
             "54 00 00 00") +            // 84 bytes of admissions:
         kAdmissionsBytes;
}

TEST(MicroBatchWire, TheBytesArePinned) {
  const MicroBatch b = small_batch();
  EXPECT_EQ(b.admissions, hex(kAdmissionsBytes));
  EXPECT_EQ(encode(b), hex(batch_bytes()));
  auto back = decode_microbatch(hex(batch_bytes()));
  ASSERT_TRUE(back) << back.error();
  EXPECT_EQ(*back, b);
  auto admitted = decode_admissions(back->admissions);
  ASSERT_TRUE(admitted) << admitted.error();
  ASSERT_EQ(admitted->size(), 1u);
  EXPECT_EQ((*admitted)[0], small_admission());
}

TEST(MicroBatchWire, ADecodeStepIsTwentyOneBytesASequence) {
  MicroBatch b;
  for (uint64_t i = 0; i < 256; ++i) {
    b.seqs.push_back({.slice = {1000 + i, 130, 1}, .sample = true});
    b.token_ids.push_back(int32_t(i));
  }
  // Fixed part, five counts and 17 + 4 bytes per sequence (slice, flags, token id).
  EXPECT_EQ(encode(b).size(), size_t(4 + 8 + 4 + 4 + 1) + 5 * 4 + 256 * (17 + 4));
  auto back = decode_microbatch(encode(b));
  ASSERT_TRUE(back) << back.error();
  EXPECT_EQ(*back, b);
}

TEST(MicroBatchWire, EveryCutIsRefusedNamingAField) {
  const std::vector<uint8_t> whole = hex(batch_bytes());
  for (size_t n = 0; n < whole.size(); ++n) {
    auto cut = decode_microbatch(std::span(whole).first(n));
    ASSERT_FALSE(cut) << n << " bytes";
    EXPECT_NE(cut.error().find("malformed micro-batch: "), std::string::npos) << cut.error();
  }
  auto cut = decode_microbatch(std::span(whole).first(whole.size() - 1));
  EXPECT_NE(cut.error().find("field 'admissions'"), std::string::npos) << cut.error();
  std::vector<uint8_t> longer = whole;
  longer.push_back(0);
  auto trailing = decode_microbatch(longer);
  ASSERT_FALSE(trailing);
  EXPECT_NE(trailing.error().find("trailing bytes"), std::string::npos) << trailing.error();
}

TEST(MicroBatchWire, BadFieldsAreNamed) {
  const std::vector<uint8_t> whole = hex(batch_bytes());
  auto refused = [&](size_t at, uint8_t value, const std::string& what) {
    std::vector<uint8_t> bad = whole;
    bad[at] = value;
    auto r = decode_microbatch(bad);
    ASSERT_FALSE(r) << what;
    EXPECT_NE(r.error().find(what), std::string::npos) << r.error();
  };
  refused(0, 0x42, "bad magic word");
  refused(20, uint8_t(DType::I32), "activation dtype");
  refused(25 + 16, 0x11, "sequence 5 has unknown step flags 17");
  refused(25 + 12, 0x03, "slices cover 4 tokens but 3 token ids were sent");  // 5's num_tokens: 3
  refused(25 + 12, 0x00, "sequence 5 has start_pos 0 and num_tokens 0");
}

TEST(MicroBatchWire, TheDtypeIsPatchedInPlace) {
  std::vector<uint8_t> bytes = encode(small_batch());
  auto as_bytes = std::as_writable_bytes(std::span(bytes));
  ASSERT_TRUE(patch_activation_dtype(as_bytes, DType::BF16).ok());
  auto back = decode_microbatch(bytes);
  ASSERT_TRUE(back) << back.error();
  MicroBatch want = small_batch();
  want.activation_dtype = DType::BF16;
  EXPECT_EQ(*back, want);
  EXPECT_NE(patch_activation_dtype(as_bytes, DType::I32).message().find("not F32, F16 or BF16"), std::string::npos);
  std::vector<uint8_t> other = encode(BatchResult{});
  EXPECT_NE(patch_activation_dtype(std::as_writable_bytes(std::span(other)), DType::F16).message().find("magic"),
            std::string::npos);
  EXPECT_NE(patch_activation_dtype(as_bytes.first(20), DType::F16).message().find("too few"), std::string::npos);
}

TEST(MicroBatchWire, ValidateNamesWhatDoesNotFitTheModel) {
  ModelConfig config;
  config.n_positions = 16, config.vocab_size = 100;
  MicroBatch b = small_batch();
  EXPECT_TRUE(validate(b, config).ok()) << validate(b, config).message();
  auto message = [&](auto change) {
    MicroBatch bad = small_batch();
    change(bad);
    return validate(bad, config).message();
  };
  EXPECT_NE(message([](MicroBatch& m) { m.seqs[1].slice.start_pos = 16; }).find("sequence 6 runs to position 17"),
            std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) { m.seqs[1].lookahead_token = 100; }).find("lookahead token 100"),
            std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) { m.token_ids[2] = -1; }).find("token id -1"), std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) { m.forks[0].child = 5; }).find("into itself"), std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) { m.forks[0].num_tokens = 0; }).find("num_tokens 0"), std::string::npos);
}

// A step ahead's slice (SeqStep::own_token) travels as flag 8; its token is the placeholder,
// which validate takes only there, and only for one decode token.
TEST(MicroBatchWire, AnOwnTokenSliceTravelsAndIsChecked) {
  ModelConfig config;
  config.n_positions = 16, config.vocab_size = 100;
  MicroBatch b;
  b.batch_id = 3;
  b.seqs.push_back({.slice = {7, 4, 1}, .sample = true});
  b.seqs.push_back({.slice = {8, 9, 1}, .sample = true, .own_token = true});
  b.token_ids = {42, kOwnTokenPlaceholder};
  const std::vector<uint8_t> bytes = encode(b);
  EXPECT_EQ(bytes[25 + 17 + 16], 1 | 8);  // the second slice's flags (header 25 bytes, a slice 17)
  auto back = decode_microbatch(bytes);
  ASSERT_TRUE(back) << back.error();
  EXPECT_EQ(*back, b);
  EXPECT_TRUE(validate(b, config).ok()) << validate(b, config).message();
  auto message = [&](auto change) {
    MicroBatch bad = b;
    change(bad);
    return validate(bad, config).message();
  };
  EXPECT_NE(message([](MicroBatch& m) { m.token_ids[0] = kOwnTokenPlaceholder; }).find("token id -1"), std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) { m.token_ids[1] = 5; }).find("sequence 8: a step on the stage's own token"),
            std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) { m.seqs[1].prefill = true; }).find("must be one decode token"),
            std::string::npos);
  EXPECT_NE(message([](MicroBatch& m) {
              m.seqs[1].slice.num_tokens = 2;
              m.token_ids.push_back(kOwnTokenPlaceholder);
            }).find("must be one decode token"),
            std::string::npos);
}

TEST(AdmissionsWire, RoundTripAndRefuseWhatIsWrong) {
  EXPECT_TRUE(encode_admissions({}).empty());
  auto none = decode_admissions({});
  ASSERT_TRUE(none) << none.error();
  EXPECT_TRUE(none->empty());

  const std::vector<uint8_t> whole = hex(kAdmissionsBytes);
  for (size_t n = 1; n < whole.size(); ++n) {
    auto cut = decode_admissions(std::span(whole).first(n));
    ASSERT_FALSE(cut) << n << " bytes";
    EXPECT_NE(cut.error().find("malformed admissions: "), std::string::npos) << cut.error();
  }
  EXPECT_NE(decode_admissions(std::span(whole).first(whole.size() - 3)).error().find("field 'logit_bias'"),
            std::string::npos);
  std::vector<uint8_t> longer = whole;
  longer.push_back(7);
  EXPECT_NE(decode_admissions(longer).error().find("trailing bytes"), std::string::npos);

  ModelConfig config;
  config.n_positions = 16, config.vocab_size = 50257;
  SeqState st = small_admission().state;
  EXPECT_TRUE(validate(st, config).ok()) << validate(st, config).message();
  st.top_logprobs = 21;
  EXPECT_NE(validate(st, config).message().find("top_logprobs 21"), std::string::npos);
  st = small_admission().state;
  st.prompt_len = 17;
  EXPECT_NE(validate(st, config).message().find("prompt_len 17"), std::string::npos);
  st = small_admission().state;
  st.sampling.logit_bias = {{int32_t(config.vocab_size), 1.f}};
  EXPECT_NE(validate(st, config).message().find("logit_bias"), std::string::npos);
}

BatchResult small_result() {
  BatchResult r;
  r.batch_id = 7, r.pipeline = 1, r.epoch = 3, r.busy_seconds = 0.25;
  SeqResult s;
  s.seq_id = 5, s.token = 11, s.logprob = -0.5f;
  s.top = {{11, -0.5f}};
  s.prompt_logprobs = {-1.f};
  s.prompt_top = {{{12, -1.f}}};
  r.seqs.push_back(s);
  return r;
}

TEST(BatchResultWire, TheBytesArePinned) {
  const char* const kBytes =
      "43 52 52 31"                                     // magic "CRR1"
      "07 00 00 00 00 00 00 00 01 00 00 00 03 00 00 00"  // batch_id 7, pipeline 1, epoch 3
      "00 00 00 00 00 00 d0 3f"                         // busy_seconds 0.25
      "00 00 00 00"                                     // error ""
      "01 00 00 00"                                     // one sequence
      "05 00 00 00 00 00 00 00 0b 00 00 00 00 00 00 bf"  // 5: token 11, logprob -0.5
      "01 00 00 00 0b 00 00 00 00 00 00 bf"             //    top [(11, -0.5)]
      "01 00 00 00 00 00 80 bf"                         //    prompt_logprobs [-1]
      "01 00 00 00 01 00 00 00 0c 00 00 00 00 00 80 bf";  // prompt_top [[(12, -1)]]
  EXPECT_EQ(encode(small_result()), hex(kBytes));
  auto back = decode_batch_result(hex(kBytes));
  ASSERT_TRUE(back) << back.error();
  EXPECT_EQ(*back, small_result());

  BatchResult failed;
  failed.error = "stage 2: gone";
  auto again = decode_batch_result(encode(failed));
  ASSERT_TRUE(again) << again.error();
  EXPECT_EQ(*again, failed);

  const std::vector<uint8_t> whole = hex(kBytes);
  for (size_t n = 0; n < whole.size(); ++n) {
    auto cut = decode_batch_result(std::span(whole).first(n));
    ASSERT_FALSE(cut) << n << " bytes";
    EXPECT_NE(cut.error().find("malformed batch result: "), std::string::npos) << cut.error();
  }
  EXPECT_NE(decode_batch_result(std::span(whole).first(whole.size() - 2)).error().find("field 'prompt_top'"),
            std::string::npos);
}

}  // namespace
}  // namespace conveyor

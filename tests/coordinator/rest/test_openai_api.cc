// parse_completion_request and parse_completion_body: what a completion request may say,
// the refusals (each naming its parameter), and the shape of an API error.
#include "coordinator/rest/openai_api.h"

#include <cmath>
#include <set>

#include <gtest/gtest.h>

#include "tests/coordinator/rest/openai_test_util.h"

namespace conveyor {
namespace {

using namespace openai_test;

TEST(ParseCompletion, DefaultsForAMinimalRequest) {
  CompletionRequest r = ok({{"prompt", "The jury said"}});
  EXPECT_EQ(r.model, kModel);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], tok().encode("The jury said"));
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.echo);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_TRUE(r.stop.empty());
  EXPECT_FALSE(r.return_token_ids);
  EXPECT_FALSE(r.ignore_eos);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.0f);
  // The end-of-text token stops generation (and min_tokens masks it).
  EXPECT_EQ(r.sampling.stop_token_ids, std::vector<int32_t>{0});
  EXPECT_TRUE(r.id.starts_with("cmpl-"));
  EXPECT_GT(r.id.size(), 20u);
}

TEST(ParseCompletion, AbsentSeedDrawsADifferentRandomSeedEachTime) {
  std::set<uint64_t> seeds;
  std::set<std::string> ids;
  for (int i = 0; i < 8; ++i) {
    CompletionRequest r = ok(kBase);
    seeds.insert(r.sampling.seed);
    ids.insert(r.id);
  }
  EXPECT_EQ(seeds.size(), 8u);
  EXPECT_EQ(ids.size(), 8u);
}

TEST(ParseCompletion, EveryFieldIsRead) {
  CompletionRequest r = ok({{"model", kModel},
                            {"prompt", "Hello"},
                            {"max_tokens", 7},
                            {"temperature", 0.5},
                            {"top_p", 0.9},
                            {"top_k", 40},
                            {"n", 3},
                            {"stream", true},
                            {"stream_options", {{"include_usage", true}}},
                            {"logprobs", 5},
                            {"echo", true},
                            {"stop", {"\n", "."}},
                            {"seed", 1234},
                            {"presence_penalty", 0.5},
                            {"frequency_penalty", -0.5},
                            {"repetition_penalty", 1.3},
                            {"min_tokens", 2},
                            {"return_token_ids", true},
                            {"ignore_eos", true},
                            {"user", "someone"},
                            {"best_of", 3},
                            {"logit_bias", json::object()},
                            {"suffix", nullptr}});
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.num_choices(), 3u);
  EXPECT_TRUE(r.stream);
  EXPECT_EQ(r.logprobs, 5);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "."}));
  EXPECT_EQ(r.sampling.seed, 1234u);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.3f);
  EXPECT_EQ(r.sampling.min_tokens, 2);
  EXPECT_TRUE(r.return_token_ids);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_TRUE(r.sampling.stop_token_ids.empty());  // ignore_eos: eos is not a stop id
}

TEST(ParseCompletion, NullMeansDefault) {
  CompletionRequest r = ok({{"prompt", "Hi"}, {"max_tokens", nullptr}, {"temperature", nullptr}, {"logprobs", nullptr},
                            {"stop", nullptr}, {"n", nullptr}, {"model", nullptr}});
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_EQ(r.n, 1);
  EXPECT_TRUE(r.stop.empty());
}

TEST(ParseCompletion, PromptForms) {
  CompletionRequest ids = ok(with(kBase, "prompt", {5, 6, 7}));
  ASSERT_EQ(ids.prompts.size(), 1u);
  EXPECT_EQ(ids.prompts[0], (std::vector<int32_t>{5, 6, 7}));

  CompletionRequest strings = ok(with(kBase, "prompt", {"Hello", "The end"}));
  ASSERT_EQ(strings.prompts.size(), 2u);
  EXPECT_EQ(strings.prompts[1], tok().encode("The end"));

  CompletionRequest arrays = ok(with(with(kBase, "prompt", {{1, 2}, {3}}), "n", 2));
  ASSERT_EQ(arrays.prompts.size(), 2u);
  EXPECT_EQ(arrays.prompts[1], std::vector<int32_t>{3});
  EXPECT_EQ(arrays.num_choices(), 4u);

  // The largest and smallest ids are accepted.
  ok(with(kBase, "prompt", {0, 4095}));
}

TEST(ParseCompletion, BadPrompts) {
  refused({{"model", kModel}}, "prompt");
  refused(with(kBase, "prompt", ""), "prompt");
  refused(with(kBase, "prompt", json::array()), "prompt");
  refused(with(kBase, "prompt", {""}), "prompt");
  refused(with(kBase, "prompt", {json::array()}), "prompt");
  refused(with(kBase, "prompt", 5.5), "prompt");
  refused(with(kBase, "prompt", 42), "prompt");
  refused(with(kBase, "prompt", {{"a", 1}}), "prompt");
  refused(with(kBase, "prompt", {1, "a"}), "prompt");
  refused(with(kBase, "prompt", {"a", 1}), "prompt");
  refused(with(kBase, "prompt", {{1}, "a"}), "prompt");
  refused(with(kBase, "prompt", {1.5}), "prompt");
  EXPECT_NE(refused(with(kBase, "prompt", {4096}), "prompt").find("4096"), std::string::npos);
  EXPECT_NE(refused(with(kBase, "prompt", {-1}), "prompt").find("-1"), std::string::npos);
  refused(with(kBase, "prompt", {{1, 2}, {99999}}), "prompt");
  const std::string msg = refused(with(kBase, "prompt", ids_of_length(257)), "prompt");
  EXPECT_NE(msg.find("257"), std::string::npos) << msg;
  EXPECT_NE(msg.find("256"), std::string::npos) << msg;
  ApiLimits limits;
  limits.max_prompts = 2;
  Parsed p = parse(with(kBase, "prompt", {"a", "b", "c"}), limits);
  EXPECT_FALSE(p.request.ok());
  EXPECT_EQ(p.error.param, "prompt");
}

TEST(ParseCompletion, ModelMustBeTheServedOne) {
  refused(with(kBase, "model", "gpt-4"), "model", 404);
  EXPECT_EQ(parse(with(kBase, "model", "gpt-4")).error.code, "model_not_found");
  refused(with(kBase, "model", 3), "model");
  // A server with no name accepts any model and echoes it.
  Expected<CompletionRequest> r = parse_completion_request(with(kBase, "model", "anything"), tok(), cfg(), {}, "");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->model, "anything");
}

TEST(ParseCompletion, MaxTokens) {
  // 0 is the scoring idiom's (echo only): test_openai_scoring.cc.
  EXPECT_NE(refused(with(kBase, "max_tokens", 0), "max_tokens").find("needs echo"), std::string::npos);
  refused(with(kBase, "max_tokens", -3), "max_tokens");
  EXPECT_NE(refused(with(kBase, "max_tokens", "5"), "max_tokens").find("integer"), std::string::npos);
  refused(with(kBase, "max_tokens", 1.5), "max_tokens");
  refused(with(kBase, "max_tokens", true), "max_tokens");
  refused(with(kBase, "max_tokens", uint64_t(1) << 40), "max_tokens");
  // Prompt + max_tokens beyond the context: the message gives the numbers.
  const std::string msg = refused(with(with(kBase, "prompt", ids_of_length(250)), "max_tokens", 10), "max_tokens");
  EXPECT_NE(msg.find("256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("260"), std::string::npos) << msg;
  EXPECT_NE(msg.find("250"), std::string::npos) << msg;
  EXPECT_EQ(ok(with(with(kBase, "prompt", ids_of_length(250)), "max_tokens", 6)).max_tokens, 6);
  // Without max_tokens the default shrinks to fit.
  EXPECT_EQ(ok(with(kBase, "prompt", ids_of_length(250))).max_tokens, 6);
  EXPECT_EQ(ok(with(kBase, "prompt", ids_of_length(255))).max_tokens, 1);
  // With max_tokens given, a prompt that fills the context blames max_tokens (it was sent).
  refused(with(with(kBase, "prompt", ids_of_length(256)), "max_tokens", 1), "max_tokens");
  // The longest of several prompts decides.
  refused(with(with(kBase, "prompt", {ids_of_length(10), ids_of_length(250)}), "max_tokens", 7), "max_tokens");
}

TEST(ParseCompletion, PromptFillingTheContextWithoutMaxTokensBlamesThePrompt) {
  // The client sent no max_tokens, so the message must not be about max_tokens.
  const std::string msg = refused(with(kBase, "prompt", ids_of_length(256)), "prompt");
  EXPECT_EQ(msg, "this model's maximum context length is 256 tokens, however the prompt has 256 tokens, "
                 "which leaves no room for a completion; reduce the prompt");
  EXPECT_EQ(msg.find("max_tokens"), std::string::npos) << msg;
  // In a batch the longest prompt is named; null max_tokens is "not sent" too.
  EXPECT_EQ(refused(with(kBase, "prompt", {ids_of_length(256), ids_of_length(3)}), "prompt"),
            "this model's maximum context length is 256 tokens, however the longest prompt has 256 tokens, "
            "which leaves no room for a completion; reduce the prompt");
  refused(with(with(kBase, "prompt", ids_of_length(256)), "max_tokens", nullptr), "prompt");
}

TEST(ParseCompletion, SamplingRanges) {
  ok(with(kBase, "temperature", 0));
  ok(with(kBase, "temperature", 2));
  refused(with(kBase, "temperature", 2.5), "temperature");
  refused(with(kBase, "temperature", -0.1), "temperature");
  EXPECT_NE(refused(with(kBase, "temperature", "hot"), "temperature").find("number"), std::string::npos);

  ok(with(kBase, "top_p", 1));
  refused(with(kBase, "top_p", 0), "top_p");
  refused(with(kBase, "top_p", 1.01), "top_p");
  refused(with(kBase, "top_p", "x"), "top_p");

  ok(with(kBase, "top_k", 0));
  refused(with(kBase, "top_k", -1), "top_k");
  refused(with(kBase, "top_k", 2.5), "top_k");

  refused(with(kBase, "presence_penalty", 2.1), "presence_penalty");
  refused(with(kBase, "presence_penalty", "x"), "presence_penalty");
  refused(with(kBase, "frequency_penalty", -2.5), "frequency_penalty");
  ok(with(with(kBase, "frequency_penalty", -2), "presence_penalty", 2));

  refused(with(kBase, "repetition_penalty", 0), "repetition_penalty");
  refused(with(kBase, "repetition_penalty", -1), "repetition_penalty");
  refused(with(kBase, "repetition_penalty", false), "repetition_penalty");

  refused(with(kBase, "min_tokens", -1), "min_tokens");
  refused(with(with(kBase, "min_tokens", 20), "max_tokens", 10), "min_tokens");
  refused(with(kBase, "min_tokens", "2"), "min_tokens");
}

TEST(ParseCompletion, ChoicesStreamLogprobsEcho) {
  refused(with(kBase, "n", 0), "n");
  refused(with(kBase, "n", 129), "n");
  refused(with(kBase, "n", "2"), "n");
  EXPECT_EQ(ok(with(kBase, "n", 128)).n, 128);

  refused(with(kBase, "stream", "true"), "stream");
  refused(with(kBase, "stream", 1), "stream");
  refused(with(kBase, "stream_options", {{"include_usage", true}}), "stream_options");  // needs stream
  refused(with(with(kBase, "stream", true), "stream_options", {{"bogus", true}}), "stream_options");
  refused(with(with(kBase, "stream", true), "stream_options", 3), "stream_options");
  refused(with(with(kBase, "stream", true), "stream_options", {{"include_usage", "yes"}}),
          "stream_options.include_usage");
  refused(with(with(kBase, "stream", true), "stream_options", {{"include_usage", 1}}), "stream_options.include_usage");
  refused(with(with(kBase, "stream", false), "stream_options", {{"include_usage", false}}), "stream_options");

  EXPECT_EQ(ok(with(kBase, "logprobs", 0)).logprobs, 0);
  EXPECT_EQ(ok(with(kBase, "logprobs", 20)).logprobs, 20);
  refused(with(kBase, "logprobs", 21), "logprobs");
  refused(with(kBase, "logprobs", -1), "logprobs");
  refused(with(kBase, "logprobs", true), "logprobs");

  refused(with(kBase, "echo", "yes"), "echo");
  refused(with(kBase, "return_token_ids", 1), "return_token_ids");
  refused(with(kBase, "ignore_eos", "no"), "ignore_eos");
}

TEST(ParseCompletion, Stop) {
  EXPECT_EQ(ok(with(kBase, "stop", "\n")).stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(ok(with(kBase, "stop", {"a", "b", "c", "d"})).stop.size(), 4u);
  refused(with(kBase, "stop", ""), "stop");
  refused(with(kBase, "stop", {"a", ""}), "stop");
  refused(with(kBase, "stop", {"a", "b", "c", "d", "e"}), "stop");
  refused(with(kBase, "stop", {1}), "stop");
  refused(with(kBase, "stop", 5), "stop");
}

TEST(ParseCompletion, Seed) {
  EXPECT_EQ(ok(with(kBase, "seed", 42)).sampling.seed, 42u);
  EXPECT_EQ(ok(with(kBase, "seed", 0)).sampling.seed, 0u);
  EXPECT_EQ(ok(with(kBase, "seed", -1)).sampling.seed, UINT64_MAX);
  EXPECT_EQ(ok(with(kBase, "seed", UINT64_MAX)).sampling.seed, UINT64_MAX);
  refused(with(kBase, "seed", "42"), "seed");
  refused(with(kBase, "seed", 4.2), "seed");
}

// Seeds as clients write them (raw JSON text, so numbers past 64 bits reach the parser).
Parsed parse_seed(const std::string& seed_text) {
  ApiError error;
  Expected<CompletionRequest> r =
      parse_completion_body(R"({"prompt": "x", "seed": )" + seed_text + "}", tok(), cfg(), {}, kModel, &error);
  return {std::move(r), error};
}

uint64_t seed_of(const std::string& seed_text) {
  Parsed p = parse_seed(seed_text);
  EXPECT_TRUE(p.request.ok()) << seed_text << " -> " << p.error.message;
  return p.request.ok() ? p.request->sampling.seed : 0;
}

std::string seed_refusal(const std::string& seed_text) {
  Parsed p = parse_seed(seed_text);
  EXPECT_FALSE(p.request.ok()) << seed_text;
  EXPECT_EQ(p.error.param, "seed");
  EXPECT_EQ(p.error.http_status, 400);
  return p.error.message;
}

TEST(ParseCompletion, SeedsAtTheEdgesOf64Bits) {
  // Signed and unsigned extremes are accepted; negative values map modulo 2^64.
  EXPECT_EQ(seed_of("18446744073709551615"), UINT64_MAX);              // 2^64-1
  EXPECT_EQ(seed_of("9223372036854775808"), uint64_t(1) << 63);        // 2^63
  EXPECT_EQ(seed_of("9223372036854775807"), (uint64_t(1) << 63) - 1);  // 2^63-1
  EXPECT_EQ(seed_of("-9223372036854775808"), uint64_t(1) << 63);       // -2^63
  EXPECT_EQ(seed_of("-2"), UINT64_MAX - 1);
  // One past either end does not fit, and the message says so (not "non-integer").
  for (const char* text : {"18446744073709551616", "-9223372036854775809", "100000000000000000000000"}) {
    const std::string msg = seed_refusal(text);
    EXPECT_TRUE(msg.starts_with("'seed' must be an integer from -2^63 to 2^64-1; ")) << msg;
    EXPECT_TRUE(msg.ends_with(" does not fit in 64 bits")) << msg;
  }
  EXPECT_EQ(seed_refusal("4.5"), "'seed' must be an integer from -2^63 to 2^64-1, got a non-integer number");
  EXPECT_EQ(seed_refusal("\"7\""), "'seed' must be an integer from -2^63 to 2^64-1, got a string");
}

TEST(ParseCompletion, ResponseOptions) {
  ResponseOptions o;
  ASSERT_TRUE(parse(with(with(kBase, "stream", true), "stream_options", {{"include_usage", true}}), {}, &o).request.ok());
  EXPECT_TRUE(o.include_usage);
  const std::string fingerprint = o.system_fingerprint;
  ASSERT_TRUE(parse(with(with(kBase, "stream", true), "stream_options", {{"include_usage", false}}), {}, &o).request.ok());
  EXPECT_FALSE(o.include_usage);
  ASSERT_TRUE(parse(with(kBase, "stream", true), {}, &o).request.ok());
  EXPECT_FALSE(o.include_usage);
  EXPECT_EQ(o.system_fingerprint, fingerprint);  // the same for every request of one server
}

TEST(SystemFingerprint, StableAndDerivedFromTheModel) {
  const std::string fp = system_fingerprint(kModel, cfg(), tok());
  ASSERT_EQ(fp.size(), 15u) << fp;
  EXPECT_TRUE(fp.starts_with("fp_")) << fp;
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef", 3), std::string::npos) << fp;
  EXPECT_EQ(system_fingerprint(kModel, cfg(), tok()), fp);
  EXPECT_NE(system_fingerprint("other-model", cfg(), tok()), fp);
  ModelConfig longer = cfg();
  longer.n_positions *= 2;
  EXPECT_NE(system_fingerprint(kModel, longer, tok()), fp);
  ModelConfig erf = cfg();
  erf.activation = erf.activation == Activation::Gelu ? Activation::GeluNew : Activation::Gelu;
  EXPECT_NE(system_fingerprint(kModel, erf, tok()), fp);
}

TEST(ParseCompletion, UnsupportedOpenAIFields) {
  ok(with(kBase, "best_of", 1));
  ok(with(with(kBase, "best_of", 2), "n", 2));
  refused(with(kBase, "best_of", "2"), "best_of");  // best_of by sampling: test_openai_scoring.cc
  EXPECT_NE(refused(with(kBase, "suffix", "end"), "suffix").find("not supported"), std::string::npos);
  ok(with(kBase, "suffix", ""));
  refused(with(kBase, "suffix", 1), "suffix");
  refused(with(kBase, "user", 5), "user");
}

TEST(ParseCompletion, LogitBias) {
  // OpenAI's shape: token id strings to biases, sorted by id into the sampling parameters.
  CompletionRequest r = ok(with(kBase, "logit_bias", {{"4095", -100}, {"13", 2.5}, {"0", 100}}));
  const std::vector<std::pair<int32_t, float>> want = {{0, 100.f}, {13, 2.5f}, {4095, -100.f}};
  EXPECT_EQ(r.sampling.logit_bias, want);
  EXPECT_TRUE(ok(with(kBase, "logit_bias", json::object())).sampling.logit_bias.empty());
  EXPECT_TRUE(ok(with(kBase, "logit_bias", nullptr)).sampling.logit_bias.empty());
  // Wrong shapes, ids and values: 400 naming logit_bias, with what was wrong.
  refused(with(kBase, "logit_bias", 5), "logit_bias");
  refused(with(kBase, "logit_bias", json::array({1, 2})), "logit_bias");
  EXPECT_NE(refused(with(kBase, "logit_bias", {{"4096", 1}}), "logit_bias").find("0..4095"), std::string::npos);
  refused(with(kBase, "logit_bias", {{"-1", 1}}), "logit_bias");
  refused(with(kBase, "logit_bias", {{"abc", 1}}), "logit_bias");
  refused(with(kBase, "logit_bias", {{"", 1}}), "logit_bias");
  refused(with(kBase, "logit_bias", {{"1.5", 1}}), "logit_bias");
  refused(with(kBase, "logit_bias", {{"99999999999", 1}}), "logit_bias");
  EXPECT_NE(refused(with(kBase, "logit_bias", {{"5", 100.5}}), "logit_bias").find("between -100 and 100"),
            std::string::npos);
  refused(with(kBase, "logit_bias", {{"5", -101}}), "logit_bias");
  refused(with(kBase, "logit_bias", {{"5", "high"}}), "logit_bias");
  EXPECT_NE(refused(with(kBase, "logit_bias", {{"7", 1}, {"007", 2}}), "logit_bias").find("twice"), std::string::npos);
  json many = json::object();
  for (int i = 0; i < 300; ++i) many[std::to_string(i)] = 1;
  EXPECT_EQ(ok(with(kBase, "logit_bias", many)).sampling.logit_bias.size(), 300u);
  many["300"] = 1;
  EXPECT_NE(refused(with(kBase, "logit_bias", many), "logit_bias").find("at most 300"), std::string::npos);
}

TEST(ParseCompletion, BeamSearch) {
  const json beam = with(with(kBase, "use_beam_search", true), "max_tokens", 8);
  // Defaults: best_of = n, temperature 0, length_penalty 1, early_stopping false.
  CompletionRequest r = ok(beam);
  EXPECT_TRUE(r.use_beam_search);
  EXPECT_EQ(r.best_of, 1);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.length_penalty, 1.0f);
  EXPECT_EQ(r.early_stopping, EarlyStopping::Heuristic);
  EXPECT_EQ(r.num_sequences(), 1u);
  r = ok(with(with(with(with(with(beam, "best_of", 4), "n", 2), "length_penalty", -0.5), "early_stopping", "never"),
              "temperature", 0));
  EXPECT_EQ(r.best_of, 4);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.num_choices(), 2u);
  EXPECT_EQ(r.num_sequences(), 4u);
  EXPECT_EQ(r.length_penalty, -0.5f);
  EXPECT_EQ(r.early_stopping, EarlyStopping::Never);
  EXPECT_EQ(ok(with(beam, "early_stopping", true)).early_stopping, EarlyStopping::Stop);
  EXPECT_EQ(ok(with(beam, "early_stopping", false)).early_stopping, EarlyStopping::Heuristic);
  EXPECT_EQ(ok(with(with(beam, "n", 3), "stream", true)).best_of, 3);
  EXPECT_TRUE(ok(with(with(beam, "echo", true), "return_token_ids", true)).echo);
  EXPECT_TRUE(ok(with(beam, "ignore_eos", true)).ignore_eos);
  EXPECT_EQ(ok(with(beam, "best_of", 10)).best_of, 10);
  // Widths and counts.
  EXPECT_NE(refused(with(beam, "best_of", 11), "best_of").find("between 1 and 10"), std::string::npos);
  refused(with(beam, "best_of", 0), "best_of");
  refused(with(beam, "best_of", "4"), "best_of");
  EXPECT_NE(refused(with(with(beam, "best_of", 2), "n", 3), "n").find("must not exceed best_of"), std::string::npos);
  refused(with(beam, "use_beam_search", "yes"), "use_beam_search");
  // The beam-only fields, without beam search.
  refused(with(kBase, "length_penalty", 1.0), "length_penalty");
  refused(with(kBase, "early_stopping", true), "early_stopping");
  refused(with(with(kBase, "use_beam_search", false), "early_stopping", true), "early_stopping");
  refused(with(beam, "early_stopping", "always"), "early_stopping");
  refused(with(beam, "early_stopping", 1), "early_stopping");
  refused(with(beam, "length_penalty", "long"), "length_penalty");
  refused(with(beam, "length_penalty", 1000), "length_penalty");
  // What would make the beams differ from HuggingFace's deterministic search.
  EXPECT_NE(refused(with(beam, "temperature", 0.7), "temperature").find("temperature 0"), std::string::npos);
  refused(with(beam, "top_p", 0.9), "top_p");
  refused(with(beam, "top_k", 5), "top_k");
  refused(with(beam, "presence_penalty", 0.5), "presence_penalty");
  refused(with(beam, "frequency_penalty", 0.5), "frequency_penalty");
  refused(with(beam, "repetition_penalty", 1.2), "repetition_penalty");
  refused(with(beam, "logit_bias", {{"5", 1}}), "logit_bias");
  refused(with(beam, "min_tokens", 2), "min_tokens");
  refused(with(beam, "stop", "\n"), "stop");
  refused(with(beam, "logprobs", 2), "logprobs");
  EXPECT_NE(refused(with(beam, "logprobs", 0), "logprobs").find("use_beam_search"), std::string::npos);
  // Defaults given explicitly are fine.
  ok(with(with(with(beam, "top_p", 1), "top_k", 0), "presence_penalty", 0));
}

TEST(ParseCompletion, UnknownFieldIsNamed) {
  EXPECT_NE(refused(with(kBase, "temprature", 0.5), "temprature").find("temprature"), std::string::npos);
  refused(with(kBase, "messages", json::array()), "messages");
}

TEST(ParseCompletion, WrongBodies) {
  ApiError error;
  Expected<CompletionRequest> r = parse_completion_body("{\"prompt\": \"x\",", tok(), cfg(), {}, kModel, &error);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(error.http_status, 400);
  EXPECT_NE(error.message.find("JSON"), std::string::npos) << error.message;
  r = parse_completion_body("", tok(), cfg(), {}, kModel, &error);
  EXPECT_FALSE(r.ok());
  r = parse_completion_body("[1, 2]", tok(), cfg(), {}, kModel, &error);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(error.message.find("object"), std::string::npos) << error.message;
  r = parse_completion_body(R"({"prompt": "ok", "max_tokens": 3})", tok(), cfg(), {}, kModel, &error);
  EXPECT_TRUE(r.ok()) << r.error();
}

TEST(ApiErrors, OpenAIShape) {
  EXPECT_EQ(error_json(api_error(400, "bad", "max_tokens")),
            json::parse(R"({"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": null}})"));
  EXPECT_EQ(error_json(api_error(429, "full", "", "rate_limit_error", "queue_full")),
            json::parse(R"({"error": {"message": "full", "type": "rate_limit_error", "param": null, "code": "queue_full"}})"));
  // Invalid UTF-8 in a message does not throw.
  EXPECT_EQ(error_body(api_error(400, "bad \xff")),
            R"({"error":{"code":null,"message":"bad )" "\xef\xbf\xbd" R"(","param":null,"type":"invalid_request_error"}})");
}


// Found by fuzzing (issue 28): nlohmann parses any depth iteratively, but dump() and copies
// recurse, so a 4 MB body of nested arrays could overflow the stack once a value was printed
// into an error. Bodies deeper than kMaxJsonDepth are refused first, with a 400.
TEST(OpenAiApi, DeeplyNestedBodyIsRefused) {
  const int depth = 100000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  for (const std::string& body : {R"({"prompt": "a", "logit_bias": {"1": )" + deep + "}}",
                                  R"({"prompt": [1, )" + deep + "]}", R"({"prompt": "a", "stop": )" + deep + "}"}) {
    ApiError error;
    auto r = parse_completion_body(body, tok(), cfg(), ApiLimits{}, kModel, &error);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(error.http_status, 400);
    EXPECT_NE(error.message.find("nests deeper than 64 levels"), std::string::npos) << error.message;
  }
  // Ordinary nesting (a batch of token prompts in the body) is three levels.
  EXPECT_TRUE(parse(json{{"prompt", json::array({json::array({1, 2}), json::array({3})})}}).request.ok());
}


// Found by fuzz/fuzz_completion (issue 28): a number too large for a double ("1e999") makes
// nlohmann throw out_of_range, not parse_error, which parse_completion_body did not catch;
// the server answered 500 instead of 400. The crashing input, as the fuzzer saved it:
TEST(OpenAiApi, NumberOverflowIsA400) {
  const std::string crash("\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t912594050682423.8e8880005330877021\x03\x00"
                          "88888888{PPPPPX", 69);
  for (const std::string& body : {crash, std::string(R"({"prompt": "a", "temperature": 1e999})")}) {
    ApiError error;
    Expected<CompletionRequest> r = CompletionRequest{};
    ASSERT_NO_THROW(r = parse_completion_body(body, tok(), cfg(), ApiLimits{}, kModel, &error));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(error.http_status, 400);
    EXPECT_NE(error.message.find("not valid JSON"), std::string::npos) << error.message;
  }
}

}  // namespace
}  // namespace conveyor

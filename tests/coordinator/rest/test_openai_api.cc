#include "coordinator/rest/openai_api.h"

#include <cmath>
#include <set>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace conveyor {
namespace {

using nlohmann::json;
constexpr const char* kModel = "brown-gpt2";

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load(testing::source_dir() + "/models/brown-gpt2").value();
  return t;
}

const ModelConfig& cfg() {
  static const ModelConfig c = load_model_config(testing::source_dir() + "/models/brown-gpt2").value();
  return c;
}

struct Parsed {
  Expected<CompletionRequest> request;
  ApiError error;
};

Parsed parse(const json& body, const ApiLimits& limits = {}, ResponseOptions* options = nullptr) {
  ApiError error;
  Expected<CompletionRequest> r = parse_completion_request(body, tok(), cfg(), limits, kModel, &error, options);
  return {std::move(r), error};
}

CompletionRequest ok(const json& body) {
  Parsed p = parse(body);
  EXPECT_TRUE(p.request.ok()) << body.dump() << " -> " << p.request.error();
  return p.request.ok() ? std::move(p.request).value() : CompletionRequest{};
}

// Expects a refusal naming `param` (HTTP 400 unless told otherwise); returns the message.
std::string refused(const json& body, const std::string& param, int status = 400) {
  Parsed p = parse(body);
  EXPECT_FALSE(p.request.ok()) << "accepted: " << body.dump();
  EXPECT_EQ(p.error.param, param) << body.dump() << " -> " << p.error.message;
  EXPECT_EQ(p.error.http_status, status) << body.dump();
  EXPECT_EQ(p.error.type, "invalid_request_error");
  EXPECT_FALSE(p.error.message.empty());
  if (!p.request.ok()) {
    EXPECT_EQ(p.request.error(), p.error.message);
  }
  return p.error.message;
}

json with(json base, const std::string& key, json value) {
  base[key] = std::move(value);
  return base;
}

const json kBase = {{"model", kModel}, {"prompt", "The jury said"}};

std::vector<int32_t> ids_of_length(size_t n) {
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = int32_t(10 + i % 1000);
  return ids;
}

// --- parsing -------------------------------------------------------------------------

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
  refused(with(kBase, "max_tokens", 0), "max_tokens");
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
  refused(with(kBase, "n", 17), "n");
  refused(with(kBase, "n", "2"), "n");
  EXPECT_EQ(ok(with(kBase, "n", 16)).n, 16);

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
  EXPECT_NE(refused(with(kBase, "best_of", 2), "best_of").find("use_beam_search"), std::string::npos);
  refused(with(kBase, "best_of", "2"), "best_of");
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

// --- responses -----------------------------------------------------------------------

ResponseOptions options(bool include_usage = false) {
  ResponseOptions o;
  o.include_usage = include_usage;
  o.system_fingerprint = "fp_0123456789ab";
  return o;
}

std::shared_ptr<CompletionRequest> request_for(const json& body) {
  auto r = std::make_shared<CompletionRequest>(ok(body));
  r->id = "cmpl-test";
  return r;
}

ChoiceUpdate update(size_t choice, std::vector<int32_t> ids, std::string text,
                    std::optional<std::string> finish = std::nullopt) {
  ChoiceUpdate u;
  u.choice = choice;
  for (int32_t id : ids) u.tokens.push_back(TokenOut{id, -1.5f, {}});
  u.text = std::move(text);
  u.finish_reason = std::move(finish);
  return u;
}

int32_t id_of(const std::string& text) {
  std::vector<int32_t> ids = tok().encode(text);
  EXPECT_EQ(ids.size(), 1u) << text;
  return ids.empty() ? 0 : ids[0];
}

TEST(CompletionResponse, NonStreamingDocument) {
  auto req = request_for({{"prompt", "The jury"}, {"max_tokens", 3}});
  CompletionResponseBuilder b(req, tok(), 1700000000, options());
  const int32_t a = id_of(" said"), c = id_of(" it");
  b.add(update(0, {a}, " said"));
  b.add(update(0, {c}, " it", "length"));
  EXPECT_TRUE(b.all_finished());
  const int64_t prompt_tokens = int64_t(req->prompts[0].size());
  const json expected = {
      {"id", "cmpl-test"},
      {"object", "text_completion"},
      {"created", 1700000000},
      {"model", kModel},
      {"system_fingerprint", "fp_0123456789ab"},
      {"choices", {{{"text", " said it"}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", "length"}}}},
      {"usage", {{"prompt_tokens", prompt_tokens},
                 {"completion_tokens", 2},
                 {"total_tokens", prompt_tokens + 2},
                 {"prompt_tokens_details", {{"cached_tokens", 0}}}}}};
  EXPECT_EQ(b.response(), expected) << b.response().dump(2);
}

TEST(CompletionResponse, SeveralPromptsAndChoicesWithEchoAndTokenIds) {
  auto req = request_for({{"prompt", {"A", "B"}}, {"n", 2}, {"echo", true}, {"return_token_ids", true}});
  CompletionResponseBuilder b(req, tok(), 1, options());
  // Interleaved updates, as the core may send them.
  b.add(update(3, {7}, "x"));
  b.add(update(0, {8}, "y", "stop"));
  b.add(update(1, {9}, "z", "length"));
  b.add(update(2, {10}, "w", "length"));
  EXPECT_FALSE(b.all_finished());
  b.add(update(3, {11}, "v", "length"));
  EXPECT_TRUE(b.all_finished());
  const json doc = b.response();
  ASSERT_EQ(doc["choices"].size(), 4u);
  EXPECT_EQ(doc["choices"][0]["text"], "Ay");
  EXPECT_EQ(doc["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(doc["choices"][1]["text"], "Az");
  EXPECT_EQ(doc["choices"][2]["text"], "Bw");
  EXPECT_EQ(doc["choices"][3]["text"], "Bxv");
  EXPECT_EQ(doc["choices"][3]["index"], 3);
  EXPECT_EQ(doc["choices"][3]["token_ids"], json({7, 11}));
  EXPECT_EQ(doc["choices"][3]["prompt_token_ids"], json(tok().encode("B")));
  // Each prompt counts once in usage, whatever n is.
  EXPECT_EQ(doc["usage"]["prompt_tokens"], int64_t(tok().encode("A").size() + tok().encode("B").size()));
  EXPECT_EQ(doc["usage"]["completion_tokens"], 5);
}

TEST(CompletionResponse, LogprobsWithEchoFollowOpenAIShape) {
  auto req = request_for({{"prompt", "The jury"}, {"logprobs", 1}, {"echo", true}});
  const std::vector<int32_t>& prompt = req->prompts[0];
  ASSERT_GE(prompt.size(), 2u);
  CompletionResponseBuilder b(req, tok(), 1, options());
  ChoiceUpdate u = update(0, {id_of(" said")}, " said");
  u.tokens[0].logprob = -0.5f;
  u.tokens[0].top = {{id_of(" was"), -0.25f}};  // the chosen token is not the top one
  for (size_t i = 0; i < prompt.size(); ++i)
    u.prompt_tokens.push_back(TokenOut{prompt[i], i == 0 ? NAN : -2.0f, i == 0 ? std::vector<std::pair<int32_t, float>>{}
                                                                              : std::vector<std::pair<int32_t, float>>{{prompt[i], -2.0f}}});
  b.add(u);
  ChoiceUpdate last = update(0, {id_of(" it")}, " it", "length");
  last.tokens[0].logprob = -1.0f;
  last.tokens[0].top = {{id_of(" it"), -1.0f}};
  b.add(last);
  const json lp = b.response()["choices"][0]["logprobs"];
  const size_t n = prompt.size() + 2;
  ASSERT_EQ(lp["tokens"].size(), n);
  ASSERT_EQ(lp["token_logprobs"].size(), n);
  ASSERT_EQ(lp["top_logprobs"].size(), n);
  ASSERT_EQ(lp["text_offset"].size(), n);
  EXPECT_EQ(lp["tokens"][0], tok().token_bytes(prompt[0]));
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());  // the first prompt token has no context
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["token_logprobs"][1], -2.0);
  EXPECT_EQ(lp["tokens"][n - 2], " said");
  EXPECT_EQ(lp["token_logprobs"][n - 2], -0.5);
  EXPECT_EQ(lp["top_logprobs"][n - 2], json({{" was", -0.25}, {" said", -0.5}}));  // chosen always listed
  EXPECT_EQ(lp["top_logprobs"][n - 1], json({{" it", -1.0}}));
  // Byte offsets into the returned text, the echoed prompt first.
  const std::string text = b.response()["choices"][0]["text"];
  EXPECT_EQ(text, "The jury said it");
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][n - 2], 8);   // " said" starts after "The jury"
  EXPECT_EQ(lp["text_offset"][n - 1], 13);  // " it"
}

TEST(CompletionResponse, LogprobsWithoutEchoStartAtZero) {
  auto req = request_for({{"prompt", "The jury"}, {"logprobs", 0}});
  CompletionResponseBuilder b(req, tok(), 1, options());
  b.add(update(0, {id_of(" said"), id_of(" it")}, " said it", "length"));
  const json lp = b.response()["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({" said", " it"}));
  EXPECT_EQ(lp["text_offset"], json({0, 5}));
  EXPECT_EQ(lp["top_logprobs"][0], json({{" said", -1.5}}));  // logprobs 0: just the chosen token
}

TEST(CompletionResponse, TokenStringsAreValidUtf8) {
  const int32_t partial = tok().token_id("\xc3\xa2").value();  // the byte-level symbol of byte 0xE2
  ASSERT_EQ(tok().token_bytes(partial), "\xe2");
  EXPECT_EQ(token_display_string(tok(), partial), "bytes:\\xe2");
  EXPECT_EQ(token_display_string(tok(), id_of(" said")), " said");
  // A text delta with a broken character is replaced, not thrown on.
  auto req = request_for({{"prompt", "x"}, {"logprobs", 0}});
  CompletionResponseBuilder b(req, tok(), 1, options());
  const std::string event = b.sse_chunk(update(0, {partial}, "\xe2", "length"));
  EXPECT_NE(event.find("\"bytes:\\\\xe2\""), std::string::npos) << event;
  EXPECT_NE(event.find("\"text\":\"\xef\xbf\xbd\""), std::string::npos) << event;
  EXPECT_NO_THROW(json::parse(event.substr(6)));
}

TEST(CompletionResponse, SseGoldenWithoutUsage) {
  // No stream_options: OpenAI sends no "usage" field in any chunk.
  auto req = request_for({{"prompt", "The jury"}, {"stream", true}});
  CompletionResponseBuilder b(req, tok(), 1700000000, options());
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" said")}, " said")),
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"logprobs\":null,\"text\":\" said\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\"}\n\n");
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" it")}, " it", "stop")),
            "data: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"logprobs\":null,\"text\":\" it\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\"}\n\n");
  EXPECT_EQ(b.sse_finish(), "data: [DONE]\n\n");
  EXPECT_EQ(CompletionResponseBuilder::sse_error(api_error(500, "boom", "", "server_error")),
            "data: {\"error\":{\"code\":null,\"message\":\"boom\",\"param\":null,\"type\":\"server_error\"}}\n\n");
}

TEST(CompletionResponse, SseGoldenWithIncludeUsage) {
  // include_usage: every choice chunk has "usage": null, then one chunk with no choices
  // carries the usage, then [DONE].
  auto req = request_for({{"prompt", "The jury"}, {"stream", true}, {"stream_options", {{"include_usage", true}}}});
  const int64_t p = int64_t(req->prompts[0].size());
  CompletionResponseBuilder b(req, tok(), 1700000000, options(/*include_usage=*/true));
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" said")}, " said")),
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"logprobs\":null,\"text\":\" said\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\",\"usage\":null}\n\n");
  EXPECT_EQ(b.sse_chunk(update(0, {id_of(" it")}, " it", "stop")),
            "data: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"logprobs\":null,\"text\":\" it\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\",\"object\":\"text_completion\","
            "\"system_fingerprint\":\"fp_0123456789ab\",\"usage\":null}\n\n");
  EXPECT_EQ(b.sse_finish(),
            "data: {\"choices\":[],\"created\":1700000000,\"id\":\"cmpl-test\",\"model\":\"brown-gpt2\","
            "\"object\":\"text_completion\",\"system_fingerprint\":\"fp_0123456789ab\",\"usage\":{\"completion_tokens\":2,"
            "\"prompt_tokens\":" + std::to_string(p) + ",\"prompt_tokens_details\":{\"cached_tokens\":0},\"total_tokens\":" +
            std::to_string(p + 2) + "}}\n\n"
            "data: [DONE]\n\n");
}

TEST(CompletionResponse, NoFingerprintIsNull) {
  auto req = request_for({{"prompt", "The jury"}});
  CompletionResponseBuilder b(req, tok(), 1, ResponseOptions{});
  const json doc = b.response();
  ASSERT_TRUE(doc.contains("system_fingerprint"));
  EXPECT_TRUE(doc["system_fingerprint"].is_null());
}

TEST(CompletionResponse, SseEchoAndUsageWhenTheCoreEndsEarly) {
  const json body = {{"prompt", "The jury"}, {"stream", true}, {"echo", true}, {"n", 2}, {"return_token_ids", true}};
  for (bool include_usage : {false, true}) {
    SCOPED_TRACE(include_usage ? "include_usage" : "no usage");
    auto req = request_for(body);
    CompletionResponseBuilder b(req, tok(), 1, options(include_usage));
    json first = json::parse(b.sse_chunk(update(1, {5}, " a")).substr(6));
    EXPECT_EQ(first["choices"][0]["index"], 1);
    EXPECT_EQ(first["choices"][0]["text"], "The jury a");  // the echo rides on a choice's first chunk
    EXPECT_EQ(first["choices"][0]["token_ids"], json({5}));
    EXPECT_EQ(first["choices"][0]["prompt_token_ids"], json(req->prompts[0]));
    json second = json::parse(b.sse_chunk(update(1, {6}, " b", "length")).substr(6));
    EXPECT_EQ(second["choices"][0]["text"], " b");
    EXPECT_FALSE(second["choices"][0].contains("prompt_token_ids"));
    EXPECT_EQ(second.contains("usage"), include_usage);
    if (include_usage) {
      EXPECT_TRUE(second["usage"].is_null());
    }
    // The core ends with choice 0 unfinished: the usage chunk (when asked for) still comes.
    const std::string tail = b.sse_finish();
    ASSERT_TRUE(tail.ends_with("data: [DONE]\n\n"));
    if (!include_usage) {
      EXPECT_EQ(tail, "data: [DONE]\n\n");
      continue;
    }
    json usage_chunk = json::parse(tail.substr(6, tail.find("\n\n") - 6));
    EXPECT_TRUE(usage_chunk["choices"].empty());
    EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 2);
    EXPECT_EQ(usage_chunk["system_fingerprint"], "fp_0123456789ab");
  }
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

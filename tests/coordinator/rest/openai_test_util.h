// What the OpenAI API test programs (test_openai_*.cc) share: the brown-gpt2 tokenizer and
// config, and parse_completion_request called as the server calls it, with helpers that
// expect an acceptance or a refusal naming its parameter.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/rest/openai_api.h"
#include "tests/test_util.h"

namespace conveyor::openai_test {

using nlohmann::json;
inline constexpr const char* kModel = "brown-gpt2";

inline const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load(testing::source_dir() + "/models/brown-gpt2").value();
  return t;
}

inline const ModelConfig& cfg() {
  static const ModelConfig c = load_model_config(testing::source_dir() + "/models/brown-gpt2").value();
  return c;
}

struct Parsed {
  Expected<CompletionRequest> request;
  ApiError error;
};

inline Parsed parse(const json& body, const ApiLimits& limits = {}, ResponseOptions* options = nullptr) {
  ApiError error;
  Expected<CompletionRequest> r = parse_completion_request(body, tok(), cfg(), limits, kModel, &error, options);
  return {std::move(r), error};
}

inline CompletionRequest ok(const json& body) {
  Parsed p = parse(body);
  EXPECT_TRUE(p.request.ok()) << body.dump() << " -> " << p.request.error();
  return p.request.ok() ? std::move(p.request).value() : CompletionRequest{};
}

// Expects a refusal naming `param` (HTTP 400 unless told otherwise); returns the message.
inline std::string refused(const json& body, const std::string& param, int status = 400) {
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

inline json with(json base, const std::string& key, json value) {
  base[key] = std::move(value);
  return base;
}

inline const json kBase = {{"model", kModel}, {"prompt", "The jury said"}};

inline std::vector<int32_t> ids_of_length(size_t n) {
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = int32_t(10 + i % 1000);
  return ids;
}

}  // namespace conveyor::openai_test

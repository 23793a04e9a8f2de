// POST /tokenize and POST /detokenize, as vLLM has them:
//   /tokenize   {"prompt": "text"} or {"messages": [...], "add_generation_prompt": true}
//               (the chat template renders them, as /v1/chat/completions would), optional
//               "model", "add_special_tokens" (GPT-2 tokenizers add none either way) and
//               "return_token_strs" -> {"tokens": [ids], "count": N, "max_model_len": M,
//               "token_strs": [...] or null}
//   /detokenize {"tokens": [ids]} (optional "model") -> {"prompt": "text"}
// Bad input is a 400 naming the field: wrong types, unknown fields, ids outside the vocabulary.
#pragma once

#include <string_view>

#include <nlohmann/json.hpp>

#include "coordinator/rest/http_server.h"

namespace conveyor {

// On success fills `*out` with the answer's body; else `*error`.
bool tokenize_request(std::string_view body, const RestContext& ctx, nlohmann::json* out, ApiError* error);
bool detokenize_request(std::string_view body, const RestContext& ctx, nlohmann::json* out, ApiError* error);

}  // namespace conveyor

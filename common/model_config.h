// The shape of a GPT-2-family model, parsed from a HuggingFace config.json.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace conveyor {

enum class Activation : uint8_t { GeluNew, Gelu };  // gelu_new = tanh form; gelu = erf form

struct ModelConfig {
  int64_t n_embd = 0;
  int64_t n_head = 0;
  int64_t n_layer = 0;
  int64_t n_inner = 0;  // MLP width; config.json's null means 4 * n_embd
  int64_t n_positions = 0;
  int64_t vocab_size = 0;
  float layer_norm_epsilon = 1e-5f;
  Activation activation = Activation::GeluNew;
  bool tie_word_embeddings = true;
  int64_t eos_token_id = -1;  // -1: none given

  int64_t head_dim() const { return n_embd / n_head; }
};

// Reads and validates DIR/config.json (or a config.json path). Errors name the file
// and the offending key.
Expected<ModelConfig> load_model_config(const std::string& path);
Expected<ModelConfig> parse_model_config(const std::string& json_text, const std::string& source_name);

// "gpt2-xl", "gpt3-6.7b", "gpt3-13b", "gpt3-175b" or "n_layer,n_embd,n_head" (vocab 50257,
// n_positions 2048, n_inner 4*n_embd): the shapes used for synthetic-weight benchmarks.
Expected<ModelConfig> named_model_shape(const std::string& spec);

}  // namespace conveyor

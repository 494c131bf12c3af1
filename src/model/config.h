// Qwen2 model configuration: the fields of a Hugging Face Qwen2ForCausalLM config.json that
// shape the computation, plus derived sizes. Parsing accepts the classic transformers form and
// the transformers-5 form (`dtype`, `rope_parameters.rope_theta`, `layer_types`).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"

namespace memtune {

struct Qwen2Config {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;  // transformers Qwen2Config default; presets set their own
  bool tie_word_embeddings = false;
  DType torch_dtype = DType::F32;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t q_dim() const { return num_attention_heads * head_dim(); }
  int64_t kv_dim() const { return num_key_value_heads * head_dim(); }
};

// Parses and validates a config.json document. `source` names the file in error messages.
// Refuses other architectures, rope scaling, an active sliding window, attention dropout,
// inconsistent head counts and heads wider than the attention kernels take.
Qwen2Config parse_qwen2_config(const nlohmann::json& doc, const std::string& source);
Qwen2Config load_qwen2_config(const std::string& path);
// Refuses a run whose sequences may be longer than the model was trained for: an Error naming
// both values and `source` (the config file) when max_length > max_position_embeddings.
// max_length 0 means no limit and is not checked.
void check_max_length(const Qwen2Config& config, int64_t max_length, const std::string& source);
// The classic (transformers 4.x) config.json form, with architectures/model_type set.
nlohmann::json qwen2_config_to_json(const Qwen2Config& config);

// Named presets: the real Qwen2.5 shapes, and `tiny` for tests.
Qwen2Config qwen2_preset(const std::string& name);

}  // namespace memtune

// The parameters of a config by their Hugging Face names and shapes (see parameters.h).
#include "model/parameters.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/quantized.h"
#include "io/safetensors.h"

namespace memtune {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamSpec> model_parameter_specs(const ModelConfig& c) {
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<ParamSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, D}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    specs.push_back({p + "input_layernorm.weight", {D}});
    specs.push_back({p + "self_attn.q_proj.weight", {qd, D}});
    if (c.attention_bias) specs.push_back({p + "self_attn.q_proj.bias", {qd}});
    specs.push_back({p + "self_attn.k_proj.weight", {kvd, D}});
    if (c.attention_bias) specs.push_back({p + "self_attn.k_proj.bias", {kvd}});
    specs.push_back({p + "self_attn.v_proj.weight", {kvd, D}});
    if (c.attention_bias) specs.push_back({p + "self_attn.v_proj.bias", {kvd}});
    specs.push_back({p + "self_attn.o_proj.weight", {D, qd}});
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim()}});
      specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim()}});
    }
    specs.push_back({p + "post_attention_layernorm.weight", {D}});
    specs.push_back({p + "mlp.gate_proj.weight", {I, D}});
    specs.push_back({p + "mlp.up_proj.weight", {I, D}});
    specs.push_back({p + "mlp.down_proj.weight", {D, I}});
  }
  specs.push_back({"model.norm.weight", {D}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, D}});
  return specs;
}

int packed_bits(const ModelConfig& c, const ParamSpec& s) {
  if (!c.quant.enabled() || s.shape.size() != 2) return 0;
  if (s.name.starts_with("model.layers.")) return c.quant.bits;
  return s.name == "lm_head.weight" ? c.quant.lm_head_bits : 0;
}

int64_t model_parameter_count(const ModelConfig& config) {
  int64_t total = 0;
  for (const auto& s : model_parameter_specs(config)) total += s.numel();
  return total;
}

}  // namespace memtune

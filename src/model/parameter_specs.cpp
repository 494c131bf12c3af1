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
    if (c.moe.sparse(l)) {  // transformers' Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock
      const MoeConfig& m = c.moe;
      const int64_t Ie = m.expert_intermediate_size, Is = m.shared_expert_intermediate_size;
      specs.push_back({p + "mlp.gate.weight", {m.num_experts, D}});
      for (int64_t e = 0; e < m.num_experts; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
        specs.push_back({x + "gate_proj.weight", {Ie, D}});
        specs.push_back({x + "up_proj.weight", {Ie, D}});
        specs.push_back({x + "down_proj.weight", {D, Ie}});
      }
      if (Is > 0) {
        specs.push_back({p + "mlp.shared_expert.gate_proj.weight", {Is, D}});
        specs.push_back({p + "mlp.shared_expert.up_proj.weight", {Is, D}});
        specs.push_back({p + "mlp.shared_expert.down_proj.weight", {D, Is}});
        specs.push_back({p + "mlp.shared_expert_gate.weight", {1, D}});
      }
      continue;
    }
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
  // A sparse layer's router and shared-expert gate stay as stored (Qwen's GPTQ MoE checkpoints:
  // their few outputs do not pack), its experts' projections are packed.
  if (s.name.ends_with(".mlp.gate.weight") || s.name.ends_with(".mlp.shared_expert_gate.weight")) return 0;
  if (s.name.starts_with("model.layers.")) return c.quant.bits;
  return s.name == "lm_head.weight" ? c.quant.lm_head_bits : 0;
}

int64_t model_parameter_count(const ModelConfig& config) {
  int64_t total = 0;
  for (const auto& s : model_parameter_specs(config)) total += s.numel();
  return total;
}

int64_t model_active_parameter_count(const ModelConfig& config) {
  int64_t shared = 0, routed = 0;
  for (const auto& s : model_parameter_specs(config))
    (s.name.find(".mlp.experts.") != std::string::npos ? routed : shared) += s.numel();
  const MoeConfig& m = config.moe;
  return m.enabled() ? shared + routed / m.num_experts * m.experts_per_token : shared;
}

}  // namespace memtune

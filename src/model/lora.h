// LoRA adapters with PEFT semantics: for a targeted linear layer y = x W^T (+ b), the adapter
// adds scaling * (dropout(x) A^T) B^T with A [r, in] and B [out, r], scaling = alpha / r
// (alpha / sqrt(r) with rslora). A starts Kaiming-uniform (PEFT's default: bound 1/sqrt(in)),
// B at zero, so training starts from the base model. Adapters are float32 and trainable; the
// base stays frozen in its storage dtype. Files: adapter_model.safetensors and
// adapter_config.json exactly as PEFT writes them, so PEFT and vLLM load them unchanged.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace memtune {

// The seven linear layers of a decoder layer, in PEFT's module names.
enum class LinearSite { Q, K, V, O, Gate, Up, Down, kCount };
constexpr size_t kNumLinearSites = static_cast<size_t>(LinearSite::kCount);
std::string_view linear_site_name(LinearSite site);  // "q_proj", ..., "down_proj"
// "self_attn" or "mlp"
std::string_view linear_site_block(LinearSite site);

// The key of a LoRA dropout mask: one per (step seed, layer, site), mixed so that every pair of
// sites' masks is independent (Backend::dropout_forward hashes key + i x golden ratio, so unmixed
// keys of neighbouring sites would give one mask shifted by some elements).
uint64_t lora_dropout_key(uint64_t seed, int64_t layer, LinearSite site);

struct LoraConfig {
  int64_t rank = 0;  // 0: no adapters
  double alpha = 32.0;
  double dropout = 0.0;
  bool use_rslora = false;
  std::array<bool, kNumLinearSites> targets{};  // which sites carry an adapter

  bool enabled() const { return rank > 0; }
  double scaling() const;
  std::vector<std::string> target_names() const;
};

// Parses target module names ("q_proj", ..., or "all-linear", which like PEFT means every linear
// layer except the LM head) into the config; Error naming the unknown module otherwise.
void set_lora_targets(LoraConfig& config, const std::vector<std::string>& names);

// PEFT's tensor name of an adapter matrix, e.g.
// base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
std::string lora_tensor_name(int64_t layer, LinearSite site, bool is_b);

// The same for an expert's projection in a sparse layer (site Gate, Up or Down; expert -1: the
// shared expert), e.g. base_model.model.model.layers.3.mlp.experts.7.gate_proj.lora_A.weight
std::string lora_expert_tensor_name(int64_t layer, int64_t expert, LinearSite site, bool is_b);
// An expert's dropout key: the site's, mixed with the expert (-1: the shared expert).
uint64_t lora_expert_dropout_key(uint64_t seed, int64_t layer, LinearSite site, int64_t expert);

// adapter_config.json as PEFT writes it, and the reverse (validated; `source` names the file).
nlohmann::json lora_adapter_config_json(const LoraConfig& config, const std::string& base_model_name_or_path);
LoraConfig parse_lora_adapter_config(const nlohmann::json& doc, const std::string& source);
// Reads dir/adapter_config.json (errors name the file).
LoraConfig load_lora_adapter_config(const std::string& dir);

}  // namespace memtune

// The model configuration: the fields of a Hugging Face config.json (Qwen2ForCausalLM,
// Qwen3ForCausalLM, LlamaForCausalLM) that shape the computation, plus derived sizes. Parsing accepts the classic transformers form and
// the transformers-5 form (`dtype`, `rope_parameters.rope_theta`, `layer_types`).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"

namespace memtune {

// The decoder families one ModelConfig describes. They share the block (RMSNorm, GQA attention
// with RoPE, SwiGLU MLP) and differ only in the traits below, one row per family in
// model/config.cpp (kFamilyTraits). Parsing, serialization and the decoder read the traits,
// never the family's name:
//   qwen2   q/k/v biases, head_dim = hidden / heads
//   qwen3   no biases (attention_bias), head_dim from config.json (default 128), RMSNorm over
//           each head of q and k before RoPE (q_norm, k_norm)
//   llama   no biases, head_dim from config.json (default hidden / heads), Llama 3's
//           rope_scaling ("llama3"), no tied embeddings by default
//   qwen2_moe   qwen2's attention (biases from config.json's qkv_bias, default true) with
//               mixture-of-experts MLPs and a gated shared expert (MoeConfig)
//   qwen3_moe   qwen3's attention with mixture-of-experts MLPs (head_dim from config.json,
//               default hidden / heads)
enum class ModelFamily { Qwen2, Qwen3, Llama, Qwen2Moe, Qwen3Moe };
struct FamilyTraits {
  ModelFamily family;
  std::string_view model_type;    // config.json's model_type
  std::string_view architecture;  // config.json's architectures[0]
  // q/k/v biases: always (qwen2), or config.json's attention_bias with default false.
  bool attention_bias_always;
  // config.json's head_dim may differ from hidden_size / heads; default_head_dim applies when it
  // is absent (0: hidden_size / heads). Otherwise head_dim is hidden_size / heads.
  bool head_dim_in_config;
  int64_t default_head_dim;
  bool qk_norm;              // RMSNorm over each head of q and k before RoPE
  bool llama3_rope_scaling;  // rope_scaling's rope_type "llama3" is taken
  bool sliding_window_keys;  // its config.json carries use_sliding_window / max_window_layers
  bool llama_mlp_keys;       // its config.json carries mlp_bias / pretraining_tp
  bool qkv_bias_key;         // q/k/v biases from config.json's qkv_bias (default true)
  bool moe;                  // mixture-of-experts MLPs (MoeConfig)
};
const FamilyTraits& family_traits(ModelFamily family);
std::string_view model_family_name(ModelFamily family);  // the config.json model_type

// Llama 3's RoPE frequency scaling (transformers' rope_type "llama3"): wavelengths above
// original_max_position_embeddings / low_freq_factor are divided by factor, those below
// original / high_freq_factor kept, the ones between interpolated.
struct RopeScaling {
  bool llama3 = false;
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// Weight-only quantization of the decoder layers' linear weights (config.json's
// quantization_config), as Qwen's -GPTQ-Int4 / -Int8 and -AWQ checkpoints store them
// (io/quantized.h); embeddings and norms stay in torch_dtype, and so does the LM head unless
// lm_head_bits packs it too (GPTQ's "lm_head": true, round-to-nearest, the layers' group size;
// the head is then untied from the embedding, which keeps its 16 bits for the lookup).
enum class QuantMethod { None, Gptq, Awq };
struct QuantConfig {
  QuantMethod method = QuantMethod::None;
  int bits = 4;
  int64_t group_size = 128;  // -1: one group over each layer's whole input
  bool desc_act = false;     // GPTQ act-order: each layer's g_idx is read from the file
  bool sym = true;
  int lm_head_bits = 0;      // 4 or 8: the LM head is packed too; 0: it stays in torch_dtype
  bool enabled() const { return method != QuantMethod::None; }
  int64_t groups(int64_t in) const { return group_size > 0 ? (in + group_size - 1) / group_size : 1; }
  int64_t group_size_for(int64_t in) const { return group_size > 0 ? group_size : in; }
};
std::string_view quant_method_name(QuantMethod method);  // "gptq", "awq"
// A quantization by the name of Qwen's checkpoints ("gptq-int4", "gptq-int8", "awq"), group 128:
// what `memtune quantize` makes and `memtune plan --quantization` plans. An Error otherwise.
QuantConfig parse_quantization_name(std::string_view name);
std::string quantization_name(const QuantConfig& q);  // "gptq-int4", "awq", "none"

// Mixture-of-experts MLPs (qwen2_moe, qwen3_moe; transformers' Qwen2MoeSparseMoeBlock and
// Qwen3MoeSparseMoeBlock): a router (`mlp.gate`, [experts, hidden], no bias) scores each token,
// softmax in float32, the top experts_per_token experts run on it (optionally renormalized to sum
// to 1) and their outputs are summed with those weights; qwen2_moe adds a shared expert on every
// token, scaled by sigmoid(shared_expert_gate . x). Layer l is sparse unless it is in
// mlp_only_layers or (l + 1) % decoder_sparse_step != 0; dense layers keep the SwiGLU MLP of
// intermediate_size.
struct MoeConfig {
  int64_t num_experts = 0;  // 0: no mixture of experts
  int64_t experts_per_token = 0;                // num_experts_per_tok
  int64_t expert_intermediate_size = 0;         // moe_intermediate_size
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe; 0: no shared expert
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;
  bool enabled() const { return num_experts > 0; }
  bool sparse(int64_t layer) const;
};

struct ModelConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;  // the standard deviation of init-model's weights (transformers' meaning)
  double rope_theta = 10000.0;  // transformers' Qwen2Config default; presets set their own
  bool tie_word_embeddings = false;
  DType torch_dtype = DType::F32;
  ModelFamily family = ModelFamily::Qwen2;
  int64_t explicit_head_dim = 0;  // config.json's head_dim (qwen3, llama); 0: hidden_size / heads
  bool attention_bias = true;     // q/k/v projections have biases (qwen2; false for qwen3 and llama)
  bool qk_norm = false;           // RMSNorm over each head of q and k before RoPE (qwen3)
  RopeScaling rope_scaling;
  QuantConfig quant;
  MoeConfig moe;

  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_attention_heads; }
  int64_t q_dim() const { return num_attention_heads * head_dim(); }
  int64_t kv_dim() const { return num_key_value_heads * head_dim(); }
};

// Plans `config` as if quantized by `name` (a float model's config): an Error when it already is,
// or when its layer shapes do not take that quantization.
void apply_quantization(ModelConfig& config, std::string_view name);
// Packs the LM head of a quantized model's config with `bits` (4 or 8) when it is loaded
// (--lm_head_bits): the head is untied, and ModelParameters::load rounds it from the float head
// (or the tied embedding) where the checkpoint has no packed one. An Error for a float model,
// other widths, or a head that does not split into words.
void quantize_lm_head(ModelConfig& config, int bits);

// RoPE's inverse frequencies, head_dim / 2 of them: theta^(-2i / head_dim), with rope_scaling
// applied (as transformers computes them, in double, then rounded to float).
std::vector<float> rope_inv_freq(const ModelConfig& config);

// Parses and validates a config.json document. `source` names the file in error messages.
// Refuses other architectures, rope scaling, an active sliding window, attention dropout,
// inconsistent head counts and heads wider than the attention kernels take.
ModelConfig parse_model_config(const nlohmann::json& doc, const std::string& source);
ModelConfig load_config_json(const std::string& path);
// Refuses a run whose sequences may be longer than the model was trained for: an Error naming
// both values and `source` (the config file) when max_length > max_position_embeddings.
// max_length 0 means no limit and is not checked.
void check_max_length(const ModelConfig& config, int64_t max_length, const std::string& source);
// The classic (transformers 4.x) config.json form, with architectures/model_type set.
nlohmann::json config_to_json(const ModelConfig& config);

// Named presets: the real Qwen2.5, Qwen3, Qwen3-MoE, Qwen2-MoE and Llama 3 shapes, and `tiny`
// (`tiny-qwen3`, `tiny-llama`, `tiny-qwen3-moe`, `tiny-qwen2-moe`) for tests.
ModelConfig model_preset(const std::string& name);
// Every preset model_preset knows, comma-separated: "tiny, tiny-qwen3, ..., llama-3.1-70b".
std::string model_preset_names();

}  // namespace memtune

// config.json parsing (Qwen2, Qwen3, Llama: the family traits table), validation, serialization
// and the named presets. Parsing fills absent optional fields with transformers' defaults for
// the family and refuses anything the engine would silently compute differently from
// transformers (another architecture, RoPE scaling, sliding-window attention, head counts that
// do not divide).
#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "backend/backend.h"
#include "core/error.h"
#include "core/json_reader.h"

namespace memtune {
namespace {

// transformers' Qwen2Config defaults for fields a config.json may omit.
constexpr int64_t kDefaultMaxPositionEmbeddings = 32768;
constexpr double kDefaultRmsNormEps = 1e-6;
constexpr double kDefaultRopeTheta = 10000.0;

// A positive, finite number.
double positive_number(const JsonReader& value) {
  const double number = value.as_number();
  if (!(number > 0)) value.fail(fmt::format("expected a positive number, got {}", json_excerpt(value.value())));
  return number;
}

std::optional<double> optional_positive_number(const JsonReader& doc, std::string_view key) {
  const std::optional<JsonReader> value = doc.find(key);
  return value ? std::optional(positive_number(*value)) : std::nullopt;
}

// One row per family: what config.json calls it and how it departs from the shared block.
constexpr FamilyTraits kFamilyTraits[] = {
    {.family = ModelFamily::Qwen2, .model_type = "qwen2", .architecture = "Qwen2ForCausalLM",
     .attention_bias_always = true, .head_dim_in_config = false, .default_head_dim = 0, .qk_norm = false,
     .llama3_rope_scaling = false, .sliding_window_keys = true, .llama_mlp_keys = false, .qkv_bias_key = false,
     .moe = false},
    {.family = ModelFamily::Qwen3, .model_type = "qwen3", .architecture = "Qwen3ForCausalLM",
     .attention_bias_always = false, .head_dim_in_config = true, .default_head_dim = 128, .qk_norm = true,
     .llama3_rope_scaling = false, .sliding_window_keys = true, .llama_mlp_keys = false, .qkv_bias_key = false,
     .moe = false},
    {.family = ModelFamily::Llama, .model_type = "llama", .architecture = "LlamaForCausalLM",
     .attention_bias_always = false, .head_dim_in_config = true, .default_head_dim = 0, .qk_norm = false,
     .llama3_rope_scaling = true, .sliding_window_keys = false, .llama_mlp_keys = true, .qkv_bias_key = false,
     .moe = false},
    {.family = ModelFamily::Qwen2Moe, .model_type = "qwen2_moe", .architecture = "Qwen2MoeForCausalLM",
     .attention_bias_always = false, .head_dim_in_config = false, .default_head_dim = 0, .qk_norm = false,
     .llama3_rope_scaling = false, .sliding_window_keys = true, .llama_mlp_keys = false, .qkv_bias_key = true,
     .moe = true},
    {.family = ModelFamily::Qwen3Moe, .model_type = "qwen3_moe", .architecture = "Qwen3MoeForCausalLM",
     .attention_bias_always = false, .head_dim_in_config = true, .default_head_dim = 0, .qk_norm = true,
     .llama3_rope_scaling = false, .sliding_window_keys = true, .llama_mlp_keys = false, .qkv_bias_key = false,
     .moe = true}};
constexpr std::string_view kSupported =
    "Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3), LlamaForCausalLM (llama), Qwen2MoeForCausalLM "
    "(qwen2_moe), Qwen3MoeForCausalLM (qwen3_moe)";

// The mixture-of-experts keys of a qwen2_moe / qwen3_moe config.json, with transformers' defaults
// where a key may be absent.
MoeConfig parse_moe_config(const JsonReader& doc, const ModelConfig& c) {
  MoeConfig m;
  m.num_experts = doc.integer("num_experts", 1);
  m.experts_per_token = doc.integer("num_experts_per_tok", 1, m.num_experts);
  m.expert_intermediate_size = doc.integer("moe_intermediate_size", 1);
  if (c.family == ModelFamily::Qwen2Moe)
    m.shared_expert_intermediate_size = doc.integer("shared_expert_intermediate_size", 1);
  m.norm_topk_prob = doc.optional_bool("norm_topk_prob").value_or(false);
  m.decoder_sparse_step = doc.optional_integer("decoder_sparse_step", 1).value_or(1);
  if (const std::optional<JsonReader> only = doc.optional_array("mlp_only_layers"))
    for (size_t i = 0; i < only->size(); ++i) m.mlp_only_layers.push_back((*only)[i].as_integer(0, c.num_hidden_layers - 1));
  if (const std::optional<JsonReader> coef = doc.find("router_aux_loss_coef")) {
    m.router_aux_loss_coef = coef->as_number();
    if (m.router_aux_loss_coef < 0) coef->fail(fmt::format("is {}; expected 0 or more", m.router_aux_loss_coef));
  }
  m.output_router_logits = doc.optional_bool("output_router_logits").value_or(false);
  return m;
}

ModelFamily check_architecture(const JsonReader& doc) {
  std::optional<ModelFamily> by_arch, by_type;
  const std::optional<JsonReader> arch = doc.find("architectures");
  if (arch) {
    for (size_t i = 0; i < arch->size(); ++i)
      for (const FamilyTraits& f : kFamilyTraits)
        if ((*arch)[i].as_string() == f.architecture) by_arch = f.family;
    if (!by_arch) arch->fail(fmt::format("is {}; supported are {}", json_excerpt(arch->value()), kSupported));
  }
  const std::optional<std::string> model_type = doc.optional_string("model_type");
  if (model_type) {
    for (const FamilyTraits& f : kFamilyTraits)
      if (*model_type == f.model_type) by_type = f.family;
    if (!by_type) doc.fail("model_type", fmt::format("is \"{}\"; supported are {}", *model_type, kSupported));
  }
  if (!arch && !model_type)
    doc.fail(fmt::format("neither \"architectures\" nor \"model_type\" is set; expected one of {}", kSupported));
  if (by_arch && by_type && *by_arch != *by_type)
    doc.fail("model_type", fmt::format("is \"{}\" but \"architectures\" is {}", *model_type, json_excerpt(arch->value())));
  return by_type ? *by_type : *by_arch;
}

// rope_scaling (transformers 4) or rope_parameters (transformers 5): the unscaled "default" RoPE,
// and for llama models Llama 3's "llama3" scaling (into `scaling`). Returns the object's
// rope_theta, if it has one.
std::optional<JsonReader> checked_rope_object_theta(const JsonReader& doc, std::string_view key, ModelFamily family,
                                                    RopeScaling& scaling) {
  const std::optional<JsonReader> rope = doc.optional_object(key);
  if (!rope) return std::nullopt;
  std::optional<JsonReader> type = rope->find("rope_type");
  if (!type) type = rope->find("type");
  if (!type) rope->fail("has no \"rope_type\"");
  const bool llama3_allowed = family_traits(family).llama3_rope_scaling;
  if (llama3_allowed && type->value() == "llama3") {
    scaling.llama3 = true;
    scaling.factor = positive_number(rope->get("factor"));
    scaling.low_freq_factor = positive_number(rope->get("low_freq_factor"));
    scaling.high_freq_factor = positive_number(rope->get("high_freq_factor"));
    scaling.original_max_position_embeddings = rope->integer("original_max_position_embeddings", 1);
    if (scaling.high_freq_factor <= scaling.low_freq_factor)
      rope->fail(fmt::format("has high_freq_factor {} <= low_freq_factor {}", scaling.high_freq_factor,
                             scaling.low_freq_factor));
  } else if (type->value() != "default") {
    rope->fail(fmt::format("asks for rope_type {}; supported are \"default\" (no scaling){}",
                           json_excerpt(type->value()), llama3_allowed ? " and \"llama3\"" : ""));
  }
  return rope->find("rope_theta");
}

double parse_rope_theta(const JsonReader& doc, ModelFamily family, RopeScaling& scaling) {
  std::optional<double> theta = optional_positive_number(doc, "rope_theta");
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const std::optional<JsonReader> nested = checked_rope_object_theta(doc, key, family, scaling);
    if (!nested) continue;
    const double nested_theta = positive_number(*nested);
    if (theta && *theta != nested_theta)
      nested->fail(fmt::format("is {} but \"rope_theta\" says {}", nested_theta, *theta));
    theta = nested_theta;
  }
  return theta.value_or(kDefaultRopeTheta);
}

DType parse_torch_dtype(const JsonReader& doc) {
  const std::optional<JsonReader> torch_dtype = doc.find("torch_dtype");
  const std::optional<JsonReader> dtype = doc.find("dtype");
  std::optional<DType> a, b;
  if (torch_dtype) a = parse_dtype(torch_dtype->as_string(), torch_dtype->where());
  if (dtype) b = parse_dtype(dtype->as_string(), dtype->where());
  if (a && b && *a != *b)
    dtype->fail(fmt::format("is \"{}\" but \"torch_dtype\" is \"{}\"", dtype->as_string(), torch_dtype->as_string()));
  return a.value_or(b.value_or(DType::F32));
}

void check_attention_layout(const JsonReader& doc, int64_t num_hidden_layers) {
  if (const std::optional<JsonReader> sliding = doc.find("use_sliding_window"); sliding && sliding->as_bool())
    sliding->fail("is true; sliding-window attention is not supported");
  doc.optional_integer("sliding_window");  // only checked: no window applies while use_sliding_window is false
  if (const std::optional<JsonReader> dropout = doc.find("attention_dropout"); dropout && dropout->as_number() != 0)
    dropout->fail(
        fmt::format("is {}; attention dropout is not supported (expected 0)", json_excerpt(dropout->value())));

  const std::optional<JsonReader> layer_types = doc.optional_array("layer_types");
  if (!layer_types) return;
  if (static_cast<int64_t>(layer_types->size()) != num_hidden_layers)
    layer_types->fail(
        fmt::format("has {} entries but num_hidden_layers is {}", layer_types->size(), num_hidden_layers));
  // With use_sliding_window false, transformers gives "sliding_attention" layers no window,
  // so both kinds compute full attention.
  for (size_t i = 0; i < layer_types->size(); ++i) {
    const JsonReader type = (*layer_types)[i];
    if (type.value() != "full_attention" && type.value() != "sliding_attention")
      type.fail(fmt::format("is {}; expected \"full_attention\"", json_excerpt(type.value())));
  }
}

// A mixture of experts' GPTQ files name the projections a block packs
// (modules_in_block_to_quantize, optimum's GPTQ loader reads it): attention's and every expert's
// (and a dense layer's MLP, and the shared expert's), never the router nor the shared expert's
// gate, which keep their stored weights (packed_bits). In optimum's order: q / k / v, o, the
// MLPs' gate / up, their down.
std::vector<std::vector<std::string>> moe_modules_in_block(const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  std::vector<std::vector<std::string>> lists = {
      {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {"self_attn.o_proj"}, {}, {}};
  bool dense = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) dense = dense || !m.sparse(l);
  std::vector<std::string> mlps;
  if (dense) mlps.push_back("mlp");
  for (int64_t e = 0; e < m.num_experts; ++e) mlps.push_back(fmt::format("mlp.experts.{}", e));
  if (m.shared_expert_intermediate_size > 0) mlps.push_back("mlp.shared_expert");
  for (const std::string& mlp : mlps) {
    lists[2].push_back(mlp + ".gate_proj");
    lists[2].push_back(mlp + ".up_proj");
    lists[3].push_back(mlp + ".down_proj");
  }
  return lists;
}

// quantization_config: GPTQ (4 or 8 bits, AutoGPTQ's "gptq" checkpoint format) and AWQ (4 bits,
// version "gemm", with zero points); every other method is refused by name.
QuantConfig parse_quant_config(const JsonReader& doc, const ModelConfig& c) {
  QuantConfig q;
  const std::optional<JsonReader> section = doc.find("quantization_config");
  if (!section) return q;
  section->as_object();
  const std::string method = section->string("quant_method");
  const std::optional<JsonReader> group = section->find("group_size");
  q.group_size = group ? group->as_integer(-1) : 128;
  if (q.group_size == 0) group->fail("is 0; expected a positive group size or -1 (one group)");
  if (method == "gptq") {
    q.method = QuantMethod::Gptq;
    q.bits = static_cast<int>(section->integer("bits", 1));
    if (q.bits != 4 && q.bits != 8) section->fail("bits", fmt::format("is {}; GPTQ layers of 4 or 8 bits are supported", q.bits));
    q.desc_act = section->optional_bool("desc_act").value_or(false);
    q.sym = section->optional_bool("sym").value_or(true);
    if (const std::optional<std::string> format = section->optional_string("checkpoint_format");
        format && *format != "gptq")
      section->fail("checkpoint_format", fmt::format("is \"{}\"; the \"gptq\" format (zeros stored minus one) is supported", *format));
  } else if (method == "awq") {
    q.method = QuantMethod::Awq;
    q.bits = static_cast<int>(section->optional_integer("bits", 1).value_or(4));
    if (q.bits != 4) section->fail("bits", fmt::format("is {}; AWQ checkpoints have 4 bits", q.bits));
    std::string version = section->optional_string("version").value_or("gemm");
    std::transform(version.begin(), version.end(), version.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (version != "gemm") section->fail("version", fmt::format("is \"{}\"; the \"gemm\" packing is supported", version));
    if (!section->optional_bool("zero_point").value_or(true))
      section->fail("zero_point", "is false; AWQ checkpoints with zero points are supported");
    if (q.group_size < 0) section->fail("group_size", "is -1; AWQ needs a positive group size");
    q.sym = false;
  } else {
    section->fail("quant_method", fmt::format("is \"{}\"; supported: \"gptq\", \"awq\"", method));
  }
  // Which projections a block packs, where the file says (a mixture of experts' GPTQ files): they
  // must be the ones memtune packs, every expert's and attention's but not the router's.
  if (const std::optional<JsonReader> listed = section->optional_array("modules_in_block_to_quantize")) {
    std::set<std::string> names, want;
    for (size_t i = 0; i < listed->size(); ++i) {
      const JsonReader inner = (*listed)[i];
      inner.as_array();
      for (size_t j = 0; j < inner.size(); ++j) names.insert(inner[j].as_string());
    }
    if (c.moe.enabled())
      for (const auto& list : moe_modules_in_block(c)) want.insert(list.begin(), list.end());
    else
      for (const char* n : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
        want.insert(n);
    for (const std::string& n : names)
      if (!want.contains(n))
        listed->fail(fmt::format("names \"{}\"; memtune packs attention's and the MLPs' (every expert's) projections, "
                                 "and keeps {} as stored", n,
                                 c.moe.enabled() ? "the router (mlp.gate) and the shared expert's gate" : "the rest"));
    for (const std::string& n : want)
      if (!names.contains(n))
        listed->fail(fmt::format("leaves out \"{}\"; memtune reads every attention and MLP projection packed", n));
  }
  // A packed LM head (gptqmodel's "lm_head": true; "lm_head_bits" when it differs from the layers').
  if (section->optional_bool("lm_head").value_or(false)) {
    if (q.method != QuantMethod::Gptq)
      section->fail("lm_head", "is true; packed LM heads are read from GPTQ files (AWQ files keep it 16-bit)");
    q.lm_head_bits = static_cast<int>(section->optional_integer("lm_head_bits", 1).value_or(q.bits));
    if (q.lm_head_bits != 4 && q.lm_head_bits != 8)
      section->fail("lm_head_bits", fmt::format("is {}; a packed LM head has 4 or 8 bits", q.lm_head_bits));
    if (c.tie_word_embeddings)
      section->fail("lm_head", "is true but tie_word_embeddings is true; a packed head is a tensor of its own "
                               "(lm_head.qweight), so the config must say tie_word_embeddings false");
    // GPTQ files pack codes along the input and zeros along the output, 32 / bits per int32.
    for (const int64_t n : {c.hidden_size, c.vocab_size})
      if (n % (32 / q.lm_head_bits) != 0)
        section->fail("lm_head_bits", fmt::format("is {}, but the LM head's {} {} do not split into int32 words of "
                                                  "{}-bit codes",
                                                  q.lm_head_bits, n, n == c.hidden_size ? "inputs" : "outputs",
                                                  q.lm_head_bits));
  }
  // Every quantized layer's input must split into words and (for AWQ) whole groups.
  const int per_word = 32 / q.bits;
  for (const int64_t in : {c.hidden_size, c.intermediate_size, c.q_dim()}) {
    if (in % per_word != 0)
      section->fail(fmt::format("a layer with {} inputs cannot hold {}-bit codes ({} per int32)", in, q.bits, per_word));
    if (q.method == QuantMethod::Awq && in % q.group_size != 0)
      section->fail("group_size", fmt::format("is {}, which does not divide a layer's {} inputs", q.group_size, in));
  }
  return q;
}

}  // namespace

std::string_view quant_method_name(QuantMethod method) {
  return method == QuantMethod::Gptq ? "gptq" : method == QuantMethod::Awq ? "awq" : "none";
}

QuantConfig parse_quantization_name(std::string_view name) {
  if (name == "gptq-int4") return {QuantMethod::Gptq, 4, 128, false, true};
  if (name == "gptq-int8") return {QuantMethod::Gptq, 8, 128, false, true};
  if (name == "awq" || name == "awq-int4") return {QuantMethod::Awq, 4, 128, false, false};
  throw Error(fmt::format("unknown quantization \"{}\" (known: gptq-int4, gptq-int8, awq)", name));
}

std::string quantization_name(const QuantConfig& q) {
  if (q.method == QuantMethod::Awq) return "awq";
  if (q.method == QuantMethod::Gptq) return fmt::format("gptq-int{}", q.bits);
  return "none";
}

void quantize_lm_head(ModelConfig& c, int bits) {
  if (!c.quant.enabled())
    throw Error(fmt::format("--lm_head_bits {}: the model is not quantized (GPTQ / AWQ); memtune quantize "
                            "--lm_head_bits {} packs a float model's head with its layers",
                            bits, bits));
  if (bits != 4 && bits != 8) throw Error(fmt::format("--lm_head_bits {}: expected 4 or 8", bits));
  if (c.hidden_size % (32 / bits) != 0)
    throw Error(fmt::format("--lm_head_bits {}: the LM head's {} inputs cannot hold {}-bit codes", bits,
                            c.hidden_size, bits));
  if (c.quant.lm_head_bits != 0 && c.quant.lm_head_bits != bits)
    throw Error(fmt::format("--lm_head_bits {}: the checkpoint's LM head is packed with {} bits", bits,
                            c.quant.lm_head_bits));
  c.quant.lm_head_bits = bits;
  c.tie_word_embeddings = false;
}

void apply_quantization(ModelConfig& c, std::string_view name) {
  if (c.quant.enabled())
    throw Error(fmt::format("--quantization {}: the model is already quantized ({})", name, quantization_name(c.quant)));
  c.quant = parse_quantization_name(name);
  parse_model_config(config_to_json(c), fmt::format("--quantization {}", name));  // the shapes' checks
}

ModelConfig parse_model_config(const nlohmann::json& document, const std::string& source) {
  const JsonReader doc(document, source);
  doc.as_object();
  const ModelFamily family = check_architecture(doc);
  if (const std::optional<std::string> act = doc.optional_string("hidden_act"); act && *act != "silu")
    doc.fail("hidden_act", fmt::format("is \"{}\"; the supported models use \"silu\"", *act));
  if (const std::optional<bool> mlp_bias = doc.optional_bool("mlp_bias"); mlp_bias && *mlp_bias)
    doc.fail("mlp_bias", "is true; MLP biases are not supported (Llama 3 has none)");
  if (const std::optional<int64_t> tp = doc.optional_integer("pretraining_tp", 1); tp && *tp != 1)
    doc.fail("pretraining_tp", fmt::format("is {}; only 1 (the usual linear layers) is supported", *tp));

  ModelConfig c;
  c.hidden_size = doc.integer("hidden_size", 1);
  c.intermediate_size = doc.integer("intermediate_size", 1);
  c.num_hidden_layers = doc.integer("num_hidden_layers", 1);
  c.num_attention_heads = doc.integer("num_attention_heads", 1);
  c.vocab_size = doc.integer("vocab_size", 1);
  c.num_key_value_heads = doc.optional_integer("num_key_value_heads", 1).value_or(c.num_attention_heads);
  c.max_position_embeddings =
      doc.optional_integer("max_position_embeddings", 1).value_or(kDefaultMaxPositionEmbeddings);
  c.rms_norm_eps = optional_positive_number(doc, "rms_norm_eps").value_or(kDefaultRmsNormEps);
  c.initializer_range = optional_positive_number(doc, "initializer_range").value_or(0.02);
  c.family = family;
  c.rope_theta = parse_rope_theta(doc, family, c.rope_scaling);
  c.tie_word_embeddings = doc.optional_bool("tie_word_embeddings").value_or(false);
  c.torch_dtype = parse_torch_dtype(doc);
  check_attention_layout(doc, c.num_hidden_layers);

  const FamilyTraits& traits = family_traits(family);
  c.attention_bias = traits.attention_bias_always || doc.optional_bool("attention_bias").value_or(false);
  c.qk_norm = traits.qk_norm;
  if (traits.head_dim_in_config && (doc.has("head_dim") || traits.default_head_dim > 0)) {
    c.explicit_head_dim = doc.optional_integer("head_dim", 1).value_or(traits.default_head_dim);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      doc.fail("hidden_size",
               fmt::format("{} is not divisible by num_attention_heads ({})", c.hidden_size, c.num_attention_heads));
    if (traits.head_dim_in_config) c.explicit_head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    doc.fail("num_attention_heads", fmt::format("{} is not divisible by num_key_value_heads ({})",
                                                c.num_attention_heads, c.num_key_value_heads));
  if (!traits.head_dim_in_config) {
    if (c.head_dim() % 2 != 0)
      doc.fail("hidden_size",
               fmt::format("{} / num_attention_heads ({}) gives head_dim {}, which must be even for rotary embeddings",
                           c.hidden_size, c.num_attention_heads, c.head_dim()));
    if (c.head_dim() > kMaxAttentionHeadDim)
      doc.fail("hidden_size",
               fmt::format("{} / num_attention_heads ({}) gives head_dim {}; the attention kernels take at most {}",
                           c.hidden_size, c.num_attention_heads, c.head_dim(), kMaxAttentionHeadDim));
    if (const std::optional<JsonReader> head_dim = doc.find("head_dim");
        head_dim && head_dim->as_integer(1) != c.head_dim())
      head_dim->fail(
          fmt::format("is {} but hidden_size / num_attention_heads is {}", head_dim->as_integer(1), c.head_dim()));
  } else {
    const char* field = doc.has("head_dim") ? "head_dim" : "hidden_size";
    if (c.head_dim() % 2 != 0)
      doc.fail(field, fmt::format("gives head_dim {}, which must be even for rotary embeddings", c.head_dim()));
    if (c.head_dim() > kMaxAttentionHeadDim)
      doc.fail(field, fmt::format("gives head_dim {}; the attention kernels take at most {}", c.head_dim(),
                                  kMaxAttentionHeadDim));
  }
  if (traits.qkv_bias_key) c.attention_bias = doc.optional_bool("qkv_bias").value_or(true);
  if (traits.moe) c.moe = parse_moe_config(doc, c);
  c.quant = parse_quant_config(doc, c);
  return c;
}

bool MoeConfig::sparse(int64_t layer) const {
  return enabled() && layer % decoder_sparse_step == decoder_sparse_step - 1 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

ModelConfig load_config_json(const std::string& path) {
  return parse_model_config(read_json_file(path), path);
}

void check_max_length(const ModelConfig& config, int64_t max_length, const std::string& source) {
  if (max_length > config.max_position_embeddings)
    throw Error(
        fmt::format("--max_length {} exceeds max_position_embeddings {} of {}: the model has not been "
                    "trained on positions that far; use --max_length {} or less (or --ignore_max_position_embeddings "
                    "to go beyond knowingly)",
                    max_length, config.max_position_embeddings, source, config.max_position_embeddings));
}

const FamilyTraits& family_traits(ModelFamily family) {
  for (const FamilyTraits& f : kFamilyTraits)
    if (f.family == family) return f;
  MT_ASSERT(false);
  return kFamilyTraits[0];
}

std::string_view model_family_name(ModelFamily family) { return family_traits(family).model_type; }

std::vector<float> rope_inv_freq(const ModelConfig& c) {
  const int64_t hd = c.head_dim();
  std::vector<float> out(static_cast<size_t>(hd / 2));
  const RopeScaling& r = c.rope_scaling;
  const double pi = 3.14159265358979323846;
  for (int64_t i = 0; i < hd / 2; ++i) {
    double f = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * i) / static_cast<double>(hd));
    if (r.llama3) {
      const double old_len = static_cast<double>(r.original_max_position_embeddings);
      const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
      const double wavelen = 2 * pi / f;
      if (wavelen > low_wavelen) {
        f /= r.factor;
      } else if (wavelen >= high_wavelen) {  // between the two: interpolated
        const double smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = (1 - smooth) * f / r.factor + smooth * f;
      }
    }
    out[static_cast<size_t>(i)] = static_cast<float>(f);
  }
  return out;
}

namespace {

nlohmann::json config_json(const ModelConfig& c);

}  // namespace

nlohmann::json config_to_json(const ModelConfig& c) {
  nlohmann::json j = config_json(c);
  const QuantConfig& q = c.quant;
  if (q.method == QuantMethod::Gptq)
    j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", q.bits},           {"group_size", q.group_size},
                                {"desc_act", q.desc_act},  {"sym", q.sym},             {"checkpoint_format", "gptq"},
                                {"static_groups", false},  {"true_sequential", true}};
  if (q.method == QuantMethod::Gptq && c.moe.enabled())
    j["quantization_config"]["modules_in_block_to_quantize"] = moe_modules_in_block(c);
  if (q.method == QuantMethod::Gptq && q.lm_head_bits) {
    j["quantization_config"]["lm_head"] = true;
    if (q.lm_head_bits != q.bits) j["quantization_config"]["lm_head_bits"] = q.lm_head_bits;
  }
  if (q.method == QuantMethod::Awq)
    j["quantization_config"] = {{"quant_method", "awq"}, {"bits", q.bits},         {"group_size", q.group_size},
                                {"version", "gemm"},     {"zero_point", true},     {"modules_to_not_convert", nullptr}};
  return j;
}

namespace {

// The keys every family writes, then each family's own (its traits say which).
nlohmann::json config_json(const ModelConfig& c) {
  const FamilyTraits& traits = family_traits(c.family);
  nlohmann::json j = {
      {"architectures", {traits.architecture}},
      {"model_type", traits.model_type},
      {"hidden_act", "silu"},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"initializer_range", c.initializer_range},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"attention_dropout", 0.0},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"torch_dtype", dtype_torch_name(c.torch_dtype)},
  };
  if (traits.head_dim_in_config) j["head_dim"] = c.head_dim();
  if (traits.qkv_bias_key)
    j["qkv_bias"] = c.attention_bias;
  else if (!traits.attention_bias_always)
    j["attention_bias"] = c.attention_bias;
  if (traits.moe) {
    const MoeConfig& m = c.moe;
    j["num_experts"] = m.num_experts;
    j["num_experts_per_tok"] = m.experts_per_token;
    j["moe_intermediate_size"] = m.expert_intermediate_size;
    if (c.family == ModelFamily::Qwen2Moe) j["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
    j["norm_topk_prob"] = m.norm_topk_prob;
    j["decoder_sparse_step"] = m.decoder_sparse_step;
    j["mlp_only_layers"] = m.mlp_only_layers;
    j["router_aux_loss_coef"] = m.router_aux_loss_coef;
    j["output_router_logits"] = m.output_router_logits;
  }
  if (traits.sliding_window_keys) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_hidden_layers;
  }
  if (traits.llama_mlp_keys) {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  if (c.rope_scaling.llama3)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  return j;
}

}  // namespace

namespace {

struct Preset {
  const char* name;
  ModelConfig config;
};

std::vector<Preset> make_presets() {
  // Shapes of the base checkpoints Qwen/Qwen2.5-*B (config.json on the Hub). The -Instruct
  // checkpoints share the shapes but list max_position_embeddings 32768 and rms_norm_eps 1e-6.
  auto qwen25 = [](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t kv_heads, int64_t vocab,
                   bool tied, double eps, int64_t max_positions) {
    return ModelConfig{.hidden_size = hidden,
                       .intermediate_size = intermediate,
                       .num_hidden_layers = layers,
                       .num_attention_heads = heads,
                       .num_key_value_heads = kv_heads,
                       .vocab_size = vocab,
                       .max_position_embeddings = max_positions,
                       .rms_norm_eps = eps,
                       .rope_theta = 1000000.0,
                       .tie_word_embeddings = tied,
                       .torch_dtype = DType::BF16,
                       .rope_scaling = {},
                       .quant = {}};
  };
  // Qwen/Qwen3-*B (config.json on the Hub): head_dim 128, q_norm/k_norm, no biases.
  auto qwen3 = [](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t kv_heads, bool tied) {
    return ModelConfig{.hidden_size = hidden,
                       .intermediate_size = intermediate,
                       .num_hidden_layers = layers,
                       .num_attention_heads = heads,
                       .num_key_value_heads = kv_heads,
                       .vocab_size = 151936,
                       .max_position_embeddings = 40960,
                       .rms_norm_eps = 1e-6,
                       .rope_theta = 1000000.0,
                       .tie_word_embeddings = tied,
                       .torch_dtype = DType::BF16,
                       .family = ModelFamily::Qwen3,
                       .explicit_head_dim = 128,
                       .attention_bias = false,
                       .qk_norm = true,
                       .rope_scaling = {},
                       .quant = {}};
  };
  auto qwen3_moe = [&](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t kv_heads,
                       int64_t expert_intermediate) {
    ModelConfig c = qwen3(hidden, intermediate, layers, heads, kv_heads, false);
    c.family = ModelFamily::Qwen3Moe;
    c.moe = {.num_experts = 128, .experts_per_token = 8, .expert_intermediate_size = expert_intermediate,
             .norm_topk_prob = true};
    return c;
  };
  auto qwen2_moe = [&](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t kv_heads,
                       int64_t experts, int64_t per_token, int64_t expert_intermediate, int64_t shared,
                       int64_t max_positions) {
    ModelConfig c = qwen25(hidden, intermediate, layers, heads, kv_heads, 151936, false, 1e-6, max_positions);
    c.family = ModelFamily::Qwen2Moe;
    c.moe = {.num_experts = experts, .experts_per_token = per_token, .expert_intermediate_size = expert_intermediate,
             .shared_expert_intermediate_size = shared};
    return c;
  };
  // meta-llama/Llama-3.2-*B and Llama-3.1-*B: vocabulary 128256, 8 KV heads, RoPE theta 500000
  // with Llama 3 scaling (factor 32 for 3.2, 8 for 3.1; low 1, high 4, original 8192 positions).
  auto llama3 = [](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t head_dim, bool tied,
                   double factor) {
    return ModelConfig{.hidden_size = hidden,
                       .intermediate_size = intermediate,
                       .num_hidden_layers = layers,
                       .num_attention_heads = heads,
                       .num_key_value_heads = 8,
                       .vocab_size = 128256,
                       .max_position_embeddings = 131072,
                       .rms_norm_eps = 1e-5,
                       .rope_theta = 500000.0,
                       .tie_word_embeddings = tied,
                       .torch_dtype = DType::BF16,
                       .family = ModelFamily::Llama,
                       .explicit_head_dim = head_dim,
                       .attention_bias = false,
                       .qk_norm = false,
                       .rope_scaling = {.llama3 = true,
                                        .factor = factor,
                                        .low_freq_factor = 1.0,
                                        .high_freq_factor = 4.0,
                                        .original_max_position_embeddings = 8192},
                       .quant = {}};
  };
  const ModelConfig tiny{.hidden_size = 64,
                         .intermediate_size = 176,
                         .num_hidden_layers = 2,
                         .num_attention_heads = 4,
                         .num_key_value_heads = 2,
                         .vocab_size = 512,
                         .max_position_embeddings = 2048,
                         .rms_norm_eps = 1e-6,
                         .rope_theta = 1000000.0,
                         .tie_word_embeddings = true,
                         .torch_dtype = DType::F32,
                         .rope_scaling = {},
                       .quant = {}};
  // The tiny shape in the other families; head_dim differs from hidden / heads on purpose.
  ModelConfig tiny_qwen3 = tiny;
  tiny_qwen3.family = ModelFamily::Qwen3;
  tiny_qwen3.explicit_head_dim = 24;
  tiny_qwen3.attention_bias = false;
  tiny_qwen3.qk_norm = true;
  // Mixtures of experts small enough for the tests and transformers' oracle: 8 experts, 2 a token,
  // renormalized (qwen3_moe); 6 experts, 2 a token, a shared expert, layer 0 dense (qwen2_moe's
  // decoder_sparse_step 2).
  ModelConfig tiny_qwen3_moe = tiny_qwen3;
  tiny_qwen3_moe.family = ModelFamily::Qwen3Moe;
  tiny_qwen3_moe.explicit_head_dim = 24;
  tiny_qwen3_moe.moe = {.num_experts = 8, .experts_per_token = 2, .expert_intermediate_size = 48,
                        .norm_topk_prob = true};
  ModelConfig tiny_qwen2_moe = tiny;
  tiny_qwen2_moe.family = ModelFamily::Qwen2Moe;
  tiny_qwen2_moe.moe = {.num_experts = 6, .experts_per_token = 2, .expert_intermediate_size = 40,
                        .shared_expert_intermediate_size = 56, .decoder_sparse_step = 2};
  ModelConfig tiny_llama = tiny;
  tiny_llama.family = ModelFamily::Llama;
  tiny_llama.explicit_head_dim = 32;
  tiny_llama.attention_bias = false;
  tiny_llama.tie_word_embeddings = false;
  tiny_llama.rope_theta = 500000.0;
  tiny_llama.rms_norm_eps = 1e-5;
  // A scaling whose bands all hold some of a head_dim-32 model's frequencies.
  tiny_llama.rope_scaling = {.llama3 = true,
                             .factor = 8.0,
                             .low_freq_factor = 1.0,
                             .high_freq_factor = 4.0,
                             .original_max_position_embeddings = 64};
  return {
      {"tiny", tiny},
      {"tiny-qwen3", tiny_qwen3},
      {"tiny-llama", tiny_llama},
      {"tiny-qwen3-moe", tiny_qwen3_moe},
      {"tiny-qwen2-moe", tiny_qwen2_moe},
      {"qwen2.5-0.5b", qwen25(896, 4864, 24, 14, 2, 151936, true, 1e-6, 32768)},
      {"qwen2.5-1.5b", qwen25(1536, 8960, 28, 12, 2, 151936, true, 1e-6, 131072)},
      {"qwen2.5-3b", qwen25(2048, 11008, 36, 16, 2, 151936, true, 1e-6, 32768)},
      {"qwen2.5-7b", qwen25(3584, 18944, 28, 28, 4, 152064, false, 1e-6, 131072)},
      {"qwen2.5-14b", qwen25(5120, 13824, 48, 40, 8, 152064, false, 1e-5, 131072)},
      {"qwen2.5-32b", qwen25(5120, 27648, 64, 40, 8, 152064, false, 1e-5, 131072)},
      {"qwen2.5-72b", qwen25(8192, 29568, 80, 64, 8, 152064, false, 1e-5, 131072)},
      {"qwen3-0.6b", qwen3(1024, 3072, 28, 16, 8, true)},
      {"qwen3-1.7b", qwen3(2048, 6144, 28, 16, 8, true)},
      {"qwen3-4b", qwen3(2560, 9728, 36, 32, 8, true)},
      {"qwen3-8b", qwen3(4096, 12288, 36, 32, 8, false)},
      {"qwen3-14b", qwen3(5120, 17408, 40, 40, 8, false)},
      {"qwen3-32b", qwen3(5120, 25600, 64, 64, 8, false)},
      // Qwen/Qwen3-30B-A3B and -235B-A22B (config.json on the Hub): 128 experts, 8 a token,
      // renormalized, head_dim 128.
      {"qwen3-30b-a3b", qwen3_moe(2048, 6144, 48, 32, 4, 768)},
      {"qwen3-235b-a22b", qwen3_moe(4096, 12288, 94, 64, 4, 1536)},
      // Qwen/Qwen2-57B-A14B and Qwen/Qwen1.5-MoE-A2.7B: a shared expert beside the routed ones.
      {"qwen2-57b-a14b", qwen2_moe(3584, 18944, 28, 28, 4, 64, 8, 2560, 20480, 131072)},
      {"qwen1.5-moe-a2.7b", qwen2_moe(2048, 5632, 24, 16, 16, 60, 4, 1408, 5632, 8192)},
      {"llama-3.2-1b", llama3(2048, 8192, 16, 32, 64, true, 32.0)},
      {"llama-3.2-3b", llama3(3072, 8192, 28, 24, 128, true, 32.0)},
      {"llama-3.1-8b", llama3(4096, 14336, 32, 32, 128, false, 8.0)},
      {"llama-3.1-70b", llama3(8192, 28672, 80, 64, 128, false, 8.0)},
  };
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> table = make_presets();
  return table;
}

}  // namespace

ModelConfig model_preset(const std::string& name) {
  std::string key = name;
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char ch) { return std::tolower(ch); });
  for (const Preset& p : presets())
    if (key == p.name) return p.config;
  throw Error("unknown model preset \"" + name + "\" (valid presets: " + model_preset_names() + ")");
}

std::string model_preset_names() {
  std::string names;
  for (const Preset& p : presets()) names += (names.empty() ? "" : ", ") + std::string(p.name);
  return names;
}

}  // namespace memtune

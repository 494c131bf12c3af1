// Qwen2 config.json parsing, validation, serialization and the named presets. Parsing fills
// absent optional fields with transformers' Qwen2Config defaults and refuses anything the
// engine would silently compute differently from transformers (another architecture, RoPE
// scaling, sliding-window attention, head counts that do not divide).
#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <optional>

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

void check_architecture(const JsonReader& doc) {
  const std::optional<JsonReader> arch = doc.find("architectures");
  if (arch) {
    bool qwen2 = false;
    for (size_t i = 0; i < arch->size(); ++i) qwen2 = (*arch)[i].as_string() == "Qwen2ForCausalLM" || qwen2;
    if (!qwen2) arch->fail(fmt::format("is {}; only Qwen2ForCausalLM is supported", json_excerpt(arch->value())));
  }
  const std::optional<std::string> model_type = doc.optional_string("model_type");
  if (model_type && *model_type != "qwen2")
    doc.fail("model_type", fmt::format("is \"{}\"; only \"qwen2\" is supported", *model_type));
  if (!arch && !model_type)
    doc.fail("neither \"architectures\" nor \"model_type\" is set; expected a Qwen2ForCausalLM config");
}

// rope_scaling (transformers 4) or rope_parameters (transformers 5): only the unscaled
// "default" RoPE is computed by the engine. Returns the object's rope_theta, if it has one.
std::optional<JsonReader> checked_rope_object_theta(const JsonReader& doc, std::string_view key) {
  const std::optional<JsonReader> rope = doc.optional_object(key);
  if (!rope) return std::nullopt;
  std::optional<JsonReader> type = rope->find("rope_type");
  if (!type) type = rope->find("type");
  if (!type) rope->fail("has no \"rope_type\"");
  if (type->value() != "default")
    rope->fail(fmt::format("asks for rope_type {}; only the \"default\" RoPE (no scaling) is supported",
                           json_excerpt(type->value())));
  return rope->find("rope_theta");
}

double parse_rope_theta(const JsonReader& doc) {
  std::optional<double> theta = optional_positive_number(doc, "rope_theta");
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const std::optional<JsonReader> nested = checked_rope_object_theta(doc, key);
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

}  // namespace

Qwen2Config parse_qwen2_config(const nlohmann::json& document, const std::string& source) {
  const JsonReader doc(document, source);
  doc.as_object();
  check_architecture(doc);
  if (const std::optional<std::string> act = doc.optional_string("hidden_act"); act && *act != "silu")
    doc.fail("hidden_act", fmt::format("is \"{}\"; Qwen2 uses \"silu\"", *act));

  Qwen2Config c;
  c.hidden_size = doc.integer("hidden_size", 1);
  c.intermediate_size = doc.integer("intermediate_size", 1);
  c.num_hidden_layers = doc.integer("num_hidden_layers", 1);
  c.num_attention_heads = doc.integer("num_attention_heads", 1);
  c.vocab_size = doc.integer("vocab_size", 1);
  c.num_key_value_heads = doc.optional_integer("num_key_value_heads", 1).value_or(c.num_attention_heads);
  c.max_position_embeddings =
      doc.optional_integer("max_position_embeddings", 1).value_or(kDefaultMaxPositionEmbeddings);
  c.rms_norm_eps = optional_positive_number(doc, "rms_norm_eps").value_or(kDefaultRmsNormEps);
  c.rope_theta = parse_rope_theta(doc);
  c.tie_word_embeddings = doc.optional_bool("tie_word_embeddings").value_or(false);
  c.torch_dtype = parse_torch_dtype(doc);
  check_attention_layout(doc, c.num_hidden_layers);

  if (c.hidden_size % c.num_attention_heads != 0)
    doc.fail("hidden_size",
             fmt::format("{} is not divisible by num_attention_heads ({})", c.hidden_size, c.num_attention_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    doc.fail("num_attention_heads", fmt::format("{} is not divisible by num_key_value_heads ({})",
                                                c.num_attention_heads, c.num_key_value_heads));
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
  return c;
}

Qwen2Config load_qwen2_config(const std::string& path) {
  return parse_qwen2_config(read_json_file(path), path);
}

void check_max_length(const Qwen2Config& config, int64_t max_length, const std::string& source) {
  if (max_length > config.max_position_embeddings)
    throw Error(
        fmt::format("--max_length {} exceeds max_position_embeddings {} of {}: the model has not been "
                    "trained on positions that far; use --max_length {} or less (or --ignore_max_position_embeddings "
                    "to go beyond knowingly)",
                    max_length, config.max_position_embeddings, source, config.max_position_embeddings));
}

nlohmann::json qwen2_config_to_json(const Qwen2Config& c) {
  return {
      {"architectures", {"Qwen2ForCausalLM"}},
      {"model_type", "qwen2"},
      {"hidden_act", "silu"},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"torch_dtype", dtype_torch_name(c.torch_dtype)},
      {"use_sliding_window", false},
      {"sliding_window", nullptr},
      {"max_window_layers", c.num_hidden_layers},
      {"attention_dropout", 0.0},
  };
}

Qwen2Config qwen2_preset(const std::string& name) {
  struct Preset {
    const char* name;
    Qwen2Config config;
  };
  // Shapes of the base checkpoints Qwen/Qwen2.5-*B (config.json on the Hub). The -Instruct
  // checkpoints share the shapes but list max_position_embeddings 32768 and rms_norm_eps 1e-6.
  auto qwen25 = [](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t kv_heads, int64_t vocab,
                   bool tied, double eps, int64_t max_positions) {
    return Qwen2Config{.hidden_size = hidden,
                       .intermediate_size = intermediate,
                       .num_hidden_layers = layers,
                       .num_attention_heads = heads,
                       .num_key_value_heads = kv_heads,
                       .vocab_size = vocab,
                       .max_position_embeddings = max_positions,
                       .rms_norm_eps = eps,
                       .rope_theta = 1000000.0,
                       .tie_word_embeddings = tied,
                       .torch_dtype = DType::BF16};
  };
  static const Preset presets[] = {
      {"tiny", Qwen2Config{.hidden_size = 64,
                           .intermediate_size = 176,
                           .num_hidden_layers = 2,
                           .num_attention_heads = 4,
                           .num_key_value_heads = 2,
                           .vocab_size = 512,
                           .max_position_embeddings = 2048,
                           .rms_norm_eps = 1e-6,
                           .rope_theta = 1000000.0,
                           .tie_word_embeddings = true,
                           .torch_dtype = DType::F32}},
      {"qwen2.5-0.5b", qwen25(896, 4864, 24, 14, 2, 151936, true, 1e-6, 32768)},
      {"qwen2.5-1.5b", qwen25(1536, 8960, 28, 12, 2, 151936, true, 1e-6, 131072)},
      {"qwen2.5-3b", qwen25(2048, 11008, 36, 16, 2, 151936, true, 1e-6, 32768)},
      {"qwen2.5-7b", qwen25(3584, 18944, 28, 28, 4, 152064, false, 1e-6, 131072)},
      {"qwen2.5-14b", qwen25(5120, 13824, 48, 40, 8, 152064, false, 1e-5, 131072)},
      {"qwen2.5-32b", qwen25(5120, 27648, 64, 40, 8, 152064, false, 1e-5, 131072)},
      {"qwen2.5-72b", qwen25(8192, 29568, 80, 64, 8, 152064, false, 1e-5, 131072)},
  };
  std::string key = name;
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char ch) { return std::tolower(ch); });
  std::string valid;
  for (const Preset& p : presets) {
    if (key == p.name) return p.config;
    valid += (valid.empty() ? "" : ", ") + std::string(p.name);
  }
  throw Error("unknown model preset \"" + name + "\" (valid presets: " + valid + ")");
}

}  // namespace memtune

// Qwen2 config.json parsing, validation, serialization and the named presets. Parsing fills
// absent optional fields with transformers' Qwen2Config defaults and refuses anything the
// engine would silently compute differently from transformers (another architecture, RoPE
// scaling, sliding-window attention, head counts that do not divide).
#include "model/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"

namespace memtune {
namespace {

using nlohmann::json;

// transformers' Qwen2Config defaults for fields a config.json may omit.
constexpr int64_t kDefaultMaxPositionEmbeddings = 32768;
constexpr double kDefaultRmsNormEps = 1e-6;
constexpr double kDefaultRopeTheta = 10000.0;

class Fields {
 public:
  Fields(const json& doc, const std::string& source) : doc_(doc), source_(source) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw Error(source_ + ": field \"" + field + "\" " + problem);
  }

  // The value of a top-level field, or nullptr when absent or null (HF writes null for unset).
  const json* find(const std::string& field) const {
    auto it = doc_.find(field);
    return it == doc_.end() || it->is_null() ? nullptr : &*it;
  }

  int64_t positive_int(const std::string& field, const json& v) const {
    if (!v.is_number_integer()) fail(field, "must be an integer, got " + text(v));
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(field, "is too large: " + text(v));
    if (v.get<int64_t>() <= 0) fail(field, "must be positive, got " + text(v));
    return v.get<int64_t>();
  }
  int64_t required_int(const std::string& field) const {
    const json* v = find(field);
    if (!v) throw Error(source_ + ": missing required field \"" + field + "\"");
    return positive_int(field, *v);
  }
  int64_t optional_int(const std::string& field, int64_t fallback) const {
    const json* v = find(field);
    return v ? positive_int(field, *v) : fallback;
  }

  double positive_number(const std::string& field, const json& v) const {
    if (!v.is_number()) fail(field, "must be a number, got " + text(v));
    double d = v.get<double>();
    if (!(d > 0) || !std::isfinite(d)) fail(field, "must be a positive number, got " + text(v));
    return d;
  }
  std::optional<double> optional_number(const std::string& field) const {
    const json* v = find(field);
    return v ? std::optional<double>(positive_number(field, *v)) : std::nullopt;
  }

  bool optional_bool(const std::string& field, bool fallback) const {
    const json* v = find(field);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(field, "must be true or false, got " + text(*v));
    return v->get<bool>();
  }

  const std::string* optional_string(const std::string& field) const {
    const json* v = find(field);
    if (!v) return nullptr;
    if (!v->is_string()) fail(field, "must be a string, got " + text(*v));
    return &v->get_ref<const std::string&>();
  }

  static std::string text(const json& v) {
    std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
    return s.size() > 60 ? s.substr(0, 57) + "..." : s;
  }

 private:
  const json& doc_;
  const std::string& source_;
};

void check_architecture(const Fields& f, const std::string& source) {
  const json* arch = f.find("architectures");
  if (arch) {
    if (!arch->is_array() || !std::all_of(arch->begin(), arch->end(), [](const json& a) { return a.is_string(); }))
      f.fail("architectures", "must be a list of strings, got " + Fields::text(*arch));
    if (std::find(arch->begin(), arch->end(), json("Qwen2ForCausalLM")) == arch->end())
      f.fail("architectures", "is " + Fields::text(*arch) + "; only Qwen2ForCausalLM is supported");
  }
  const std::string* model_type = f.optional_string("model_type");
  if (model_type && *model_type != "qwen2")
    f.fail("model_type", "is \"" + *model_type + "\"; only \"qwen2\" is supported");
  if (!arch && !model_type)
    throw Error(source + ": neither \"architectures\" nor \"model_type\" is set; expected a Qwen2ForCausalLM config");
}

// rope_scaling (transformers 4) or rope_parameters (transformers 5): only the unscaled
// "default" RoPE is computed by the engine. Returns the rope_theta the object carries, if any.
std::optional<double> check_rope_object(const Fields& f, const std::string& field) {
  const json* rope = f.find(field);
  if (!rope) return std::nullopt;
  if (!rope->is_object()) f.fail(field, "must be an object or null, got " + Fields::text(*rope));
  auto type = rope->find("rope_type");
  if (type == rope->end()) type = rope->find("type");
  if (type == rope->end()) f.fail(field, "has no \"rope_type\"");
  if (!type->is_string() || type->get_ref<const std::string&>() != "default")
    f.fail(field,
           "asks for rope_type " + Fields::text(*type) + "; only the \"default\" RoPE (no scaling) is supported");
  auto theta = rope->find("rope_theta");
  if (theta == rope->end() || theta->is_null()) return std::nullopt;
  return f.positive_number(field + ".rope_theta", *theta);
}

double parse_rope_theta(const Fields& f) {
  std::optional<double> theta = f.optional_number("rope_theta");
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    std::optional<double> nested = check_rope_object(f, field);
    if (!nested) continue;
    if (theta && *theta != *nested)
      f.fail(std::string(field) + ".rope_theta",
             "is " + std::to_string(*nested) + " but \"rope_theta\" says " + std::to_string(*theta));
    theta = nested;
  }
  return theta.value_or(kDefaultRopeTheta);
}

DType parse_torch_dtype(const Fields& f, const std::string& source) {
  const std::string* torch_dtype = f.optional_string("torch_dtype");
  const std::string* dtype = f.optional_string("dtype");
  std::optional<DType> a, b;
  if (torch_dtype) a = parse_dtype(*torch_dtype, source + ": field \"torch_dtype\"");
  if (dtype) b = parse_dtype(*dtype, source + ": field \"dtype\"");
  if (a && b && *a != *b) f.fail("dtype", "is \"" + *dtype + "\" but \"torch_dtype\" is \"" + *torch_dtype + "\"");
  return a.value_or(b.value_or(DType::F32));
}

void check_attention_layout(const Fields& f, int64_t num_hidden_layers) {
  if (f.optional_bool("use_sliding_window", false))
    f.fail("use_sliding_window", "is true; sliding-window attention is not supported");
  const json* window = f.find("sliding_window");
  if (window && !window->is_number_integer())
    f.fail("sliding_window", "must be an integer or null, got " + Fields::text(*window));

  const json* layer_types = f.find("layer_types");
  if (!layer_types) return;
  if (!layer_types->is_array()) f.fail("layer_types", "must be a list, got " + Fields::text(*layer_types));
  if (static_cast<int64_t>(layer_types->size()) != num_hidden_layers)
    f.fail("layer_types", "has " + std::to_string(layer_types->size()) + " entries but num_hidden_layers is " +
                              std::to_string(num_hidden_layers));
  // With use_sliding_window false, transformers gives "sliding_attention" layers no window,
  // so both kinds compute full attention.
  for (size_t i = 0; i < layer_types->size(); ++i) {
    const json& t = (*layer_types)[i];
    if (t != "full_attention" && t != "sliding_attention")
      f.fail("layer_types[" + std::to_string(i) + "]", "is " + Fields::text(t) + "; expected \"full_attention\"");
  }
}

}  // namespace

Qwen2Config parse_qwen2_config(const nlohmann::json& doc, const std::string& source) {
  if (!doc.is_object()) throw Error(source + ": expected a JSON object, got " + Fields::text(doc));
  const Fields f(doc, source);
  check_architecture(f, source);
  const std::string* act = f.optional_string("hidden_act");
  if (act && *act != "silu") f.fail("hidden_act", "is \"" + *act + "\"; Qwen2 uses \"silu\"");

  Qwen2Config c;
  c.hidden_size = f.required_int("hidden_size");
  c.intermediate_size = f.required_int("intermediate_size");
  c.num_hidden_layers = f.required_int("num_hidden_layers");
  c.num_attention_heads = f.required_int("num_attention_heads");
  c.vocab_size = f.required_int("vocab_size");
  c.num_key_value_heads = f.optional_int("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = f.optional_int("max_position_embeddings", kDefaultMaxPositionEmbeddings);
  c.rms_norm_eps = f.optional_number("rms_norm_eps").value_or(kDefaultRmsNormEps);
  c.rope_theta = parse_rope_theta(f);
  c.tie_word_embeddings = f.optional_bool("tie_word_embeddings", false);
  c.torch_dtype = parse_torch_dtype(f, source);
  check_attention_layout(f, c.num_hidden_layers);

  if (c.hidden_size % c.num_attention_heads != 0)
    f.fail("hidden_size", "(" + std::to_string(c.hidden_size) + ") is not divisible by num_attention_heads (" +
                              std::to_string(c.num_attention_heads) + ")");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.fail("num_attention_heads", "(" + std::to_string(c.num_attention_heads) +
                                      ") is not divisible by num_key_value_heads (" +
                                      std::to_string(c.num_key_value_heads) + ")");
  if (c.head_dim() % 2 != 0)
    f.fail("hidden_size", "/ num_attention_heads gives head_dim " + std::to_string(c.head_dim()) +
                              ", which must be even for rotary embeddings");
  if (const json* head_dim = f.find("head_dim"); head_dim && f.positive_int("head_dim", *head_dim) != c.head_dim())
    f.fail("head_dim", "is " + Fields::text(*head_dim) + " but hidden_size / num_attention_heads is " +
                           std::to_string(c.head_dim()));
  return c;
}

Qwen2Config load_qwen2_config(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw Error(path + ": is a directory, expected a config.json file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open model config: " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
  return parse_qwen2_config(doc, path);
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

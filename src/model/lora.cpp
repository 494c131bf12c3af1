#include "model/lora.h"

#include <cmath>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"
#include "core/rng.h"

namespace memtune {

namespace {
constexpr std::array<std::string_view, kNumLinearSites> kSiteNames = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"};
}  // namespace

uint64_t lora_dropout_key(uint64_t seed, int64_t layer, LinearSite site) {
  return mix64(seed ^ (static_cast<uint64_t>(layer) * kNumLinearSites + static_cast<uint64_t>(site) + 1) *
                          0x9e3779b97f4a7c15ull);
}

uint64_t lora_expert_dropout_key(uint64_t seed, int64_t layer, LinearSite site, int64_t expert) {
  return mix64(lora_dropout_key(seed, layer, site) ^ static_cast<uint64_t>(expert + 2) * 0xbf58476d1ce4e5b9ull);
}

std::string_view linear_site_name(LinearSite site) {
  return kSiteNames[static_cast<size_t>(site)];
}

std::string_view linear_site_block(LinearSite site) {
  return static_cast<size_t>(site) <= static_cast<size_t>(LinearSite::O) ? "self_attn" : "mlp";
}

double LoraConfig::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

std::vector<std::string> LoraConfig::target_names() const {
  std::vector<std::string> names;
  for (size_t s = 0; s < kNumLinearSites; ++s)
    if (targets[s]) names.emplace_back(kSiteNames[s]);
  return names;
}

void set_lora_targets(LoraConfig& config, const std::vector<std::string>& names) {
  config.targets = {};
  for (const auto& name : names) {
    if (name == "all-linear" || name == "all_linear") {
      config.targets.fill(true);
      continue;
    }
    size_t s = 0;
    while (s < kNumLinearSites && kSiteNames[s] != name) ++s;
    if (s == kNumLinearSites)
      throw Error(fmt::format(
          "target_modules: unknown module \"{}\" (expected q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
          "down_proj or all-linear)",
          name));
    config.targets[s] = true;
  }
  bool any = false;
  for (bool t : config.targets) any = any || t;
  if (!any) throw Error("target_modules: no module selected for LoRA");
}

std::string lora_tensor_name(int64_t layer, LinearSite site, bool is_b) {
  return fmt::format("base_model.model.model.layers.{}.{}.{}.lora_{}.weight", layer, linear_site_block(site),
                     linear_site_name(site), is_b ? "B" : "A");
}

std::string lora_expert_tensor_name(int64_t layer, int64_t expert, LinearSite site, bool is_b) {
  const std::string module = expert < 0 ? std::string("shared_expert") : fmt::format("experts.{}", expert);
  return fmt::format("base_model.model.model.layers.{}.mlp.{}.{}.lora_{}.weight", layer, module,
                     linear_site_name(site), is_b ? "B" : "A");
}

nlohmann::json lora_adapter_config_json(const LoraConfig& c, const std::string& base_model_name_or_path) {
  return {{"alpha_pattern", nlohmann::json::object()},
          {"auto_mapping", nullptr},
          {"base_model_name_or_path", base_model_name_or_path},
          {"bias", "none"},
          {"fan_in_fan_out", false},
          {"inference_mode", true},
          {"init_lora_weights", true},
          {"layers_pattern", nullptr},
          {"layers_to_transform", nullptr},
          {"lora_alpha", c.alpha},
          {"lora_dropout", c.dropout},
          {"modules_to_save", nullptr},
          {"peft_type", "LORA"},
          {"r", c.rank},
          {"rank_pattern", nlohmann::json::object()},
          {"revision", nullptr},
          {"target_modules", c.target_names()},
          {"task_type", "CAUSAL_LM"},
          {"use_dora", false},
          {"use_rslora", c.use_rslora}};
}

LoraConfig parse_lora_adapter_config(const nlohmann::json& document, const std::string& source) {
  const JsonReader doc(document, source);
  doc.as_object();
  if (const std::string peft_type = doc.optional_string("peft_type").value_or("LORA"); peft_type != "LORA")
    doc.fail("peft_type", fmt::format("expected \"LORA\", got \"{}\"", peft_type));
  LoraConfig c;
  c.rank = doc.integer("r", 1);
  c.alpha = doc.optional_number("lora_alpha").value_or(8.0);  // PEFT's default
  if (!(c.alpha > 0)) doc.fail("lora_alpha", fmt::format("expected a positive number, got {}", c.alpha));
  c.dropout = doc.optional_number("lora_dropout").value_or(c.dropout);
  if (!(c.dropout >= 0 && c.dropout < 1))
    doc.fail("lora_dropout", fmt::format("expected a probability in [0, 1), got {}", c.dropout));
  c.use_rslora = doc.optional_bool("use_rslora").value_or(c.use_rslora);
  if (doc.optional_string("bias").value_or("none") != "none") doc.fail("bias", "only \"none\" is supported");
  if (doc.optional_bool("use_dora").value_or(false)) doc.fail("use_dora", "DoRA is not supported");
  if (doc.optional_bool("fan_in_fan_out").value_or(false)) doc.fail("fan_in_fan_out", "must be false (the linear weights are stored [out, in])");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (const std::optional<JsonReader> pattern = doc.optional_object(key); pattern && !pattern->value().empty())
      pattern->fail("per-module patterns are not supported");
  if (const std::optional<JsonReader> modules = doc.find("modules_to_save"); modules && !modules->value().empty())
    modules->fail("is not supported");
  const JsonReader targets = doc.get("target_modules");
  std::vector<std::string> names;
  if (targets.value().is_string()) {
    names.push_back(targets.as_string());
  } else if (targets.value().is_array()) {
    for (size_t i = 0; i < targets.size(); ++i) names.push_back(targets[i].as_string());
  } else {
    targets.fail(fmt::format("expected a module name or a list of them, got {}", json_excerpt(targets.value())));
  }
  set_lora_targets(c, names);
  return c;
}

LoraConfig load_lora_adapter_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "adapter_config.json").string();
  return parse_lora_adapter_config(read_json_file(path), path);
}

}  // namespace memtune

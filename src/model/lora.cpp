#include "model/lora.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace memtune {

namespace {
constexpr std::array<std::string_view, kNumLinearSites> kSiteNames = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"};
}  // namespace

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

LoraConfig parse_lora_adapter_config(const nlohmann::json& doc, const std::string& source) {
  auto fail = [&](const std::string& field, const std::string& what) -> Error {
    return Error(fmt::format("{}: \"{}\" {}", source, field, what));
  };
  if (!doc.is_object()) throw Error(fmt::format("{}: expected a JSON object", source));
  if (doc.value("peft_type", std::string("LORA")) != "LORA") throw fail("peft_type", "must be LORA");
  if (!doc.contains("r") || !doc["r"].is_number_integer() || doc["r"].get<int64_t>() <= 0)
    throw fail("r", "must be a positive integer");
  LoraConfig c;
  c.rank = doc["r"].get<int64_t>();
  if (doc.contains("lora_alpha")) {
    if (!doc["lora_alpha"].is_number()) throw fail("lora_alpha", "must be a number");
    c.alpha = doc["lora_alpha"].get<double>();
  } else {
    c.alpha = 8.0;  // PEFT's default
  }
  if (doc.contains("lora_dropout") && doc["lora_dropout"].is_number()) c.dropout = doc["lora_dropout"].get<double>();
  if (doc.contains("use_rslora") && doc["use_rslora"].is_boolean()) c.use_rslora = doc["use_rslora"].get<bool>();
  if (doc.value("bias", std::string("none")) != "none") throw fail("bias", "only \"none\" is supported");
  if (doc.contains("use_dora") && doc["use_dora"].is_boolean() && doc["use_dora"].get<bool>())
    throw fail("use_dora", "DoRA is not supported");
  if (doc.contains("fan_in_fan_out") && doc["fan_in_fan_out"].is_boolean() && doc["fan_in_fan_out"].get<bool>())
    throw fail("fan_in_fan_out", "must be false for Qwen2");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (doc.contains(key) && doc[key].is_object() && !doc[key].empty())
      throw fail(key, "per-module patterns are not supported");
  if (doc.contains("modules_to_save") && !doc["modules_to_save"].is_null() && !doc["modules_to_save"].empty())
    throw fail("modules_to_save", "is not supported");
  if (!doc.contains("target_modules")) throw fail("target_modules", "is required");
  std::vector<std::string> names;
  if (doc["target_modules"].is_string()) {
    names.push_back(doc["target_modules"].get<std::string>());
  } else if (doc["target_modules"].is_array()) {
    for (const auto& n : doc["target_modules"]) {
      if (!n.is_string()) throw fail("target_modules", "must hold module names");
      names.push_back(n.get<std::string>());
    }
  } else {
    throw fail("target_modules", "must be a list of module names");
  }
  set_lora_targets(c, names);
  return c;
}

LoraConfig load_lora_adapter_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "adapter_config.json").string();
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("{}: cannot open file", path));
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) throw Error(fmt::format("{}: invalid JSON", path));
  return parse_lora_adapter_config(doc, path);
}

}  // namespace memtune

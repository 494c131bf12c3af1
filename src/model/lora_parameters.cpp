// LoRA adapters as parameters: initialization, PEFT adapter files in and out, adapter sets,
// and merging into the base weights (see parameters.h).
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

void ModelParameters::init_lora(uint64_t seed) {
  MT_ASSERT(options_.lora.enabled());
  std::vector<float> values;
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const ParamSpec& s = trainables_[i].spec;
    if (!s.name.ends_with(".lora_A.weight") && !s.name.ends_with(".lora_B.weight")) continue;
    values.assign(static_cast<size_t>(s.numel()), 0.0f);
    if (s.name.ends_with(".lora_A.weight")) {
      // PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in] -> bound = 1/sqrt(in)
      const double bound = 1.0 / std::sqrt(static_cast<double>(s.shape[1]));
      Rng rng(seed, s.name);
      for (float& v : values) v = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
    }
    upload_f32(*backend_, trainable_value(i), values);
  }
}

namespace {

// Reads the adapter file of a PEFT directory: every tensor `specs` names, checked against its
// shape, converted to float32 and handed to store(i, values); the file must hold exactly these.
template <class Store>
void read_adapter_file(const std::string& dir, const std::vector<const ParamSpec*>& specs, Store store) {
  const std::string path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  const SafetensorsFile file(path);
  std::vector<float> values;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = *specs[i];
    const TensorInfo* t = file.find(s.name);
    if (!t) throw Error(fmt::format("{}: adapter tensor \"{}\" is missing", path, s.name));
    if (t->shape != s.shape)
      throw Error(fmt::format("{}: tensor \"{}\" has shape {}, the adapter config needs {}", path, s.name,
                              shape_string(t->shape), shape_string(s.shape)));
    const auto bytes = file.data(*t);
    std::vector<std::byte> aligned(bytes.begin(), bytes.end());  // the mapping may be unaligned
    values.resize(static_cast<size_t>(s.numel()));
    convert_to_f32(aligned.data(), t->dtype, values.data(), values.size());
    store(i, values);
  }
  if (file.tensors().size() != specs.size())
    throw Error(fmt::format("{}: holds {} tensors, the adapter config describes {}", path, file.tensors().size(),
                            specs.size()));
}

}  // namespace

void ModelParameters::load_adapter(const std::string& dir) {
  MT_ASSERT(options_.lora.enabled());
  std::vector<const ParamSpec*> specs;
  std::vector<size_t> index;
  for (size_t i = 0; i < trainables_.size(); ++i)
    if (trainables_[i].spec.name.starts_with("base_model.")) {
      specs.push_back(&trainables_[i].spec);
      index.push_back(i);
    }
  read_adapter_file(dir, specs, [&](size_t i, const std::vector<float>& values) {
    upload_f32(*backend_, trainable_value(index[i]), values);
  });
}

Tensor ModelParameters::adapter_a(size_t k, int64_t l, LinearSite s) const {
  const AdapterSet& a = adapter_sets_.at(k);
  if (!a.targeted.at(static_cast<size_t>(l))[static_cast<size_t>(s)]) return {};
  const Linear lin = linear(l, s);
  return device().f32(a.ab[static_cast<size_t>(l)][static_cast<size_t>(s)].first,
                      {options_.adapter_sets[k].rank, lin.in});
}

Tensor ModelParameters::adapter_b(size_t k, int64_t l, LinearSite s) const {
  const AdapterSet& a = adapter_sets_.at(k);
  if (!a.targeted.at(static_cast<size_t>(l))[static_cast<size_t>(s)]) return {};
  const Linear lin = linear(l, s);
  return device().f32(a.ab[static_cast<size_t>(l)][static_cast<size_t>(s)].second,
                      {lin.out, options_.adapter_sets[k].rank});
}

std::pair<Tensor, Tensor> ModelParameters::adapter_expert(size_t k, int64_t l, int64_t e, LinearSite s) const {
  const AdapterSet& a = adapter_sets_.at(k);
  const LoraConfig& set = options_.adapter_sets.at(k);
  if (!set.targets[static_cast<size_t>(s)]) return {};
  const auto& experts = a.expert_ab.at(static_cast<size_t>(l));
  const size_t index = e < 0 ? experts.size() - 1 : static_cast<size_t>(e);
  const auto& [ida, idb] = experts.at(index)[static_cast<size_t>(s) - static_cast<size_t>(LinearSite::Gate)];
  const Linear lin = expert_linear(l, e, s);
  return {device().f32(ida, {set.rank, lin.in}), device().f32(idb, {lin.out, set.rank})};
}

void ModelParameters::load_adapter_set(size_t k, const std::string& dir) {
  const AdapterSet& a = adapter_sets_.at(k);
  std::vector<const ParamSpec*> specs;
  for (const ParamSpec& s : a.specs) specs.push_back(&s);
  read_adapter_file(dir, specs, [&](size_t i, const std::vector<float>& values) {
    upload_f32(*backend_, device().f32(a.ids[i], {a.specs[i].numel()}), values);
  });
}

void ModelParameters::save_adapter(const std::string& dir, const std::string& base_model_name_or_path) const {
  MT_ASSERT(options_.lora.enabled());
  std::filesystem::create_directories(dir);
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < trainables_.size(); ++i)
    tensors.push_back(
        device_tensor_to_write(*backend_, trainables_[i].spec.name, trainables_[i].spec.shape, trainable_value(i)));
  write_safetensors((std::filesystem::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomically((std::filesystem::path(dir) / "adapter_config.json").string(),
                        lora_adapter_config_json(options_.lora, base_model_name_or_path).dump(2) + "\n");
}

// Merging is a one-off host computation: W, A and B come to host memory, W += scaling B A is
// formed there in float64, and W goes back.
void ModelParameters::merge_lora() {
  MT_ASSERT(options_.lora.enabled());
  if (config_.quant.enabled())
    throw Error(
        "adapters cannot be merged into a quantized base; they are applied unmerged (leave out --merge_adapter)");
  const double scaling = options_.lora.scaling();
  const int64_t r = options_.lora.rank;
  ++values_version_;
  auto merge = [&](const Linear& lin) {
    if (lin.lora < 0) return;
    std::vector<float> w = download_f32(*backend_, param(lin.weight));
    const std::vector<float> a = download_f32(*backend_, trainable_value(lin.lora));
    const std::vector<float> b = download_f32(*backend_, trainable_value(lin.lora + 1));
    // W [out, in] += scaling * B [out, r] A [r, in]
    for (int64_t o = 0; o < lin.out; ++o)
      for (int64_t i = 0; i < lin.in; ++i) {
        double sum = 0.0;
        for (int64_t k = 0; k < r; ++k) sum += double(b[o * r + k]) * a[k * lin.in + i];
        w[o * lin.in + i] = static_cast<float>(w[o * lin.in + i] + scaling * sum);
      }
    upload_f32(*backend_, param(lin.weight), w);
  };
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    const LayerParams& p = layer(l);
    for (size_t s = 0; s < kNumLinearSites; ++s) {
      const LinearSite site = static_cast<LinearSite>(s);
      if (!p.moe || linear_site_block(site) != "mlp") {
        merge(linear(l, site));
        continue;
      }
      for (int64_t e = first_expert(); e < config_.moe.num_experts; ++e) merge(expert_linear(l, e, site));
    }
  }
  lora_merged_ = true;
}

}  // namespace memtune

// The model's parameters: specs, plan declarations, views, and their movement between files and
// the backend (see parameters.h).
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

TensorToWrite device_tensor_to_write(Backend& backend, const std::string& name, const std::vector<int64_t>& shape,
                                     const Tensor& tensor) {
  TensorToWrite t{name, tensor.dtype, shape, nullptr, {}};
  const Tensor flat = tensor.flat_range(0, tensor.numel());
  t.fetch = [&backend, flat](size_t offset, std::span<std::byte> out) {
    const size_t element = dtype_size(flat.dtype);
    MT_ASSERT(offset % element == 0 && out.size() % element == 0, "fetch of a partial element");
    backend.copy_to_host(out.data(), flat.flat_range(static_cast<int64_t>(offset / element),
                                                     static_cast<int64_t>(out.size() / element)));
  };
  return t;
}

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

int64_t model_parameter_count(const ModelConfig& config) {
  int64_t total = 0;
  for (const auto& s : model_parameter_specs(config)) total += s.numel();
  return total;
}

ModelParameters::ModelParameters(const ModelConfig& config, const ModelOptions& options, MemoryPlan& device_plan,
                                 MemoryPlan& host_plan)
    : config_(config), options_(options), specs_(model_parameter_specs(config)) {
  std::unordered_map<std::string, size_t> index;
  for (size_t k = 0; k < specs_.size(); ++k) index[specs_[k].name] = k;
  auto find = [&](const std::string& name) -> std::optional<size_t> {
    const auto it = index.find(name);
    return it == index.end() ? std::nullopt : std::optional(it->second);
  };
  auto at = [&](const std::string& name) { return find(name).value(); };
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    layer_params_.push_back({.ln1 = at(p + "input_layernorm.weight"),
                             .wq = at(p + "self_attn.q_proj.weight"),
                             .wk = at(p + "self_attn.k_proj.weight"),
                             .wv = at(p + "self_attn.v_proj.weight"),
                             .wo = at(p + "self_attn.o_proj.weight"),
                             .ln2 = at(p + "post_attention_layernorm.weight"),
                             .wg = at(p + "mlp.gate_proj.weight"),
                             .wu = at(p + "mlp.up_proj.weight"),
                             .wd = at(p + "mlp.down_proj.weight"),
                             .bq = find(p + "self_attn.q_proj.bias"),
                             .bk = find(p + "self_attn.k_proj.bias"),
                             .bv = find(p + "self_attn.v_proj.bias"),
                             .q_norm = find(p + "self_attn.q_norm.weight"),
                             .k_norm = find(p + "self_attn.k_norm.weight")});
  }
  final_norm_ = at("model.norm.weight");
  head_ = config.tie_word_embeddings ? embed_ : at("lm_head.weight");
  const QuantConfig& q = config.quant;
  for (const auto& s : specs_) {
    // A quantized model: every linear weight of the decoder layers is packed (io/quantized.h).
    if (q.enabled() && s.shape.size() == 2 && s.name.starts_with("model.layers.")) {
      const int64_t out = s.shape[0], in = s.shape[1], groups = q.groups(in);
      QuantIds ids{device_plan.declare_persistent(s.name + ".codes", Category::Weights, out * in * q.bits / 8),
                   device_plan.declare_persistent(s.name + ".scales", Category::Weights, out * groups * 2),
                   device_plan.declare_persistent(s.name + ".zeros", Category::Weights, out * groups * 2),
                   std::nullopt};
      if (q.desc_act) ids.g_idx = device_plan.declare_persistent(s.name + ".g_idx", Category::Weights, in * 4);
      quant_.push_back(ids);
      weight_ids_.push_back(BufferId{});
      continue;
    }
    quant_.push_back(std::nullopt);
    weight_ids_.push_back(
        device_plan.declare_persistent(s.name, Category::Weights, s.numel() * dtype_size(config.torch_dtype)));
  }
  declare_trainables(device_plan, host_plan);
}

void ModelParameters::bind(Arena* device, Arena* host, Backend& backend) {
  device_ = device;
  host_ = host;
  backend_ = &backend;
}

// Base parameters get gradients (and optimizer state) only when they are trained; with LoRA the
// adapters are the only trainable tensors and the base stays frozen in its storage dtype.
void ModelParameters::declare_trainables(MemoryPlan& device_plan, MemoryPlan& host_plan) {
  const DType dt = config_.torch_dtype;
  const bool optimizer = options_.with_optimizer;
  if (optimizer && !options_.with_grads) throw Error("an optimizer needs gradients (with_grads)");
  if (options_.optim_offload && !optimizer) throw Error("optim_offload needs an optimizer");
  if (options_.zero_stage < 0 || options_.zero_stage > 1)
    throw Error(fmt::format("zero_stage must be 0 or 1, got {}", options_.zero_stage));
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
    throw Error(fmt::format("rank {} of world size {}: impossible", options_.rank, options_.world_size));
  if (config_.quant.enabled() && base_trainable())
    throw Error(fmt::format(
        "a {}-bit {} model cannot be fine-tuned in full: train LoRA adapters on it (--tuner_type lora, QLoRA), or "
        "fine-tune the float model it was quantized from",
        config_.quant.bits, quant_method_name(config_.quant.method)));
  MemoryPlan& state_plan = options_.optim_offload ? host_plan : device_plan;
  // Optimizer state (moments, masters) covers this rank's shard of each tensor.
  auto shard_bytes = [&](const ParamSpec& spec) {
    return shard_of_tensor(static_cast<size_t>(spec.numel())).size() * 4;
  };
  auto add = [&](const ParamSpec& spec, BufferId value, std::optional<size_t> widen_into) {
    const size_t bytes = static_cast<size_t>(spec.numel()) * 4;
    Trainable t{spec, value, device_plan.declare_persistent("grad." + spec.name, Category::Gradients, bytes),
                {},   {},    widen_into};
    if (optimizer) {
      t.m = state_plan.declare_persistent("adam_m." + spec.name, Category::OptimizerState, shard_bytes(spec));
      t.v = state_plan.declare_persistent("adam_v." + spec.name, Category::OptimizerState, shard_bytes(spec));
    }
    trainables_.push_back(std::move(t));
  };
  if (base_trainable()) {
    for (size_t i = 0; i < specs_.size(); ++i) {
      const ParamSpec& s = specs_[i];
      if (optimizer && dt != DType::F32) {
        const BufferId master =
            state_plan.declare_persistent("master." + s.name, Category::TrainableParams, shard_bytes(s));
        add(s, master, i);
      } else {
        add(s, weight_ids_[i], std::nullopt);
      }
      grad_ids_.push_back(trainables_.back().grad);
    }
  }
  for (size_t k = 0; k < options_.adapter_sets.size(); ++k) {
    const LoraConfig& set = options_.adapter_sets[k];
    MT_ASSERT(!options_.lora.enabled() && !options_.with_grads, "adapter sets are for inference without lora");
    AdapterSet a;
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      a.ab.emplace_back();
      a.targeted.emplace_back();
      a.targeted.back().fill(false);
      for (size_t s = 0; s < kNumLinearSites; ++s) {
        if (!set.targets[s]) continue;
        const Linear lin = linear(l, static_cast<LinearSite>(s));
        BufferId ids[2];
        for (bool is_b : {false, true}) {
          ParamSpec spec{lora_tensor_name(l, static_cast<LinearSite>(s), is_b),
                         is_b ? std::vector<int64_t>{lin.out, set.rank} : std::vector<int64_t>{set.rank, lin.in}};
          ids[is_b] = device_plan.declare_persistent(fmt::format("adapter{}.{}", k, spec.name), Category::Weights,
                                                     spec.numel() * 4);
          a.specs.push_back(spec);
          a.ids.push_back(ids[is_b]);
        }
        a.ab.back()[s] = {ids[0], ids[1]};
        a.targeted.back()[s] = true;
      }
    }
    adapter_sets_.push_back(std::move(a));
  }
  const LoraConfig& lora = options_.lora;
  if (!lora.enabled()) return;
  const ModelConfig& c = config_;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::array<int, kNumLinearSites> index;
    index.fill(-1);
    for (size_t s = 0; s < kNumLinearSites; ++s) {
      if (!lora.targets[s]) continue;
      const Linear lin = linear(l, static_cast<LinearSite>(s));
      index[s] = static_cast<int>(trainables_.size());
      for (bool is_b : {false, true}) {
        ParamSpec spec{lora_tensor_name(l, static_cast<LinearSite>(s), is_b),
                       is_b ? std::vector<int64_t>{lin.out, lora.rank} : std::vector<int64_t>{lora.rank, lin.in}};
        const BufferId value = device_plan.declare_persistent(spec.name, Category::TrainableParams, spec.numel() * 4);
        if (options_.with_grads) {
          add(spec, value, std::nullopt);
        } else {
          trainables_.push_back({spec, value, {}, {}, {}, std::nullopt});  // inference: values only
        }
      }
    }
    lora_index_.push_back(index);
  }
}

ModelParameters::Linear ModelParameters::linear(int64_t l, LinearSite s) const {
  const LayerParams& p = layer_params_[l];
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  // While declare_trainables builds lora_index_, later layers have no entry yet.
  const int lora = !lora_merged_ && static_cast<size_t>(l) < lora_index_.size() ? lora_index_[l][static_cast<size_t>(s)]
                                                                                 : -1;
  switch (s) {
    case LinearSite::Q:
      return {p.wq, p.bq, D, qd, lora};
    case LinearSite::K:
      return {p.wk, p.bk, D, kvd, lora};
    case LinearSite::V:
      return {p.wv, p.bv, D, kvd, lora};
    case LinearSite::O:
      return {p.wo, std::nullopt, qd, D, lora};
    case LinearSite::Gate:
      return {p.wg, std::nullopt, D, I, lora};
    case LinearSite::Up:
      return {p.wu, std::nullopt, D, I, lora};
    case LinearSite::Down:
      return {p.wd, std::nullopt, I, D, lora};
    case LinearSite::kCount:
      break;
  }
  MT_ASSERT(false, "bad linear site");
  return {};
}

QuantizedWeight ModelParameters::quantized_param(size_t i) const {
  const QuantIds& ids = quant_.at(i).value();
  const QuantConfig& q = config_.quant;
  const int64_t out = specs_[i].shape[0], in = specs_[i].shape[1], groups = q.groups(in);
  Arena& a = device();
  QuantizedWeight w;
  w.codes = Tensor(a.raw(ids.codes), DType::I32, {out, in * q.bits / 32});
  w.scales = Tensor(a.raw(ids.scales), DType::F16, {out, groups});
  w.zeros = Tensor(a.raw(ids.zeros), DType::F16, {out, groups});
  if (ids.g_idx) w.g_idx = Tensor(a.raw(*ids.g_idx), DType::I32, {in});
  w.bits = q.bits;
  w.in = in;
  w.out = out;
  w.group_size = q.group_size_for(in);
  w.groups = groups;
  return w;
}

namespace {

template <class T>
std::vector<T> download(Backend& backend, const Tensor& t) {
  std::vector<T> values(static_cast<size_t>(t.bytes() / sizeof(T)));
  backend.copy_to_host(values.data(), t);
  return values;
}

}  // namespace

std::vector<float> ModelParameters::dequantized(size_t i) const {
  const QuantizedWeight w = quantized_param(i);
  QuantizedLayer layer{w.bits, w.in, w.out, w.group_size, w.groups, download<int32_t>(*backend_, w.codes),
                       download<uint16_t>(*backend_, w.scales), download<uint16_t>(*backend_, w.zeros), {}};
  if (w.g_idx) layer.g_idx = download<int32_t>(*backend_, w.g_idx);
  return dequantize_layer(layer);
}

Tensor ModelParameters::param(size_t i) const {
  MT_ASSERT(!quantized(i), "a quantized weight has no plain view (quantized_param)");
  const ParamSpec& p = specs_.at(i);
  void* data = device().raw(weight_ids_.at(i));
  if (p.shape.size() == 1) return Tensor(data, config_.torch_dtype, {p.shape[0]});
  return Tensor(data, config_.torch_dtype, {p.shape[0], p.shape[1]});
}

Tensor ModelParameters::grad(size_t i) const {
  MT_ASSERT(base_trainable(), "base parameters are not trainable in this model");
  const ParamSpec& p = specs_.at(i);
  void* data = device().raw(grad_ids_.at(i));
  if (p.shape.size() == 1) return Tensor(data, DType::F32, {p.shape[0]});
  return Tensor(data, DType::F32, {p.shape[0], p.shape[1]});
}

Tensor ModelParameters::trainable_value(size_t i) const {
  // A master is optimizer state (a shard with ZeRO-1); any other value is the parameter itself.
  const Trainable& t = trainables_.at(i);
  if (t.widen_into) return state_arena().f32(t.value, {static_cast<int64_t>(optimizer_shard(i).size())});
  return device().f32(t.value, {t.spec.numel()});
}
Tensor ModelParameters::trainable_grad(size_t i) const {
  return device().f32(trainables_.at(i).grad, {trainables_.at(i).spec.numel()});
}
Shard ModelParameters::shard_of_tensor(size_t n) const {
  return options_.shards_optimizer() ? shard_of(n, options_.rank, options_.world_size) : Shard{0, n};
}

Shard ModelParameters::optimizer_shard(size_t i) const {
  return shard_of_tensor(static_cast<size_t>(trainables_.at(i).spec.numel()));
}

Tensor ModelParameters::shard_value(size_t i) const {
  // A master covers the shard only; any other value is the whole tensor.
  const Shard s = optimizer_shard(i);
  if (trainables_.at(i).widen_into) return trainable_value(i);
  return trainable_value(i).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size()));
}
Tensor ModelParameters::shard_grad(size_t i) const {
  const Shard s = optimizer_shard(i);
  return trainable_grad(i).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size()));
}

Tensor ModelParameters::trainable_storage(size_t i) const {
  const Trainable& t = trainables_.at(i);
  const Tensor storage = t.widen_into ? param(*t.widen_into) : device().f32(t.value, {t.spec.numel()});
  return storage.flat_range(0, storage.numel());
}

Tensor ModelParameters::adam_m(size_t i) const {
  return state_arena().f32(trainables_.at(i).m, {static_cast<int64_t>(optimizer_shard(i).size())});
}
Tensor ModelParameters::adam_v(size_t i) const {
  return state_arena().f32(trainables_.at(i).v, {static_cast<int64_t>(optimizer_shard(i).size())});
}

void ModelParameters::store_trainable(size_t i) {
  const Trainable& t = trainables_.at(i);
  if (!t.widen_into) return;
  const Shard s = optimizer_shard(i);
  backend_->convert(param(*t.widen_into).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size())),
                    trainable_value(i));
}

void ModelParameters::load_masters() {
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const Trainable& t = trainables_[i];
    if (!t.widen_into) continue;
    const Shard s = optimizer_shard(i);
    backend_->convert(trainable_value(i),
                      param(*t.widen_into).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size())));
  }
}

void ModelParameters::zero_grads() {
  if (!options_.with_grads) return;
  for (size_t i = 0; i < trainables_.size(); ++i) backend_->fill(trainable_grad(i), 0.0f);
}

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
    throw Error(
        fmt::format("{}: holds {} tensors, the adapter config describes {}", path, file.tensors().size(), specs.size()));
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
    throw Error("adapters cannot be merged into a quantized base; they are applied unmerged (leave out --merge_adapter)");
  const double scaling = options_.lora.scaling();
  const int64_t r = options_.lora.rank;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    for (size_t s = 0; s < kNumLinearSites; ++s) {
      const Linear lin = linear(l, static_cast<LinearSite>(s));
      if (lin.lora < 0) continue;
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
    }
  lora_merged_ = true;
}

void ModelParameters::init_random(uint64_t seed) {
  if (config_.quant.enabled()) throw Error("a quantized model is made by memtune quantize, not initialized at random");
  std::vector<float> values;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& s = specs_[i];
    values.assign(static_cast<size_t>(s.numel()), 0.0f);
    if (s.name.ends_with("norm.weight")) {
      std::fill(values.begin(), values.end(), 1.0f);
    } else if (s.name.ends_with(".weight")) {
      Rng rng(seed, s.name);
      for (float& v : values) v = static_cast<float>(0.02 * rng.normal());
    }
    upload_f32(*backend_, param(i), values);
  }
}

void ModelParameters::load(const CheckpointReader& checkpoint) {
  std::set<std::string> expected;
  std::vector<std::byte> staging;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& s = specs_[i];
    if (quantized(i)) {
      load_quantized(checkpoint, i, expected);
      continue;
    }
    expected.insert(s.name);
    if (!checkpoint.contains(s.name))
      throw Error(fmt::format("checkpoint is missing tensor \"{}\" required by the config", s.name));
    // Through host staging in bounded slices: the file's bytes, converted, then copied over.
    const Tensor dst = param(i);
    const int64_t n = dst.numel();
    const int64_t slice = std::max<int64_t>(1, static_cast<int64_t>(kTransferBytes / dtype_size(dst.dtype)));
    staging.resize(static_cast<size_t>(std::min(n, slice)) * dtype_size(dst.dtype));
    for (int64_t begin = 0; begin < n; begin += slice) {
      const int64_t count = std::min(slice, n - begin);
      checkpoint.read_into(s.name, s.shape, staging.data(), dst.dtype, static_cast<size_t>(begin),
                           static_cast<size_t>(count));
      backend_->copy_to_device(dst.flat_range(begin, count), staging.data());
    }
  }
  for (const auto& name : checkpoint.tensor_names()) {
    if (expected.contains(name)) continue;
    // A tied checkpoint may still carry lm_head.weight (transformers ignores it); old ones carry
    // RoPE's inv_freq buffer. Anything else means the checkpoint does not match the config.
    if (name.ends_with("rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && config_.tie_word_embeddings) continue;
    throw Error(fmt::format("checkpoint tensor \"{}\" (in {}) is not a parameter of this {} config", name,
                            checkpoint.file_of(name).path(), model_family_name(config_.family)));
  }
}

// A packed layer X.weight is read from X.qweight, X.qzeros, X.scales (and GPTQ's X.g_idx), converted
// into memtune's layout on the host, one layer at a time, and copied over.
void ModelParameters::load_quantized(const CheckpointReader& checkpoint, size_t i, std::set<std::string>& expected) {
  const ParamSpec& s = specs_[i];
  const std::string base = s.name.substr(0, s.name.size() - std::string_view(".weight").size());
  const QuantConfig& q = config_.quant;
  const int64_t out = s.shape[0], in = s.shape[1], groups = q.groups(in), per_word = 32 / q.bits;
  auto read = [&]<class T>(const std::string& suffix, std::vector<int64_t> shape, DType dtype, std::vector<T>& dst) {
    const std::string name = base + suffix;
    expected.insert(name);
    if (!checkpoint.contains(name))
      throw Error(fmt::format("checkpoint is missing tensor \"{}\" of the {}-bit {} layer {}", name, q.bits,
                              quant_method_name(q.method), base));
    if (checkpoint.info(name).dtype != dtype)
      throw Error(fmt::format("checkpoint tensor \"{}\" (in {}) is {}, expected {}", name, checkpoint.file_of(name).path(),
                              dtype_safetensors_name(checkpoint.info(name).dtype), dtype_safetensors_name(dtype)));
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    dst.resize(static_cast<size_t>(n));
    checkpoint.read_into(name, shape, dst.data(), dtype);
  };
  std::vector<int32_t> qweight, qzeros, g_idx;
  std::vector<uint16_t> scales;
  QuantizedLayer layer;
  try {
    read(".scales", {groups, out}, DType::F16, scales);
    if (q.method == QuantMethod::Gptq) {
      read(".qweight", {in / per_word, out}, DType::I32, qweight);
      read(".qzeros", {groups, out / per_word}, DType::I32, qzeros);
      if (checkpoint.contains(base + ".g_idx") || q.desc_act) read(".g_idx", {in}, DType::I32, g_idx);
      layer = gptq_to_layer({qweight, qzeros, g_idx, scales}, q.bits, in, out, groups, q.group_size);
    } else {
      read(".qweight", {in, out / 8}, DType::I32, qweight);
      read(".qzeros", {groups, out / 8}, DType::I32, qzeros);
      layer = awq_to_layer({qweight, qzeros, scales}, in, out, q.group_size);
    }
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", base, e.what()));
  }
  const QuantizedWeight w = quantized_param(i);
  backend_->copy_to_device(w.codes, layer.codes.data());
  backend_->copy_to_device(w.scales, layer.scales.data());
  backend_->copy_to_device(w.zeros, layer.zeros.data());
  if (w.g_idx) {
    // Act-order files keep their g_idx even where it is the plain k / group_size.
    if (layer.g_idx.empty())
      for (int64_t k = 0; k < in; ++k) layer.g_idx.push_back(static_cast<int32_t>(k / w.group_size));
    backend_->copy_to_device(w.g_idx, layer.g_idx.data());
  } else if (!layer.g_idx.empty()) {
    throw Error(fmt::format("{}.g_idx reorders the inputs (act-order) but quantization_config says desc_act false",
                            base));
  }
}

void ModelParameters::restore(const std::string& dir) {
  if (options_.lora.enabled())
    load_adapter(dir);
  else
    load(CheckpointReader(dir));
}

void ModelParameters::save(const std::string& dir) const {
  if (config_.quant.enabled())
    throw Error(dir + ": a quantized base is not written back; memtune quantize writes quantized models");
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < specs_.size(); ++i)
    tensors.push_back(device_tensor_to_write(*backend_, specs_[i].name, specs_[i].shape, param(i)));
  write_checkpoint(dir, tensors);
  write_file_atomically((std::filesystem::path(dir) / "config.json").string(),
                        config_to_json(config_).dump(2) + "\n");
}

}  // namespace memtune

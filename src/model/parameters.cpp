// The model's parameters in the plan: their declarations (weights, gradients, float32 masters,
// AdamW state, ZeRO-1 shards) and the views over them (see parameters.h).
#include "backend/registry.h"
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

void check_mixture_of_experts(const ModelConfig& config, const ModelOptions& options) {
  if (!config.moe.enabled()) return;
  const std::string model = fmt::format("{} ({})", family_traits(config.family).architecture,
                                        model_family_name(config.family));
  const Backend& backend = options.backend ? *options.backend : default_backend();
  if (!backend.computes_mixture_of_experts())
    throw Error(fmt::format("{}: --backend {} has no mixture-of-experts layers yet; use --backend cpu", model,
                            backend.name()));
  if ((options.with_grads || options.with_optimizer) && !backend.trains_mixture_of_experts())
    throw Error(fmt::format("{}: --backend {} does not train mixture-of-experts layers yet (it runs their forward "
                            "pass: eval, dump, generate); use --backend cpu",
                            model, backend.name()));
}

ModelParameters::ModelParameters(const ModelConfig& config, const ModelOptions& options, MemoryPlan& device_plan,
                                 MemoryPlan& host_plan)
    : config_(config), options_(options), specs_(model_parameter_specs(config)) {
  check_mixture_of_experts(config, options);
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
                             .wg = find(p + "mlp.gate_proj.weight").value_or(kNone),
                             .wu = find(p + "mlp.up_proj.weight").value_or(kNone),
                             .wd = find(p + "mlp.down_proj.weight").value_or(kNone),
                             .bq = find(p + "self_attn.q_proj.bias"),
                             .bk = find(p + "self_attn.k_proj.bias"),
                             .bv = find(p + "self_attn.v_proj.bias"),
                             .q_norm = find(p + "self_attn.q_norm.weight"),
                             .k_norm = find(p + "self_attn.k_norm.weight"),
                             .moe = std::nullopt});
    if (config.moe.sparse(l)) {
      MoeParams m{.router = at(p + "mlp.gate.weight"), .experts = {}, .shared = std::nullopt, .shared_gate = std::nullopt};
      auto expert = [&](const std::string& x) {
        return ExpertParams{at(x + "gate_proj.weight"), at(x + "up_proj.weight"), at(x + "down_proj.weight")};
      };
      for (int64_t e = 0; e < config.moe.num_experts; ++e) m.experts.push_back(expert(fmt::format("{}mlp.experts.{}.", p, e)));
      if (config.moe.shared_expert_intermediate_size > 0) {
        m.shared = expert(p + "mlp.shared_expert.");
        m.shared_gate = at(p + "mlp.shared_expert_gate.weight");
      }
      layer_params_.back().moe = std::move(m);
    }
  }
  final_norm_ = at("model.norm.weight");
  head_ = config.tie_word_embeddings ? embed_ : at("lm_head.weight");
  const QuantConfig& q = config.quant;
  auto in_a_layer = [](const ParamSpec& s) { return s.name.starts_with("model.layers."); };
  for (const auto& s : specs_) {
    // A quantized model: every linear weight of the decoder layers is packed (io/quantized.h),
    // and the LM head with quant.lm_head_bits (round-to-nearest: never act-order).
    if (const int bits = packed_bits(config, s)) {
      const int64_t out = s.shape[0], in = s.shape[1], groups = q.groups(in);
      QuantIds ids{device_plan.declare_persistent(s.name + ".codes", Category::Weights, out * in * bits / 8),
                   device_plan.declare_persistent(s.name + ".scales", Category::Weights, out * groups * 2),
                   device_plan.declare_persistent(s.name + ".zeros", Category::Weights, out * groups * 2),
                   std::nullopt, bits};
      if (q.desc_act && in_a_layer(s)) ids.g_idx = device_plan.declare_persistent(s.name + ".g_idx", Category::Weights, in * 4);
      quant_.push_back(ids);
      weight_ids_.push_back(BufferId{});
      continue;
    }
    quant_.push_back(std::nullopt);
    weight_ids_.push_back(
        device_plan.declare_persistent(s.name, Category::Weights, s.numel() * dtype_size(config.torch_dtype)));
  }
  const Backend& backend = options_.backend ? *options_.backend : default_backend();
  // The optimizer runs where the backend computes; a device's shaders cannot reach host memory.
  if (options_.optim_offload && !backend.host_addressable())
    throw Error(fmt::format(
        "--optim_offload keeps AdamW's state and the float32 masters in host memory, which --backend {} cannot "
        "update (its optimizer runs on the device): leave it out, and fit with --gradient_checkpointing, LoRA or "
        "--zero_stage 1 over several ranks (memtune plan --fit lists what fits)",
        backend.name()));
  declare_trainables(device_plan, host_plan);
  // Data parallel on a backend whose memory the host cannot address: MPI reads host memory, so a
  // collective runs on a host copy of one tensor at a time, as large as the largest trainable.
  if (options_.world_size > 1 && options_.with_grads && !backend.host_addressable() &&
      !backend.memory_in_host_pages()) {
    size_t largest = 0;
    for (const Trainable& t : trainables_) largest = std::max(largest, static_cast<size_t>(t.spec.numel()) * 4);
    collective_staging_ = host_plan.declare_persistent("collective.staging", Category::Gradients, largest);
  }
}

std::byte* ModelParameters::collective_staging() const {
  if (!collective_staging_) return nullptr;
  MT_ASSERT(host_, "this model was built plan-only (allocate = false)");
  return static_cast<std::byte*>(host_->raw(*collective_staging_));
}

void ModelParameters::bind(Arena* device, Arena* host, Backend& backend) {
  device_ = device;
  host_ = host;
  backend_ = &backend;
  // The gradients' views, made once here: zeroing them every step allocates nothing.
  grad_views_.clear();
  if (options_.with_grads && device_)
    for (size_t i = 0; i < trainables_.size(); ++i) grad_views_.push_back(trainable_grad(i));
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
      a.expert_ab.emplace_back();
      auto declare = [&](const std::string& name_a, const std::string& name_b, int64_t in, int64_t out) {
        BufferId ids[2];
        for (bool is_b : {false, true}) {
          ParamSpec spec{is_b ? name_b : name_a,
                         is_b ? std::vector<int64_t>{out, set.rank} : std::vector<int64_t>{set.rank, in}};
          ids[is_b] = device_plan.declare_persistent(fmt::format("adapter{}.{}", k, spec.name), Category::Weights,
                                                     spec.numel() * 4);
          a.specs.push_back(spec);
          a.ids.push_back(ids[is_b]);
        }
        return std::pair(ids[0], ids[1]);
      };
      const MoeParams* moe = layer_params_[static_cast<size_t>(l)].moe ? &*layer_params_[static_cast<size_t>(l)].moe
                                                                      : nullptr;
      if (moe) a.expert_ab.back().resize(moe->experts.size() + (moe->shared ? 1 : 0));
      for (size_t s = 0; s < kNumLinearSites; ++s) {
        if (!set.targets[s]) continue;
        const LinearSite site = static_cast<LinearSite>(s);
        if (moe && linear_site_block(site) == "mlp") {  // every expert's projection (as the trained adapter)
          const size_t j = s - static_cast<size_t>(LinearSite::Gate);
          for (size_t e = 0; e < a.expert_ab.back().size(); ++e) {
            const int64_t expert = e < moe->experts.size() ? static_cast<int64_t>(e) : -1;
            const Linear lin = expert_linear(l, expert, site);
            a.expert_ab.back()[e][j] = declare(lora_expert_tensor_name(l, expert, site, false),
                                               lora_expert_tensor_name(l, expert, site, true), lin.in, lin.out);
          }
          continue;
        }
        const Linear lin = linear(l, site);
        a.ab.back()[s] = declare(lora_tensor_name(l, site, false), lora_tensor_name(l, site, true), lin.in, lin.out);
        a.targeted.back()[s] = true;
      }
    }
    adapter_sets_.push_back(std::move(a));
  }
  const LoraConfig& lora = options_.lora;
  if (!lora.enabled()) return;
  const ModelConfig& c = config_;
  // One adapter (A [r, in], B [out, r]); returns the index of its A among the trainables.
  auto declare_adapter = [&](const std::string& name_a, const std::string& name_b, int64_t in, int64_t out) {
    const int index = static_cast<int>(trainables_.size());
    for (bool is_b : {false, true}) {
      ParamSpec spec{is_b ? name_b : name_a,
                     is_b ? std::vector<int64_t>{out, lora.rank} : std::vector<int64_t>{lora.rank, in}};
      const BufferId value = device_plan.declare_persistent(spec.name, Category::TrainableParams, spec.numel() * 4);
      if (options_.with_grads) {
        add(spec, value, std::nullopt);
      } else {
        trainables_.push_back({spec, value, {}, {}, {}, std::nullopt});  // inference: values only
      }
    }
    return index;
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::array<int, kNumLinearSites> index;
    index.fill(-1);
    LayerParams& p = layer_params_[static_cast<size_t>(l)];
    for (size_t s = 0; s < kNumLinearSites; ++s) {
      const LinearSite site = static_cast<LinearSite>(s);
      if (!lora.targets[s]) continue;
      if (p.moe && linear_site_block(site) == "mlp") {
        // A sparse layer's MLP sites are its experts' (PEFT matches gate_proj, up_proj and
        // down_proj inside mlp.experts.E and mlp.shared_expert alike).
        const size_t k = s - static_cast<size_t>(LinearSite::Gate);
        for (int64_t e = first_expert(); e < c.moe.num_experts; ++e) {
          const Linear lin = expert_linear(l, e, site);
          (e < 0 ? *p.moe->shared : p.moe->experts[static_cast<size_t>(e)]).lora[k] =
              declare_adapter(lora_expert_tensor_name(l, e, site, false), lora_expert_tensor_name(l, e, site, true),
                              lin.in, lin.out);
        }
        continue;
      }
      const Linear lin = linear(l, site);
      index[s] = declare_adapter(lora_tensor_name(l, site, false), lora_tensor_name(l, site, true), lin.in, lin.out);
    }
    lora_index_.push_back(index);
  }
}

ModelParameters::Linear ModelParameters::expert_linear(int64_t l, int64_t e, LinearSite s) const {
  const MoeParams& moe = layer(l).moe.value();
  const ExpertParams& w = e < 0 ? moe.shared.value() : moe.experts.at(static_cast<size_t>(e));
  const int64_t D = config_.hidden_size;
  const int64_t width = e < 0 ? config_.moe.shared_expert_intermediate_size : config_.moe.expert_intermediate_size;
  const size_t k = static_cast<size_t>(s) - static_cast<size_t>(LinearSite::Gate);
  MT_ASSERT(k < 3, "an expert has gate, up and down projections");
  const int lora = lora_merged_ ? -1 : w.lora[k];
  if (s == LinearSite::Down) return {w.down, std::nullopt, width, D, lora};
  return {s == LinearSite::Gate ? w.gate : w.up, std::nullopt, D, width, lora};
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
  w.codes = Tensor(a.raw(ids.codes), DType::I32, {out, in * ids.bits / 32});
  w.scales = Tensor(a.raw(ids.scales), DType::F16, {out, groups});
  w.zeros = Tensor(a.raw(ids.zeros), DType::F16, {out, groups});
  if (ids.g_idx) w.g_idx = Tensor(a.raw(*ids.g_idx), DType::I32, {in});
  w.bits = ids.bits;
  w.in = in;
  w.out = out;
  w.group_size = q.group_size_for(in);
  w.groups = groups;
  w.int8_activations = options_.int8_activations && !options_.with_grads && backend().takes_int8_activations();
  w.int8_decode = w.int8_activations && backend().takes_int8_decode_activations();
  w.bf16_products =
      options_.bf16_quantized_products && !options_.with_grads && !backend().bf16_quantized_products().empty();
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

Tensor ModelParameters::master_storage(size_t i) const {
  const Trainable& t = trainables_.at(i);
  if (!t.widen_into) return {};
  const Shard s = optimizer_shard(i);
  return param(*t.widen_into).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size()));
}

void ModelParameters::load_masters() {
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const Trainable& t = trainables_[i];
    if (t.widen_into) backend_->convert(trainable_value(i), master_storage(i));
  }
}

void ModelParameters::zero_grads() {
  if (!options_.with_grads) return;
  backend_->fill_group(grad_views_, 0.0f);
}

}  // namespace memtune

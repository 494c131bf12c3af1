#include "model/qwen2.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/labels.h"
#include "core/rng.h"
#include "io/checkpoint.h"
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

std::vector<ParamSpec> qwen2_parameter_specs(const Qwen2Config& c) {
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<ParamSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, D}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    specs.push_back({p + "input_layernorm.weight", {D}});
    specs.push_back({p + "self_attn.q_proj.weight", {qd, D}});
    specs.push_back({p + "self_attn.q_proj.bias", {qd}});
    specs.push_back({p + "self_attn.k_proj.weight", {kvd, D}});
    specs.push_back({p + "self_attn.k_proj.bias", {kvd}});
    specs.push_back({p + "self_attn.v_proj.weight", {kvd, D}});
    specs.push_back({p + "self_attn.v_proj.bias", {kvd}});
    specs.push_back({p + "self_attn.o_proj.weight", {D, qd}});
    specs.push_back({p + "post_attention_layernorm.weight", {D}});
    specs.push_back({p + "mlp.gate_proj.weight", {I, D}});
    specs.push_back({p + "mlp.up_proj.weight", {I, D}});
    specs.push_back({p + "mlp.down_proj.weight", {D, I}});
  }
  specs.push_back({"model.norm.weight", {D}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, D}});
  return specs;
}

int64_t qwen2_parameter_count(const Qwen2Config& config) {
  int64_t total = 0;
  for (const auto& s : qwen2_parameter_specs(config)) total += s.numel();
  return total;
}

Qwen2Model::Qwen2Model(const Qwen2Config& config, const ModelOptions& options)
    : config_(config),
      options_(options),
      specs_(qwen2_parameter_specs(config)),
      backend_(options.backend ? options.backend : &default_backend()) {
  if (options.max_tokens <= 0) throw Error(fmt::format("max_tokens must be positive, got {}", options.max_tokens));
  size_t i = 1;  // specs_[0] is the embedding
  for (int64_t l = 0; l < config.num_hidden_layers; ++l, i += 12)
    layer_params_.push_back({i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7, i + 8, i + 9, i + 10, i + 11});
  final_norm_ = i;
  head_ = config.tie_word_embeddings ? embed_ : i + 1;
  declare_buffers();
  batch_positions_.reserve(static_cast<size_t>(options.max_tokens));
  batch_targets_.reserve(static_cast<size_t>(options.max_tokens));
  if (options.allocate) {
    arena_ = std::make_unique<Arena>(*plan_, backend_);
    if (host_plan_->peak_bytes() > 0) host_arena_ = std::make_unique<Arena>(*host_plan_, nullptr);
  }
}

Qwen2Model::LayerActs Qwen2Model::declare_layer_acts(const std::string& prefix, Category cat, Phase first, Phase last) {
  const size_t N = static_cast<size_t>(options_.max_tokens);
  const size_t D = config_.hidden_size, I = config_.intermediate_size, qd = config_.q_dim(), kvd = config_.kv_dim();
  const size_t Hq = config_.num_attention_heads;
  auto f32 = [&](const char* name, size_t elems) { return plan_->declare(prefix + name, cat, elems * 4, first, last); };
  LayerActs acts{f32("ln1", N * D),  f32("rstd1", N),    f32("q", N * qd),   f32("k", N * kvd), f32("v", N * kvd),
                 f32("att", N * qd), f32("lse", N * Hq), f32("res1", N * D), f32("ln2", N * D), f32("rstd2", N),
                 f32("gate", N * I), f32("up", N * I),   f32("h", N * I)};
  const LoraConfig& lora = options_.lora;
  for (size_t s = 0; s < kNumLinearSites; ++s)
    if (lora.enabled() && lora.targets[s])
      acts.lora_u[s] = plan_->declare(prefix + std::string(linear_site_name(static_cast<LinearSite>(s))) + ".lora_u",
                                      cat, N * static_cast<size_t>(lora.rank) * 4, first, last);
  return acts;
}

// Lifetimes, chosen so they nest (see MemoryPlan):
//   persistent   weights, gradients, batch, residual stream x_0..x_L (saved for backward)
//   forward      checkpointing: one layer's activations; weight conversion scratch
//   loss..bwd    rstd of the final norm, d(normed hidden)
//   loss         normed hidden, logits chunk, gathered rows, head weight conversion
//   backward     activation gradients; checkpointing: one recomputed layer; weight conversion
void Qwen2Model::declare_buffers() {
  plan_ = std::make_unique<MemoryPlan>();
  host_plan_ = std::make_unique<MemoryPlan>();
  const Qwen2Config& c = config_;
  const size_t N = static_cast<size_t>(options_.max_tokens);
  const size_t D = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, qd = c.q_dim(), kvd = c.kv_dim();
  const DType dt = c.torch_dtype;

  for (const auto& s : specs_)
    weight_ids_.push_back(plan_->declare_persistent(s.name, Category::Weights, s.numel() * dtype_size(dt)));
  declare_trainables();

  ids_ = plan_->declare_persistent("batch.input_ids", Category::Batch, N * 4);
  positions_ = plan_->declare_persistent("batch.positions", Category::Batch, N * 4);
  targets_ = plan_->declare_persistent("batch.targets", Category::Batch, N * 4);
  cu_seqlens_ = plan_->declare_persistent("batch.cu_seqlens", Category::Batch, (N + 1) * 4);

  const Phase F = Phase::Forward, L = Phase::Loss, B = Phase::Backward;
  // Without gradients nothing needs to survive the forward pass except what the loss reads.
  const Phase keep_until = options_.with_grads ? B : L;
  for (int64_t l = 0; l <= c.num_hidden_layers; ++l)
    residual_.push_back(
        plan_->declare(fmt::format("act.x{}", l), Category::SavedActivations, N * D * 4, F, keep_until));
  if (options_.gradient_checkpointing || !options_.with_grads) {
    fwd_scratch_ = declare_layer_acts("fwd.layer.", Category::Working, F, F);
  } else {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      saved_.push_back(declare_layer_acts(fmt::format("act.layer{}.", l), Category::SavedActivations, F, B));
  }

  // 16-bit storage: weights are widened right before use into per-phase scratch.
  size_t largest_matrix = 0, largest_vector = 0;
  for (const auto& s : specs_) {
    if (s.shape.size() == 1)
      largest_vector = std::max<size_t>(largest_vector, s.numel());
    else if (s.name.starts_with("model.layers."))
      largest_matrix = std::max<size_t>(largest_matrix, s.numel());
  }
  const bool widen = dt != DType::F32;
  auto declare_widening = [&](Phase ph, size_t matrix_elems) {
    const std::string p{phase_name(ph)};
    matrix_f32_[static_cast<size_t>(ph)] =
        plan_->declare(p + ".matrix_f32", Category::Working, matrix_elems * 4, ph, ph);
    vector_f32_[static_cast<size_t>(ph)] =
        plan_->declare(p + ".vector_f32", Category::Working, largest_vector * 4, ph, ph);
  };
  if (widen) declare_widening(F, largest_matrix);

  normed_ = plan_->declare("loss.normed_hidden", Category::LossWorkspace, N * D * 4, L, L);
  chunk_rows_ = static_cast<int64_t>(std::clamp<size_t>(options_.loss_workspace_bytes / ((V + 2 * D) * 4), 1, N));
  const size_t chunk = static_cast<size_t>(chunk_rows_);
  logits_chunk_ = plan_->declare("loss.logits_chunk", Category::LossWorkspace, chunk * V * 4, L, L);
  rows_ = plan_->declare("loss.hidden_rows", Category::LossWorkspace, chunk * D * 4, L, L);
  drows_ = plan_->declare("loss.dhidden_rows", Category::LossWorkspace, chunk * D * 4, L, L);
  loss_positions_ = plan_->declare("loss.target_positions", Category::LossWorkspace, N * 4, L, L);
  row_targets_ = plan_->declare("loss.row_targets", Category::LossWorkspace, chunk * 4, L, L);
  // Host losses and observers read the chunk from host memory: a staged copy when the backend's
  // memory is not the host's.
  stages_chunks_ = !backend_->host_addressable();
  if (stages_chunks_) {
    staging_logits_ = host_plan_->declare_persistent("staging.logits_chunk", Category::LossWorkspace, chunk * V * 4);
    staging_targets_ = host_plan_->declare_persistent("staging.row_targets", Category::LossWorkspace, chunk * 4);
    staging_positions_ = host_plan_->declare_persistent("staging.row_positions", Category::LossWorkspace, chunk * 4);
  }
  if (widen) {
    // The final norm's weight, and the LM head widened a vocabulary slice at a time.
    vector_f32_[static_cast<size_t>(L)] =
        plan_->declare("loss.vector_f32", Category::Working, largest_vector * 4, L, L);
    head_slice_rows_ = std::min<int64_t>(V, kHeadSliceRows);
    head_slice_ = plan_->declare("loss.head_weight_slice_f32", Category::LossWorkspace,
                                 static_cast<size_t>(head_slice_rows_) * D * 4, L, L);
  }

  if (options_.with_grads) {
    rstd_final_ = plan_->declare("act.rstd_final", Category::SavedActivations, N * 4, L, B);
    dnormed_ = plan_->declare("grad.normed_hidden", Category::Working, N * D * 4, L, B);
    dstream_ = plan_->declare("bwd.dresidual", Category::Working, N * D * 4, B, B);
    dln_ = plan_->declare("bwd.dnormed", Category::Working, N * D * 4, B, B);
    datt_ = plan_->declare("bwd.dattention", Category::Working, N * qd * 4, B, B);
    dq_ = plan_->declare("bwd.dq", Category::Working, N * qd * 4, B, B);
    dk_ = plan_->declare("bwd.dk", Category::Working, N * kvd * 4, B, B);
    dv_ = plan_->declare("bwd.dv", Category::Working, N * kvd * 4, B, B);
    dh_ = plan_->declare("bwd.dh", Category::Working, N * I * 4, B, B);
    dgate_ = plan_->declare("bwd.dgate", Category::Working, N * I * 4, B, B);
    dup_ = plan_->declare("bwd.dup", Category::Working, N * I * 4, B, B);
    if (options_.gradient_checkpointing)
      recompute_ = declare_layer_acts("bwd.recompute.", Category::RecomputeScratch, B, B);
    if (widen) declare_widening(B, largest_matrix);
  } else {
    rstd_final_ = plan_->declare("act.rstd_final", Category::LossWorkspace, N * 4, L, L);
  }
  if (options_.lora.enabled() && options_.with_grads) {
    const size_t r = static_cast<size_t>(options_.lora.rank), widest = std::max(D, I);
    lora_du_ = plan_->declare("bwd.lora_du", Category::Working, N * r * 4, B, B);
    if (options_.lora.dropout > 0) {
      // Dropout masks are regenerated from a seed; only the dropped input is materialized.
      lora_xd_[static_cast<size_t>(F)] =
          plan_->declare("forward.lora_dropped_x", Category::Working, N * widest * 4, F, F);
      lora_xd_[static_cast<size_t>(B)] =
          plan_->declare("backward.lora_dropped_x", Category::Working, N * widest * 4, B, B);
      lora_dxd_ = plan_->declare("bwd.lora_ddropped_x", Category::Working, N * widest * 4, B, B);
    }
  }
  plan_->finalize();
  host_plan_->finalize();
}

// Base parameters get gradients (and optimizer state) only when they are trained; with LoRA the
// adapters are the only trainable tensors and the base stays frozen in its storage dtype.
void Qwen2Model::declare_trainables() {
  const DType dt = config_.torch_dtype;
  const bool optimizer = options_.with_optimizer;
  if (optimizer && !options_.with_grads) throw Error("an optimizer needs gradients (with_grads)");
  if (options_.optim_offload && !optimizer) throw Error("optim_offload needs an optimizer");
  if (options_.zero_stage < 0 || options_.zero_stage > 1)
    throw Error(fmt::format("zero_stage must be 0 or 1, got {}", options_.zero_stage));
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
    throw Error(fmt::format("rank {} of world size {}: impossible", options_.rank, options_.world_size));
  MemoryPlan& state_plan = options_.optim_offload ? *host_plan_ : *plan_;
  // Optimizer state (moments, masters) covers this rank's shard of each tensor.
  auto shard_bytes = [&](const ParamSpec& spec) {
    return shard_of_tensor(static_cast<size_t>(spec.numel())).size() * 4;
  };
  auto add = [&](const ParamSpec& spec, BufferId value, std::optional<size_t> widen_into) {
    const size_t bytes = static_cast<size_t>(spec.numel()) * 4;
    Trainable t{spec, value, plan_->declare_persistent("grad." + spec.name, Category::Gradients, bytes),
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
  const LoraConfig& lora = options_.lora;
  if (!lora.enabled()) return;
  const Qwen2Config& c = config_;
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
        const BufferId value = plan_->declare_persistent(spec.name, Category::TrainableParams, spec.numel() * 4);
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

Qwen2Model::Linear Qwen2Model::linear(int64_t l, LinearSite s) const {
  const LayerParams& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  // While declare_trainables builds lora_index_, later layers have no entry yet.
  const int lora = static_cast<size_t>(l) < lora_index_.size() ? lora_index_[l][static_cast<size_t>(s)] : -1;
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

Tensor Qwen2Model::param(size_t i) const {
  const ParamSpec& p = specs_.at(i);
  void* data = arena_->raw(weight_ids_.at(i));
  if (p.shape.size() == 1) return Tensor(data, config_.torch_dtype, {p.shape[0]});
  return Tensor(data, config_.torch_dtype, {p.shape[0], p.shape[1]});
}

Tensor Qwen2Model::grad(size_t i) const {
  MT_ASSERT(base_trainable(), "base parameters are not trainable in this model");
  const ParamSpec& p = specs_.at(i);
  void* data = arena_->raw(grad_ids_.at(i));
  if (p.shape.size() == 1) return Tensor(data, DType::F32, {p.shape[0]});
  return Tensor(data, DType::F32, {p.shape[0], p.shape[1]});
}

Tensor Qwen2Model::trainable_value(size_t i) const {
  // A master is optimizer state (a shard with ZeRO-1); any other value is the parameter itself.
  const Trainable& t = trainables_.at(i);
  if (t.widen_into) return state_arena().f32(t.value, {static_cast<int64_t>(optimizer_shard(i).size())});
  return arena_->f32(t.value, {t.spec.numel()});
}
Tensor Qwen2Model::trainable_grad(size_t i) const {
  return arena_->f32(trainables_.at(i).grad, {trainables_.at(i).spec.numel()});
}
Shard Qwen2Model::shard_of_tensor(size_t n) const {
  return options_.shards_optimizer() ? shard_of(n, options_.rank, options_.world_size) : Shard{0, n};
}

Shard Qwen2Model::optimizer_shard(size_t i) const {
  return shard_of_tensor(static_cast<size_t>(trainables_.at(i).spec.numel()));
}

Tensor Qwen2Model::shard_value(size_t i) const {
  // A master covers the shard only; any other value is the whole tensor.
  const Shard s = optimizer_shard(i);
  if (trainables_.at(i).widen_into) return trainable_value(i);
  return trainable_value(i).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size()));
}
Tensor Qwen2Model::shard_grad(size_t i) const {
  const Shard s = optimizer_shard(i);
  return trainable_grad(i).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size()));
}

Tensor Qwen2Model::trainable_storage(size_t i) const {
  const Trainable& t = trainables_.at(i);
  const Tensor storage = t.widen_into ? param(*t.widen_into) : arena_->f32(t.value, {t.spec.numel()});
  return storage.flat_range(0, storage.numel());
}

Tensor Qwen2Model::adam_m(size_t i) const {
  return state_arena().f32(trainables_.at(i).m, {static_cast<int64_t>(optimizer_shard(i).size())});
}
Tensor Qwen2Model::adam_v(size_t i) const {
  return state_arena().f32(trainables_.at(i).v, {static_cast<int64_t>(optimizer_shard(i).size())});
}

void Qwen2Model::store_trainable(size_t i) {
  const Trainable& t = trainables_.at(i);
  if (!t.widen_into) return;
  const Shard s = optimizer_shard(i);
  backend_->convert(param(*t.widen_into).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size())),
                    trainable_value(i));
}

void Qwen2Model::load_masters() {
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const Trainable& t = trainables_[i];
    if (!t.widen_into) continue;
    const Shard s = optimizer_shard(i);
    backend_->convert(trainable_value(i),
                      param(*t.widen_into).flat_range(static_cast<int64_t>(s.begin), static_cast<int64_t>(s.size())));
  }
}

void Qwen2Model::zero_grads() {
  if (!options_.with_grads) return;
  for (size_t i = 0; i < trainables_.size(); ++i) backend_->fill(trainable_grad(i), 0.0f);
}

void Qwen2Model::init_lora(uint64_t seed) {
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

void Qwen2Model::load_adapter(const std::string& dir) {
  MT_ASSERT(options_.lora.enabled());
  const std::string path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  const SafetensorsFile file(path);
  size_t expected = 0;
  std::vector<float> values;
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const ParamSpec& s = trainables_[i].spec;
    if (!s.name.starts_with("base_model.")) continue;
    ++expected;
    const TensorInfo* t = file.find(s.name);
    if (!t) throw Error(fmt::format("{}: adapter tensor \"{}\" is missing", path, s.name));
    if (t->shape != s.shape)
      throw Error(fmt::format("{}: tensor \"{}\" has shape {}, the adapter config needs {}", path, s.name,
                              shape_string(t->shape), shape_string(s.shape)));
    const auto bytes = file.data(*t);
    std::vector<std::byte> aligned(bytes.begin(), bytes.end());  // the mapping may be unaligned
    values.resize(static_cast<size_t>(s.numel()));
    convert_to_f32(aligned.data(), t->dtype, values.data(), values.size());
    upload_f32(*backend_, trainable_value(i), values);
  }
  if (file.tensors().size() != expected)
    throw Error(
        fmt::format("{}: holds {} tensors, the adapter config describes {}", path, file.tensors().size(), expected));
}

void Qwen2Model::save_adapter(const std::string& dir, const std::string& base_model_name_or_path) const {
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
void Qwen2Model::merge_lora() {
  MT_ASSERT(options_.lora.enabled());
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
}

void Qwen2Model::init_random(uint64_t seed) {
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

void Qwen2Model::load(const CheckpointReader& checkpoint) {
  std::set<std::string> expected;
  std::vector<std::byte> staging;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& s = specs_[i];
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
    throw Error(fmt::format("checkpoint tensor \"{}\" (in {}) is not a parameter of this Qwen2 config", name,
                            checkpoint.file_of(name).path()));
  }
}

void Qwen2Model::save(const std::string& dir) const {
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < specs_.size(); ++i)
    tensors.push_back(device_tensor_to_write(*backend_, specs_[i].name, specs_[i].shape, param(i)));
  write_checkpoint(dir, tensors);
  write_file_atomically((std::filesystem::path(dir) / "config.json").string(),
                        qwen2_config_to_json(config_).dump(2) + "\n");
}

Tensor Qwen2Model::weight_f32(size_t p) {
  const Tensor w = param(p);
  if (w.dtype == DType::F32) return w;
  const size_t phase = static_cast<size_t>(arena_->phase());
  const bool vector = specs_[p].shape.size() == 1;
  Tensor out =
      vector ? arena_->f32(vector_f32_[phase], {w.numel()}) : arena_->f32(matrix_f32_[phase], {w.rows(), w.cols()});
  backend_->convert(out, w);
  return out;
}

void Qwen2Model::upload_batch(const TokenBatch& batch) {
  const int64_t N = static_cast<int64_t>(batch.input_ids.size());
  if (N > options_.max_tokens)
    throw Error(fmt::format("micro-batch has {} tokens, the plan was made for at most {}", N, options_.max_tokens));
  if (batch.labels.size() != batch.input_ids.size())
    throw Error(fmt::format("labels has {} entries, input_ids has {}", batch.labels.size(), N));
  if (batch.cu_seqlens.size() < 2 || batch.cu_seqlens.front() != 0 || batch.cu_seqlens.back() != N)
    throw Error("cu_seqlens must start at 0 and end at the number of tokens");
  const int64_t S = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
  if (!batch.position_offsets.empty() && static_cast<int64_t>(batch.position_offsets.size()) != S)
    throw Error(fmt::format("position_offsets has {} entries for {} sequences", batch.position_offsets.size(), S));
  // Built in host staging (the batch's own planned size, reused every step), then copied over.
  std::vector<int32_t>& pos = batch_positions_;
  std::vector<int32_t>& tgt = batch_targets_;
  pos.resize(static_cast<size_t>(N));
  tgt.resize(static_cast<size_t>(N));
  for (int64_t s = 0; s < S; ++s) {
    const int32_t begin = batch.cu_seqlens[s], end = batch.cu_seqlens[s + 1];
    if (end <= begin) throw Error(fmt::format("sequence {} is empty or cu_seqlens is not increasing", s));
    const int32_t offset = batch.position_offsets.empty() ? 0 : batch.position_offsets[s];
    for (int32_t t = begin; t < end; ++t) {
      const int32_t id = batch.input_ids[t];
      if (id < 0 || id >= config_.vocab_size)
        throw Error(
            fmt::format("token id {} at position {} is outside the vocabulary [0, {})", id, t, config_.vocab_size));
      pos[t] = offset + t - begin;
      const int32_t label = t + 1 < end ? batch.labels[t + 1] : kIgnoreIndex;
      if (label != kIgnoreIndex && (label < 0 || label >= config_.vocab_size))
        throw Error(fmt::format("label {} at position {} is outside the vocabulary [0, {}) and is not -100", label,
                                t + 1, config_.vocab_size));
      tgt[t] = label;
    }
  }
  num_tokens_ = N;
  num_seqs_ = S;
  backend_->copy_to_device(arena_->i32(ids_, {N}), batch.input_ids.data());
  backend_->copy_to_device(arena_->i32(positions_, {N}), pos.data());
  backend_->copy_to_device(arena_->i32(targets_, {N}), tgt.data());
  backend_->copy_to_device(arena_->i32(cu_seqlens_, {S + 1}), batch.cu_seqlens.data());
}

uint64_t Qwen2Model::dropout_key(int64_t l, LinearSite s) const {
  return *dropout_seed_ ^
         (static_cast<uint64_t>(l) * kNumLinearSites + static_cast<uint64_t>(s) + 1) * 0x9e3779b97f4a7c15ull;
}

Tensor Qwen2Model::lora_input(int64_t l, LinearSite s, const Tensor& x) {
  const float p = static_cast<float>(options_.lora.dropout);
  if (p <= 0.0f || !dropout_seed_) return x;
  const Tensor out = act(lora_xd_[static_cast<size_t>(arena_->phase())], x.cols());
  backend_->dropout_forward(out, x, dropout_key(l, s), p);
  return out;
}

void Qwen2Model::linear_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y) {
  const Linear lin = linear(l, s);
  Backend& be = *backend_;
  // The weight and the bias widen into different scratch buffers (matrix / vector).
  be.matmul_forward(y, x, weight_f32(lin.weight), lin.bias ? weight_f32(*lin.bias) : Tensor{});
  if (lin.lora < 0) return;
  const int64_t r = options_.lora.rank;
  const Tensor u = act(a.lora_u[static_cast<size_t>(s)], r);
  const Tensor A = trainable_value(lin.lora), B = trainable_value(lin.lora + 1);
  be.matmul_forward(u, lora_input(l, s, x), Tensor(A.data, DType::F32, {r, lin.in}), Tensor{});
  be.matmul_accumulate(y, u, Tensor(B.data, DType::F32, {lin.out, r}), static_cast<float>(options_.lora.scaling()));
}

void Qwen2Model::linear_backward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& dy, const Tensor& x,
                                 const Tensor& dx) {
  const Linear lin = linear(l, s);
  Backend& be = *backend_;
  be.matmul_backward(dx, base_grad_or_none(lin.weight), lin.bias ? base_grad_or_none(*lin.bias) : Tensor{}, dy, x,
                     weight_f32(lin.weight), 1.0f);
  if (lin.lora < 0) return;
  // y += s * u B^T, u = xd A^T:  du = s dy B, dB += s dy^T u, dA += du^T xd, dxd = du A.
  const int64_t r = options_.lora.rank;
  const Tensor A(trainable_value(lin.lora).data, DType::F32, {r, lin.in});
  const Tensor B(trainable_value(lin.lora + 1).data, DType::F32, {lin.out, r});
  const Tensor dA(trainable_grad(lin.lora).data, DType::F32, {r, lin.in});
  const Tensor dB(trainable_grad(lin.lora + 1).data, DType::F32, {lin.out, r});
  const Tensor du = act(lora_du_, r);
  be.fill(du, 0.0f);
  be.matmul_backward(du, dB, Tensor{}, dy, act(a.lora_u[static_cast<size_t>(s)], r), B,
                     static_cast<float>(options_.lora.scaling()));
  const Tensor xd = lora_input(l, s, x);
  if (xd.data == x.data) {
    be.matmul_backward(dx, dA, Tensor{}, du, x, A, 1.0f);
    return;
  }
  // Dropout: the same mask (regenerated from the key) routes the gradient back to x.
  const Tensor dxd = act(lora_dxd_, lin.in);
  be.fill(dxd, 0.0f);
  be.matmul_backward(dxd, dA, Tensor{}, du, xd, A, 1.0f);
  be.dropout_forward(dxd, dxd, dropout_key(l, s), static_cast<float>(options_.lora.dropout));
  be.add_inplace(dx, dxd);
}

void Qwen2Model::layer_forward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& x_out) {
  const auto& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Hq = c.num_attention_heads, hd = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta), eps = static_cast<float>(c.rms_norm_eps);
  Backend& be = *backend_;
  const Tensor pos = arena_->i32(positions_, {num_tokens_});
  const Tensor ln1 = act(a.ln1, D), q = act(a.q, qd), k = act(a.k, kvd), v = act(a.v, kvd), att = act(a.att, qd);
  const Tensor res1 = act(a.res1, D), ln2 = act(a.ln2, D), gate = act(a.gate, I), up = act(a.up, I), h = act(a.h, I);

  be.rmsnorm_forward(ln1, act(a.rstd1, 1), x, weight_f32(p.ln1), eps);
  linear_forward(l, LinearSite::Q, a, ln1, q);
  linear_forward(l, LinearSite::K, a, ln1, k);
  linear_forward(l, LinearSite::V, a, ln1, v);
  be.rope_forward(q, pos, hd, theta);
  be.rope_forward(k, pos, hd, theta);
  be.attention_forward(att, act(a.lse, Hq), q, k, v, arena_->i32(cu_seqlens_, {num_seqs_ + 1}), hd);
  linear_forward(l, LinearSite::O, a, att, res1);
  be.add_inplace(res1, x);
  be.rmsnorm_forward(ln2, act(a.rstd2, 1), res1, weight_f32(p.ln2), eps);
  linear_forward(l, LinearSite::Gate, a, ln2, gate);
  linear_forward(l, LinearSite::Up, a, ln2, up);
  be.swiglu_forward(h, gate, up);
  linear_forward(l, LinearSite::Down, a, h, x_out);
  be.add_inplace(x_out, res1);
}

// Gradient of layer l. On entry dstream holds d(loss)/d(layer output); on exit d(loss)/d(x).
void Qwen2Model::layer_backward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& dstream) {
  const auto& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Hq = c.num_attention_heads, hd = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta);
  Backend& be = *backend_;
  const Tensor pos = arena_->i32(positions_, {num_tokens_});
  const Tensor dh = act(dh_, I), dgate = act(dgate_, I), dup = act(dup_, I), dln = act(dln_, D);
  const Tensor datt = act(datt_, qd), dq = act(dq_, qd), dk = act(dk_, kvd), dv = act(dv_, kvd);

  // MLP: x_out = res1 + down(silu(gate(ln2)) * up(ln2))
  be.fill(dh, 0.0f);
  linear_backward(l, LinearSite::Down, a, dstream, act(a.h, I), dh);
  be.fill(dgate, 0.0f);
  be.fill(dup, 0.0f);
  be.swiglu_backward(dgate, dup, dh, act(a.gate, I), act(a.up, I));
  be.fill(dln, 0.0f);
  linear_backward(l, LinearSite::Gate, a, dgate, act(a.ln2, D), dln);
  linear_backward(l, LinearSite::Up, a, dup, act(a.ln2, D), dln);
  be.rmsnorm_backward(dstream, base_grad_or_none(p.ln2), dln, act(a.res1, D), weight_f32(p.ln2), act(a.rstd2, 1));
  // Attention: res1 = x + o(attn(rope(q(ln1)), rope(k(ln1)), v(ln1)))
  be.fill(datt, 0.0f);
  linear_backward(l, LinearSite::O, a, dstream, act(a.att, qd), datt);
  be.attention_backward(dq, dk, dv, datt, act(a.att, qd), act(a.lse, Hq), act(a.q, qd), act(a.k, kvd), act(a.v, kvd),
                        arena_->i32(cu_seqlens_, {num_seqs_ + 1}), hd);
  be.rope_backward(dq, pos, hd, theta);
  be.rope_backward(dk, pos, hd, theta);
  be.fill(dln, 0.0f);
  linear_backward(l, LinearSite::Q, a, dq, act(a.ln1, D), dln);
  linear_backward(l, LinearSite::K, a, dk, act(a.ln1, D), dln);
  linear_backward(l, LinearSite::V, a, dv, act(a.ln1, D), dln);
  be.rmsnorm_backward(dstream, base_grad_or_none(p.ln1), dln, x, weight_f32(p.ln1), act(a.rstd1, 1));
}

LossSum Qwen2Model::forward_backward(const TokenBatch& batch, float* logits_out) {
  return run_step(batch, logits_out, options_.with_grads);
}

LossSum Qwen2Model::run_step(const TokenBatch& batch, float* logits_out, bool backward) {
  Arena& A = *arena_;
  Backend& be = *backend_;
  const Qwen2Config& c = config_;
  const int64_t D = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const bool ckpt = options_.gradient_checkpointing || !options_.with_grads;

  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  timings_ = {};
  auto t0 = Clock::now();
  A.enter_phase(Phase::Forward);
  upload_batch(batch);
  const int64_t N = num_tokens_;
  be.embedding_forward(act(residual_[0], D), A.i32(ids_, {N}), param(embed_));
  for (int64_t l = 0; l < L; ++l)
    layer_forward(l, ckpt ? fwd_scratch_ : saved_[l], act(residual_[l], D), act(residual_[l + 1], D));

  timings_.forward = seconds_since(t0);
  t0 = Clock::now();
  A.enter_phase(Phase::Loss);
  const Tensor normed = act(normed_, D);
  be.rmsnorm_forward(normed, act(rstd_final_, 1), act(residual_[L], D), weight_f32(final_norm_),
                     static_cast<float>(c.rms_norm_eps));
  if (logits_out) {  // debugging only: computed on the host from copies, in the caller's memory
    const std::vector<float> hidden = download_f32(be, normed), head = download_f32(be, param(head_));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < V; ++v) {
        double s = 0.0;
        for (int64_t d = 0; d < D; ++d) s += double(hidden[n * D + d]) * head[v * D + d];
        logits_out[n * V + v] = static_cast<float>(s);
      }
  }
  const bool grads = backward;
  const int64_t chunk = chunk_rows_;
  LmHeadArgs head{.hidden = normed,
                  .targets = A.i32(targets_, {N}),
                  .weight = param(head_),
                  .loss = loss_,
                  .dhidden = grads ? act(dnormed_, D) : Tensor{},
                  .dweight = grads ? base_grad_or_none(head_) : Tensor{},
                  .grad_scale = grad_scale_,
                  .observer = observer_,
                  .logits = A.f32(logits_chunk_, {chunk, V}),
                  .rows = A.f32(rows_, {chunk, D}),
                  .drows = A.f32(drows_, {chunk, D}),
                  .positions = A.i32(loss_positions_, {N}),
                  .row_targets = A.i32(row_targets_, {chunk}),
                  .weight_slice = head_slice_rows_ ? A.f32(head_slice_, {head_slice_rows_, D}) : Tensor{},
                  .staging = {}};
  if (stages_chunks_)
    head.staging = {host_arena_->f32(staging_logits_, {chunk, V}).as<float>(),
                    host_arena_->i32(staging_targets_, {chunk}).as<int32_t>(),
                    host_arena_->i32(staging_positions_, {chunk}).as<int32_t>()};
  const LossSum loss = be.lm_head_loss(head);
  timings_.loss = seconds_since(t0);
  if (!grads) return loss;

  t0 = Clock::now();
  A.enter_phase(Phase::Backward);
  const Tensor dstream = act(dstream_, D);
  be.fill(dstream, 0.0f);
  be.rmsnorm_backward(dstream, base_grad_or_none(final_norm_), act(dnormed_, D), act(residual_[L], D),
                      weight_f32(final_norm_), act(rstd_final_, 1));
  for (int64_t l = L - 1; l >= 0; --l) {
    const Tensor x = act(residual_[l], D);
    if (options_.gradient_checkpointing) {
      // Rebuild this layer's activations from its saved input; its output is not needed again.
      layer_forward(l, recompute_, x, act(dln_, D));
      layer_backward(l, recompute_, x, dstream);
    } else {
      layer_backward(l, saved_[l], x, dstream);
    }
    if (layer_grads_ready_) layer_grads_ready_(l);
  }
  if (base_trainable()) be.embedding_backward(grad(embed_), dstream, A.i32(ids_, {N}));
  timings_.backward = seconds_since(t0);
  A.enter_phase(Phase::Forward);
  return loss;
}

}  // namespace memtune

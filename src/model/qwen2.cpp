#include "model/qwen2.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace memtune {

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
    : config_(config), options_(options), specs_(qwen2_parameter_specs(config)) {
  if (options.max_tokens <= 0) throw Error(fmt::format("max_tokens must be positive, got {}", options.max_tokens));
  size_t i = 1;  // specs_[0] is the embedding
  for (int64_t l = 0; l < config.num_hidden_layers; ++l, i += 12)
    layer_params_.push_back({i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7, i + 8, i + 9, i + 10, i + 11});
  final_norm_ = i;
  head_ = config.tie_word_embeddings ? embed_ : i + 1;
  declare_buffers();
  if (options.allocate) {
    arena_ = std::make_unique<Arena>(*plan_);
    if (host_plan_->peak_bytes() > 0) host_arena_ = std::make_unique<Arena>(*host_plan_);
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

void* Qwen2Model::param_data(size_t i) const {
  return arena_->raw(weight_ids_.at(i));
}

float* Qwen2Model::grad_data(size_t i) const {
  MT_ASSERT(base_trainable(), "base parameters are not trainable in this model");
  return arena_->get<float>(grad_ids_.at(i));
}

float* Qwen2Model::trainable_value(size_t i) const {
  // A master is optimizer state; any other value is the parameter itself.
  const Trainable& t = trainables_.at(i);
  return (t.widen_into ? state_arena() : *arena_).get<float>(t.value);
}
float* Qwen2Model::trainable_grad(size_t i) const {
  return arena_->get<float>(trainables_.at(i).grad);
}
Shard Qwen2Model::shard_of_tensor(size_t n) const {
  return options_.shards_optimizer() ? shard_of(n, options_.rank, options_.world_size) : Shard{0, n};
}

Shard Qwen2Model::optimizer_shard(size_t i) const {
  return shard_of_tensor(static_cast<size_t>(trainables_.at(i).spec.numel()));
}

float* Qwen2Model::shard_value(size_t i) const {
  // A master covers the shard only; any other value is the whole tensor.
  return trainables_.at(i).widen_into ? trainable_value(i) : trainable_value(i) + optimizer_shard(i).begin;
}

std::span<std::byte> Qwen2Model::trainable_storage(size_t i) const {
  const Trainable& t = trainables_.at(i);
  const size_t n = static_cast<size_t>(t.spec.numel());
  if (t.widen_into) return {static_cast<std::byte*>(param_data(*t.widen_into)), n * dtype_size(config_.torch_dtype)};
  return {reinterpret_cast<std::byte*>(trainable_value(i)), n * 4};
}

float* Qwen2Model::adam_m(size_t i) const {
  return state_arena().get<float>(trainables_.at(i).m);
}
float* Qwen2Model::adam_v(size_t i) const {
  return state_arena().get<float>(trainables_.at(i).v);
}

void Qwen2Model::store_trainable(size_t i) {
  const Trainable& t = trainables_.at(i);
  if (!t.widen_into) return;
  const Shard s = optimizer_shard(i);
  const size_t element = dtype_size(config_.torch_dtype);
  convert_from_f32(trainable_value(i), static_cast<std::byte*>(param_data(*t.widen_into)) + s.begin * element,
                   config_.torch_dtype, s.size());
}

void Qwen2Model::load_masters() {
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const Trainable& t = trainables_[i];
    if (!t.widen_into) continue;
    const Shard s = optimizer_shard(i);
    const size_t element = dtype_size(config_.torch_dtype);
    convert_to_f32(static_cast<const std::byte*>(param_data(*t.widen_into)) + s.begin * element, config_.torch_dtype,
                   trainable_value(i), s.size());
  }
}

void Qwen2Model::zero_grads() {
  for (size_t i = 0; i < trainables_.size(); ++i)
    if (options_.with_grads) std::fill_n(trainable_grad(i), trainables_[i].spec.numel(), 0.0f);
}

void Qwen2Model::init_lora(uint64_t seed) {
  MT_ASSERT(options_.lora.enabled());
  for (size_t i = 0; i < trainables_.size(); ++i) {
    const ParamSpec& s = trainables_[i].spec;
    if (!s.name.ends_with(".lora_A.weight") && !s.name.ends_with(".lora_B.weight")) continue;
    float* v = trainable_value(i);
    if (s.name.ends_with(".lora_B.weight")) {
      std::fill_n(v, s.numel(), 0.0f);
      continue;
    }
    // PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in] -> bound = 1/sqrt(in)
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.shape[1]));
    Rng rng(seed, s.name);
    for (int64_t j = 0; j < s.numel(); ++j) v[j] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
  }
}

void Qwen2Model::load_adapter(const std::string& dir) {
  MT_ASSERT(options_.lora.enabled());
  const std::string path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  const SafetensorsFile file(path);
  size_t expected = 0;
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
    convert_to_f32(aligned.data(), t->dtype, trainable_value(i), static_cast<size_t>(s.numel()));
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
    tensors.push_back({trainables_[i].spec.name, DType::F32, trainables_[i].spec.shape, trainable_value(i)});
  write_safetensors((std::filesystem::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomically((std::filesystem::path(dir) / "adapter_config.json").string(),
                        lora_adapter_config_json(options_.lora, base_model_name_or_path).dump(2) + "\n");
}

void Qwen2Model::merge_lora() {
  MT_ASSERT(options_.lora.enabled());
  const float scaling = static_cast<float>(options_.lora.scaling());
  const int64_t r = options_.lora.rank;
  std::vector<float> w;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    for (size_t s = 0; s < kNumLinearSites; ++s) {
      const Linear lin = linear(l, static_cast<LinearSite>(s));
      if (lin.lora < 0) continue;
      w.resize(static_cast<size_t>(lin.out * lin.in));
      convert_to_f32(param_data(lin.weight), config_.torch_dtype, w.data(), w.size());
      // W [out, in] += scaling * B [out, r] A [r, in]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, lin.out, lin.in, r, scaling, trainable_value(lin.lora + 1),
                  r, trainable_value(lin.lora), lin.in, 1.0f, w.data(), lin.in);
      convert_from_f32(w.data(), param_data(lin.weight), config_.torch_dtype, w.size());
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
    convert_from_f32(values.data(), param_data(i), config_.torch_dtype, values.size());
  }
}

void Qwen2Model::load(const CheckpointReader& checkpoint) {
  std::set<std::string> expected;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& s = specs_[i];
    expected.insert(s.name);
    if (!checkpoint.contains(s.name))
      throw Error(fmt::format("checkpoint is missing tensor \"{}\" required by the config", s.name));
    checkpoint.read_into(s.name, s.shape, param_data(i), config_.torch_dtype);
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
    tensors.push_back({specs_[i].name, config_.torch_dtype, specs_[i].shape, param_data(i)});
  write_checkpoint(dir, tensors);
  write_file_atomically((std::filesystem::path(dir) / "config.json").string(),
                        qwen2_config_to_json(config_).dump(2) + "\n");
}

const float* Qwen2Model::weight_f32(size_t param) {
  if (config_.torch_dtype == DType::F32) return static_cast<const float*>(param_data(param));
  const size_t phase = static_cast<size_t>(arena_->phase());
  float* out = arena_->get<float>(specs_[param].shape.size() == 1 ? vector_f32_[phase] : matrix_f32_[phase]);
  convert_to_f32(param_data(param), config_.torch_dtype, out, static_cast<size_t>(specs_[param].numel()));
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
  int32_t* ids = arena_->get<int32_t>(ids_);
  int32_t* pos = arena_->get<int32_t>(positions_);
  int32_t* tgt = arena_->get<int32_t>(targets_);
  int32_t* cu = arena_->get<int32_t>(cu_seqlens_);
  for (int64_t s = 0; s < S; ++s) {
    const int32_t begin = batch.cu_seqlens[s], end = batch.cu_seqlens[s + 1];
    if (end <= begin) throw Error(fmt::format("sequence {} is empty or cu_seqlens is not increasing", s));
    for (int32_t t = begin; t < end; ++t) {
      const int32_t id = batch.input_ids[t];
      if (id < 0 || id >= config_.vocab_size)
        throw Error(
            fmt::format("token id {} at position {} is outside the vocabulary [0, {})", id, t, config_.vocab_size));
      ids[t] = id;
      pos[t] = t - begin;
      const int32_t label = t + 1 < end ? batch.labels[t + 1] : kIgnoreIndex;
      if (label != kIgnoreIndex && (label < 0 || label >= config_.vocab_size))
        throw Error(fmt::format("label {} at position {} is outside the vocabulary [0, {}) and is not -100", label,
                                t + 1, config_.vocab_size));
      tgt[t] = label;
    }
  }
  std::copy(batch.cu_seqlens.begin(), batch.cu_seqlens.end(), cu);
  num_tokens_ = N;
  num_seqs_ = S;
}

uint64_t Qwen2Model::dropout_key(int64_t l, LinearSite s) const {
  return *dropout_seed_ ^
         (static_cast<uint64_t>(l) * kNumLinearSites + static_cast<uint64_t>(s) + 1) * 0x9e3779b97f4a7c15ull;
}

const float* Qwen2Model::lora_input(int64_t l, LinearSite s, const float* x, int64_t n) {
  const float p = static_cast<float>(options_.lora.dropout);
  if (p <= 0.0f || !dropout_seed_) return x;
  float* out = arena_->get<float>(lora_xd_[static_cast<size_t>(arena_->phase())]);
  cpu::dropout_forward(out, x, num_tokens_ * n, dropout_key(l, s), p);
  return out;
}

void Qwen2Model::linear_forward(int64_t l, LinearSite s, const LayerActs& a, const float* x, float* y) {
  const Linear lin = linear(l, s);
  const int64_t N = num_tokens_;
  // The weight and the bias widen into different scratch buffers (matrix / vector).
  cpu::matmul_forward(y, x, weight_f32(lin.weight), lin.bias ? weight_f32(*lin.bias) : nullptr, N, lin.in, lin.out);
  if (lin.lora < 0) return;
  const int64_t r = options_.lora.rank;
  float* u = arena_->get<float>(a.lora_u[static_cast<size_t>(s)]);
  cpu::matmul_forward(u, lora_input(l, s, x, lin.in), trainable_value(lin.lora), nullptr, N, lin.in, r);
  cpu::matmul_accumulate(y, u, trainable_value(lin.lora + 1), N, r, lin.out,
                         static_cast<float>(options_.lora.scaling()));
}

void Qwen2Model::linear_backward(int64_t l, LinearSite s, const LayerActs& a, const float* dy, const float* x,
                                 float* dx) {
  const Linear lin = linear(l, s);
  const int64_t N = num_tokens_;
  cpu::matmul_backward(dx, base_grad_or_null(lin.weight), lin.bias ? base_grad_or_null(*lin.bias) : nullptr, dy, x,
                       weight_f32(lin.weight), N, lin.in, lin.out);
  if (lin.lora < 0) return;
  // y += s * u B^T, u = xd A^T:  du = s dy B, dB += s dy^T u, dA += du^T xd, dxd = du A.
  const int64_t r = options_.lora.rank;
  float* du = arena_->get<float>(lora_du_);
  std::fill_n(du, N * r, 0.0f);
  cpu::matmul_backward(du, trainable_grad(lin.lora + 1), nullptr, dy,
                       arena_->get<float>(a.lora_u[static_cast<size_t>(s)]), trainable_value(lin.lora + 1), N, r,
                       lin.out, static_cast<float>(options_.lora.scaling()));
  const float* xd = lora_input(l, s, x, lin.in);
  if (xd == x) {
    cpu::matmul_backward(dx, trainable_grad(lin.lora), nullptr, du, x, trainable_value(lin.lora), N, lin.in, r);
    return;
  }
  // Dropout: the same mask (regenerated from the key) routes the gradient back to x.
  float* dxd = arena_->get<float>(lora_dxd_);
  std::fill_n(dxd, N * lin.in, 0.0f);
  cpu::matmul_backward(dxd, trainable_grad(lin.lora), nullptr, du, xd, trainable_value(lin.lora), N, lin.in, r);
  cpu::dropout_forward(dxd, dxd, N * lin.in, dropout_key(l, s), static_cast<float>(options_.lora.dropout));
  cpu::add_inplace(dx, dxd, N * lin.in);
}

void Qwen2Model::layer_forward(int64_t l, const LayerActs& a, const float* x, float* x_out) {
  const auto& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t N = num_tokens_, D = c.hidden_size, I = c.intermediate_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta), eps = static_cast<float>(c.rms_norm_eps);
  Arena& A = *arena_;
  auto f = [&](BufferId id) { return A.get<float>(id); };
  const int32_t* pos = A.get<int32_t>(positions_);

  cpu::rmsnorm_forward(f(a.ln1), f(a.rstd1), x, weight_f32(p.ln1), N, D, eps);
  linear_forward(l, LinearSite::Q, a, f(a.ln1), f(a.q));
  linear_forward(l, LinearSite::K, a, f(a.ln1), f(a.k));
  linear_forward(l, LinearSite::V, a, f(a.ln1), f(a.v));
  cpu::rope_forward(f(a.q), pos, N, Hq, hd, theta);
  cpu::rope_forward(f(a.k), pos, N, Hkv, hd, theta);
  cpu::attention_forward(f(a.att), f(a.lse), f(a.q), f(a.k), f(a.v), A.get<int32_t>(cu_seqlens_), num_seqs_, Hq, Hkv,
                         hd);
  linear_forward(l, LinearSite::O, a, f(a.att), f(a.res1));
  cpu::add_inplace(f(a.res1), x, N * D);
  cpu::rmsnorm_forward(f(a.ln2), f(a.rstd2), f(a.res1), weight_f32(p.ln2), N, D, eps);
  linear_forward(l, LinearSite::Gate, a, f(a.ln2), f(a.gate));
  linear_forward(l, LinearSite::Up, a, f(a.ln2), f(a.up));
  cpu::swiglu_forward(f(a.h), f(a.gate), f(a.up), N * I);
  linear_forward(l, LinearSite::Down, a, f(a.h), x_out);
  cpu::add_inplace(x_out, f(a.res1), N * D);
}

// Gradient of layer l. On entry dstream holds d(loss)/d(layer output); on exit d(loss)/d(x).
void Qwen2Model::layer_backward(int64_t l, const LayerActs& a, const float* x, float* dstream) {
  const auto& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t N = num_tokens_, D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim();
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta);
  Arena& A = *arena_;
  auto f = [&](BufferId id) { return A.get<float>(id); };
  auto zero = [&](BufferId id, int64_t n) { std::fill_n(f(id), n, 0.0f); };
  const int32_t* pos = A.get<int32_t>(positions_);

  // MLP: x_out = res1 + down(silu(gate(ln2)) * up(ln2))
  zero(dh_, N * I);
  linear_backward(l, LinearSite::Down, a, dstream, f(a.h), f(dh_));
  zero(dgate_, N * I);
  zero(dup_, N * I);
  cpu::swiglu_backward(f(dgate_), f(dup_), f(dh_), f(a.gate), f(a.up), N * I);
  zero(dln_, N * D);
  linear_backward(l, LinearSite::Gate, a, f(dgate_), f(a.ln2), f(dln_));
  linear_backward(l, LinearSite::Up, a, f(dup_), f(a.ln2), f(dln_));
  cpu::rmsnorm_backward(dstream, base_grad_or_null(p.ln2), f(dln_), f(a.res1), weight_f32(p.ln2), f(a.rstd2), N, D);
  // Attention: res1 = x + o(attn(rope(q(ln1)), rope(k(ln1)), v(ln1)))
  zero(datt_, N * qd);
  linear_backward(l, LinearSite::O, a, dstream, f(a.att), f(datt_));
  cpu::attention_backward(f(dq_), f(dk_), f(dv_), f(datt_), f(a.att), f(a.lse), f(a.q), f(a.k), f(a.v),
                          A.get<int32_t>(cu_seqlens_), num_seqs_, Hq, Hkv, hd);
  cpu::rope_backward(f(dq_), pos, N, Hq, hd, theta);
  cpu::rope_backward(f(dk_), pos, N, Hkv, hd, theta);
  zero(dln_, N * D);
  linear_backward(l, LinearSite::Q, a, f(dq_), f(a.ln1), f(dln_));
  linear_backward(l, LinearSite::K, a, f(dk_), f(a.ln1), f(dln_));
  linear_backward(l, LinearSite::V, a, f(dv_), f(a.ln1), f(dln_));
  cpu::rmsnorm_backward(dstream, base_grad_or_null(p.ln1), f(dln_), x, weight_f32(p.ln1), f(a.rstd1), N, D);
}

cpu::LossSum Qwen2Model::forward_backward(const TokenBatch& batch, float* logits_out) {
  return run_step(batch, logits_out, options_.with_grads);
}

cpu::LossSum Qwen2Model::run_step(const TokenBatch& batch, float* logits_out, bool backward) {
  Arena& A = *arena_;
  const Qwen2Config& c = config_;
  const int64_t D = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const bool ckpt = options_.gradient_checkpointing || !options_.with_grads;

  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  timings_ = {};
  auto t0 = Clock::now();
  A.enter_phase(Phase::Forward);
  upload_batch(batch);
  const int64_t N = num_tokens_;
  cpu::embedding_forward(A.get<float>(residual_[0]), A.get<int32_t>(ids_), param_data(embed_), c.torch_dtype, N, D);
  for (int64_t l = 0; l < L; ++l)
    layer_forward(l, ckpt ? fwd_scratch_ : saved_[l], A.get<float>(residual_[l]), A.get<float>(residual_[l + 1]));

  timings_.forward = seconds_since(t0);
  t0 = Clock::now();
  A.enter_phase(Phase::Loss);
  float* normed = A.get<float>(normed_);
  cpu::rmsnorm_forward(normed, A.get<float>(rstd_final_), A.get<float>(residual_[L]), weight_f32(final_norm_), N, D,
                       static_cast<float>(c.rms_norm_eps));
  if (logits_out) {  // debugging only: the caller's memory, widened weight built there too
    std::vector<float> head(static_cast<size_t>(V * D));
    convert_to_f32(param_data(head_), c.torch_dtype, head.data(), head.size());
    cpu::matmul_forward(logits_out, normed, head.data(), nullptr, N, D, V);
  }
  const bool widen = c.torch_dtype != DType::F32;
  const cpu::LmHeadWorkspace ws{.logits = A.get<float>(logits_chunk_),
                                .rows = A.get<float>(rows_),
                                .drows = A.get<float>(drows_),
                                .positions = A.get<int32_t>(loss_positions_),
                                .row_targets = A.get<int32_t>(row_targets_),
                                .chunk_rows = chunk_rows_,
                                .weight_slice = widen ? A.get<float>(head_slice_) : nullptr,
                                .slice_rows = head_slice_rows_};
  const bool grads = backward;
  const cpu::LossSum loss = cpu::lm_head_loss(normed, A.get<int32_t>(targets_), N, param_data(head_), c.torch_dtype, V,
                                              D, *loss_, grads ? A.get<float>(dnormed_) : nullptr,
                                              grads ? base_grad_or_null(head_) : nullptr, ws, grad_scale_, observer_);
  timings_.loss = seconds_since(t0);
  if (!grads) return loss;

  t0 = Clock::now();
  A.enter_phase(Phase::Backward);
  float* dstream = A.get<float>(dstream_);
  std::fill_n(dstream, N * D, 0.0f);
  cpu::rmsnorm_backward(dstream, base_grad_or_null(final_norm_), A.get<float>(dnormed_), A.get<float>(residual_[L]),
                        weight_f32(final_norm_), A.get<float>(rstd_final_), N, D);
  for (int64_t l = L - 1; l >= 0; --l) {
    const float* x = A.get<float>(residual_[l]);
    if (options_.gradient_checkpointing) {
      // Rebuild this layer's activations from its saved input; its output is not needed again.
      layer_forward(l, recompute_, x, A.get<float>(dln_));
      layer_backward(l, recompute_, x, dstream);
    } else {
      layer_backward(l, saved_[l], x, dstream);
    }
    if (layer_grads_ready_) layer_grads_ready_(l);
  }
  if (base_trainable()) cpu::embedding_backward(grad_data(embed_), dstream, A.get<int32_t>(ids_), N, D);
  timings_.backward = seconds_since(t0);
  A.enter_phase(Phase::Forward);
  return loss;
}

}  // namespace memtune

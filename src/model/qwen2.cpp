#include "model/qwen2.h"

#include <fmt/format.h>
#include <algorithm>
#include <chrono>
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
  arena_ = std::make_unique<Arena>(*plan_);
}

Qwen2Model::LayerActs Qwen2Model::declare_layer_acts(const std::string& prefix, Category cat, Phase first, Phase last) {
  const size_t N = static_cast<size_t>(options_.max_tokens);
  const size_t D = config_.hidden_size, I = config_.intermediate_size, qd = config_.q_dim(), kvd = config_.kv_dim();
  const size_t Hq = config_.num_attention_heads;
  auto f32 = [&](const char* name, size_t elems) { return plan_->declare(prefix + name, cat, elems * 4, first, last); };
  return LayerActs{f32("ln1", N * D),  f32("rstd1", N),    f32("q", N * qd),   f32("k", N * kvd), f32("v", N * kvd),
                   f32("att", N * qd), f32("lse", N * Hq), f32("res1", N * D), f32("ln2", N * D), f32("rstd2", N),
                   f32("gate", N * I), f32("up", N * I),   f32("h", N * I)};
}

// Lifetimes, chosen so they nest (see MemoryPlan):
//   persistent   weights, gradients, batch, residual stream x_0..x_L (saved for backward)
//   forward      checkpointing: one layer's activations; weight conversion scratch
//   loss..bwd    rstd of the final norm, d(normed hidden)
//   loss         normed hidden, logits chunk, gathered rows, head weight conversion
//   backward     activation gradients; checkpointing: one recomputed layer; weight conversion
void Qwen2Model::declare_buffers() {
  plan_ = std::make_unique<MemoryPlan>();
  const Qwen2Config& c = config_;
  const size_t N = static_cast<size_t>(options_.max_tokens);
  const size_t D = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, qd = c.q_dim(), kvd = c.kv_dim();
  const DType dt = c.torch_dtype;

  for (const auto& s : specs_)
    weight_ids_.push_back(plan_->declare_persistent(s.name, Category::Weights, s.numel() * dtype_size(dt)));
  if (options_.with_grads)
    for (const auto& s : specs_)
      grad_ids_.push_back(plan_->declare_persistent("grad." + s.name, Category::Gradients, s.numel() * 4));
  if (options_.with_optimizer) {
    if (!options_.with_grads) throw Error("an optimizer needs gradients (with_grads)");
    for (const auto& s : specs_) {
      const size_t bytes = s.numel() * 4;
      adam_m_ids_.push_back(plan_->declare_persistent("adam_m." + s.name, Category::OptimizerState, bytes));
      adam_v_ids_.push_back(plan_->declare_persistent("adam_v." + s.name, Category::OptimizerState, bytes));
      if (dt != DType::F32)
        master_ids_.push_back(plan_->declare_persistent("master." + s.name, Category::TrainableParams, bytes));
    }
  }

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
  plan_->finalize();
}

void* Qwen2Model::param_data(size_t i) const {
  return arena_->raw(weight_ids_.at(i));
}

float* Qwen2Model::grad_data(size_t i) const {
  MT_ASSERT(options_.with_grads, "model built without gradients");
  return arena_->get<float>(grad_ids_.at(i));
}

float* Qwen2Model::adam_m(size_t i) const {
  return arena_->get<float>(adam_m_ids_.at(i));
}
float* Qwen2Model::adam_v(size_t i) const {
  return arena_->get<float>(adam_v_ids_.at(i));
}
float* Qwen2Model::master(size_t i) const {
  return master_ids_.empty() ? nullptr : arena_->get<float>(master_ids_.at(i));
}

void Qwen2Model::zero_grads() {
  for (size_t i = 0; i < grad_ids_.size(); ++i) std::fill_n(grad_data(i), specs_[i].numel(), 0.0f);
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
      const int32_t label = t + 1 < end ? batch.labels[t + 1] : cpu::kIgnoreIndex;
      if (label != cpu::kIgnoreIndex && (label < 0 || label >= config_.vocab_size))
        throw Error(fmt::format("label {} at position {} is outside the vocabulary [0, {}) and is not -100", label,
                                t + 1, config_.vocab_size));
      tgt[t] = label;
    }
  }
  std::copy(batch.cu_seqlens.begin(), batch.cu_seqlens.end(), cu);
  num_tokens_ = N;
  num_seqs_ = S;
}

void Qwen2Model::layer_forward(int64_t l, const LayerActs& a, const float* x, float* x_out) {
  const auto& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t N = num_tokens_, D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta), eps = static_cast<float>(c.rms_norm_eps);
  Arena& A = *arena_;
  auto f = [&](BufferId id) { return A.get<float>(id); };
  const int32_t* pos = A.get<int32_t>(positions_);

  cpu::rmsnorm_forward(f(a.ln1), f(a.rstd1), x, weight_f32(p.ln1), N, D, eps);
  cpu::matmul_forward(f(a.q), f(a.ln1), weight_f32(p.wq), weight_f32(p.bq), N, D, qd);
  cpu::matmul_forward(f(a.k), f(a.ln1), weight_f32(p.wk), weight_f32(p.bk), N, D, kvd);
  cpu::matmul_forward(f(a.v), f(a.ln1), weight_f32(p.wv), weight_f32(p.bv), N, D, kvd);
  cpu::rope_forward(f(a.q), pos, N, Hq, hd, theta);
  cpu::rope_forward(f(a.k), pos, N, Hkv, hd, theta);
  cpu::attention_forward(f(a.att), f(a.lse), f(a.q), f(a.k), f(a.v), A.get<int32_t>(cu_seqlens_), num_seqs_, Hq, Hkv,
                         hd);
  cpu::matmul_forward(f(a.res1), f(a.att), weight_f32(p.wo), nullptr, N, qd, D);
  cpu::add_inplace(f(a.res1), x, N * D);
  cpu::rmsnorm_forward(f(a.ln2), f(a.rstd2), f(a.res1), weight_f32(p.ln2), N, D, eps);
  cpu::matmul_forward(f(a.gate), f(a.ln2), weight_f32(p.wg), nullptr, N, D, I);
  cpu::matmul_forward(f(a.up), f(a.ln2), weight_f32(p.wu), nullptr, N, D, I);
  cpu::swiglu_forward(f(a.h), f(a.gate), f(a.up), N * I);
  cpu::matmul_forward(x_out, f(a.h), weight_f32(p.wd), nullptr, N, I, D);
  cpu::add_inplace(x_out, f(a.res1), N * D);
}

// Gradient of layer l. On entry dstream holds d(loss)/d(layer output); on exit d(loss)/d(x).
void Qwen2Model::layer_backward(int64_t l, const LayerActs& a, const float* x, float* dstream) {
  const auto& p = layer_params_[l];
  const Qwen2Config& c = config_;
  const int64_t N = num_tokens_, D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta);
  Arena& A = *arena_;
  auto f = [&](BufferId id) { return A.get<float>(id); };
  auto g = [&](size_t param) { return grad_data(param); };
  auto zero = [&](BufferId id, int64_t n) { std::fill_n(f(id), n, 0.0f); };
  const int32_t* pos = A.get<int32_t>(positions_);

  // MLP: x_out = res1 + down(silu(gate(ln2)) * up(ln2))
  zero(dh_, N * I);
  cpu::matmul_backward(f(dh_), g(p.wd), nullptr, dstream, f(a.h), weight_f32(p.wd), N, I, D);
  zero(dgate_, N * I);
  zero(dup_, N * I);
  cpu::swiglu_backward(f(dgate_), f(dup_), f(dh_), f(a.gate), f(a.up), N * I);
  zero(dln_, N * D);
  cpu::matmul_backward(f(dln_), g(p.wg), nullptr, f(dgate_), f(a.ln2), weight_f32(p.wg), N, D, I);
  cpu::matmul_backward(f(dln_), g(p.wu), nullptr, f(dup_), f(a.ln2), weight_f32(p.wu), N, D, I);
  cpu::rmsnorm_backward(dstream, g(p.ln2), f(dln_), f(a.res1), weight_f32(p.ln2), f(a.rstd2), N, D);
  // Attention: res1 = x + o(attn(rope(q(ln1)), rope(k(ln1)), v(ln1)))
  zero(datt_, N * qd);
  cpu::matmul_backward(f(datt_), g(p.wo), nullptr, dstream, f(a.att), weight_f32(p.wo), N, qd, D);
  cpu::attention_backward(f(dq_), f(dk_), f(dv_), f(datt_), f(a.att), f(a.lse), f(a.q), f(a.k), f(a.v),
                          A.get<int32_t>(cu_seqlens_), num_seqs_, Hq, Hkv, hd);
  cpu::rope_backward(f(dq_), pos, N, Hq, hd, theta);
  cpu::rope_backward(f(dk_), pos, N, Hkv, hd, theta);
  zero(dln_, N * D);
  cpu::matmul_backward(f(dln_), g(p.wq), g(p.bq), f(dq_), f(a.ln1), weight_f32(p.wq), N, D, qd);
  cpu::matmul_backward(f(dln_), g(p.wk), g(p.bk), f(dk_), f(a.ln1), weight_f32(p.wk), N, D, kvd);
  cpu::matmul_backward(f(dln_), g(p.wv), g(p.bv), f(dv_), f(a.ln1), weight_f32(p.wv), N, D, kvd);
  cpu::rmsnorm_backward(dstream, g(p.ln1), f(dln_), x, weight_f32(p.ln1), f(a.rstd1), N, D);
}

cpu::LossSum Qwen2Model::forward_backward(const TokenBatch& batch, float* logits_out) {
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
  const bool grads = options_.with_grads;
  const cpu::LossSum loss =
      cpu::lm_head_loss(normed, A.get<int32_t>(targets_), N, param_data(head_), c.torch_dtype, V, D, *loss_,
                        grads ? A.get<float>(dnormed_) : nullptr, grads ? grad_data(head_) : nullptr, ws);
  timings_.loss = seconds_since(t0);
  if (!grads) return loss;

  t0 = Clock::now();
  A.enter_phase(Phase::Backward);
  float* dstream = A.get<float>(dstream_);
  std::fill_n(dstream, N * D, 0.0f);
  cpu::rmsnorm_backward(dstream, grad_data(final_norm_), A.get<float>(dnormed_), A.get<float>(residual_[L]),
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
  }
  cpu::embedding_backward(grad_data(embed_), dstream, A.get<int32_t>(ids_), N, D);
  timings_.backward = seconds_since(t0);
  A.enter_phase(Phase::Forward);
  return loss;
}

}  // namespace memtune

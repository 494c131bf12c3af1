// The decoder's compute graph: forward, fused LM head and backward, written against the backend
// interface (see decoder.h).
#include "backend/registry.h"
#include "model/decoder.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "core/labels.h"

namespace memtune {

Decoder::Decoder(const ModelConfig& config, const ModelOptions& options) : Decoder(config, options, nullptr) {}

namespace {
// A generation view's options: the base's LoRA (applied from the base's trainables) and backend.
ModelOptions view_options(const Decoder& base, ModelOptions options) {
  if (!options.inference()) throw Error("a generation view needs KV cache options");
  if (!options.adapter_sets.empty()) throw Error("a generation view uses its base model's adapter, not adapter sets");
  options.lora = base.options().lora;
  options.backend = &base.backend();
  options.with_grads = options.with_optimizer = options.optim_offload = false;
  options.zero_stage = 0;
  return options;
}
}  // namespace

Decoder::Decoder(Decoder& base, const ModelOptions& options)
    : Decoder(base.config(), view_options(base, options), &base.parameters()) {}

Decoder::Decoder(const ModelConfig& config, const ModelOptions& options, ModelParameters* borrowed)
    : config_(config),
      options_(options),
      backend_(options.backend ? options.backend : &default_backend()),
      step_work_(*backend_),
      plan_(std::make_unique<MemoryPlan>()),
      host_plan_(std::make_unique<MemoryPlan>()),
      own_params_(borrowed ? nullptr : std::make_unique<ModelParameters>(config, options, *plan_, *host_plan_)),
      params_(borrowed ? borrowed : own_params_.get()),
      buf_(declare_decoder_buffers(config, options, params_->specs(), *backend_, *plan_, *host_plan_,
                                   !params_->base_trainable())),
      half_(sixteen_bit_operands(config, options, *backend_)) {
  if (options.max_tokens <= 0) throw Error(fmt::format("max_tokens must be positive, got {}", options.max_tokens));
  const KvCacheOptions& kv = options.kv_cache;
  if (options.inference()) {
    MT_ASSERT(!options.with_grads && !options.with_optimizer, "an inference model has no gradients");
    if (kv.block_size <= 0 || kv.max_seqs <= 0 || kv.max_blocks_per_seq <= 0)
      throw Error(fmt::format("the KV cache needs positive block_size, max_seqs and max_blocks_per_seq, got {}, {}, {}",
                              kv.block_size, kv.max_seqs, kv.max_blocks_per_seq));
  }
  plan_->finalize();
  host_plan_->finalize();
  batch_positions_.reserve(static_cast<size_t>(options.max_tokens));
  batch_targets_.reserve(static_cast<size_t>(options.max_tokens));
  batch_last_rows_.reserve(static_cast<size_t>(kv.max_seqs));
  batch_cu_.reserve(static_cast<size_t>(kv.max_seqs) + 1);
  batch_adapters_.reserve(static_cast<size_t>(kv.max_seqs));
  step_key_.reserve(static_cast<size_t>(kv.max_seqs) + 3);
  if (router_aux_loss()) {
    const size_t E = static_cast<size_t>(config.moe.num_experts);
    router_aux_.selections.assign(E, 0.0);
    router_aux_.probabilities.assign(E, 0.0);
    router_aux_.dprobability.assign(E, 0.0f);
  }
  if (options.allocate) {
    arena_ = std::make_unique<Arena>(*plan_, backend_);
    if (host_plan_->peak_bytes() > 0) host_arena_ = std::make_unique<Arena>(*host_plan_, nullptr);
    const std::vector<float> inv_freq = rope_inv_freq(config_);
    backend_->copy_to_device(rope_freqs(), inv_freq.data());
  }
  if (own_params_) own_params_->bind(arena_.get(), host_arena_.get(), *backend_);
}

Tensor Decoder::weight_f32(size_t p) {
  const Tensor w = params_->param(p);
  if (w.dtype == DType::F32) return w;
  const bool vector = params_->specs()[p].shape.size() == 1;
  if (vector && buf_.vectors_f32) return widened_vector(p);
  const size_t phase = static_cast<size_t>(arena_->phase());
  Tensor out = vector ? arena_->f32(buf_.vector_f32[phase], {w.numel()})
                      : arena_->f32(buf_.matrix_f32[phase], {w.rows(), w.cols()});
  backend_->convert(out, w);
  return out;
}

// The frozen base's vectors, widened together the first time one is asked for after the weights
// changed (ModelParameters::values_version): a convert per vector per load, not per step.
void Decoder::widen_vectors() {
  if (widened_version_ == params_->values_version()) return;
  const std::vector<ParamSpec>& specs = params_->specs();
  const Tensor all = arena_->f32(*buf_.vectors_f32, {static_cast<int64_t>(frozen_vector_elems(config_, specs, true))});
  int64_t at = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].shape.size() != 1) continue;
    backend_->convert(all.flat_range(at, specs[i].numel()), params_->param(i));
    at += specs[i].numel();
  }
  widened_version_ = params_->values_version();
}

Tensor Decoder::widened_vector(size_t p) {
  widen_vectors();
  const std::vector<ParamSpec>& specs = params_->specs();
  const Tensor all = arena_->f32(*buf_.vectors_f32, {static_cast<int64_t>(frozen_vector_elems(config_, specs, true))});
  int64_t at = 0;
  for (size_t i = 0; i < p; ++i)
    if (specs[i].shape.size() == 1) at += specs[i].numel();
  MT_ASSERT(specs[p].shape.size() == 1, "widened_vector of a vector parameter");
  return all.flat_range(at, specs[p].numel());
}

Tensor Decoder::rounded(const Tensor& x, bool dout) {
  const BufferId buffer = dout ? buf_.half_dout : buf_.half_input[static_cast<size_t>(arena_->phase())];
  const Tensor out = arena_->view(buffer, *half_, {x.rows(), x.cols()});
  backend_->convert(out, x);
  return out;
}

Tensor Decoder::quantized_scratch(int64_t in) const {
  return arena_->f32(buf_.matrix_f32[static_cast<size_t>(arena_->phase())],
                     {static_cast<int64_t>(backend_->quantized_scratch_elems(in))});
}

void Decoder::upload_batch(const TokenBatch& batch) {
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
  backend_->copy_to_device(arena_->i32(buf_.ids, {N}), batch.input_ids.data());
  backend_->copy_to_device(arena_->i32(buf_.positions, {N}), pos.data());
  backend_->copy_to_device(arena_->i32(buf_.targets, {N}), tgt.data());
  backend_->copy_to_device(arena_->i32(buf_.cu_seqlens, {S + 1}), batch.cu_seqlens.data());
}

void Decoder::upload_generation_batch(const GenerationBatch& batch) {
  const KvCacheOptions& kv = options_.kv_cache;
  const int64_t N = static_cast<int64_t>(batch.input_ids.size());
  const int64_t S = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
  const int64_t R = static_cast<int64_t>(batch.sample_seqs.size());
  MT_ASSERT(N >= 1 && N <= options_.max_tokens, fmt::format("a generation step of {} tokens (planned {})", N,
                                                           options_.max_tokens));
  MT_ASSERT(S >= 1 && S <= kv.max_seqs && R <= S, fmt::format("a generation step of {} sequences, {} sampled (planned {})",
                                                              S, R, kv.max_seqs));
  MT_ASSERT(batch.cu_seqlens.front() == 0 && batch.cu_seqlens.back() == N && batch.context_lens.size() == size_t(S) &&
            batch.block_tables.size() == size_t(S * kv.max_blocks_per_seq));
  std::vector<int32_t>& pos = batch_positions_;
  std::vector<int32_t>& slots = batch_targets_;  // the same planned staging, holding cache slots here
  pos.resize(static_cast<size_t>(N));
  slots.resize(static_cast<size_t>(N));
  for (int64_t s = 0; s < S; ++s) {
    const int32_t begin = batch.cu_seqlens[s], end = batch.cu_seqlens[s + 1], ctx = batch.context_lens[s];
    MT_ASSERT(begin < end && end - begin <= ctx && ctx <= kv.max_blocks_per_seq * kv.block_size,
              fmt::format("sequence {}: {} new tokens, {} in the cache", s, end - begin, ctx));
    for (int32_t t = begin; t < end; ++t) {
      const int32_t id = batch.input_ids[t];
      if (id < 0 || id >= config_.vocab_size)
        throw Error(fmt::format("token id {} is outside the vocabulary [0, {})", id, config_.vocab_size));
      const int32_t p = ctx - (end - begin) + (t - begin);
      const int32_t block = batch.block_tables[s * kv.max_blocks_per_seq + p / kv.block_size];
      MT_ASSERT(block >= 0 && block < kv.blocks, fmt::format("block {} outside the pool of {}", block, kv.blocks));
      pos[t] = p;
      slots[t] = static_cast<int32_t>(block * kv.block_size + p % kv.block_size);
    }
  }
  batch_cu_.assign(batch.cu_seqlens.begin(), batch.cu_seqlens.end());
  batch_adapters_.clear();
  if (!batch.seq_adapters.empty()) {
    MT_ASSERT(batch.seq_adapters.size() == static_cast<size_t>(S));
    for (const int32_t k : batch.seq_adapters)
      MT_ASSERT(k >= -1 && k < static_cast<int32_t>(params_->num_adapter_sets()), fmt::format("adapter set {}", k));
    batch_adapters_.assign(batch.seq_adapters.begin(), batch.seq_adapters.end());
  }
  // Each sampled sequence's last new token.
  std::vector<int32_t>& rows = batch_last_rows_;
  rows.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const int32_t s = batch.sample_seqs[r];
    MT_ASSERT(s >= 0 && s < S);
    rows[r] = batch.cu_seqlens[s + 1] - 1;
  }
  num_tokens_ = N;
  num_seqs_ = S;
  sample_rows_ = R;
  Arena& A = *arena_;
  backend_->copy_to_device(A.i32(buf_.ids, {N}), batch.input_ids.data());
  backend_->copy_to_device(A.i32(buf_.positions, {N}), pos.data());
  backend_->copy_to_device(A.i32(buf_.slots, {N}), slots.data());
  backend_->copy_to_device(A.i32(buf_.cu_seqlens, {S + 1}), batch.cu_seqlens.data());
  backend_->copy_to_device(A.i32(buf_.context_lens, {S}), batch.context_lens.data());
  backend_->copy_to_device(A.i32(buf_.block_tables, {S * kv.max_blocks_per_seq}), batch.block_tables.data());
  if (R > 0) backend_->copy_to_device(A.i32(buf_.last_rows_index, {R}), rows.data());
}

void Decoder::generation_forward(const GenerationBatch& batch) {
  MT_ASSERT(options_.inference(), "generation_step needs a model planned with a KV cache");
  Arena& A = *arena_;
  Backend& be = *backend_;
  // Residency is sampled every kGenerationSampleSteps steps: mincore walks the whole arena, a
  // visible share of a short decode step, and decoding steps repeat (docs/benchmarks.md).
  const bool sample = generation_steps_++ % kGenerationSampleSteps == 0;
  A.enter_phase(Phase::Forward, sample);
  upload_generation_batch(batch);
  // The frozen base's vectors widened (where the weights changed) before any step's commands, so
  // that those are the same every time.
  if (buf_.vectors_f32) widen_vectors();
  // A decoding step (one new token per sequence) runs the same commands whenever its sequences,
  // sampled rows and adapters are the same: recorded once per such key, run again after (where
  // the backend keeps commands). The uploads above are the step's data. A mixture of experts
  // routes on the host, between its commands, so it records nothing.
  const int64_t N = num_tokens_, R = sample_rows_;
  const bool repeats = N == num_seqs_ && !config_.moe.enabled();
  if (repeats) {
    step_key_.assign({static_cast<int64_t>(reinterpret_cast<uintptr_t>(this)), N, R});
    step_key_.insert(step_key_.end(), batch_adapters_.begin(), batch_adapters_.end());
    if (be.replay_commands(step_key_)) {
      A.enter_phase(Phase::Loss, sample);
      return;
    }
    be.begin_commands(step_key_);
  }
  generation_commands(sample);
  if (repeats) be.end_commands();
}

void Decoder::generation_commands(bool sample) {
  Arena& A = *arena_;
  Backend& be = *backend_;
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const int64_t N = num_tokens_, R = sample_rows_;
  be.embedding_forward(act(buf_.residual[0], D), A.i32(buf_.ids, {N}), params_->param(params_->embed()));
  for (int64_t l = 0; l < L; ++l)
    layer_forward(l, buf_.fwd_scratch, act(buf_.residual[l % 2], D), act(buf_.residual[(l + 1) % 2], D), true);
  A.enter_phase(Phase::Loss, sample);
  if (R == 0) return;
  // The final norm and the head over the sampled rows only.
  const Tensor rows = A.f32(buf_.last_rows, {R, D}), normed = A.f32(buf_.last_normed, {R, D});
  be.gather_rows(rows, act(buf_.residual[L % 2], D), A.i32(buf_.last_rows_index, {R}));
  be.rmsnorm_forward(normed, A.f32(buf_.last_rstd, {R}), rows, weight_f32(params_->final_norm()),
                     static_cast<float>(c.rms_norm_eps));
  // The head over at most max_seqs rows, in its storage dtype (widened in registers), or packed.
  const size_t head = params_->head();
  if (params_->quantized(head))
    be.quantized_matmul_forward(A.f32(buf_.last_logits, {R, V}), normed, params_->quantized_param(head), Tensor{},
                                quantized_scratch(D));
  else
    be.matmul_forward(A.f32(buf_.last_logits, {R, V}), normed, params_->param(head), Tensor{});
}

StepLogits Decoder::generation_step(const GenerationBatch& batch) {
  generation_forward(batch);
  const int64_t R = sample_rows_, V = config_.vocab_size;
  if (R == 0) return {};
  const Tensor logits = arena_->f32(buf_.last_logits, {R, V});
  if (!buf_.stages_chunks) return {logits.as<const float>(), R, V};
  MT_ASSERT(buf_.staging_last_logits, "host logits of a generation step on this backend need ModelOptions::host_logits");
  float* host = host_arena_->f32(*buf_.staging_last_logits, {R, V}).as<float>();
  backend_->copy_to_host(host, logits);
  return {host, R, V};
}

void Decoder::sample_tokens(std::span<const SampleRow> rows, std::span<const PenaltyToken> penalties,
                            std::span<int32_t> tokens, SamplerScratch& scratch) {
  const int64_t R = sample_rows_;
  MT_ASSERT(static_cast<int64_t>(rows.size()) == R && static_cast<int64_t>(tokens.size()) == R,
            "one sampling row and one token per sampled sequence");
  if (R == 0) return;
  SampleArgs args{.logits = arena_->f32(buf_.last_logits, {R, config_.vocab_size}),
                  .rows = rows,
                  .penalties = penalties,
                  .tokens = tokens,
                  .host_scratch = &scratch};
  if (buf_.stages_chunks) {
    const auto P = static_cast<int64_t>(penalties.size());
    MT_ASSERT(P <= buf_.sample_penalty_capacity, "more penalty tokens than the sequences' planned cache slots");
    args.device_rows = arena_->i32(buf_.sample_rows, {R * kSampleRowWords});
    args.device_penalties = P ? arena_->i32(buf_.sample_penalties, {3 * P}) : Tensor{};
    args.device_tokens = arena_->i32(buf_.sampled_tokens, {R});
  }
  backend_->sample_tokens(args);
}

uint64_t Decoder::dropout_key(int64_t l, LinearSite s, std::optional<int64_t> expert) const {
  if (!dropout_seed_) return 0;  // no dropout
  return expert ? lora_expert_dropout_key(*dropout_seed_, l, s, *expert) : lora_dropout_key(*dropout_seed_, l, s);
}

Tensor Decoder::lora_input(uint64_t key, const Tensor& x) {
  const float p = static_cast<float>(options_.lora.dropout);
  if (p <= 0.0f || !dropout_seed_) return x;
  const Tensor out = arena_->f32(buf_.lora_xd[static_cast<size_t>(arena_->phase())], {x.rows(), x.cols()});
  backend_->dropout_forward(out, x, key, p);
  return out;
}

void Decoder::lora_forward(const ModelParameters::Linear& lin, uint64_t key, const Tensor& x, const Tensor& y,
                           const Tensor& u) {
  Backend& be = *backend_;
  const int64_t r = options_.lora.rank;
  const Tensor A = params_->trainable_value(lin.lora), B = params_->trainable_value(lin.lora + 1);
  be.matmul_forward(u, lora_input(key, x), Tensor(A.data, DType::F32, {r, lin.in}), Tensor{});
  be.matmul_accumulate(y, u, Tensor(B.data, DType::F32, {lin.out, r}), static_cast<float>(options_.lora.scaling()));
}

void Decoder::lora_backward(const ModelParameters::Linear& lin, uint64_t key, const Tensor& dy, const Tensor& x,
                            const Tensor& dx, const Tensor& u) {
  // y += s * u B^T, u = xd A^T:  du = s dy B, dB += s dy^T u, dA += du^T xd, dxd = du A.
  Backend& be = *backend_;
  const int64_t r = options_.lora.rank, rows = x.rows();
  const Tensor A(params_->trainable_value(lin.lora).data, DType::F32, {r, lin.in});
  const Tensor B(params_->trainable_value(lin.lora + 1).data, DType::F32, {lin.out, r});
  const Tensor dA(params_->trainable_grad(lin.lora).data, DType::F32, {r, lin.in});
  const Tensor dB(params_->trainable_grad(lin.lora + 1).data, DType::F32, {lin.out, r});
  const Tensor du = arena_->f32(buf_.lora_du, {rows, r});
  be.fill(du, 0.0f);
  be.matmul_backward(du, dB, Tensor{}, dy, u, B, static_cast<float>(options_.lora.scaling()));
  const Tensor xd = lora_input(key, x);
  if (xd.data == x.data) {
    be.matmul_backward(dx, dA, Tensor{}, du, x, A, 1.0f);
    return;
  }
  // Dropout: the same mask (regenerated from the key) routes the gradient back to x.
  const Tensor dxd = arena_->f32(buf_.lora_dxd, {rows, lin.in});
  be.fill(dxd, 0.0f);
  be.matmul_backward(dxd, dA, Tensor{}, du, xd, A, 1.0f);
  be.dropout_forward(dxd, dxd, key, static_cast<float>(options_.lora.dropout));
  be.add_inplace(dx, dxd);
}

void Decoder::linear_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y,
                             const Tensor& x16) {
  if (linear_input_observer_) linear_input_observer_(l, s, std::nullopt, x);
  product(params_->linear(l, s), x, y, x16);
  linear_adapters_forward(l, s, a, x, y);
}

void Decoder::product(const ModelParameters::Linear& lin, const Tensor& x, const Tensor& y, const Tensor& x16) {
  Backend& be = *backend_;
  // The weight and the bias widen into different scratch buffers (matrix / vector); a few rows
  // (decoding) read a 16-bit weight as it is stored, and quantized weights are never widened whole.
  if (params_->quantized(lin.weight)) {
    be.quantized_matmul_forward(y, x, params_->quantized_param(lin.weight), lin.bias ? weight_f32(*lin.bias) : Tensor{},
                                quantized_scratch(lin.in));
  } else if (sixteen_bit_step()) {  // 16-bit operands: the weight as stored, the input rounded
    be.matmul_forward(y, x16 ? x16 : rounded(x), params_->param(lin.weight), lin.bias ? weight_f32(*lin.bias) : Tensor{});
  } else {
    const Tensor w =
        num_tokens_ <= backend_->stored_weight_rows() ? params_->param(lin.weight) : weight_f32(lin.weight);
    be.matmul_forward(y, x, w, lin.bias ? weight_f32(*lin.bias) : Tensor{});
  }
}

namespace {
// Rows [r0, r0 + n) of a float32 matrix view.
Tensor row_range(const Tensor& t, int64_t r0, int64_t n) {
  return Tensor(t.flat_range(r0 * t.cols(), n * t.cols()).data, DType::F32, {n, t.cols()});
}
}  // namespace

const int64_t* Decoder::route(const Tensor& logits) {
  const MoeConfig& m = config_.moe;
  const MoeBuffers& b = *buf_.moe;
  const int64_t N = num_tokens_, E = m.num_experts, K = m.experts_per_token, R = N * K;
  Backend& be = *backend_;
  Arena& H = *host_arena_;
  // Softmax in float32, each token's K best experts (the first of equal ones), their weights
  // renormalized to sum to 1 where the config says so.
  float* probs = H.f32(b.host_logits, {N, E}).as<float>();
  be.copy_to_host(probs, logits);
  auto* choices = H.i32(b.host_choices, {R}).as<int32_t>();
  float* choice_weights = H.f32(b.host_choice_weights, {R}).as<float>();
  auto* offsets = static_cast<int64_t*>(H.raw(b.host_offsets));  // each expert's first row
  std::fill(offsets, offsets + E + 1, int64_t{0});
  for (int64_t n = 0; n < N; ++n) {
    float* z = probs + n * E;
    const float top = *std::max_element(z, z + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (z[e] = std::exp(z[e] - top));
    for (int64_t e = 0; e < E; ++e) z[e] /= sum;
    int32_t* chosen = choices + n * K;
    float* w = choice_weights + n * K;
    float chosen_sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      int32_t best = -1;
      for (int32_t e = 0; e < E; ++e)
        if (std::find(chosen, chosen + k, e) == chosen + k && (best < 0 || z[e] > z[best])) best = e;
      chosen[k] = best;
      w[k] = z[best];
      chosen_sum += z[best];
      ++offsets[best + 1];
    }
    if (m.norm_topk_prob)
      for (int64_t k = 0; k < K; ++k) w[k] /= chosen_sum;
  }
  // The auxiliary loss counts a step's forward pass (not a checkpointed layer's recomputation).
  if (router_aux_loss() && arena_->phase() == Phase::Forward) {
    RouterAux& aux = router_aux_;
    for (int64_t i = 0; i < R; ++i) aux.selections[static_cast<size_t>(choices[i])] += 1.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) aux.probabilities[static_cast<size_t>(e)] += probs[n * E + e];
    aux.rows += N;
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  // Rows grouped by expert, tokens in order within each expert; each token's rows ascending
  // (its experts in id order, the order its outputs are summed in, as transformers sums them).
  auto* tokens = H.i32(b.host_tokens, {R}).as<int32_t>();
  float* weights = H.f32(b.host_weights, {R}).as<float>();
  auto* token_rows = H.i32(b.host_token_rows, {N, K}).as<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    int32_t* own = token_rows + n * K;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = offsets[choices[n * K + k]]++;
      tokens[r] = static_cast<int32_t>(n);
      weights[r] = choice_weights[n * K + k];
      own[k] = static_cast<int32_t>(r);
    }
    std::sort(own, own + K);
  }
  for (int64_t e = E; e > 0; --e) offsets[e] = offsets[e - 1];  // each back to its first row
  offsets[0] = 0;
  be.copy_to_device(arena_->i32(b.tokens, {R}), tokens);
  be.copy_to_device(arena_->f32(b.weights, {R}), weights);
  be.copy_to_device(arena_->i32(b.token_rows, {N, K}), token_rows);
  return offsets;
}

Decoder::ExpertSites Decoder::expert_sites(int64_t l, const LayerActs& a, int64_t e, int64_t row0, int64_t rows) {
  const MoeConfig& m = config_.moe;
  const int64_t width = e < 0 ? m.shared_expert_intermediate_size : m.expert_intermediate_size;
  // Every routed row's activations, grouped by expert, then the shared expert's (its rows start at
  // row0 = N x k); or one expert's at a time.
  const int64_t first = a.expert_rows ? row0 * m.expert_intermediate_size : 0;
  auto view = [&](BufferId id, int64_t at, int64_t cols) {
    return Tensor(static_cast<float*>(arena_->raw(id)) + at, DType::F32, {rows, cols});
  };
  ExpertSites x{.gate = params_->expert_linear(l, e, LinearSite::Gate),
                .up = params_->expert_linear(l, e, LinearSite::Up),
                .down = params_->expert_linear(l, e, LinearSite::Down),
                .acts = {view(a.gate, first, width), view(a.up, first, width), view(a.h, first, width)},
                .lora_u = {},
                .keys = {}};
  const int64_t r = options_.lora.rank, lora_row = a.expert_rows ? row0 : 0;
  for (size_t k = 0; k < 3; ++k) {
    const LinearSite site = static_cast<LinearSite>(static_cast<size_t>(LinearSite::Gate) + k);
    if ((k == 0 ? x.gate : k == 1 ? x.up : x.down).lora < 0) continue;
    x.lora_u[k] = view(a.lora_u[static_cast<size_t>(site)], lora_row * r, r);
    x.keys[k] = dropout_key(l, site, e);
  }
  return x;
}

void Decoder::moe_forward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& x_out) {
  const ModelParameters::MoeParams& p = *params_->layer(l).moe;
  const MoeConfig& m = config_.moe;
  const MoeBuffers& b = *buf_.moe;
  const int64_t N = num_tokens_, D = config_.hidden_size, E = m.num_experts, K = m.experts_per_token, R = N * K;
  Backend& be = *backend_;
  const Tensor logits = arena_->f32(a.router, {N, E});
  const Tensor x16 = sixteen_bit_step() ? rounded(x) : Tensor{};
  product({p.router, std::nullopt, D, E}, x, logits, x16);
  // The shared expert's gate reads x as well, before the experts' inputs take x16's buffer.
  const Tensor shared_logit = p.shared ? arena_->f32(a.shared_logit, {N, 1}) : Tensor{};
  if (p.shared) product({*p.shared_gate, std::nullopt, D, 1}, x, shared_logit, x16);
  const int64_t* offsets = route(logits);
  // Each routed row's input, then each expert over its rows.
  const Tensor rows = arena_->f32(b.rows, {R, D}), outputs = arena_->f32(b.outputs, {R, D});
  be.gather_rows(rows, x, arena_->i32(b.tokens, {R}));
  // Expert e's MLP (-1: the shared expert) on its rows, whose activations start at row `row0` of
  // the layer's layout (LayerActs::expert_rows; 0 without).
  auto mlp = [&](int64_t e, int64_t row0, const Tensor& in, const Tensor& out) {
    const ExpertSites x = expert_sites(l, a, e, row0, in.rows());
    if (linear_input_observer_) linear_input_observer_(l, LinearSite::Gate, e, in);
    const Tensor in16 = sixteen_bit_step() ? rounded(in) : Tensor{};
    product(x.gate, in, x.acts.gate, in16);
    product(x.up, in, x.acts.up, in16);
    if (x.gate.lora >= 0) lora_forward(x.gate, x.keys[0], in, x.acts.gate, x.lora_u[0]);
    if (x.up.lora >= 0) lora_forward(x.up, x.keys[1], in, x.acts.up, x.lora_u[1]);
    if (!batch_adapters_.empty()) {
      expert_adapter_sets_forward(l, e, LinearSite::Gate, row0, a, in, x.acts.gate);
      expert_adapter_sets_forward(l, e, LinearSite::Up, row0, a, in, x.acts.up);
    }
    be.swiglu_forward(x.acts.h, x.acts.gate, x.acts.up);
    if (linear_input_observer_) linear_input_observer_(l, LinearSite::Down, e, x.acts.h);
    product(x.down, x.acts.h, out);
    if (x.down.lora >= 0) lora_forward(x.down, x.keys[2], x.acts.h, out, x.lora_u[2]);
    if (!batch_adapters_.empty()) expert_adapter_sets_forward(l, e, LinearSite::Down, row0, a, x.acts.h, out);
  };
  if (!routed_experts_grouped(l, a))
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[e], c = offsets[e + 1] - r0;
      if (c > 0) mlp(e, r0, row_range(rows, r0, c), row_range(outputs, r0, c));
    }
  be.fill(x_out, 0.0f);
  be.combine_rows(x_out, outputs, arena_->i32(b.token_rows, {N, K}), arena_->f32(b.weights, {R}));
  if (!p.shared) return;
  // The shared expert on every token, scaled by sigmoid(shared_expert_gate . x).
  const Tensor shared_out = row_range(outputs, 0, N);
  mlp(-1, R, x, shared_out);
  be.combine_rows(x_out, shared_out, Tensor{}, shared_expert_weights(a));
}

bool Decoder::routed_experts_grouped(int64_t l, const LayerActs& a) {
  // Few rows (decoding) read each routed expert's weights as stored, every expert of the step in
  // one matmul_forward_group for gate / up and one for down, where nothing else reads an expert's
  // rows one expert at a time (adapters, a calibration observer) and every routed row's
  // activations fit the layer's gate / up / h (they do with expert_rows; a forward-only plan holds
  // max_tokens x one expert's width, which decoding's few tokens x k rows fit).
  const MoeConfig& m = config_.moe;
  const int64_t N = num_tokens_, R = N * m.experts_per_token, Ie = m.expert_intermediate_size;
  if (N > backend_->stored_weight_rows() || sixteen_bit_step() || linear_input_observer_ || !batch_adapters_.empty() ||
      R * Ie > options_.max_tokens * mlp_width(config_, a.expert_rows))
    return false;
  const ModelParameters::MoeParams& p = *params_->layer(l).moe;
  for (const ModelParameters::ExpertParams& x : p.experts)
    for (const int lora : x.lora)
      if (lora >= 0) return false;
  const MoeBuffers& b = *buf_.moe;
  const auto* offsets = static_cast<const int64_t*>(host_arena_->raw(b.host_offsets));
  const int64_t D = config_.hidden_size;
  const Tensor rows = arena_->f32(b.rows, {R, D}), outputs = arena_->f32(b.outputs, {R, D});
  // Every routed row's gate / up / h at its row of the layer's layout, as expert_rows lays them.
  auto acts = [&](BufferId id, int64_t r0, int64_t c) {
    return Tensor(static_cast<float*>(arena_->raw(id)) + r0 * Ie, DType::F32, {c, Ie});
  };
  constexpr size_t kMembers = 32;  // gate / up of 16 experts, or down of 32, a group
  std::array<GroupMember, kMembers> group;
  std::array<QuantizedWeight, kMembers> packed;
  size_t n = 0;
  auto add = [&](size_t weight, const Tensor& x, const Tensor& y) {
    GroupMember& g = group[n] = GroupMember{};
    g.out = y;
    g.inp = x;
    if (params_->quantized(weight)) {
      packed[n] = params_->quantized_param(weight);
      g.quantized = &packed[n];
    } else {
      g.weight = params_->param(weight);
    }
    ++n;
  };
  auto flush = [&](int64_t in) {
    if (n > 0) backend_->matmul_forward_group(std::span(group.data(), n), Tensor{}, quantized_scratch(in));
    n = 0;
  };
  for (int64_t e = 0; e < m.num_experts; ++e) {
    const int64_t r0 = offsets[e], c = offsets[e + 1] - r0;
    if (c == 0) continue;
    if (n + 2 > kMembers) flush(D);
    const ModelParameters::ExpertParams& x = p.experts[static_cast<size_t>(e)];
    add(x.gate, row_range(rows, r0, c), acts(a.gate, r0, c));
    add(x.up, row_range(rows, r0, c), acts(a.up, r0, c));
  }
  flush(D);
  backend_->swiglu_forward(acts(a.h, 0, R), acts(a.gate, 0, R), acts(a.up, 0, R));
  for (int64_t e = 0; e < m.num_experts; ++e) {
    const int64_t r0 = offsets[e], c = offsets[e + 1] - r0;
    if (c == 0) continue;
    if (n + 1 > kMembers) flush(Ie);
    add(p.experts[static_cast<size_t>(e)].down, acts(a.h, r0, c), row_range(outputs, r0, c));
  }
  flush(Ie);
  return true;
}

Tensor Decoder::shared_expert_weights(const LayerActs& a) {
  const MoeBuffers& b = *buf_.moe;
  const int64_t N = num_tokens_;
  float* sig = host_arena_->f32(b.host_shared_weights, {N}).as<float>();
  backend_->copy_to_host(sig, arena_->f32(a.shared_logit, {N}));
  for (int64_t n = 0; n < N; ++n) sig[n] = 1.0f / (1.0f + std::exp(-sig[n]));
  const Tensor weights = arena_->f32(b.shared_weights, {N});
  backend_->copy_to_device(weights, sig);
  return weights;
}

void Decoder::expert_adapter_sets_forward(int64_t l, int64_t e, LinearSite s, int64_t row0, const LayerActs& a,
                                          const Tensor& x, const Tensor& y) {
  // Each row's token: the routing's (host staging) for a routed expert, the row itself for the
  // shared expert; its sequence's adapter set. Rows run in token order, so sequences are runs.
  const auto* tokens = e < 0 ? nullptr : static_cast<const int32_t*>(host_arena_->raw(buf_.moe->host_tokens)) + row0;
  auto adapter_of = [&](int64_t i) {
    const int32_t token = tokens ? tokens[i] : static_cast<int32_t>(i);
    const auto q = std::upper_bound(batch_cu_.begin(), batch_cu_.begin() + num_seqs_ + 1, token) - batch_cu_.begin() - 1;
    return batch_adapters_[static_cast<size_t>(q)];
  };
  auto rows = [](const Tensor& t, int64_t begin, int64_t end) { return row_range(t, begin, end - begin); };
  for (int64_t i = 0; i < x.rows();) {
    const int32_t k = adapter_of(i);
    int64_t j = i + 1;
    while (j < x.rows() && adapter_of(j) == k) ++j;
    if (k >= 0) {
      const auto [A, B] = params_->adapter_expert(static_cast<size_t>(k), l, e, s);
      if (A) {
        const Tensor u = arena_->f32(a.adapter_u, {j - i, A.rows()});
        backend_->matmul_forward(u, rows(x, i, j), A, Tensor{});
        backend_->matmul_accumulate(rows(y, i, j), u, B,
                                    static_cast<float>(params_->adapter_set_config(static_cast<size_t>(k)).scaling()));
      }
    }
    i = j;
  }
}

void Decoder::moe_backward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& dy, const Tensor& dx) {
  MT_ASSERT(a.expert_rows, "a sparse layer's backward reads every routed row's activations");
  const ModelParameters::MoeParams& p = *params_->layer(l).moe;
  const MoeConfig& m = config_.moe;
  const MoeBuffers& b = *buf_.moe;
  const int64_t N = num_tokens_, D = config_.hidden_size, E = m.num_experts, K = m.experts_per_token, R = N * K;
  Backend& be = *backend_;
  Arena& H = *host_arena_;
  const int64_t* offsets = route(arena_->f32(a.router, {N, E}));
  const Tensor rows = arena_->f32(b.rows, {R, D}), outputs = arena_->f32(b.outputs, {R, D});
  const Tensor tokens = arena_->i32(b.tokens, {R}), dweights = arena_->f32(b.dweights, {R});
  be.gather_rows(rows, x, tokens);
  // An expert's output again (it is not kept): down(h), with its adapter.
  auto expert_output = [&](const ExpertSites& x, const Tensor& out) {
    product(x.down, x.acts.h, out);
    if (x.down.lora < 0) return;
    const Tensor B = params_->trainable_value(x.down.lora + 1);
    be.matmul_accumulate(out, x.lora_u[2], Tensor(B.data, DType::F32, {D, options_.lora.rank}),
                         static_cast<float>(options_.lora.scaling()));
  };
  // One expert's MLP backward from d(out) (which then receives d(in) unless d_in is given
  // elsewhere): out = down(silu(gate(in)) * up(in)).
  auto mlp_backward = [&](const ExpertSites& x, const Tensor& dout, const Tensor& in, const Tensor& din) {
    const int64_t c = in.rows(), width = x.acts.h.cols();
    const Tensor dh = arena_->f32(buf_.dh, {c, width}), dgate = arena_->f32(buf_.dgate, {c, width}),
                 dup = arena_->f32(buf_.dup, {c, width});
    be.fill(dh, 0.0f);
    product_backward(x.down, dout, x.acts.h, dh);
    if (x.down.lora >= 0) lora_backward(x.down, x.keys[2], dout, x.acts.h, dh, x.lora_u[2]);
    be.fill(dgate, 0.0f);
    be.fill(dup, 0.0f);
    be.swiglu_backward(dgate, dup, dh, x.acts.gate, x.acts.up);
    if (din.data == dout.data) be.fill(din, 0.0f);  // d(out) is spent
    product_backward(x.gate, dgate, in, din);
    if (x.gate.lora >= 0) lora_backward(x.gate, x.keys[0], dgate, in, din, x.lora_u[0]);
    product_backward(x.up, dup, in, din);
    if (x.up.lora >= 0) lora_backward(x.up, x.keys[1], dup, in, din, x.lora_u[1]);
  };
  float* dw = H.f32(b.host_dweights, {R}).as<float>();
  if (p.shared) {
    // x_out += sigmoid(s) * shared(x), s = shared_expert_gate . x.
    const Tensor shared_weights = shared_expert_weights(a);
    const float* sig = H.f32(b.host_shared_weights, {N}).as<float>();
    const ExpertSites shared = expert_sites(l, a, -1, R, N);
    const Tensor out = row_range(outputs, 0, N), dots = dweights.flat_range(0, N);
    expert_output(shared, out);
    be.combine_rows_backward(out, dots, out, dy, Tensor{}, shared_weights);
    mlp_backward(shared, out, x, dx);
    be.copy_to_host(dw, dots);
    for (int64_t n = 0; n < N; ++n) dw[n] *= sig[n] * (1.0f - sig[n]);
    const Tensor ds = arena_->f32(b.shared_grad, {N, 1});
    be.copy_to_device(ds, dw);
    product_backward({*p.shared_gate, std::nullopt, D, 1}, ds, x, dx);
  }
  // The routed experts: their outputs again (not kept), then d(weight) of each row and d(out).
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], c = offsets[e + 1] - r0;
    if (c > 0)
      expert_output(expert_sites(l, a, e, r0, c), row_range(outputs, r0, c));
  }
  be.combine_rows_backward(outputs, dweights, outputs, dy, tokens, arena_->f32(b.weights, {R}));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], c = offsets[e + 1] - r0;
    if (c == 0) continue;
    const Tensor d = row_range(outputs, r0, c);
    mlp_backward(expert_sites(l, a, e, r0, c), d, row_range(rows, r0, c), d);
  }
  // Each token's rows' input gradients summed into dx.
  const Tensor ones = arena_->f32(b.ones, {R});
  be.fill(ones, 1.0f);
  be.combine_rows(dx, outputs, arena_->i32(b.token_rows, {N, K}), ones);
  // The router: d(weights) through the renormalization, the auxiliary loss's d(probabilities),
  // then the softmax, on the host; its logits' gradient back through the router's product.
  be.copy_to_host(dw, dweights);
  const auto* row_tokens = H.i32(b.host_tokens, {R}).as<int32_t>();
  const auto* choices = H.i32(b.host_choices, {R}).as<int32_t>();
  const float* choice_weights = H.f32(b.host_choice_weights, {R}).as<float>();
  float* dchoice = H.f32(b.host_choice_grads, {R}).as<float>();  // per token and choice k
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const int32_t* own = choices + int64_t{row_tokens[r]} * K;
      dchoice[(own - choices) + (std::find(own, own + K, e) - own)] = dw[r];
    }
  float* probs = H.f32(b.host_logits, {N, E}).as<float>();
  const bool aux = router_aux_loss();
  for (int64_t n = 0; n < N; ++n) {
    float* z = probs + n * E;  // probabilities in, d(logits) out
    const int32_t* chosen = choices + n * K;
    float* g = dchoice + n * K;  // d(weight), then p x d(probability) of each choice
    if (m.norm_topk_prob) {
      float chosen_sum = 0.0f, dot = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        chosen_sum += z[chosen[k]];
        dot += g[k] * choice_weights[n * K + k];
      }
      for (int64_t k = 0; k < K; ++k) g[k] = (g[k] - dot) / chosen_sum;
    }
    float dot = 0.0f;  // sum over experts of p x d(probability)
    for (int64_t k = 0; k < K; ++k) dot += (g[k] *= z[chosen[k]]);
    if (aux)
      for (int64_t e = 0; e < E; ++e) dot += z[e] * router_aux_.dprobability[static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e)
      z[e] *= (aux ? router_aux_.dprobability[static_cast<size_t>(e)] : 0.0f) - dot;
    for (int64_t k = 0; k < K; ++k) z[chosen[k]] += g[k];
  }
  const Tensor dlogits = arena_->f32(b.router_grad, {N, E});
  be.copy_to_device(dlogits, probs);
  product_backward({p.router, std::nullopt, D, E}, dlogits, x, dx);
}

void Decoder::linear_group_forward(int64_t l, std::span<const SiteOutput> sites, const LayerActs& a,
                                      const Tensor& x, const Tensor& swiglu) {
  MT_ASSERT(!swiglu || (sites.size() == 2 && sites[0].site == LinearSite::Gate && sites[1].site == LinearSite::Up));
  // The activation joins the products' pass unless adapters add to gate or up after them.
  const bool adapted = swiglu && (!batch_adapters_.empty() || params_->linear(l, LinearSite::Gate).lora >= 0 ||
                                  params_->linear(l, LinearSite::Up).lora >= 0);
  // Many rows widen each weight into one shared scratch buffer: one layer at a time. With 16-bit
  // products the input is rounded once for the group.
  if (sixteen_bit_step() || num_tokens_ > backend_->stored_weight_rows()) {
    const Tensor x16 = sixteen_bit_step() ? rounded(x) : Tensor{};
    // Gate, up and the activation in one pass where both weights are read as stored (16-bit
    // operands, or float32 weights: not quantized, not widened one at a time into the one matrix
    // scratch) and both biases are live at once (float32, or 16-bit ones widened once:
    // weight_f32 would otherwise widen both into the one vector scratch).
    const auto fuses = [&] {
      for (const LinearSite site : {LinearSite::Gate, LinearSite::Up}) {
        const ModelParameters::Linear lin = params_->linear(l, site);
        if (params_->quantized(lin.weight)) return false;
        if (!sixteen_bit_step() && params_->param(lin.weight).dtype != DType::F32) return false;
        if (lin.bias && params_->param(*lin.bias).dtype != DType::F32 && !buf_.vectors_f32) return false;
      }
      return true;
    };
    if (swiglu && !adapted && fuses()) {
      std::array<GroupMember, 2> gate_up;
      for (size_t i = 0; i < 2; ++i) {
        const ModelParameters::Linear lin = params_->linear(l, sites[i].site);
        if (linear_input_observer_) linear_input_observer_(l, sites[i].site, std::nullopt, x);
        gate_up[i] = GroupMember{sites[i].y, params_->param(lin.weight), lin.bias ? weight_f32(*lin.bias) : Tensor{},
                                 nullptr, Tensor{}};
      }
      return backend_->matmul_forward_group_swiglu(gate_up, x16 ? x16 : x, Tensor{}, swiglu);
    }
    for (const SiteOutput& s : sites) linear_forward(l, s.site, a, x, s.y, x16);
    if (swiglu) backend_->swiglu_forward(swiglu, sites[0].y, sites[1].y);
    return;
  }
  constexpr size_t kMaxSites = DecoderBuffers::kMaxGroupSites;
  MT_ASSERT(sites.size() <= kMaxSites);
  std::array<GroupMember, kMaxSites> group;
  std::array<Tensor, kMaxSites> stored_bias;
  std::array<QuantizedWeight, kMaxSites> packed;
  bool quantized = false;
  int64_t widened = 0;  // 16-bit bias elements
  for (size_t i = 0; i < sites.size(); ++i) {
    const ModelParameters::Linear lin = params_->linear(l, sites[i].site);
    if (linear_input_observer_) linear_input_observer_(l, sites[i].site, std::nullopt, x);
    group[i].out = sites[i].y;
    if (lin.bias) stored_bias[i] = params_->param(*lin.bias);
    if (stored_bias[i] && stored_bias[i].dtype != DType::F32) widened += stored_bias[i].numel();
    if (params_->quantized(lin.weight)) {
      packed[i] = params_->quantized_param(lin.weight);
      group[i].quantized = &packed[i];
      quantized = true;
    } else {
      group[i].weight = params_->param(lin.weight);
    }
  }
  // The members' 16-bit biases are all live at once, so they widen into the matrix scratch (the
  // vector scratch holds one vector only), past what the quantized members use of it.
  const int64_t first =
      quantized ? static_cast<int64_t>(backend_->quantized_scratch_used(num_tokens_, x.cols())) : 0;
  if (buf_.vectors_f32) widened = 0;
  const Tensor biases = widened ? arena_->f32(buf_.matrix_f32[static_cast<size_t>(arena_->phase())],
                                              {first + widened})
                                : Tensor{};
  int64_t at = first;
  for (size_t i = 0; i < sites.size(); ++i) {
    group[i].bias = stored_bias[i];
    if (!stored_bias[i] || stored_bias[i].dtype == DType::F32) continue;
    if (buf_.vectors_f32) {  // widened once
      group[i].bias = weight_f32(*params_->linear(l, sites[i].site).bias);
      continue;
    }
    group[i].bias = biases.flat_range(at, stored_bias[i].numel());
    backend_->convert(group[i].bias, stored_bias[i]);
    at += stored_bias[i].numel();
  }
  const std::span<const GroupMember> members(group.data(), sites.size());
  const Tensor scratch = quantized ? quantized_scratch(x.cols()) : Tensor{};
  if (swiglu && !adapted) return backend_->matmul_forward_group_swiglu(members, x, scratch, swiglu);
  backend_->matmul_forward_group(members, x, scratch);
  for (const SiteOutput& s : sites) linear_adapters_forward(l, s.site, a, x, s.y);
  if (swiglu) backend_->swiglu_forward(swiglu, sites[0].y, sites[1].y);
}

void Decoder::linear_adapters_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x,
                                         const Tensor& y) {
  const ModelParameters::Linear lin = params_->linear(l, s);
  if (!batch_adapters_.empty()) adapter_sets_forward(l, s, a, x, y);
  if (lin.lora >= 0)
    lora_forward(lin, dropout_key(l, s), x, y, act(a.lora_u[static_cast<size_t>(s)], options_.lora.rank));
}

void Decoder::adapter_sets_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y) {
  auto rows = [](const Tensor& t, int64_t begin, int64_t end) {
    return Tensor(t.as<float>() + begin * t.cols(), DType::F32, {end - begin, t.cols()});
  };
  // Runs of consecutive sequences with the same adapter are one pair of products.
  for (int64_t q = 0; q < num_seqs_;) {
    const int32_t k = batch_adapters_[static_cast<size_t>(q)];
    int64_t q_end = q + 1;
    while (q_end < num_seqs_ && batch_adapters_[static_cast<size_t>(q_end)] == k) ++q_end;
    const int64_t begin = batch_cu_[static_cast<size_t>(q)], end = batch_cu_[static_cast<size_t>(q_end)];
    q = q_end;
    if (k < 0) continue;
    const Tensor A = params_->adapter_a(static_cast<size_t>(k), l, s);
    if (!A) continue;
    const Tensor B = params_->adapter_b(static_cast<size_t>(k), l, s);
    const Tensor u = arena_->f32(a.adapter_u, {end - begin, A.rows()});
    backend_->matmul_forward(u, rows(x, begin, end), A, Tensor{});
    backend_->matmul_accumulate(rows(y, begin, end), u, B,
                                static_cast<float>(params_->adapter_set_config(static_cast<size_t>(k)).scaling()));
  }
}

void Decoder::product_backward(const ModelParameters::Linear& lin, const Tensor& dy, const Tensor& x,
                               const Tensor& dx) {
  Backend& be = *backend_;
  if (params_->quantized(lin.weight)) {  // frozen (QLoRA): only the input's gradient goes through it
    be.quantized_matmul_backward_input(dx, dy, params_->quantized_param(lin.weight), quantized_scratch(lin.in));
  } else if (sixteen_bit_step()) {  // 16-bit operands: dy rounded, and x too where the weight has a gradient
    const Tensor dweight = base_grad_or_none(lin.weight);
    be.matmul_backward(dx, dweight, lin.bias ? base_grad_or_none(*lin.bias) : Tensor{}, rounded(dy, true),
                       dweight ? rounded(x) : x, params_->param(lin.weight), 1.0f);
  } else {
    be.matmul_backward(dx, base_grad_or_none(lin.weight), lin.bias ? base_grad_or_none(*lin.bias) : Tensor{}, dy, x,
                       weight_f32(lin.weight), 1.0f);
  }
}

void Decoder::linear_backward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& dy, const Tensor& x,
                                 const Tensor& dx) {
  const ModelParameters::Linear lin = params_->linear(l, s);
  product_backward(lin, dy, x, dx);
  if (lin.lora >= 0)
    lora_backward(lin, dropout_key(l, s), dy, x, dx, act(a.lora_u[static_cast<size_t>(s)], options_.lora.rank));
}

void Decoder::layer_forward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& x_out, bool chained) {
  const auto& p = params_->layer(l);
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Hq = c.num_attention_heads, hd = c.head_dim();
  const float eps = static_cast<float>(c.rms_norm_eps);
  Backend& be = *backend_;
  const Tensor pos = arena_->i32(buf_.positions, {num_tokens_}), freqs = rope_freqs();
  const Tensor ln1 = act(a.ln1, D), q = act(a.q, qd), k = act(a.k, kvd), v = act(a.v, kvd), att = act(a.att, qd);
  const Tensor res1 = act(a.res1, D), ln2 = act(a.ln2, D);

  const bool input_normed = chained && l > 0, norm_next = chained && l + 1 < c.num_hidden_layers;
  if (!input_normed) be.rmsnorm_forward(ln1, act(a.rstd1, 1), x, weight_f32(p.ln1), eps);
  if (c.qk_norm) {
    // Qwen3: q and k are normalized over each head (rows of head_dim) before RoPE.
    const Tensor q_raw = act(a.q_raw, qd), k_raw = act(a.k_raw, kvd);
    linear_group_forward(l, std::array{SiteOutput{LinearSite::Q, q_raw}, SiteOutput{LinearSite::K, k_raw},
                                       SiteOutput{LinearSite::V, v}},
                         a, ln1);
    be.rmsnorm_forward(per_head(q, hd), act_rows(a.rstd_q, Hq), per_head(q_raw, hd), weight_f32(*p.q_norm), eps);
    be.rmsnorm_forward(per_head(k, hd), act_rows(a.rstd_k, c.num_key_value_heads), per_head(k_raw, hd),
                       weight_f32(*p.k_norm), eps);
  } else {
    linear_group_forward(
        l, std::array{SiteOutput{LinearSite::Q, q}, SiteOutput{LinearSite::K, k}, SiteOutput{LinearSite::V, v}}, a,
        ln1);
  }
  be.rope_forward_pair(q, k, pos, freqs);
  if (options_.inference()) {
    const KvCacheOptions& kv = options_.kv_cache;
    const int64_t slots = kv.blocks * kv.block_size;
    const Tensor kc = arena_->view(buf_.kv_k[l], c.torch_dtype, {slots, kvd});
    const Tensor vc = arena_->view(buf_.kv_v[l], c.torch_dtype, {slots, kvd});
    be.kv_cache_write(kc, vc, k, v, arena_->i32(buf_.slots, {num_tokens_}));
    be.paged_attention_forward(att, q, kc, vc, arena_->i32(buf_.block_tables, {num_seqs_, kv.max_blocks_per_seq}),
                               arena_->i32(buf_.cu_seqlens, {num_seqs_ + 1}),
                               arena_->i32(buf_.context_lens, {num_seqs_}), hd, kv.block_size);
  } else {
    be.attention_forward(att, act(a.lse, Hq), q, k, v, arena_->i32(buf_.cu_seqlens, {num_seqs_ + 1}), hd,
                         attention_operands());
  }
  linear_forward(l, LinearSite::O, a, att, res1);
  be.add_rmsnorm_forward(ln2, act(a.rstd2, 1), res1, x, weight_f32(p.ln2), eps);
  if (p.moe) {
    moe_forward(l, a, ln2, x_out);
  } else {
    const Tensor gate = act(a.gate, I), up = act(a.up, I), h = act(a.h, I);
    linear_group_forward(l, std::array{SiteOutput{LinearSite::Gate, gate}, SiteOutput{LinearSite::Up, up}}, a, ln2,
                         h);
    linear_forward(l, LinearSite::Down, a, h, x_out);
  }
  if (norm_next)  // x_out += res1, then layer l + 1's input norm of it, in one pass
    be.add_rmsnorm_forward(ln1, act(a.rstd1, 1), x_out, res1, weight_f32(params_->layer(l + 1).ln1), eps);
  else
    be.add_inplace(x_out, res1);
}

// Gradient of layer l. On entry dstream holds d(loss)/d(layer output); on exit d(loss)/d(x).
void Decoder::layer_backward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& dstream) {
  const auto& p = params_->layer(l);
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Hq = c.num_attention_heads, hd = c.head_dim();
  Backend& be = *backend_;
  const Tensor pos = arena_->i32(buf_.positions, {num_tokens_}), freqs = rope_freqs();
  const Tensor dln = act(buf_.dln, D);
  const Tensor datt = act(buf_.datt, qd), dq = act(buf_.dq, qd), dk = act(buf_.dk, kvd), dv = act(buf_.dv, kvd);

  // MLP: x_out = res1 + down(silu(gate(ln2)) * up(ln2)), or a sparse layer's experts
  be.fill(dln, 0.0f);
  if (p.moe) {
    moe_backward(l, a, act(a.ln2, D), dstream, dln);
  } else {
    const Tensor dh = act(buf_.dh, I), dgate = act(buf_.dgate, I), dup = act(buf_.dup, I);
    be.fill(dh, 0.0f);
    linear_backward(l, LinearSite::Down, a, dstream, act(a.h, I), dh);
    be.fill(dgate, 0.0f);
    be.fill(dup, 0.0f);
    be.swiglu_backward(dgate, dup, dh, act(a.gate, I), act(a.up, I));
    linear_backward(l, LinearSite::Gate, a, dgate, act(a.ln2, D), dln);
    linear_backward(l, LinearSite::Up, a, dup, act(a.ln2, D), dln);
  }
  be.rmsnorm_backward(dstream, base_grad_or_none(p.ln2), dln, act(a.res1, D), weight_f32(p.ln2), act(a.rstd2, 1));
  // Attention: res1 = x + o(attn(rope(q(ln1)), rope(k(ln1)), v(ln1)))
  be.fill(datt, 0.0f);
  linear_backward(l, LinearSite::O, a, dstream, act(a.att, qd), datt);
  be.attention_backward(dq, dk, dv, datt, act(a.att, qd), act(a.lse, Hq), act(a.q, qd), act(a.k, kvd), act(a.v, kvd),
                        arena_->i32(buf_.cu_seqlens, {num_seqs_ + 1}), hd, attention_operands());
  be.rope_backward_pair(dq, dk, pos, freqs);
  Tensor dq_in = dq, dk_in = dk;  // d(loss)/d(q and k projections)
  if (c.qk_norm) {
    dq_in = act(buf_.dq_raw, qd);
    dk_in = act(buf_.dk_raw, kvd);
    be.fill(dq_in, 0.0f);
    be.fill(dk_in, 0.0f);
    be.rmsnorm_backward(per_head(dq_in, hd), base_grad_or_none(*p.q_norm), per_head(dq, hd),
                        per_head(act(a.q_raw, qd), hd), weight_f32(*p.q_norm), act_rows(a.rstd_q, Hq));
    be.rmsnorm_backward(per_head(dk_in, hd), base_grad_or_none(*p.k_norm), per_head(dk, hd),
                        per_head(act(a.k_raw, kvd), hd), weight_f32(*p.k_norm),
                        act_rows(a.rstd_k, c.num_key_value_heads));
  }
  be.fill(dln, 0.0f);
  linear_backward(l, LinearSite::Q, a, dq_in, act(a.ln1, D), dln);
  linear_backward(l, LinearSite::K, a, dk_in, act(a.ln1, D), dln);
  linear_backward(l, LinearSite::V, a, dv, act(a.ln1, D), dln);
  be.rmsnorm_backward(dstream, base_grad_or_none(p.ln1), dln, x, weight_f32(p.ln1), act(a.rstd1, 1));
}

LossSum Decoder::forward_backward(const TokenBatch& batch, float* logits_out) {
  return run_step(batch, logits_out, options_.with_grads);
}

LossSum Decoder::run_step(const TokenBatch& batch, float* logits_out, bool backward) {
  Arena& A = *arena_;
  Backend& be = *backend_;
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const bool ckpt = options_.gradient_checkpointing || !options_.with_grads;

  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  timings_ = {};
  step_work_.begin();
  auto t0 = Clock::now();
  be.time_mark(0);
  A.enter_phase(Phase::Forward);
  upload_batch(batch);
  const int64_t N = num_tokens_;
  if (router_aux_loss()) {
    std::fill(router_aux_.selections.begin(), router_aux_.selections.end(), 0.0);
    std::fill(router_aux_.probabilities.begin(), router_aux_.probabilities.end(), 0.0);
    router_aux_.rows = 0;
  }
  be.embedding_forward(act(buf_.residual[0], D), A.i32(buf_.ids, {N}), params_->param(params_->embed()));
  for (int64_t l = 0; l < L; ++l)
    layer_forward(l, ckpt ? buf_.fwd_scratch : buf_.saved[l], act(buf_.residual[l], D), act(buf_.residual[l + 1], D));

  timings_.forward = seconds_since(t0);
  be.time_mark(1);
  t0 = Clock::now();
  A.enter_phase(Phase::Loss);
  const Tensor normed = act(buf_.normed, D);
  be.rmsnorm_forward(normed, act(buf_.rstd_final, 1), act(buf_.residual[L], D), weight_f32(params_->final_norm()),
                     static_cast<float>(c.rms_norm_eps));
  if (logits_out) {  // debugging only: computed on the host from copies, in the caller's memory
    const size_t h = params_->head();
    const std::vector<float> hidden = download_f32(be, normed),
                             head = params_->quantized(h) ? params_->dequantized(h) : download_f32(be, params_->param(h));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < V; ++v) {
        double s = 0.0;
        for (int64_t d = 0; d < D; ++d) s += double(hidden[n * D + d]) * head[v * D + d];
        logits_out[n * V + v] = static_cast<float>(s);
      }
  }
  const bool grads = backward;
  const int64_t chunk = buf_.chunk_rows;
  // A packed head (quant.lm_head_bits) is frozen: no dweight.
  const bool packed_head = params_->quantized(params_->head());
  const QuantizedWeight packed = packed_head ? params_->quantized_param(params_->head()) : QuantizedWeight{};
  LmHeadArgs head{.hidden = normed,
                  .targets = A.i32(buf_.targets, {N}),
                  .weight = packed_head ? Tensor{} : params_->param(params_->head()),
                  .quantized = packed_head ? &packed : nullptr,
                  .loss = loss_,
                  .dhidden = grads ? act(buf_.dnormed, D) : Tensor{},
                  .dweight = grads && !packed_head ? base_grad_or_none(params_->head()) : Tensor{},
                  .grad_scale = grad_scale_,
                  .observer = observer_,
                  .host_targets = batch_targets_,
                  .defer_sum = grads && defer_loss_sum_,
                  .operands = half_.value_or(DType::F32),
                  .logits = A.f32(buf_.logits_chunk, {chunk, V}),
                  .rows = A.f32(buf_.rows, {chunk, D}),
                  .drows = A.f32(buf_.drows, {chunk, D}),
                  .positions = A.i32(buf_.loss_positions, {N}),
                  .row_targets = A.i32(buf_.row_targets, {chunk}),
                  .weight_slice = buf_.head_slice_rows ? A.f32(buf_.head_slice, {buf_.head_slice_rows, D}) : Tensor{},
                  .product_slice = buf_.head_product_slice_cols
                                       ? A.f32(buf_.head_product_slice, {chunk, buf_.head_product_slice_cols})
                                       : Tensor{},
                  .row_stats = A.i32(buf_.row_stats, {N, 4}),
                  .row_losses = buf_.stages_chunks ? A.f32(buf_.row_losses, {N}) : Tensor{},
                  .staging = {}};
  if (buf_.stages_chunks) {
    Arena& H = *host_arena_;
    head.staging = {.logits = buf_.staging_logits ? H.f32(*buf_.staging_logits, {chunk, V}).as<float>() : nullptr,
                    .targets = H.i32(buf_.staging_targets, {N}).as<int32_t>(),
                    .positions = H.i32(buf_.staging_positions, {N}).as<int32_t>(),
                    .row_stats = H.i32(buf_.staging_row_stats, {N, 4}).as<RowStats>(),
                    .row_losses = H.f32(buf_.staging_row_losses, {N}).as<float>()};
  }
  LossSum loss = be.lm_head_loss(head);
  if (router_aux_loss() && router_aux_.rows > 0) {
    // transformers' load-balancing loss over the step's sparse layers (their tokens concatenated):
    // E x sum over experts of (selections / rows) x (mean probability), added to the mean loss
    // with its coefficient; as a sum over this micro-batch's items, it is weighted by them.
    RouterAux& aux = router_aux_;
    const double E = static_cast<double>(config_.moe.num_experts), rows = static_cast<double>(aux.rows);
    const double weight = config_.moe.router_aux_loss_coef * static_cast<double>(loss.count);
    double value = 0.0;
    for (size_t e = 0; e < aux.selections.size(); ++e) {
      value += aux.selections[e] * aux.probabilities[e];
      aux.dprobability[e] = static_cast<float>(weight * E * aux.selections[e] / (rows * rows) * grad_scale_);
    }
    loss.sum += weight * E * value / (rows * rows);
  }
  timings_.loss = seconds_since(t0);
  be.time_mark(2);
  if (!grads) {
    step_work_.end();
    return loss;
  }

  t0 = Clock::now();
  A.enter_phase(Phase::Backward);
  const Tensor dstream = act(buf_.dstream, D);
  be.fill(dstream, 0.0f);
  be.rmsnorm_backward(dstream, base_grad_or_none(params_->final_norm()), act(buf_.dnormed, D), act(buf_.residual[L], D),
                      weight_f32(params_->final_norm()), act(buf_.rstd_final, 1));
  for (int64_t l = L - 1; l >= 0; --l) {
    const Tensor x = act(buf_.residual[l], D);
    if (options_.gradient_checkpointing) {
      // Rebuild this layer's activations from its saved input; its output is not needed again.
      layer_forward(l, buf_.recompute, x, act(buf_.dln, D));
      layer_backward(l, buf_.recompute, x, dstream);
    } else {
      layer_backward(l, buf_.saved[l], x, dstream);
    }
    if (layer_grads_ready_) layer_grads_ready_(l);
  }
  if (params_->base_trainable()) be.embedding_backward(params_->grad(params_->embed()), dstream, A.i32(buf_.ids, {N}));
  timings_.backward = seconds_since(t0);
  be.time_mark(3);
  A.enter_phase(Phase::Forward);
  step_work_.end();
  return loss;
}

const StepTimings& Decoder::last_step_timings() {
  // The marks of run_step: 0 before the forward, then after the forward, the loss, the backward.
  if (const std::vector<double> t = backend_->time_marks(); t.size() >= 3)
    timings_ = {.forward = t[1] - t[0],
                .loss = t[2] - t[1],
                .backward = t.size() >= 4 ? t[3] - t[2] : 0.0,
                .device = true};
  return timings_;
}

}  // namespace memtune

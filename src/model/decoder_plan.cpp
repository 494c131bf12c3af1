// The decoder's buffers: every activation, gradient and workspace of a step declared in the
// plan with its lifetime (see decoder_plan.h).
#include "model/decoder_plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace memtune {

namespace {

// expert_rows: a backward reads them (LayerActs::expert_rows).
LayerActs declare_layer_acts(const ModelConfig& config_, const ModelOptions& options_, MemoryPlan& plan,
                             const std::string& prefix, Category cat, Phase first, Phase last, bool expert_rows) {
  const size_t N = static_cast<size_t>(options_.max_tokens);
  const size_t D = config_.hidden_size, I = static_cast<size_t>(mlp_width(config_, expert_rows)), qd = config_.q_dim(),
               kvd = config_.kv_dim();
  const size_t Hq = config_.num_attention_heads;
  auto f32 = [&](const char* name, size_t elems) { return plan.declare(prefix + name, cat, elems * 4, first, last); };
  LayerActs acts{f32("ln1", N * D),  f32("rstd1", N),    f32("q", N * qd),   f32("k", N * kvd), f32("v", N * kvd),
                 f32("att", N * qd), f32("lse", N * Hq), f32("res1", N * D), f32("ln2", N * D), f32("rstd2", N),
                 f32("gate", N * I), f32("up", N * I),   f32("h", N * I)};
  if (config_.qk_norm) {
    const size_t Hkv = config_.num_key_value_heads;
    acts.q_raw = f32("q_raw", N * qd);
    acts.k_raw = f32("k_raw", N * kvd);
    acts.rstd_q = f32("rstd_q", N * Hq);
    acts.rstd_k = f32("rstd_k", N * Hkv);
  }
  if (config_.moe.enabled()) {
    acts.router = f32("router_logits", N * static_cast<size_t>(config_.moe.num_experts));
    if (config_.moe.shared_expert_intermediate_size > 0) acts.shared_logit = f32("shared_gate_logits", N);
    acts.expert_rows = expert_rows;
  }
  int64_t widest = 0;
  for (const LoraConfig& set : options_.adapter_sets) widest = std::max(widest, set.rank);
  if (widest > 0) acts.adapter_u = plan.declare(prefix + "adapter_u", cat, N * static_cast<size_t>(widest) * 4, first, last);
  const LoraConfig& lora = options_.lora;
  // An MLP site's adapter in a sparse layer runs on every routed row (and the shared expert's
  // tokens) where a backward reads them, else on one expert's rows at a time.
  const MoeConfig& m = config_.moe;
  const size_t mlp_rows =
      m.enabled() && expert_rows
          ? N * static_cast<size_t>(m.experts_per_token + (m.shared_expert_intermediate_size > 0 ? 1 : 0))
          : N;
  for (size_t s = 0; s < kNumLinearSites; ++s) {
    const LinearSite site = static_cast<LinearSite>(s);
    if (lora.enabled() && lora.targets[s])
      acts.lora_u[s] = plan.declare(prefix + std::string(linear_site_name(site)) + ".lora_u", cat,
                                    (linear_site_block(site) == "mlp" ? mlp_rows : N) *
                                        static_cast<size_t>(lora.rank) * 4,
                                    first, last);
  }
  return acts;
}

// Lifetimes, chosen so they nest (see MemoryPlan):
//   persistent   weights, gradients, batch, residual stream x_0..x_L (saved for backward)
//   forward      checkpointing: one layer's activations; weight conversion scratch
//   loss..bwd    rstd of the final norm, d(normed hidden)
//   loss         normed hidden, logits chunk, gathered rows, head weight conversion
//   backward     activation gradients; checkpointing: one recomputed layer; weight conversion
size_t largest_vector_elems(const std::vector<ParamSpec>& specs) {
  size_t n = 0;
  for (const auto& s : specs)
    if (s.shape.size() == 1) n = std::max<size_t>(n, s.numel());
  return n;
}
// The float32 scratch a layer's matrices need: a whole widened 16-bit matrix, or for a packed
// one what the backend's quantized products need for its input width.
size_t layer_matrix_scratch_elems(const ModelConfig& c, const std::vector<ParamSpec>& specs, const Backend& backend) {
  size_t n = 0;
  for (const auto& s : specs)
    if (s.shape.size() > 1 && s.name.starts_with("model.layers."))
      n = std::max<size_t>(n, packed_bits(c, s) ? backend.quantized_scratch_elems(s.shape[1])
                                                : static_cast<size_t>(s.numel()));
  return n;
}

}  // namespace

int64_t mlp_width(const ModelConfig& c, bool every_routed_row) {
  const MoeConfig& m = c.moe;
  const int64_t sparse = every_routed_row
                             ? m.experts_per_token * m.expert_intermediate_size + m.shared_expert_intermediate_size
                             : std::max(m.expert_intermediate_size, m.shared_expert_intermediate_size);
  int64_t width = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) width = std::max(width, m.sparse(l) ? sparse : c.intermediate_size);
  return width;
}

size_t frozen_vector_elems(const ModelConfig& c, const std::vector<ParamSpec>& specs, bool frozen_base) {
  if (!frozen_base || c.torch_dtype == DType::F32) return 0;
  size_t n = 0;
  for (const auto& s : specs)
    if (s.shape.size() == 1) n += static_cast<size_t>(s.numel());
  return n;
}

namespace {

// A linear product's input (or output gradient) rounded to 16 bits: every row of a step, as wide
// as the widest of the layer's inputs and outputs.
size_t half_operand_bytes(const ModelConfig& c, const ModelOptions& o) {
  return static_cast<size_t>(o.max_tokens * std::max({c.hidden_size, mlp_width(c), c.q_dim(), c.moe.num_experts})) * 2;
}

MoeBuffers declare_moe_buffers(const ModelConfig& c, const ModelOptions& o, MemoryPlan& plan, MemoryPlan& host_plan) {
  const size_t N = static_cast<size_t>(o.max_tokens), D = c.hidden_size, E = c.moe.num_experts;
  const size_t R = N * static_cast<size_t>(c.moe.experts_per_token);
  const Phase F = Phase::Forward, B = Phase::Backward, last = o.with_grads ? B : F;
  auto device = [&](const char* name, size_t bytes, Phase first) {
    return plan.declare(std::string("moe.") + name, Category::Working, bytes, first, last);
  };
  auto host = [&](const char* name, size_t bytes) {
    return host_plan.declare_persistent(std::string("staging.moe.") + name, Category::Working, bytes);
  };
  MoeBuffers b{.rows = device("routed_rows", R * D * 4, F),
               .outputs = device("expert_outputs", R * D * 4, F),
               .tokens = device("row_tokens", R * 4, F),
               .weights = device("row_weights", R * 4, F),
               .token_rows = device("token_rows", R * 4, F),
               .shared_weights = device("shared_weights", N * 4, F),
               .host_logits = host("router_logits", N * E * 4),
               .host_choices = host("token_experts", R * 4),
               .host_choice_weights = host("token_expert_weights", R * 4),
               .host_tokens = host("row_tokens", R * 4),
               .host_weights = host("row_weights", R * 4),
               .host_token_rows = host("token_rows", R * 4),
               .host_shared_weights = host("shared_weights", N * 4),
               .host_offsets = host("expert_offsets", (E + 1) * 8)};
  if (o.with_grads) {
    b.dweights = device("drow_weights", R * 4, B);
    b.ones = device("ones", R * 4, B);
    b.router_grad = device("drouter_logits", N * E * 4, B);
    b.shared_grad = device("dshared_gate_logits", N * 4, B);
    b.host_dweights = host("drow_weights", R * 4);
    b.host_choice_grads = host("dtoken_expert_weights", R * 4);
  }
  return b;
}

DecoderBuffers declare_inference_buffers(const ModelConfig& c, const ModelOptions& o,
                                         const std::vector<ParamSpec>& specs, const Backend& backend,
                                         MemoryPlan& plan, MemoryPlan& host_plan, size_t frozen_vectors) {
  const bool stage_logits = !backend.host_addressable();
  DecoderBuffers b;
  const KvCacheOptions& kv = o.kv_cache;
  const size_t N = static_cast<size_t>(o.max_tokens), S = static_cast<size_t>(kv.max_seqs);
  const size_t D = c.hidden_size, V = c.vocab_size;
  const Phase F = Phase::Forward, L = Phase::Loss;
  b.ids = plan.declare_persistent("batch.input_ids", Category::Batch, N * 4);
  b.positions = plan.declare_persistent("batch.positions", Category::Batch, N * 4);
  b.rope_inv_freq = plan.declare_persistent("rope.inv_freq", Category::Batch, static_cast<size_t>(c.head_dim() / 2) * 4);
  b.slots = plan.declare_persistent("batch.cache_slots", Category::Batch, N * 4);
  b.cu_seqlens = plan.declare_persistent("batch.cu_seqlens", Category::Batch, (S + 1) * 4);
  b.context_lens = plan.declare_persistent("batch.context_lens", Category::Batch, S * 4);
  b.block_tables =
      plan.declare_persistent("batch.block_tables", Category::Batch, S * static_cast<size_t>(kv.max_blocks_per_seq) * 4);
  b.last_rows_index = plan.declare_persistent("batch.last_rows", Category::Batch, S * 4);
  // Layer l reads residual[l % 2] and writes residual[(l + 1) % 2]; nothing is kept for a backward.
  for (int i = 0; i < 2; ++i)
    b.residual.push_back(plan.declare(fmt::format("act.x{}", i), Category::Working, N * D * 4, F, L));
  b.fwd_scratch = declare_layer_acts(c, o, plan, "fwd.layer.", Category::Working, F, F, false);
  if (c.moe.enabled()) b.moe = declare_moe_buffers(c, o, plan, host_plan);
  // 16-bit products for steps of many rows (prefill); decoding's few rows read 16-bit weights
  // with float32 inputs (Decoder::sixteen_bit_step).
  const bool half = sixteen_bit_operands(c, o, backend).has_value();
  if (half && o.max_tokens > backend.stored_weight_rows())
    b.half_input[static_cast<size_t>(F)] =
        plan.declare("forward.input_16bit", Category::Working, half_operand_bytes(c, o), F, F);
  if (c.torch_dtype != DType::F32 || c.quant.enabled()) {
    // With 16-bit products no layer matrix is widened (decoding reads them as stored, longer
    // steps take 16-bit products), nor where no step has more rows than the backend reads 16-bit
    // weights as stored for: only a group's 16-bit biases, widened together.
    // Widened once instead, the vectors need neither (frozen_vectors).
    const bool as_stored = half || (!c.quant.enabled() && o.max_tokens <= backend.stored_weight_rows());
    const size_t matrix_elems = !as_stored         ? layer_matrix_scratch_elems(c, specs, backend)
                                : frozen_vectors ? 0
                                                 : DecoderBuffers::kMaxGroupSites * largest_vector_elems(specs);
    if (matrix_elems > 0)
      b.matrix_f32[static_cast<size_t>(F)] =
          plan.declare("forward.matrix_f32", Category::Working, matrix_elems * 4, F, F);
    if (frozen_vectors > 0) {
      b.vectors_f32 = plan.declare_persistent("weights.vectors_f32", Category::Working, frozen_vectors * 4);
    } else {
      b.vector_f32[static_cast<size_t>(F)] =
          plan.declare("forward.vector_f32", Category::Working, largest_vector_elems(specs) * 4, F, F);
      b.vector_f32[static_cast<size_t>(L)] =
          plan.declare("loss.vector_f32", Category::Working, largest_vector_elems(specs) * 4, L, L);
    }
  }
  // A packed head (quant.lm_head_bits) multiplies in the loss phase, with scratch of its own.
  if (c.quant.lm_head_bits)
    b.matrix_f32[static_cast<size_t>(L)] =
        plan.declare("loss.matrix_f32", Category::Working, backend.quantized_scratch_elems(D) * 4, L, L);
  b.last_rows = plan.declare("loss.last_hidden_rows", Category::LossWorkspace, S * D * 4, L, L);
  b.last_normed = plan.declare("loss.last_normed_rows", Category::LossWorkspace, S * D * 4, L, L);
  b.last_rstd = plan.declare("loss.last_rstd", Category::LossWorkspace, S * 4, L, L);
  // [max_seqs, V]: read by the sampler after the step, so they outlive the loss phase. The head
  // is applied in its storage dtype (max_seqs rows count as few, see Backend::stored_weight_rows).
  b.last_logits = plan.declare_persistent("head.last_logits", Category::LossWorkspace, V * S * 4);
  b.stages_chunks = stage_logits;
  if (stage_logits) {
    // Decoding samples on the device and reads back token ids only; host code that reads the
    // logits (Decoder::generation_step) asks for their staging with host_logits.
    if (o.host_logits)
      b.staging_last_logits = host_plan.declare_persistent("staging.last_logits", Category::LossWorkspace, V * S * 4);
    b.sample_penalty_capacity =
        std::min(kv.blocks * kv.block_size, kv.max_seqs * kv.max_blocks_per_seq * kv.block_size);
    b.sample_rows = plan.declare_persistent("sample.rows", Category::LossWorkspace, S * kSampleRowWords * 4);
    b.sample_penalties = plan.declare_persistent("sample.penalty_tokens", Category::LossWorkspace,
                                                 static_cast<size_t>(b.sample_penalty_capacity) * 3 * 4);
    b.sampled_tokens = plan.declare_persistent("sample.tokens", Category::LossWorkspace, S * 4);
  }
  declare_kv_cache(c, kv, plan, b.kv_k, b.kv_v);
  return b;
}

}  // namespace

std::optional<DType> sixteen_bit_operands(const ModelConfig& c, const ModelOptions& o, const Backend& backend) {
  if (o.compute_dtype == DType::F32 || c.quant.enabled() || c.torch_dtype != o.compute_dtype ||
      backend.sixteen_bit_products(o.compute_dtype).empty())
    return std::nullopt;
  return o.compute_dtype;
}

std::string describe_arithmetic(const ModelConfig& c, const ModelOptions& o, const Backend& backend) {
  const std::string storage(dtype_torch_name(c.torch_dtype));
  if (const std::optional<DType> half = sixteen_bit_operands(c, o, backend)) {
    const std::string attention = backend.sixteen_bit_attention(*half);
    if (attention.empty())
      return fmt::format(
          "mixed precision: the linear layers' and the LM head's products take {} operands with float32 accumulation "
          "({}); norms, attention, softmax, losses, gradients, master weights and AdamW stay float32",
          dtype_torch_name(*half), backend.sixteen_bit_products(*half));
    return fmt::format(
        "mixed precision: the linear layers', the LM head's and attention's products take {} operands with float32 "
        "accumulation ({}; attention: {}); norms, softmax, losses, gradients, master weights and AdamW stay float32",
        dtype_torch_name(*half), backend.sixteen_bit_products(*half), attention);
  }
  if (o.compute_dtype == DType::F32)
    return c.torch_dtype == DType::F32 ? "float32"
                                       : fmt::format("float32 ({} storage, widened as it is read)", storage);
  std::string why;
  if (c.quant.enabled())
    why = "quantized weights take float32 inputs in training";
  else if (c.torch_dtype != o.compute_dtype)
    why = fmt::format("the weights are stored in {}", storage);
  else
    why = fmt::format("the {} backend has no {} products here", backend.name(), dtype_torch_name(o.compute_dtype));
  return fmt::format("float32, not mixed precision: {} ({} storage)", why, storage);
}

DecoderBuffers declare_decoder_buffers(const ModelConfig& c, const ModelOptions& options_,
                                       const std::vector<ParamSpec>& specs_, const Backend& backend, MemoryPlan& plan,
                                       MemoryPlan& host_plan, bool frozen_base) {
  const bool stage_chunks = !backend.host_addressable();
  const size_t frozen_vectors = frozen_vector_elems(c, specs_, frozen_base);
  if (options_.inference())
    return declare_inference_buffers(c, options_, specs_, backend, plan, host_plan, frozen_vectors);
  DecoderBuffers b;
  const size_t N = static_cast<size_t>(options_.max_tokens);
  // The MLP's activation gradients take the layout of the activations a backward reads.
  const size_t D = c.hidden_size, I = static_cast<size_t>(mlp_width(c, true)), V = c.vocab_size, qd = c.q_dim(),
               kvd = c.kv_dim();
  const DType dt = c.torch_dtype;

  b.ids = plan.declare_persistent("batch.input_ids", Category::Batch, N * 4);
  b.positions = plan.declare_persistent("batch.positions", Category::Batch, N * 4);
  b.rope_inv_freq = plan.declare_persistent("rope.inv_freq", Category::Batch, static_cast<size_t>(c.head_dim() / 2) * 4);
  b.targets = plan.declare_persistent("batch.targets", Category::Batch, N * 4);
  b.cu_seqlens = plan.declare_persistent("batch.cu_seqlens", Category::Batch, (N + 1) * 4);

  const Phase F = Phase::Forward, L = Phase::Loss, B = Phase::Backward;
  // Without gradients nothing needs to survive the forward pass except what the loss reads.
  const Phase keep_until = options_.with_grads ? B : L;
  for (int64_t l = 0; l <= c.num_hidden_layers; ++l)
    b.residual.push_back(plan.declare(fmt::format("act.x{}", l), Category::SavedActivations, N * D * 4, F, keep_until));
  if (options_.gradient_checkpointing || !options_.with_grads) {
    b.fwd_scratch = declare_layer_acts(c, options_, plan, "fwd.layer.", Category::Working, F, F, false);
  } else {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      b.saved.push_back(declare_layer_acts(c, options_, plan, fmt::format("act.layer{}.", l),
                                           Category::SavedActivations, F, B, true));
  }
  if (c.moe.enabled()) b.moe = declare_moe_buffers(c, options_, plan, host_plan);

  // 16-bit storage: weights are widened right before use into per-phase scratch.
  const size_t largest_matrix = layer_matrix_scratch_elems(c, specs_, backend), largest_vector = largest_vector_elems(specs_);
  const bool widen = dt != DType::F32 || c.quant.enabled();
  // With 16-bit products (mixed precision) every step reads the layers' matrices as stored, so
  // only vectors (biases) are widened.
  const std::optional<DType> half = sixteen_bit_operands(c, options_, backend);
  auto declare_widening = [&](Phase ph) {
    const std::string p{phase_name(ph)};
    if (!half)
      b.matrix_f32[static_cast<size_t>(ph)] =
          plan.declare(p + ".matrix_f32", Category::Working, largest_matrix * 4, ph, ph);
    if (frozen_vectors == 0)
      b.vector_f32[static_cast<size_t>(ph)] =
          plan.declare(p + ".vector_f32", Category::Working, largest_vector * 4, ph, ph);
  };
  if (frozen_vectors > 0)
    b.vectors_f32 = plan.declare_persistent("weights.vectors_f32", Category::Working, frozen_vectors * 4);
  if (widen) declare_widening(F);
  if (half)
    b.half_input[static_cast<size_t>(F)] =
        plan.declare("forward.input_16bit", Category::Working, half_operand_bytes(c, options_), F, F);

  b.normed = plan.declare("loss.normed_hidden", Category::LossWorkspace, N * D * 4, L, L);
  const size_t max_rows =
      options_.max_targets > 0 ? std::min(N, static_cast<size_t>(options_.max_targets)) : N;
  b.chunk_rows =
      static_cast<int64_t>(std::clamp<size_t>(options_.loss_workspace_bytes / ((V + 2 * D) * 4), 1, max_rows));
  const size_t chunk = static_cast<size_t>(b.chunk_rows);
  b.logits_chunk = plan.declare("loss.logits_chunk", Category::LossWorkspace, chunk * V * 4, L, L);
  b.rows = plan.declare("loss.hidden_rows", Category::LossWorkspace, chunk * D * 4, L, L);
  b.drows = plan.declare("loss.dhidden_rows", Category::LossWorkspace, chunk * D * 4, L, L);
  b.loss_positions = plan.declare("loss.target_positions", Category::LossWorkspace, N * 4, L, L);
  b.row_targets = plan.declare("loss.row_targets", Category::LossWorkspace, chunk * 4, L, L);
  b.row_stats = plan.declare("loss.row_stats", Category::LossWorkspace, N * sizeof(RowStats), L, L);
  // Host losses and observers read the chunk from host memory: a staged copy when the backend's
  // memory is not the host's. Such a backend computes cross-entropy where the logits are and
  // hands back per-row losses and statistics.
  b.stages_chunks = stage_chunks;
  if (stage_chunks) {
    b.row_losses = plan.declare("loss.row_losses", Category::LossWorkspace, N * 4, L, L);
    if (options_.host_logits || !backend.runs_cross_entropy())
      b.staging_logits = host_plan.declare_persistent("staging.logits_chunk", Category::LossWorkspace, chunk * V * 4);
    b.staging_targets = host_plan.declare_persistent("staging.row_targets", Category::LossWorkspace, N * 4);
    b.staging_positions = host_plan.declare_persistent("staging.row_positions", Category::LossWorkspace, N * 4);
    b.staging_row_stats =
        host_plan.declare_persistent("staging.row_stats", Category::LossWorkspace, N * sizeof(RowStats));
    b.staging_row_losses = host_plan.declare_persistent("staging.row_losses", Category::LossWorkspace, N * 4);
  }
  if (widen) {
    // The final norm's weight, and the LM head widened a vocabulary slice at a time (not with
    // 16-bit products: they read the head as stored).
    if (frozen_vectors == 0)
      b.vector_f32[static_cast<size_t>(L)] = plan.declare("loss.vector_f32", Category::Working, largest_vector * 4, L, L);
  }
  if (half) {
    b.head_product_slice_cols = std::min<int64_t>(backend.head_product_slice(*half), static_cast<int64_t>(V));
    if (b.head_product_slice_cols > 0)
      b.head_product_slice = plan.declare("loss.head_product_slice", Category::LossWorkspace,
                                          chunk * static_cast<size_t>(b.head_product_slice_cols) * 4, L, L);
  }
  if (widen && !half) {
    b.head_slice_rows = std::min<int64_t>(V, DecoderBuffers::kHeadSliceRows);
    b.head_slice = plan.declare("loss.head_weight_slice_f32", Category::LossWorkspace,
                                static_cast<size_t>(b.head_slice_rows) * D * 4, L, L);
  }

  if (options_.with_grads) {
    b.rstd_final = plan.declare("act.rstd_final", Category::SavedActivations, N * 4, L, B);
    b.dnormed = plan.declare("grad.normed_hidden", Category::Working, N * D * 4, L, B);
    b.dstream = plan.declare("bwd.dresidual", Category::Working, N * D * 4, B, B);
    b.dln = plan.declare("bwd.dnormed", Category::Working, N * D * 4, B, B);
    b.datt = plan.declare("bwd.dattention", Category::Working, N * qd * 4, B, B);
    b.dq = plan.declare("bwd.dq", Category::Working, N * qd * 4, B, B);
    b.dk = plan.declare("bwd.dk", Category::Working, N * kvd * 4, B, B);
    b.dv = plan.declare("bwd.dv", Category::Working, N * kvd * 4, B, B);
    b.dh = plan.declare("bwd.dh", Category::Working, N * I * 4, B, B);
    b.dgate = plan.declare("bwd.dgate", Category::Working, N * I * 4, B, B);
    b.dup = plan.declare("bwd.dup", Category::Working, N * I * 4, B, B);
    if (c.qk_norm) {
      b.dq_raw = plan.declare("bwd.dq_raw", Category::Working, N * qd * 4, B, B);
      b.dk_raw = plan.declare("bwd.dk_raw", Category::Working, N * kvd * 4, B, B);
    }
    if (options_.gradient_checkpointing)
      b.recompute =
          declare_layer_acts(c, options_, plan, "bwd.recompute.", Category::RecomputeScratch, B, B, true);
    if (widen) declare_widening(B);
    if (half) {
      b.half_input[static_cast<size_t>(B)] =
          plan.declare("backward.input_16bit", Category::Working, half_operand_bytes(c, options_), B, B);
      b.half_dout = plan.declare("backward.dout_16bit", Category::Working, half_operand_bytes(c, options_), B, B);
    }
  } else {
    b.rstd_final = plan.declare("act.rstd_final", Category::LossWorkspace, N * 4, L, L);
  }
  if (options_.lora.enabled() && options_.with_grads) {
    const size_t r = static_cast<size_t>(options_.lora.rank), widest = std::max(D, I);
    b.lora_du = plan.declare("bwd.lora_du", Category::Working, N * r * 4, B, B);
    if (options_.lora.dropout > 0) {
      // Dropout masks are regenerated from a seed; only the dropped input is materialized.
      b.lora_xd[static_cast<size_t>(F)] =
          plan.declare("forward.lora_dropped_x", Category::Working, N * widest * 4, F, F);
      b.lora_xd[static_cast<size_t>(B)] =
          plan.declare("backward.lora_dropped_x", Category::Working, N * widest * 4, B, B);
      b.lora_dxd = plan.declare("bwd.lora_ddropped_x", Category::Working, N * widest * 4, B, B);
    }
  }
  return b;
}

}  // namespace memtune

// Planning, one job: the decoder's buffers for one micro-batch of up to max_tokens tokens, each
// declared with its category and lifetime over the phases of a step (forward, loss, backward,
// optimizer), and the host staging a backend without host-addressable memory needs. The
// compute (model/decoder.h) only looks buffers up here; the parameters declare their own
// (model/parameters.h).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memory/plan.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/parameters.h"

namespace memtune {

// One decoder layer's activations.
struct LayerActs {
  BufferId ln1, rstd1, q, k, v, att, lse, res1, ln2, rstd2, gate, up, h;
  BufferId q_raw{}, k_raw{}, rstd_q{}, rstd_k{};  // qk_norm: q and k before their norm, rstd per head
  std::array<BufferId, kNumLinearSites> lora_u{};  // x A^T of each adapter, [N, r]
  BufferId adapter_u{};                            // adapter sets: x A^T, [N, largest rank]
  // A sparse layer (MoeConfig): the router's logits [N, experts] and the shared expert's gate
  // logit [N]. With expert_rows, gate / up / h hold every routed row's activations, grouped by
  // expert ([N x k, expert width]), then the shared expert's ([N, shared width]): what a backward
  // reads; without, one expert's at a time (mlp_width).
  BufferId router{}, shared_logit{};
  bool expert_rows = false;
};

// A sparse layer's routing (MoeConfig), one layer at a time, in the forward phase and, with
// gradients, the backward: the routed rows [N x k, hidden] (each token's input gathered once per
// chosen expert, grouped by expert) and their experts' outputs (in the backward, the gradients
// of both); per routed row its token and weight, per token its k rows (ascending: expert order),
// and the shared expert's weight per token. The routing is computed on the host (host plan: the
// logits read back, each token's choices, the rows' tokens and weights, each expert's first row)
// and uploaded: a few numbers per token. With gradients also: each routed row's d(weight) (and
// the shared gate's), ones for summing the rows' input gradients per token, and d(router logits)
// [N, experts] and d(shared gate logit) [N] computed on the host and uploaded.
struct MoeBuffers {
  BufferId rows, outputs, tokens, weights, token_rows, shared_weights;
  BufferId dweights{}, ones{}, router_grad{}, shared_grad{};
  BufferId host_logits, host_choices, host_choice_weights, host_tokens, host_weights, host_token_rows,
      host_shared_weights, host_offsets;
  BufferId host_dweights{}, host_choice_grads{};
};

struct DecoderBuffers {
  static constexpr int64_t kHeadSliceRows = 4096;               // vocabulary rows of a 16-bit head widened at once
  static constexpr size_t kMaxGroupSites = 3;                  // products of one input run as a group (q, k, v)
  BufferId ids, positions, targets, cu_seqlens;                 // the batch
  BufferId rope_inv_freq;                                       // RoPE's frequencies [head_dim / 2], set once
  std::vector<BufferId> residual;                               // layer inputs x_0..x_L (x_L feeds the final norm)
  std::vector<LayerActs> saved;                                 // per layer, without checkpointing
  LayerActs fwd_scratch{}, recompute{};                         // with checkpointing (or without gradients)
  std::array<BufferId, kNumPhases> matrix_f32{}, vector_f32{};  // 16-bit weights widened per phase
  // A frozen base's 16-bit vectors (norm weights, biases) widened once, one after another in
  // parameter order (frozen_vector_elems); then no vector_f32 is planned.
  std::optional<BufferId> vectors_f32;
  // Mixed precision: a product's input rounded to 16 bits (forward and backward), and the
  // output gradient rounded (backward); [max_tokens, widest] each.
  std::array<BufferId, kNumPhases> half_input{};
  BufferId half_dout{};
  BufferId normed, rstd_final, dnormed;
  BufferId logits_chunk, rows, drows, loss_positions, row_targets, row_stats, head_slice{}, head_product_slice{};
  int64_t chunk_rows = 1, head_slice_rows = 0;
  int64_t head_product_slice_cols = 0;  // Backend::head_product_slice: [chunk_rows, cols] f32
  // Host staging of the logits chunk for host losses and observers, and of the per-row values a
  // device backend hands back (host plan); row_losses is the device side of the latter.
  bool stages_chunks = false;
  BufferId row_losses{}, staging_targets{}, staging_positions{}, staging_row_stats{}, staging_row_losses{};
  std::optional<BufferId> staging_logits;  // only where host code may read logits (ModelOptions::host_logits)
  BufferId dstream, dln, datt, dq, dk, dv, dh, dgate, dup;  // activation gradients
  BufferId dq_raw{}, dk_raw{};                               // qk_norm: gradients before the norm
  BufferId lora_du{}, lora_dxd{};
  std::array<BufferId, kNumPhases> lora_xd{};
  // Inference (options.inference()): the paged cache per layer, the step's block tables, cache
  // lengths and slots, and the LM head over the last row of each sequence that samples.
  std::optional<MoeBuffers> moe;  // a mixture-of-experts model (MoeConfig)
  std::vector<BufferId> kv_k, kv_v;
  BufferId block_tables{}, context_lens{}, slots{}, last_rows_index{};
  BufferId last_rows{}, last_normed{}, last_rstd{}, last_logits{};
  std::optional<BufferId> staging_last_logits;  // only with ModelOptions::host_logits
  // Sampling on the device (a backend whose memory the host cannot address): the rows' settings,
  // the penalty tokens (at most one per cache slot of the step's sequences), the chosen ids.
  BufferId sample_rows{}, sample_penalties{}, sampled_tokens{};
  int64_t sample_penalty_capacity = 0;
};

// The MLP activations' columns per token (gate, up, h; the widest layer's): intermediate_size
// where a layer is dense; in a sparse layer the wider of an expert's and the shared expert's
// width, one expert's rows at a time, or with every_routed_row all of them (LayerActs::
// expert_rows): k x the expert width, then the shared expert's width.
int64_t mlp_width(const ModelConfig& config, bool every_routed_row = false);

// The 16-bit dtype the decoder's products take (ModelOptions::compute_dtype) when they do: a
// model whose (unquantized) weights are stored in it, on a backend that has such products;
// nullopt otherwise (float32 operands).
std::optional<DType> sixteen_bit_operands(const ModelConfig& config, const ModelOptions& options, const Backend& backend);

// What computes the products, for `memtune plan` and the training log: mixed precision (which
// 16-bit dtype, what runs it) or float32 arithmetic, and why when mixed precision was asked for
// and is not what runs.
std::string describe_arithmetic(const ModelConfig& config, const ModelOptions& options, const Backend& backend);

// Lifetimes, chosen so they nest (see MemoryPlan):
//   persistent   batch, residual stream x_0..x_L (saved for backward)
//   forward      checkpointing: one layer's activations; weight conversion scratch
//   loss..bwd    rstd of the final norm, d(normed hidden)
//   loss         normed hidden, logits chunk, gathered rows, head weight conversion
//   backward     activation gradients; checkpointing: one recomputed layer; weight conversion
// An inference model (options.inference()) declares instead: the step's batch and two residual
// buffers (persistent), one layer's activations and weight conversion (forward), the last rows
// and their logits [V, max_seqs] (loss), and the KV cache (persistent). The backend says how
// much scratch its quantized products need, and whether logits chunks are staged on the host
// (a backend whose memory the host cannot address).
// `frozen_base`: the base weights never change during the run (inference, evaluation, LoRA: the
// parameters' own options say, which a decoder borrowing them does not share).
DecoderBuffers declare_decoder_buffers(const ModelConfig& config, const ModelOptions& options,
                                       const std::vector<ParamSpec>& specs, const Backend& backend, MemoryPlan& plan,
                                       MemoryPlan& host_plan, bool frozen_base);
// The elements of a frozen base's 16-bit vectors, widened once into DecoderBuffers::vectors_f32
// instead of into per-phase scratch at every use (a convert per norm and bias per step); 0 where
// the base trains or its vectors are float32.
size_t frozen_vector_elems(const ModelConfig& config, const std::vector<ParamSpec>& specs, bool frozen_base);

}  // namespace memtune

// The decoder's compute graph (Qwen2, Qwen3, Llama: model/config.h's family traits), written
// once against the backend interface (backend/backend.h): an explicit forward and backward, gradient checkpointing as a choice of
// saved buffers, and the fused chunked LM-head loss. The model is split by job: its parameters
// (model/parameters.h: specs, trainables, load/save/init, LoRA files, merge), its buffers
// (model/decoder_plan.h: declarations per phase) and this file, the compute. Every byte it
// touches on the device is declared in its MemoryPlan at construction and served by its Arena
// (the backend's memory, which host code never dereferences: values cross through the
// backend's copies); a training step performs no other allocation.
//
// Phases of one step: Forward (embedding + layers, residual stream saved per layer), Loss
// (final norm + fused LM head/cross-entropy, which also yields d(normed hidden) and the head's
// weight gradient), Backward (final norm, layers in reverse, embedding).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "backend/device_work.h"
#include "memory/arena.h"
#include "memory/plan.h"
#include "model/config.h"
#include "model/decoder_plan.h"
#include "model/parameters.h"

namespace memtune {

// A micro-batch: a flat stream of tokens holding sequences back to back. labels are unshifted
// (Hugging Face convention: the target of token t is labels[t+1] of the same sequence; -100 ignored).
struct TokenBatch {
  std::span<const int32_t> input_ids;
  std::span<const int32_t> labels;
  std::span<const int32_t> cu_seqlens;  // num_seqs + 1 offsets, starting at 0, ending at N
  // Optional, one per sequence: the position of its first token (the length of what a KV cache
  // already holds for it); empty means every sequence starts at position 0.
  std::span<const int32_t> position_offsets = {};
};

// One step of generation (an inference model, ModelOptions::kv_cache): the new tokens of several
// sequences back to back (a prefill chunk or one decoded token each), written into the paged
// KV cache as they are computed.
struct GenerationBatch {
  std::span<const int32_t> input_ids;     // N new tokens
  std::span<const int32_t> cu_seqlens;    // S + 1 offsets into input_ids
  std::span<const int32_t> context_lens;  // S: tokens in the cache after this step (before + new)
  std::span<const int32_t> block_tables;  // S x max_blocks_per_seq block ids (unused entries ignored)
  // R sequences (indices into the S) whose last new token's logits are wanted, R <= max_seqs;
  // a sequence in the middle of its prompt needs none.
  std::span<const int32_t> sample_seqs;
  // Optional, S entries: the adapter set (ModelOptions::adapter_sets) each sequence uses, -1 none.
  std::span<const int32_t> seq_adapters = {};
};

// The logits of a generation step in host-readable memory: [R, V], row r for sample_seqs[r].
struct StepLogits {
  const float* data = nullptr;
  int64_t rows = 0, vocab = 0;
  const float* row(int64_t r) const { return data + r * vocab; }
};

// Seconds spent in each phase of the last forward_backward (or forward_loss: backward 0): from
// the device's timestamps where the backend has them (device = true), else the host's wall
// clock between the calls (the time itself on a backend that computes as it is called).
struct StepTimings {
  double forward = 0, loss = 0, backward = 0;
  bool device = false;
};

class Decoder {
 public:
  Decoder(const ModelConfig& config, const ModelOptions& options);
  // A generation view of `base` (evaluation by generation during training): an inference model
  // (options.kv_cache) whose plan holds only its KV cache and step buffers, computing with the
  // base's parameters as they are now (weights and, with LoRA, the adapters being trained). The
  // base must outlive it; options' LoRA, gradient and optimizer settings are the base's.
  Decoder(Decoder& base, const ModelOptions& options);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  const MemoryPlan& plan() const { return *plan_; }
  // Host-side buffers (optimizer state offloaded with optim_offload); empty otherwise.
  const MemoryPlan& host_plan() const { return *host_plan_; }
  Arena& arena() {
    MT_ASSERT(arena_, "this model was built plan-only (allocate = false)");
    return *arena_;
  }
  Backend& backend() const { return *backend_; }
  // What each micro-batch step (forward_loss, a training micro-batch) asked of the device.
  const DeviceWork& step_work() const { return step_work_; }
  int64_t loss_chunk_rows() const { return buf_.chunk_rows; }

  // The parameters: specs, views, trainables, optimizer state, checkpoints and adapters.
  ModelParameters& parameters() { return *params_; }
  const ModelParameters& parameters() const { return *params_; }

  // Training applies LoRA dropout with masks derived from this seed (regenerated in backward, so
  // no mask is stored); nullopt (the default) disables dropout, as in evaluation.
  void set_dropout_seed(std::optional<uint64_t> seed) { dropout_seed_ = seed; }

  // forward, loss and backward of one micro-batch; gradients of the loss SUM are accumulated.
  // If logits_out is given ([N, V] host memory, debugging only) the full logits are written there.
  LossSum forward_backward(const TokenBatch& batch, float* logits_out = nullptr);
  // Forward and loss only (evaluation): gradients are neither computed nor touched.
  // With logits_out ([N, V] host memory, debugging only) the full logits are written there.
  LossSum forward_loss(const TokenBatch& batch, float* logits_out = nullptr) { return run_step(batch, logits_out, false); }
  // Reading device timestamps waits for the step's work to finish: ask at a point that waits anyway.
  const StepTimings& last_step_timings();
  // Inference models only: runs one generation step, leaving the sampled rows' logits [R, V] in
  // device memory until the next step. Keys and values of the new tokens go to the slots their
  // block tables give; queries attend to everything cached for their sequence up to their own
  // position.
  void generation_forward(const GenerationBatch& batch);
  // Then one token per sampled row, chosen by the backend where the logits are (the logits may
  // be overwritten): rows[r] for sample_seqs[r], tokens[r] receives its token.
  void sample_tokens(std::span<const SampleRow> rows, std::span<const PenaltyToken> penalties,
                     std::span<int32_t> tokens, SamplerScratch& scratch);
  // generation_forward, then the logits in host-readable memory (copied there for a backend
  // whose memory the host cannot address, planned with ModelOptions::host_logits), valid until
  // the next step: tests and diagnostics.
  StepLogits generation_step(const GenerationBatch& batch);
  // The token-level loss the fused LM head applies (cross-entropy by default). Not owned.
  void set_loss(const ChunkLoss& loss) { loss_ = &loss; }
  // Multiplies all gradients of the following steps (dynamic loss scaling); the trainer unscales.
  void set_grad_scale(float scale) { grad_scale_ = scale; }
  // Training steps' loss sums may stay on the device until the trainer's next read of it
  // (LmHeadArgs::defer_sum; LossSum::deferred says whether it did).
  void set_defer_loss_sum(bool defer) { defer_loss_sum_ = defer; }
  // Sees every logits chunk of the following steps (streaming metrics); nullptr for none. Not owned.
  void set_observer(ChunkObserver* observer) { observer_ = observer; }
  // Sees the input x [rows, in] of every linear layer as the forward pass reaches it (GPTQ's
  // calibration, model/quantize.h): a site's, or in a sparse layer an expert's (its index, -1 the
  // shared expert; gate and up share the input, seen at Gate) over its routed rows; an empty
  // function for none.
  using LinearInputObserver =
      std::function<void(int64_t layer, LinearSite site, std::optional<int64_t> expert, const Tensor& x)>;
  void set_linear_input_observer(LinearInputObserver observer) { linear_input_observer_ = std::move(observer); }
  // Called in backward as soon as decoder layer l's gradients are complete for this micro-batch
  // (l = L-1 down to 0), so data-parallel ranks can start reducing them while backward goes on.
  void set_layer_grads_ready(std::function<void(int64_t layer)> callback) { layer_grads_ready_ = std::move(callback); }

 private:
  Decoder(const ModelConfig& config, const ModelOptions& options, ModelParameters* borrowed);
  void upload_batch(const TokenBatch& batch);
  void upload_generation_batch(const GenerationBatch& batch);
  LossSum run_step(const TokenBatch& batch, float* logits_out, bool backward);
  // `chained` (generation, where every layer works in the same activations, fwd_scratch): the add
  // that ends a layer below the last also normalizes its output into a.ln1 / a.rstd1 by layer
  // l + 1's norm (add_rmsnorm_forward: one pass instead of two), and a layer above the first starts
  // from them.
  void layer_forward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& x_out, bool chained = false);
  void layer_backward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& dstream);
  // y = x W^T + b (+ scaling * dropout(x) A^T B^T)
  // With 16-bit products, x16 may hold x already rounded (several products of one input).
  void linear_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y,
                      const Tensor& x16 = {});
  // y = x W^T + b for one linear layer, without adapters: the weight as stored (few rows or 16-bit
  // operands, x16 holding x rounded where given), widened, or quantized.
  void product(const ModelParameters::Linear& lin, const Tensor& x, const Tensor& y, const Tensor& x16 = {});
  // dx += dy W for one linear layer without adapters, and W's (and b's) gradient where the base
  // trains: linear_backward's base part, for the router and the experts too.
  void product_backward(const ModelParameters::Linear& lin, const Tensor& dy, const Tensor& x, const Tensor& dx);
  // A sparse layer's MLP (MoeConfig): x_out = sum over each token's experts of weight x expert(x)
  // (+ the gated shared expert). gate / up / h hold what LayerActs::expert_rows says.
  void moe_forward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& x_out);
  // moe_forward's routed experts as two groups of products (gate / up, down) over every routed
  // row where a step has few rows; false (nothing run) where they run one expert at a time.
  bool routed_experts_grouped(int64_t l, const LayerActs& a);
  // Its backward: dy = d(loss)/d(x_out); dx += d(loss)/d(x); the experts', the shared expert's,
  // its gate's and the router's gradients (through the routing weights, the softmax and, with
  // the auxiliary loss, its term).
  void moe_backward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& dy, const Tensor& dx);
  // An expert's projections (e: its index, -1 the shared expert) and, over its `rows` rows that
  // start at row `row0` of the layer's layout (LayerActs::expert_rows), its activations, its
  // adapters' kept x A^T and their dropout keys (gate, up, down).
  struct ExpertSites {
    ModelParameters::Linear gate, up, down;
    struct {
      Tensor gate, up, h;
    } acts;
    std::array<Tensor, 3> lora_u;
    std::array<uint64_t, 3> keys;
  };
  ExpertSites expert_sites(int64_t l, const LayerActs& a, int64_t e, int64_t row0, int64_t rows);
  // y += s_k (x A_k^T) B_k^T of expert e's (-1: the shared expert's) adapter on site s over its
  // rows whose sequences use adapter set k (row0: the expert's first routed row).
  void expert_adapter_sets_forward(int64_t l, int64_t e, LinearSite s, int64_t row0, const LayerActs& a,
                                   const Tensor& x, const Tensor& y);
  // The shared expert's weight per token, sigmoid(shared_expert_gate . x), from the layer's gate
  // logits: on the device (MoeBuffers::shared_weights, returned) and in host staging.
  Tensor shared_expert_weights(const LayerActs& a);
  // The routing of N tokens from a sparse layer's router logits, on the host (MoeBuffers): each
  // token's experts and weights, rows grouped by expert, uploaded. Returns each expert's first
  // row (E + 1 offsets). In a step's forward pass it adds the layer to the auxiliary loss's counts.
  const int64_t* route(const Tensor& logits);
  // The auxiliary load-balancing loss (MoeConfig::output_router_logits) as transformers computes
  // it over the step's sparse layers; router_aux_ holds, during a step, each expert's selections
  // and summed probabilities over those layers' tokens, then d(loss sum)/d(probability) per expert.
  bool router_aux_loss() const {
    return config_.moe.enabled() && config_.moe.output_router_logits && !options_.inference();
  }
  struct RouterAux {
    std::vector<double> selections, probabilities;
    std::vector<float> dprobability;
    int64_t rows = 0;  // tokens x sparse layers counted
  } router_aux_;
  // Linear layers of one input (q / k / v, gate / up) as one matmul_forward_group when decoding;
  // given `swiglu` (the sites are gate and up), swiglu = silu(gate) * up after them, in the same
  // pass (matmul_forward_group_swiglu) where nothing adds to gate or up between.
  struct SiteOutput {
    LinearSite site;
    Tensor y;
  };
  void linear_group_forward(int64_t l, std::span<const SiteOutput> sites, const LayerActs& a, const Tensor& x,
                            const Tensor& swiglu = {});
  // What follows the base product: adapters chosen per sequence, the trained LoRA pair.
  void linear_adapters_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y);
  // y += s_k (x A_k^T) B_k^T over the rows of the sequences that use adapter set k.
  void adapter_sets_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y);
  // dx += dy W (+ the adapter's path); accumulates the gradients of whatever is trainable.
  void linear_backward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& dy, const Tensor& x,
                       const Tensor& dx);
  // The trained adapter of a linear layer (lin.lora >= 0): y += s (dropout(x) A^T) B^T, keeping
  // u = dropout(x) A^T [rows, r] for the backward; key: its dropout mask's (dropout_key).
  void lora_forward(const ModelParameters::Linear& lin, uint64_t key, const Tensor& x, const Tensor& y,
                    const Tensor& u);
  // Its backward: dx += d(loss)/dx through the adapter, and A's and B's gradients.
  void lora_backward(const ModelParameters::Linear& lin, uint64_t key, const Tensor& dy, const Tensor& x,
                     const Tensor& dx, const Tensor& u);
  // x itself, or dropout(x) in scratch when LoRA dropout is active.
  Tensor lora_input(uint64_t key, const Tensor& x);
  // A site's dropout key for this step (an expert's with `expert`: -1 the shared expert); 0 when
  // no dropout runs.
  uint64_t dropout_key(int64_t l, LinearSite s, std::optional<int64_t> expert = std::nullopt) const;
  Tensor base_grad_or_none(size_t param) const { return params_->base_trainable() ? params_->grad(param) : Tensor{}; }
  // The parameter as float32: its own storage, or, when stored in 16 bits, converted into the
  // current phase's conversion scratch (one for matrices, one for vectors, so a matmul's weight
  // and bias can be live together). Valid until the next call for a parameter of the same rank.
  Tensor weight_f32(size_t param);
  Tensor widened_vector(size_t param);
  void widen_vectors();  // where the weights changed since the last widening
  uint64_t widened_version_ = 0;  // the parameters' values_version the vectors were widened at
  // Mixed precision (half_): x rounded to the 16-bit dtype into the current phase's input buffer,
  // or, for an output gradient (dout), into the backward's dout buffer.
  Tensor rounded(const Tensor& x, bool dout = false);
  // The current phase's float32 scratch for a quantized matmul over `in` inputs (backend.h).
  Tensor quantized_scratch(int64_t in) const;
  // A float32 activation of the current micro-batch: [tokens, cols].
  Tensor act(BufferId id, int64_t cols) const { return arena_->f32(id, {num_tokens_, cols}); }
  // Per-head values of the micro-batch as rows: [tokens * heads, 1] (an rstd per head).
  Tensor act_rows(BufferId id, int64_t heads) const { return arena_->f32(id, {num_tokens_ * heads, 1}); }
  // [tokens, heads * head_dim] seen as [tokens * heads, head_dim]: a norm over each head.
  static Tensor per_head(const Tensor& t, int64_t head_dim) {
    return Tensor(t.data, t.dtype, {t.numel() / head_dim, head_dim});
  }
  // RoPE's frequency table (head_dim / 2 floats, set at construction).
  Tensor rope_freqs() const { return arena_->f32(buf_.rope_inv_freq, {config_.head_dim() / 2}); }

  ModelConfig config_;
  ModelOptions options_;
  Backend* backend_;
  DeviceWork step_work_;  // what each run_step asked of the device
  std::unique_ptr<MemoryPlan> plan_, host_plan_;
  std::unique_ptr<ModelParameters> own_params_;  // null in a generation view
  ModelParameters* params_;                      // own_params_, or the base's
  DecoderBuffers buf_;
  std::unique_ptr<Arena> arena_, host_arena_;
  std::optional<uint64_t> dropout_seed_;
  int64_t num_tokens_ = 0, num_seqs_ = 0;
  static constexpr int64_t kGenerationSampleSteps = 32;
  int64_t generation_steps_ = 0;
  // Host staging of the batch's positions and targets (reserved for max_tokens).
  std::vector<int32_t> batch_positions_, batch_targets_;
  std::vector<int32_t> batch_last_rows_;  // generation: the sampled rows (reserved for max_seqs)
  // Generation with adapter sets: each sequence's token range and adapter (reserved for max_seqs).
  std::vector<int32_t> batch_cu_, batch_adapters_;
  int64_t sample_rows_ = 0;               // R of the last generation step
  // generation_forward's ops after the uploads (sample: the arena's phases measure residency).
  void generation_commands(bool sample);
  std::vector<int64_t> step_key_;  // a decoding step's key (Backend::replay_commands), reserved
  StepTimings timings_;
  static inline const CrossEntropyLoss kCrossEntropy{};
  const ChunkLoss* loss_ = &kCrossEntropy;
  float grad_scale_ = 1.0f;
  bool defer_loss_sum_ = false;
  std::optional<DType> half_;  // the 16-bit dtype the products take (sixteen_bit_operands)
  // The operands attention's products take: half_ where the backend has such attention
  // (Backend::sixteen_bit_attention), else float32.
  DType attention_operands() const {
    return half_ && !backend_->sixteen_bit_attention(*half_).empty() ? *half_ : DType::F32;
  }
  // Whether this step's linear products take 16-bit operands: every training step; an inference
  // step with more rows than the backend reads 16-bit weights as stored for (prefill), while
  // decoding keeps float32 inputs against the 16-bit weights.
  bool sixteen_bit_step() const {
    return half_ && (!options_.inference() || num_tokens_ > backend_->stored_weight_rows());
  }
  ChunkObserver* observer_ = nullptr;
  std::function<void(int64_t)> layer_grads_ready_;
  LinearInputObserver linear_input_observer_;
};

}  // namespace memtune

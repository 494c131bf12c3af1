// The Qwen2 decoder, written once against the backend interface (backend/backend.h):
// parameters with Hugging Face names, an explicit forward and backward, gradient checkpointing as
// a choice of saved buffers, and the fused chunked LM-head loss. Every byte it touches on the
// device is declared in its MemoryPlan at construction and served by its Arena (the backend's
// memory, which host code never dereferences: values cross through the backend's copies); a
// training step performs no other allocation.
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
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/shard.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "memory/plan.h"
#include "model/config.h"
#include "model/lora.h"

namespace memtune {

class CheckpointReader;

struct ParamSpec {
  std::string name;  // Hugging Face name
  std::vector<int64_t> shape;
  int64_t numel() const;
};
// All parameters of a Qwen2ForCausalLM in Hugging Face order (lm_head.weight only when untied).
std::vector<ParamSpec> qwen2_parameter_specs(const Qwen2Config& config);
int64_t qwen2_parameter_count(const Qwen2Config& config);

// A tensor in backend memory for the safetensors writer: fetched through the backend slice by
// slice while the file is written, so no host copy of the whole tensor exists.
TensorToWrite device_tensor_to_write(Backend& backend, const std::string& name, const std::vector<int64_t>& shape,
                                     const Tensor& tensor);

// Default budget of the fused LM head's logits chunk: large enough that the chunk's GEMMs run
// near the machine's sgemm ceiling (measured in docs/benchmarks.md), small next to the model.
constexpr size_t kDefaultLossWorkspaceBytes = size_t{192} << 20;

struct ModelOptions {
  int64_t max_tokens = 2048;  // capacity of one micro-batch's flat token stream
  bool gradient_checkpointing = false;
  size_t loss_workspace_bytes = kDefaultLossWorkspaceBytes;  // budget for the LM head's logits chunk
  bool with_grads = true;                                    // declare gradients and backward buffers
  bool with_optimizer = false;  // declare AdamW moments (and fp32 masters for 16-bit storage)
  LoraConfig lora;              // rank > 0: adapters are trained, the base is frozen (no gradients, no optimizer state)
  bool allocate = true;         // false: declare and plan only (memtune plan for models larger than this machine)
  // AdamW moments and the float32 masters of 16-bit weights live in host memory (the host plan)
  // instead of the device plan; the optimizer step runs on the host for them (ZeRO-Offload's
  // split). On the CPU backend host and device are the same memory, so only the accounting moves.
  bool optim_offload = false;
  // ZeRO stage 1 over data-parallel ranks: this rank holds the AdamW moments (and float32
  // masters) of its block of every trainable tensor only (block r of n elements is
  // [n r / W, n (r+1) / W)); 0 keeps the whole optimizer state on every rank.
  int zero_stage = 0;
  int rank = 0, world_size = 1;
  Backend* backend = nullptr;  // where the arena lives and the ops run; null: the cpu backend
  bool shards_optimizer() const { return zero_stage >= 1 && world_size > 1; }
};

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

// Wall-clock seconds spent in each phase of the last forward_backward.
struct StepTimings {
  double forward = 0, loss = 0, backward = 0;
};

class Qwen2Model {
 public:
  Qwen2Model(const Qwen2Config& config, const ModelOptions& options);

  const Qwen2Config& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  const std::vector<ParamSpec>& params() const { return specs_; }
  const MemoryPlan& plan() const { return *plan_; }
  // Host-side buffers (optimizer state offloaded with optim_offload); empty otherwise.
  const MemoryPlan& host_plan() const { return *host_plan_; }
  Arena& arena() {
    MT_ASSERT(arena_, "this model was built plan-only (allocate = false)");
    return *arena_;
  }
  Backend& backend() const { return *backend_; }
  int64_t loss_chunk_rows() const { return chunk_rows_; }

  // Deterministic initialization like Hugging Face: N(0, 0.02) for matrices and embeddings,
  // zero biases, unit norm weights.
  void init_random(uint64_t seed);
  // Loads every parameter from a checkpoint, converting dtype if needed; refuses missing or
  // unexpected tensors and shape mismatches with the tensor and file named.
  void load(const CheckpointReader& checkpoint);
  // Writes config.json and model.safetensors (sharded when large) into dir.
  void save(const std::string& dir) const;

  // Views (device memory) of base parameter i in its storage dtype, and of its float32 gradient
  // (only when the base is trainable, i.e. no LoRA).
  Tensor param(size_t i) const;
  Tensor grad(size_t i) const;
  bool base_trainable() const { return options_.with_grads && !options_.lora.enabled(); }

  // What the optimizer updates: the base parameters (full fine-tuning) or the LoRA adapters.
  // Values are float32: the parameter itself, its float32 master when stored in 16 bits, or the
  // adapter matrix. After updating a value, store_trainable(i) rounds it into 16-bit storage.
  size_t num_trainable() const { return trainables_.size(); }
  const ParamSpec& trainable_spec(size_t i) const { return trainables_.at(i).spec; }
  Tensor trainable_value(size_t i) const;
  Tensor trainable_grad(size_t i) const;
  // The elements of trainable i whose optimizer state this rank holds: all of them, or with
  // ZeRO-1 the rank's block. adam_m, adam_v, shard_value and shard_grad are views of
  // shard.size() floats, element k standing for element shard.begin + k of the tensor; moments
  // and masters are host memory with optim_offload.
  Shard optimizer_shard(size_t i) const;
  Tensor adam_m(size_t i) const;  // with_optimizer
  Tensor adam_v(size_t i) const;
  Tensor shard_value(size_t i) const;  // the float32 values the optimizer updates
  Tensor shard_grad(size_t i) const;
  // Rounds the shard's float32 master into the 16-bit weight (nothing for float32 values).
  void store_trainable(size_t i);
  // True when trainable i is the float32 master of a 16-bit base weight (checkpoints keep it).
  bool trainable_is_master(size_t i) const { return trainables_.at(i).widen_into.has_value(); }
  // The storage every rank must hold whole after an update (the ZeRO-1 allgather): the 16-bit
  // weight a master rounds into, or the float32 value itself.
  Tensor trainable_storage(size_t i) const;
  // Sets every float32 master from its 16-bit weight (after loading or initializing weights).
  void load_masters();
  void zero_grads();

  // LoRA (options().lora enabled): PEFT initialization (A Kaiming-uniform, B zero), adapter files
  // in PEFT's format, and merging B A into the base weights.
  void init_lora(uint64_t seed);
  void load_adapter(const std::string& dir);
  void save_adapter(const std::string& dir, const std::string& base_model_name_or_path) const;
  void merge_lora();
  // Training applies LoRA dropout with masks derived from this seed (regenerated in backward, so
  // no mask is stored); nullopt (the default) disables dropout, as in evaluation.
  void set_dropout_seed(std::optional<uint64_t> seed) { dropout_seed_ = seed; }

  // forward, loss and backward of one micro-batch; gradients of the loss SUM are accumulated.
  // If logits_out is given ([N, V] host memory, debugging only) the full logits are written there.
  LossSum forward_backward(const TokenBatch& batch, float* logits_out = nullptr);
  // Forward and loss only (evaluation): gradients are neither computed nor touched.
  LossSum forward_loss(const TokenBatch& batch) { return run_step(batch, nullptr, false); }
  const StepTimings& last_step_timings() const { return timings_; }
  // The token-level loss the fused LM head applies (cross-entropy by default). Not owned.
  void set_loss(const ChunkLoss& loss) { loss_ = &loss; }
  // Multiplies all gradients of the following steps (dynamic loss scaling); the trainer unscales.
  void set_grad_scale(float scale) { grad_scale_ = scale; }
  // Sees every logits chunk of the following steps (streaming metrics); nullptr for none. Not owned.
  void set_observer(ChunkObserver* observer) { observer_ = observer; }
  // Called in backward as soon as decoder layer l's gradients are complete for this micro-batch
  // (l = L-1 down to 0), so data-parallel ranks can start reducing them while backward goes on.
  void set_layer_grads_ready(std::function<void(int64_t layer)> callback) { layer_grads_ready_ = std::move(callback); }

 private:
  struct LayerParams {
    size_t ln1, wq, bq, wk, bk, wv, bv, wo, ln2, wg, wu, wd;
  };
  struct LayerActs {
    BufferId ln1, rstd1, q, k, v, att, lse, res1, ln2, rstd2, gate, up, h;
    std::array<BufferId, kNumLinearSites> lora_u{};  // x A^T of each adapter, [N, r]
  };
  struct Trainable {
    ParamSpec spec;
    BufferId value, grad, m{}, v{};
    std::optional<size_t> widen_into;  // base parameter stored in 16 bits that value is the master of
  };
  struct Linear {  // one linear layer of a decoder layer
    size_t weight;
    std::optional<size_t> bias;
    int64_t in, out;
    int lora = -1;  // index of the adapter's A in trainables_ (B follows), or -1
  };
  LayerActs declare_layer_acts(const std::string& prefix, Category category, Phase first, Phase last);
  void declare_buffers();
  void upload_batch(const TokenBatch& batch);
  LossSum run_step(const TokenBatch& batch, float* logits_out, bool backward);
  void layer_forward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& x_out);
  void layer_backward(int64_t l, const LayerActs& a, const Tensor& x, const Tensor& dstream);
  Linear linear(int64_t l, LinearSite s) const;
  // y = x W^T + b (+ scaling * dropout(x) A^T B^T)
  void linear_forward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& x, const Tensor& y);
  // dx += dy W (+ the adapter's path); accumulates the gradients of whatever is trainable.
  void linear_backward(int64_t l, LinearSite s, const LayerActs& a, const Tensor& dy, const Tensor& x,
                       const Tensor& dx);
  // x itself, or dropout(x) in scratch when LoRA dropout is active.
  Tensor lora_input(int64_t l, LinearSite s, const Tensor& x);
  uint64_t dropout_key(int64_t l, LinearSite s) const;
  void declare_trainables();
  Tensor base_grad_or_none(size_t param) const { return base_trainable() ? grad(param) : Tensor{}; }
  // The parameter as float32: its own storage, or, when stored in 16 bits, converted into the
  // current phase's conversion scratch (one for matrices, one for vectors, so a matmul's weight
  // and bias can be live together). Valid until the next call for a parameter of the same rank.
  Tensor weight_f32(size_t param);
  // A float32 activation of the current micro-batch: [tokens, cols].
  Tensor act(BufferId id, int64_t cols) const { return arena_->f32(id, {num_tokens_, cols}); }

  Qwen2Config config_;
  ModelOptions options_;
  std::vector<ParamSpec> specs_;
  std::vector<LayerParams> layer_params_;
  size_t embed_ = 0, final_norm_ = 0, head_ = 0;
  std::vector<BufferId> weight_ids_, grad_ids_;
  std::vector<Trainable> trainables_;
  std::vector<std::array<int, kNumLinearSites>> lora_index_;  // per layer and site, into trainables_
  std::optional<uint64_t> dropout_seed_;
  std::unique_ptr<MemoryPlan> plan_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<MemoryPlan> host_plan_;
  std::unique_ptr<Arena> host_arena_;
  // This rank's block of a tensor of n elements: all of it, or its ZeRO-1 shard.
  Shard shard_of_tensor(size_t n) const;
  // Where optimizer state (moments, masters) lives: the host arena with optim_offload.
  Arena& state_arena() const { return options_.optim_offload ? *host_arena_ : *arena_; }
  int64_t chunk_rows_ = 1;
  int64_t num_tokens_ = 0, num_seqs_ = 0;
  // Host staging of the batch's positions and targets (reserved for max_tokens).
  std::vector<int32_t> batch_positions_, batch_targets_;
  StepTimings timings_;
  static inline const CrossEntropyLoss kCrossEntropy{};
  const ChunkLoss* loss_ = &kCrossEntropy;
  float grad_scale_ = 1.0f;
  ChunkObserver* observer_ = nullptr;
  Backend* backend_;
  std::function<void(int64_t)> layer_grads_ready_;

  // Buffer ids (see declare_buffers for lifetimes).
  BufferId ids_, positions_, targets_, cu_seqlens_;
  std::vector<BufferId> residual_;         // layer inputs x_0..x_L (x_L feeds the final norm)
  std::vector<LayerActs> saved_;           // per layer, without checkpointing
  LayerActs fwd_scratch_{}, recompute_{};  // with checkpointing
  std::array<BufferId, kNumPhases> matrix_f32_{}, vector_f32_{};
  BufferId normed_, rstd_final_, dnormed_;
  BufferId logits_chunk_, rows_, drows_, loss_positions_, row_targets_, head_slice_{};
  // Host staging of the logits chunk for host losses and observers (backends whose memory the
  // host cannot address); in the host plan.
  BufferId staging_logits_{}, staging_targets_{}, staging_positions_{};
  bool stages_chunks_ = false;
  static constexpr int64_t kHeadSliceRows = 4096;  // vocabulary rows of a 16-bit head widened at once
  int64_t head_slice_rows_ = 0;
  BufferId dstream_, dln_, datt_, dq_, dk_, dv_, dh_, dgate_, dup_;
  BufferId lora_du_{}, lora_dxd_{};
  std::array<BufferId, kNumPhases> lora_xd_{};
};

}  // namespace memtune

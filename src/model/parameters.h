// The model's parameters, one job: their specs with Hugging Face names and shapes, where each
// lives in the plan (weights, gradients, the trainables the optimizer updates, AdamW state, float32
// masters), the LoRA sites, and everything that moves them between files and the backend's memory
// (initialization, loading and saving checkpoints, PEFT adapter files, merging). The decoder's
// compute (model/decoder.h) reads them through views; it never declares or moves them.
// The definitions are split by job: parameter_specs.cpp (Hugging Face names and shapes),
// parameters.cpp (plan declarations, ZeRO-1 shards, views), lora_parameters.cpp (LoRA init,
// PEFT files, adapter sets, merge), parameter_files.cpp (checkpoints and GPTQ / AWQ layers).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/shard.h"
#include "io/checkpoint.h"  // kDefaultMaxShardBytes
#include "io/safetensors.h"
#include "memory/arena.h"
#include "memory/plan.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/lora.h"

namespace memtune {

class CheckpointReader;

struct ParamSpec {
  std::string name;  // Hugging Face name
  std::vector<int64_t> shape;
  int64_t numel() const;
};
// All parameters of a Qwen2ForCausalLM in Hugging Face order (lm_head.weight only when untied).
std::vector<ParamSpec> model_parameter_specs(const ModelConfig& config);
int64_t model_parameter_count(const ModelConfig& config);
// The parameters one token's forward pass reads: all of them but the routed experts', of which
// experts_per_token of num_experts count (a mixture of experts' "activated" parameters).
int64_t model_active_parameter_count(const ModelConfig& config);
// The bits of a parameter a quantized model holds packed (io/quantized.h): every decoder layer's
// linear weight (quant.bits) and, with quant.lm_head_bits, the LM head; 0 for the others.
int packed_bits(const ModelConfig& config, const ParamSpec& spec);

// A tensor in backend memory for the safetensors writer: fetched through the backend slice by
// slice while the file is written, so no host copy of the whole tensor exists.
TensorToWrite device_tensor_to_write(Backend& backend, const std::string& name, const std::vector<int64_t>& shape,
                                     const Tensor& tensor);

// Default budget of the fused LM head's logits chunk: large enough that the chunk's GEMMs run
// near the machine's sgemm ceiling (measured in docs/benchmarks.md), small next to the model.
constexpr size_t kDefaultLossWorkspaceBytes = size_t{192} << 20;

struct ModelOptions {
  int64_t max_tokens = 2048;  // capacity of one micro-batch's flat token stream
  // The most loss targets one micro-batch holds (0: max_tokens). Only target rows go through
  // the LM head, so the logits chunk never needs more rows than this: a chunk sized by tokens
  // would plan rows that no batch ever touches (prompt-heavy data has few targets per token).
  int64_t max_targets = 0;
  bool gradient_checkpointing = false;
  size_t loss_workspace_bytes = kDefaultLossWorkspaceBytes;  // budget for the LM head's logits chunk
  // Host code reads logits chunks (a custom ChunkLoss, or a metric whose needs_logits() is true,
  // or Decoder::generation_step's logits): on a backend whose memory the host cannot address,
  // plan their host staging (one chunk of rows x V floats; an inference model's [max_seqs, V]). The built-in losses and metrics never need it on a backend that runs
  // cross-entropy itself (Backend::runs_cross_entropy).
  bool host_logits = false;
  bool with_grads = true;                                    // declare gradients and backward buffers
  // Quantized weights: products of many rows in a model without gradients (prefill, serving
  // steps, evaluation) round their input to int8 where the backend takes it (int8_activations.h);
  // false keeps float32 inputs (--quantized_activations float). Training keeps float32 inputs.
  bool int8_activations = true;
  // Or bfloat16 operands for those products where the backend has them
  // (Backend::bf16_quantized_products; --quantized_activations bf16, or auto where they are the
  // backend's fastest): takes precedence over int8_activations.
  bool bf16_quantized_products = false;
  // Mixed precision (training's --bf16; a bfloat16 model's inference): the matrix products of
  // the decoder and the LM head take operands rounded to this 16-bit dtype (the weights as stored
  // in it) with float32 accumulation, where the backend has such products
  // (Backend::sixteen_bit_products) and the weights are stored in it (model/decoder_plan.h:
  // sixteen_bit_operands); F32 (or elsewhere): float32 operands.
  DType compute_dtype = DType::F32;
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
  // blocks > 0: an inference model. max_tokens is then the most tokens one step computes
  // (max_num_batched_tokens); nothing for gradients, losses or the optimizer is declared.
  KvCacheOptions kv_cache;
  bool inference() const { return kv_cache.blocks > 0; }
  // Inference: LoRA adapters held side by side, each applied unmerged to the sequences that name
  // it (GenerationBatch::seq_adapters); `lora` stays disabled.
  std::vector<LoraConfig> adapter_sets;
  bool shards_optimizer() const { return zero_stage >= 1 && world_size > 1; }
};

// What a mixture-of-experts model (MoeConfig) may do with these options: forward passes without
// gradients or adapters, on a backend that computes its layers; an Error naming the model and the
// missing piece otherwise.
void check_mixture_of_experts(const ModelConfig& config, const ModelOptions& options);

class ModelParameters {
 public:
  // Declares the weights (device plan), their gradients and the trainables with their optimizer
  // state (device plan, or the host plan with optim_offload).
  ModelParameters(const ModelConfig& config, const ModelOptions& options, MemoryPlan& device_plan,
                  MemoryPlan& host_plan);
  // Once the plans are allocated: the arenas that hold the buffers and the backend that moves them.
  void bind(Arena* device, Arena* host, Backend& backend);
  Backend& backend() const { return *backend_; }
  // ZeRO-1: this rank holds only its block of each trainable's optimizer state.
  bool optimizer_sharded() const { return options_.shards_optimizer(); }

  const std::vector<ParamSpec>& specs() const { return specs_; }
  static constexpr size_t kNone = SIZE_MAX;
  // A sparse layer's mixture of experts (MoeConfig): the router, each expert's gate / up / down,
  // and a shared expert with its gate where the family has one.
  struct ExpertParams {
    size_t gate, up, down;
    // The trained LoRA adapter of each projection (gate, up, down: the LinearSite order), the
    // index of its A among the trainables (B follows), or -1; expert_lora reads it.
    std::array<int, 3> lora{-1, -1, -1};
  };
  struct MoeParams {
    size_t router;
    std::vector<ExpertParams> experts;
    std::optional<ExpertParams> shared;
    std::optional<size_t> shared_gate;
  };
  struct LayerParams {  // indices into specs()
    size_t ln1, wq, wk, wv, wo, ln2;
    size_t wg = kNone, wu = kNone, wd = kNone;  // the dense MLP; kNone in a sparse layer
    std::optional<size_t> bq, bk, bv;     // q/k/v biases (config.attention_bias)
    std::optional<size_t> q_norm, k_norm;  // per-head RMSNorm weights (config.qk_norm)
    std::optional<MoeParams> moe;          // a sparse layer (MoeConfig::sparse)
  };
  struct Linear {  // one linear layer of a decoder layer
    size_t weight;
    std::optional<size_t> bias;
    int64_t in, out;
    int lora = -1;  // index of the adapter's A among the trainables (B follows), or -1
  };
  const LayerParams& layer(int64_t l) const { return layer_params_.at(static_cast<size_t>(l)); }
  // Expert e's (-1: the shared expert's) projection on site Gate, Up or Down of sparse layer l as
  // a linear layer, with its trained adapter unless merged.
  Linear expert_linear(int64_t l, int64_t e, LinearSite s) const;
  // The experts of a sparse layer as expert_linear numbers them: -1 (the shared expert, where the
  // model has one) up to num_experts - 1.
  int64_t first_expert() const { return config_.moe.shared_expert_intermediate_size > 0 ? -1 : 0; }
  Linear linear(int64_t l, LinearSite s) const;
  size_t embed() const { return embed_; }
  size_t final_norm() const { return final_norm_; }
  size_t head() const { return head_; }

  // Deterministic initialization like Hugging Face: N(0, initializer_range) for matrices and embeddings,
  // zero biases, unit norm weights.
  void init_random(uint64_t seed);
  // Loads every parameter from a checkpoint, converting dtype if needed; refuses missing or
  // unexpected tensors and shape mismatches with the tensor and file named.
  void load(const CheckpointReader& checkpoint);
  // Writes config.json and model.safetensors into dir: shards of at most max_shard_bytes with an
  // index when larger (save_pretrained's max_shard_size; 5GB by default, as there).
  void save(const std::string& dir, size_t max_shard_bytes = kDefaultMaxShardBytes) const;
  // Loads what a training checkpoint or output directory holds of this model: the PEFT adapter
  // with LoRA, the whole model otherwise.
  void restore(const std::string& dir);

  // Views (device memory) of base parameter i in its storage dtype, and of its float32 gradient
  // (only when the base is trainable, i.e. no LoRA).
  Tensor param(size_t i) const;
  // A quantized model (config.quant) holds the decoder layers' linear weights packed (and the LM
  // head with quant.lm_head_bits), as backend.h's QuantizedWeight (read from GPTQ / AWQ files,
  // io/quantized.h); param() of one is refused. The base is then frozen: only LoRA adapters train
  // on it (QLoRA).
  bool quantized(size_t i) const { return quant_.at(i).has_value(); }
  QuantizedWeight quantized_param(size_t i) const;
  // The float32 values [out, in] of a quantized weight (dump), formed on the host.
  std::vector<float> dequantized(size_t i) const;
  Tensor grad(size_t i) const;
  bool base_trainable() const { return options_.with_grads && !options_.lora.enabled(); }

  // What the optimizer updates: the base parameters (full fine-tuning) or the LoRA adapters.
  // Values are float32: the parameter itself, its float32 master when stored in 16 bits, or the
  // adapter matrix. An update rounds a master into its 16-bit storage (master_storage).
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
  // The view of the 16-bit weight the shard's float32 master rounds into after an update
  // (AdamWTensor::storage); empty for float32 values.
  Tensor master_storage(size_t i) const;
  // True when trainable i is the float32 master of a 16-bit base weight (checkpoints keep it).
  bool trainable_is_master(size_t i) const { return trainables_.at(i).widen_into.has_value(); }
  // The storage every rank must hold whole after an update (the ZeRO-1 allgather): the 16-bit
  // weight a master rounds into, or the float32 value itself.
  Tensor trainable_storage(size_t i) const;
  // Host memory for one trainable tensor's bytes, where collectives run on a host copy (data
  // parallel on a backend whose memory the host cannot address); null otherwise.
  std::byte* collective_staging() const;
  // Sets every float32 master from its 16-bit weight (after loading or initializing weights).
  void load_masters();
  // Counts the changes of the base weights made here (init_random, load, restore, merge_lora), so
  // that a copy made from them (Decoder's widened vectors of a frozen base) knows when it is stale.
  // The optimizer's updates of a trainable base are not counted: nothing copies a trainable base.
  uint64_t values_version() const { return values_version_; }
  void zero_grads();

  // LoRA (options.lora enabled): PEFT initialization (A Kaiming-uniform, B zero), adapter files
  // in PEFT's format, and merging B A into the base weights.
  void init_lora(uint64_t seed);
  void load_adapter(const std::string& dir);
  void save_adapter(const std::string& dir, const std::string& base_model_name_or_path) const;
  // After merging, the linear layers no longer apply the adapters (the base holds them).
  void merge_lora();

  // Adapter sets (options.adapter_sets, inference): adapter k's A [r, in] and B [out, r] at layer
  // l, site s as float32 views, empty when k does not target that site.
  size_t num_adapter_sets() const { return adapter_sets_.size(); }
  const LoraConfig& adapter_set_config(size_t k) const { return options_.adapter_sets.at(k); }
  Tensor adapter_a(size_t k, int64_t l, LinearSite s) const;
  Tensor adapter_b(size_t k, int64_t l, LinearSite s) const;
  // An expert's (e: its index, -1 the shared expert) adapter of set k on site Gate, Up or Down of
  // sparse layer l: A [r, in] and B [out, r]; empty where the set does not target the site.
  std::pair<Tensor, Tensor> adapter_expert(size_t k, int64_t l, int64_t e, LinearSite s) const;
  // Loads adapter k from a PEFT directory (its adapter_config.json must match the set's config).
  void load_adapter_set(size_t k, const std::string& dir);

 private:
  struct Trainable {
    ParamSpec spec;
    BufferId value, grad, m{}, v{};
    std::optional<size_t> widen_into;  // base parameter stored in 16 bits that value is the master of
  };
  void declare_trainables(MemoryPlan& device_plan, MemoryPlan& host_plan);
  uint64_t values_version_ = 1;
  std::vector<Tensor> grad_views_;  // trainable_grad(i) of every trainable, made by bind
  // This rank's block of a tensor of n elements: all of it, or its ZeRO-1 shard.
  Shard shard_of_tensor(size_t n) const;
  // Where optimizer state (moments, masters) lives: the host arena with optim_offload.
  Arena& state_arena() const { return options_.optim_offload ? *host_ : *device_; }
  Arena& device() const {
    MT_ASSERT(device_, "this model was built plan-only (allocate = false)");
    return *device_;
  }

  ModelConfig config_;
  ModelOptions options_;
  std::vector<ParamSpec> specs_;
  std::vector<LayerParams> layer_params_;
  size_t embed_ = 0, final_norm_ = 0, head_ = 0;
  std::vector<BufferId> weight_ids_, grad_ids_;
  struct QuantIds {
    BufferId codes, scales, zeros;
    std::optional<BufferId> g_idx;
    int bits = 4;
  };
  std::vector<std::optional<QuantIds>> quant_;  // per spec
  void load_quantized(const CheckpointReader& checkpoint, size_t i, std::set<std::string>& expected);
  void pack_from_float(const CheckpointReader& checkpoint, size_t i, const std::string& source);
  std::vector<Trainable> trainables_;
  std::vector<std::array<int, kNumLinearSites>> lora_index_;  // per layer and site, into trainables_
  Arena* device_ = nullptr;
  Arena* host_ = nullptr;
  std::optional<BufferId> collective_staging_;
  Backend* backend_ = nullptr;
  bool lora_merged_ = false;
  struct AdapterSet {
    std::vector<std::array<std::pair<BufferId, BufferId>, kNumLinearSites>> ab;  // per layer and site
    std::vector<std::array<bool, kNumLinearSites>> targeted;
    // Sparse layers: per layer, per expert (the shared expert last), gate / up / down's A and B.
    std::vector<std::vector<std::array<std::pair<BufferId, BufferId>, 3>>> expert_ab;
    std::vector<ParamSpec> specs;  // PEFT names, in declaration order
    std::vector<BufferId> ids;
  };
  std::vector<AdapterSet> adapter_sets_;
};

}  // namespace memtune

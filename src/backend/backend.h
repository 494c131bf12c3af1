// The backend interface: every operation the model, the trainer, the optimizer and the metrics
// need, over tensor views (backend/tensor.h). Model, training and evaluation code is written
// once against it; implementations live in their own folders:
//   cpu/        OpenBLAS GEMMs and OpenMP loops in float32: the fast one, and the default.
//   reference/  plain single-threaded loops with float64 accumulation, no BLAS: obviously
//               correct and slow, the oracle every other backend is tested against, op by op
//               (tests/backend/ops_test.cpp). It also enforces device-memory discipline: its
//               memory is inaccessible to the process outside its own calls.
//   vulkan/     compute shaders on a Vulkan device (a GPU, or Mesa's lavapipe on the CPU); its
//               memory is device memory that the host never dereferences (data crosses by copies).
// Another backend is another folder implementing this class plus one entry in the registry
// (kBackends in registry.cpp); the model, training, evaluation and generation do not change.
//
// Conventions: activations are [N, C] over a flat token stream holding several sequences back
// to back (cu_seqlens[s]..cu_seqlens[s+1]); linear weights are [out, in] as in PyTorch; compute
// views are float32, token ids and offsets int32. Backward ops ACCUMULATE (+=) into parameter
// and input gradients unless their comment says they overwrite; callers zero what must start
// at zero (fill). No op allocates: outputs, saved tensors and scratch come from the caller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/chunk_loss.h"
#include "backend/sample_row.h"
#include "backend/tensor.h"

namespace memtune {

// AdamW as torch.optim.AdamW (what Hugging Face Trainer uses): decoupled weight decay applied
// to the parameter before the moment update, bias-corrected moments, eps added to the
// bias-corrected square root.
struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};
struct AdamWStep {
  int64_t t = 1;  // 1-based step (bias correction)
  double learning_rate = 0;
  AdamWConfig config;
  bool decay = true;        // weight decay applies to this tensor
  float grad_scale = 1.0f;  // multiplies the gradient (clipping) inside the update
};

// Host memory the fused LM head uses when the backend's own memory is not host-addressable
// (null members otherwise): the [N]-sized arrays hold the targets' positions, their targets,
// their RowStats and per-row losses in order; logits stage a chunk for host losses and for
// observers that need logits.
struct HostChunkStaging {
  float* logits = nullptr;         // [chunk_rows, V]
  int32_t* targets = nullptr;      // [N]
  int32_t* positions = nullptr;    // [N]
  RowStats* row_stats = nullptr;   // [N]
  float* row_losses = nullptr;     // [N]
};

// The fused LM head + loss over the positions whose target is not kIgnoreIndex. Logits exist
// only as a [chunk_rows, V] workspace reused chunk after chunk. Returns the SUM of the loss and
// the COUNT of targets; gradients are those of the sum times grad_scale. Without dhidden only
// the loss is computed; dhidden rows are OVERWRITTEN (zero at ignored positions); dweight
// (float32, may be absent for a frozen head) is accumulated. A 16-bit weight is widened
// weight_slice.rows() vocabulary rows at a time, so no float32 copy of the head exists.
// A backend may compute a CrossEntropyLoss where the logits are (a device backend does: then
// only per-row losses come back, once per call), and an observer gets every row's RowStats
// (observe_rows) before any logits (observe, only when it needs_logits()). A packed head
// (`quantized`, frozen) is dequantized weight_slice.rows() vocabulary rows at a time instead.
struct QuantizedWeight;
struct LmHeadArgs {
  Tensor hidden;   // [N, D] f32
  Tensor targets;  // [N] i32
  Tensor weight;   // [V, D], any floating dtype; not read when `quantized` is set
  const QuantizedWeight* quantized = nullptr;  // a packed head [V, D] (quant.lm_head_bits)
  const ChunkLoss* loss = nullptr;
  Tensor dhidden;  // [N, D] f32, optional
  Tensor dweight;  // [V, D] f32, optional
  float grad_scale = 1.0f;
  ChunkObserver* observer = nullptr;
  // The same targets in host memory when the caller has them there (the decoder built them):
  // a backend whose memory the host cannot address then need not download them.
  std::span<const int32_t> host_targets = {};
  // The caller takes the loss sum later (take_deferred_loss_sum): a device backend may leave it
  // on the device, to come back with the step's next download (the gradient norm's), instead of
  // waiting for it here.
  bool defer_sum = false;
  // The products' operands: F32, or with mixed precision the 16-bit dtype the head is stored in
  // (Backend::sixteen_bit_products): the hidden rows and the loss's gradient (times grad_scale)
  // are then rounded to it, and logits and gradients accumulate in float32. The rows buffer
  // holds the rounded rows and the logits chunk the rounded gradient; weight_slice is not read.
  DType operands = DType::F32;
  // Workspace (device memory).
  Tensor logits;        // [chunk_rows, V] f32
  Tensor rows;          // [chunk_rows, D] f32, the gathered hidden rows
  Tensor drows;         // [chunk_rows, D] f32
  Tensor positions;     // [N] i32, the positions that have a target
  Tensor row_targets;   // [chunk_rows] i32
  Tensor weight_slice;  // [slice_rows, D] f32, only for a 16-bit weight
  // [chunk_rows, S] f32 where the backend lays the 16-bit head's products out densely through it
  // (Backend::head_product_slice); absent otherwise.
  Tensor product_slice;
  Tensor row_stats;     // [N, 4] i32 (RowStats), for an observer
  Tensor row_losses;    // [N] f32, a loss computed on the device
  HostChunkStaging staging = {};
  int64_t vocab() const;        // V
  int64_t hidden_size() const;  // D
};

// A weight-only quantized linear weight W [out, in] in device memory, laid out as
// io/quantized.h's QuantizedLayer: codes int32 [out, in * bits / 32] (input k of row n at bit
// offset bits * (k % (32 / bits)) of word k / (32 / bits)), scales and zeros float16
// [out, groups], and g_idx int32 [in] or absent (input k in group k / group_size);
// W[n, k] = scales[n, g(k)] * (code(n, k) - zeros[n, g(k)]).
struct QuantizedWeight {
  Tensor codes, scales, zeros, g_idx;
  int bits = 4;
  int64_t in = 0, out = 0, group_size = 0, groups = 0;
  // Products of many rows may round their input to int8 (int8_activations.h); set by the model
  // where the backend takes it (Backend::takes_int8_activations) and its options ask for it.
  bool int8_activations = false;
  // With int8_activations, decoding's products (at most kInt8ActivationRows rows) round their
  // input too (int8_activations.h: rounds_decode_layout); set by the model where the backend has
  // such kernels (Backend::takes_int8_decode_activations).
  bool int8_decode = false;
  // Products of many rows take bfloat16 operands instead (int8_activations.h: rounds_to_bfloat16):
  // the input and the dequantized weight rounded to bfloat16, float32 accumulation, on the CPU's
  // matrix unit; set by the model where the backend has them (Backend::bf16_quantized_products)
  // and its options ask for them.
  bool bf16_products = false;
};
inline int64_t LmHeadArgs::vocab() const { return quantized ? quantized->out : weight.rows(); }
inline int64_t LmHeadArgs::hidden_size() const { return quantized ? quantized->in : weight.cols(); }
// One product of Backend::matmul_forward_group.
struct GroupMember {
  Tensor out, weight, bias;
  const QuantizedWeight* quantized = nullptr;  // set: `weight` is not read
  Tensor inp;  // its own input (a mixture of experts' rows); absent: the group's
};
// The largest head_dim the attention ops take (a query row's accumulator lives on the stack);
// config loading refuses larger heads before any memory is planned.
constexpr int64_t kMaxAttentionHeadDim = 256;

// What a backend's device says about its memory, measured by the device rather than derived
// from the plan (memory.json's "device"; --device_memory auto).
struct DeviceMemoryFigures {
  std::string device;                // the device's name
  uint64_t heap_bytes = 0;           // its device-local heap(s)
  uint64_t max_allocation_bytes = 0; // what one allocation may hold
  // The driver's own figures where it has them (VK_EXT_memory_budget): this process's usage of
  // the device's memory, and what it may use now.
  std::optional<uint64_t> usage_bytes, budget_bytes;
  // What a plan may take: the budget where known, else the heap.
  uint64_t available_bytes() const { return budget_bytes.value_or(heap_bytes); }
};

// What the host has asked of a device that runs apart from it, since the backend opened it:
// dispatches, command buffers submitted, and waits for the device to finish.
// overlapped_waits: waits after which the device still had work the host had submitted since
// (the host waited for a step's result while the next step was queued).
// replayed_dispatches: of the dispatches, those the backend ran again as it had recorded them
// (replay_commands), which the host did not record again; replayed_command_buffers: the recorded
// command buffers they were in.
struct DeviceCounters {
  uint64_t dispatches = 0, submissions = 0, waits = 0, overlapped_waits = 0;
  uint64_t barriers = 0;  // execution and memory dependencies recorded between commands
  uint64_t replayed_dispatches = 0, replayed_command_buffers = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // The device's counters, and its dispatches by shader (kernel) since it opened; none for a
  // backend that computes on the host's threads.
  virtual std::optional<DeviceCounters> device_counters() const { return std::nullopt; }
  virtual std::map<std::string, uint64_t> dispatches_by_shader() const { return {}; }
  // Vocabulary rows of the [chunk_rows, S] float32 buffer through which the 16-bit head's
  // products of `operands` run (LmHeadArgs::product_slice, planned); 0: none.
  virtual int64_t head_product_slice(DType /*operands*/) const { return 0; }
  // Quantized products of many rows with bfloat16 operands (QuantizedWeight::bf16_products): what
  // runs them, empty where the backend has none; and whether they are its fastest way to run
  // those products (`--quantized_activations auto` takes them then, int8 activations otherwise).
  virtual std::string bf16_quantized_products() const { return {}; }
  virtual bool prefers_bf16_quantized_products() const { return false; }
  // The device's memory figures; none for a backend in host memory (the process's RSS covers it).
  virtual std::optional<DeviceMemoryFigures> device_memory_figures() const { return std::nullopt; }
  // Host memory the backend's own runtime holds beyond its arena once steps run (a driver, its
  // compiled code, staging): a term of the process prediction. The cpu backend's runtime is the
  // compute runtime term itself (OpenBLAS, OpenMP).
  virtual size_t runtime_bytes() const { return 0; }
  // Phase timings on a device that runs apart from the host: time_mark(i) records a timestamp
  // (i < kTimeMarks) taken when the work recorded before it has finished, mark 0 starting a new
  // series; time_marks() waits for that work and returns each mark's seconds since mark 0, for
  // the marks 0..n-1 of the series, once. Empty where the backend computes as the host calls it (cpu, reference: the host's
  // wall clock between the calls is then the time) or the device has no timestamps.
  static constexpr int kTimeMarks = 8;
  virtual void time_mark(int) {}
  virtual std::vector<double> time_marks() { return {}; }
  // Work that repeats (a decode step's forward): begin_commands(key) ... end_commands() brackets
  // ops whose commands are a pure function of `key` (the shapes and host values they depend on)
  // and that hand nothing to or from host memory; where the backend keeps what it recorded,
  // replay_commands(key) runs those commands again over the device memory as it is now and
  // returns true, and the caller skips the ops. The default keeps nothing (a backend that runs
  // ops as the host calls them has nothing recorded to reuse).
  virtual bool replay_commands(std::span<const int64_t> /*key*/) { return false; }
  virtual void begin_commands(std::span<const int64_t> /*key*/) {}
  virtual void end_commands() {}
  // Whether quantized products of many rows round their input to int8 when the weight asks
  // (QuantizedWeight::int8_activations, int8_activations.h); a backend that says no computes
  // them with float32 inputs.
  virtual bool takes_int8_activations() const { return false; }
  // Whether decoding's quantized products (few rows) take them too (QuantizedWeight::int8_decode).
  virtual bool takes_int8_decode_activations() const { return false; }
  // Mixed precision: what computes matrix products with 16-bit operands of `dtype` (BF16, F16)
  // and float32 accumulation (matmul_forward's inp and weight, matmul_backward's dout, inp and
  // weight, LmHeadArgs::operands), named for `memtune plan` (e.g. "oneDNN brg:avx512_core_bf16");
  // empty where this backend has none here. Then the model keeps float32 operands.
  virtual std::string sixteen_bit_products(DType) const { return {}; }
  // Mixed precision in attention: what computes attention's products with 16-bit operands of
  // `dtype` (attention_forward's `operands`), named for `memtune plan`; empty where this backend
  // keeps attention in float32 (the model then passes F32). The reference backend rounds where a
  // backend under test does, so that its ops can be compared at the same rounding points.
  virtual std::string sixteen_bit_attention(DType) const { return {}; }
  // Host memory those products' runtime holds beyond the arena (generated kernels, scratchpad
  // pages): a term of the process prediction where a model takes them.
  virtual size_t sixteen_bit_runtime_bytes() const { return 0; }

  // Device memory for an arena: zero-filled, page aligned. Host code must not dereference it.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* base, size_t bytes) = 0;
  // True when host code may read the backend's memory directly (host losses and observers then
  // run on the chunk in place; no staging is planned).
  virtual bool host_addressable() const = 0;
  // True when lm_head_loss computes a CrossEntropyLoss where the logits are, so the built-in
  // losses and metrics need no host copy of a logits chunk (a GPU backend).
  virtual bool runs_cross_entropy() const { return false; }
  // True when allocate() hands out pages of this process's own memory (map_host_pages), so
  // the process's resident set holds them and mincore can say which are resident.
  virtual bool memory_in_host_pages() const = 0;
  // True when the arena's memory is the machine's RAM and so counts in the process prediction
  // (memtune plan, --host_memory): the host backends, a Vulkan device on the CPU or an integrated
  // GPU. A discrete GPU's arena counts against the device only.
  virtual bool arena_in_host_memory() const { return memory_in_host_pages(); }

  // How the model hands weights to the matmuls is the backend's choice, asked here, never known
  // by the model. Products with at most stored_weight_rows() input rows take 16-bit weights as
  // stored (matmul_forward, matmul_forward_group); with more rows the model widens a 16-bit
  // weight into float32 scratch first and passes that.
  virtual int64_t stored_weight_rows() const = 0;
  // The float32 scratch a quantized product (quantized_matmul_forward, matmul_forward_group's
  // quantized members, quantized_matmul_backward_input) of a weight with `in` inputs needs, for
  // any number of input rows: what the model plans.
  virtual size_t quantized_scratch_elems(int64_t in) const = 0;
  // Of that scratch, the elements (from its start) a product of `rows` input rows uses; the
  // caller may put other values past them while the product runs.
  virtual size_t quantized_scratch_used(int64_t rows, int64_t in) const = 0;

  // Transfers between host memory and device views, and within the device.
  virtual void copy_to_device(const Tensor& dst, const void* src) = 0;  // dst.bytes() from host src
  virtual void copy_to_host(void* dst, const Tensor& src) = 0;          // src.bytes() to host dst
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;          // same dtype and size
  // dst = src converted between floating dtypes (f32 <-> bf16 / f16), elementwise.
  virtual void convert(const Tensor& dst, const Tensor& src) = 0;
  virtual void fill(const Tensor& dst, float value) = 0;  // f32 views
  // Every tensor of `tensors` (f32 views) set to value, as one op where the backend has one (the
  // step's gradients zeroed together); by default a fill() each.
  virtual void fill_group(std::span<const Tensor> tensors, float value) {
    for (const Tensor& t : tensors) fill(t, value);
  }
  virtual void fill_bytes(void* device, unsigned char byte, size_t bytes) = 0;

  // Mixed precision (sixteen_bit_products): an inp (dout) of a 16-bit dtype makes a product of
  // 16-bit operands, the weight (and inp for dweight) in that dtype too, accumulated in float32
  // into float32 outputs; matmul_backward then takes scale 1.
  // out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias[OC]). The weight may be stored in 16 bits
  // (bfloat16 / float16): it is then widened in registers as it is read, never copied to a
  // float32 matrix, which is what memory-bound decoding wants (few rows, each weight read once);
  // for many rows the caller widens into scratch and passes float32.
  virtual void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) = 0;
  // out[N,OC] += scale * inp[N,C] @ weight[OC,C]^T
  virtual void matmul_accumulate(const Tensor& out, const Tensor& inp, const Tensor& weight, float scale) = 0;
  // For out = scale * inp @ weight^T (+ bias): dinp += scale * dout @ weight;
  // dweight += scale * dout^T @ inp; dbias += colsum(dout) (scale 1). Absent views are skipped.
  virtual void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                               const Tensor& inp, const Tensor& weight, float scale) = 0;
  // out[N,OC] = inp[N,C] @ W^T (+ bias) for a quantized W, never dequantized whole (the cpu
  // backend reads the codes directly for few rows and dequantizes tiles of output rows into the
  // scratch for many); scratch: quantized_scratch_elems(C) float32 elements.
  virtual void quantized_matmul_forward(const Tensor& out, const Tensor& inp, const QuantizedWeight& weight,
                                        const Tensor& bias, const Tensor& scratch) = 0;
  // Several products of few rows (decoding's q / k / v and gate / up of one input; every routed
  // expert's gate / up, then down, each on its own rows): for every member, out = x @ W^T (+ bias),
  // x its own `inp` or else the group's, W its float weight (as matmul_forward takes it: 16-bit
  // for up to stored_weight_rows() rows) or, when `quantized` is set, that quantized weight
  // (scratch as quantized_matmul_forward's for the widest input). A backend may run them as one
  // pass; by default they run one after another.
  virtual void matmul_forward_group(std::span<const GroupMember> group, const Tensor& inp, const Tensor& scratch);
  // The MLP's gate and up (`gate_up`, two members as matmul_forward_group takes them), then
  // h = silu(gate) * up as swiglu_forward computes it. A device backend runs the three as one pass
  // where it runs the group as one (decoding's few rows); by default they run one after the other.
  virtual void matmul_forward_group_swiglu(std::span<const GroupMember> gate_up, const Tensor& inp,
                                           const Tensor& scratch, const Tensor& h) {
    MT_ASSERT(gate_up.size() == 2, "matmul_forward_group_swiglu takes gate and up");
    matmul_forward_group(gate_up, inp, scratch);
    swiglu_forward(h, gate_up[0].out, gate_up[1].out);
  }
  // dinp[N,C] += dout[N,OC] @ W: the gradient through a frozen quantized weight (QLoRA), tile by
  // tile through the same scratch.
  virtual void quantized_matmul_backward_input(const Tensor& dinp, const Tensor& dout, const QuantizedWeight& weight,
                                               const Tensor& scratch) = 0;
  // out = x * rsqrt(mean(x^2) + eps) * weight; saves rstd[N].
  virtual void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight,
                               float eps) = 0;
  // res += x, then out = rmsnorm(res) with rstd saved: a layer's residual add and the norm after
  // it. A device backend runs them as one pass (one dispatch, the row read once); by default they
  // run one after the other.
  virtual void add_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& res, const Tensor& x,
                                   const Tensor& weight, float eps) {
    add_inplace(res, x);
    rmsnorm_forward(out, rstd, res, weight, eps);
  }
  // dweight may be absent (frozen norm).
  virtual void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                const Tensor& weight, const Tensor& rstd) = 0;
  // Rotary embedding in place on x[N, heads * head_dim] at positions[N] (Hugging Face's
  // rotate-half convention): pair i of a head turns by position * inv_freq[i], inv_freq holding
  // head_dim / 2 float32 frequencies (model/config.h: rope_inv_freq, scaling applied). Positions
  // are absolute: a sequence continuing after cached keys starts at its cache length. backward
  // rotates the gradient back by the same angles.
  virtual void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) = 0;
  virtual void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) = 0;
  // Both of a layer's rotations (q and k, or their gradients: the same rows and positions) as
  // one op; a backend with a fused form (vulkan: one dispatch) overrides them.
  virtual void rope_forward_pair(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& inv_freq) {
    rope_forward(q, positions, inv_freq);
    rope_forward(k, positions, inv_freq);
  }
  virtual void rope_backward_pair(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                                  const Tensor& inv_freq) {
    rope_backward(dq, positions, inv_freq);
    rope_backward(dk, positions, inv_freq);
  }
  // Causal grouped-query attention over packed sequences (cu_seqlens [S+1]), never a [T, T]
  // score matrix; head_dim is at most kMaxAttentionHeadDim. q[N, Hq*hd], k/v[N, Hkv*hd] ->
  // out[N, Hq*hd]; saves lse[N, Hq]. All tensors are float32; `operands` F16 lets the products
  // (q.k, p.v; in backward dout.v, ds.k, ds.q, p.dout) round their operands to float16 with
  // float32 accumulation, where the backend says so (sixteen_bit_attention); F32: none rounded.
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& cu_seqlens, int64_t head_dim,
                                 DType operands = DType::F32) = 0;
  // dq, dk, dv are OVERWRITTEN (every token belongs to one sequence).
  virtual void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                  const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& cu_seqlens, int64_t head_dim,
                                  DType operands = DType::F32) = 0;
  // Inference over a paged KV cache. A cache is [slots, kv_dim] in the model's storage dtype;
  // slot = block * block_size + offset, and a sequence's block table lists its blocks in order.
  // kv_cache_write stores k, v [N, kv_dim] (float32) at slots[N].
  virtual void kv_cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v,
                              const Tensor& slots) = 0;
  // Causal grouped-query attention of new queries over cached keys: sequence s has queries
  // cu_seqlens[s]..cu_seqlens[s+1] (already in the cache), context_lens[s] cached tokens in all,
  // so its query i sits at position context_lens[s] - n_s + i and attends keys 0..that position,
  // read through block_tables [S, max_blocks]. q, out [N, Hq*hd] float32.
  virtual void paged_attention_forward(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                       const Tensor& v_cache, const Tensor& block_tables, const Tensor& cu_seqlens,
                                       const Tensor& context_lens, int64_t head_dim, int64_t block_size) = 0;
  // out[r] = inp[index[r]] for rows of float32 matrices.
  virtual void gather_rows(const Tensor& out, const Tensor& inp, const Tensor& index) = 0;
  // Mixture-of-experts combine: out[n] += sum over k of weights[rows[n, k]] * inp[rows[n, k]], the
  // terms added in k order (rows: [N, K] int32 row ids of inp; absent: out[n] += weights[n] *
  // inp[n]). A gather per output row: every element written by one invocation, no atomics. A
  // backend that has it says so (computes_mixture_of_experts); the decoder refuses a
  // mixture-of-experts model elsewhere.
  virtual bool computes_mixture_of_experts() const { return false; }
  virtual void combine_rows(const Tensor& /*out*/, const Tensor& /*inp*/, const Tensor& /*rows*/,
                            const Tensor& /*weights*/) {
    MT_ASSERT(false, "this backend has no combine_rows (computes_mixture_of_experts)");
  }
  // The backward of combine_rows over rows that each feed one output row (tokens: [R] int32, the
  // output row of input row r; absent: r itself): dweights[r] = inp[r] . dout[tokens[r]], then
  // dinp[r] = weights[r] * dout[tokens[r]]. Both overwrite; dinp may be inp itself (the rows'
  // values are read before their gradient replaces them). A backend that has it says so
  // (trains_mixture_of_experts); the decoder refuses to train a mixture of experts elsewhere.
  virtual bool trains_mixture_of_experts() const { return false; }
  virtual void combine_rows_backward(const Tensor& /*dinp*/, const Tensor& /*dweights*/, const Tensor& /*inp*/,
                                     const Tensor& /*dout*/, const Tensor& /*tokens*/, const Tensor& /*weights*/) {
    MT_ASSERT(false, "this backend has no combine_rows_backward (trains_mixture_of_experts)");
  }
  // h = silu(gate) * up
  virtual void swiglu_forward(const Tensor& h, const Tensor& gate, const Tensor& up) = 0;
  virtual void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dh, const Tensor& gate,
                               const Tensor& up) = 0;
  // out[n] = table[ids[n]], the table in any floating dtype; backward accumulates rows.
  virtual void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table) = 0;
  virtual void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& ids) = 0;
  // Inverted dropout: out = x * keep / (1 - p), keep drawn from a counter-based hash of
  // (key, i): the same key reproduces the same mask. out may alias x.
  virtual void dropout_forward(const Tensor& out, const Tensor& x, uint64_t key, float p) = 0;
  virtual void add_inplace(const Tensor& y, const Tensor& x) = 0;  // y += x
  virtual LossSum lm_head_loss(const LmHeadArgs& args) = 0;
  // One token per row of args.logits (backend/sample_row.h), chosen where the logits are: only
  // the token ids come back, never [rows, V] logits. By default the host sampler, row by row,
  // over memory the host can address.
  virtual void sample_tokens(const SampleArgs& args);

  // x *= scale for every tensor; returns the sum of all their squares after scaling (float64):
  // a step's gradient norm, one value handed back per call, however many tensors.
  virtual double scale_and_sum_squares(std::span<const Tensor> xs, float scale) = 0;
  // The sum of the deferred loss sums (LossSum::deferred) since the last call, in call order;
  // a wait for the device only when no read since has brought them back.
  virtual double take_deferred_loss_sum() { return 0.0; }
  // One AdamW update of param (f32) with grad, moments m and v (all of the same size; each may
  // be in host or device memory, as optimizer offload places them).
  virtual void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                            const AdamWStep& step) = 0;
  // The same update of many tensors with one step's constants, each tensor's own `decay`
  // (step.decay is not read), and each updated param rounded into its `storage` where it has one
  // (the 16-bit weight a float32 master stands for: as convert(storage, param) after the update):
  // by default adamw_update and convert per tensor, in order; a device backend makes it one
  // dispatch.
  struct AdamWTensor {
    Tensor param, grad, m, v;
    bool decay = true;
    Tensor storage;
  };
  virtual void adamw_update_group(std::span<const AdamWTensor> tensors, const AdamWStep& step);

  // Training steps decided on the device, so that the host records the next step before it
  // reads this one's result (Trainer: one process, no loss scaling, a backend for which
  // decides_steps() is true). decide_and_update does what scale_and_sum_squares and
  // adamw_update_group do, but the device takes the norm (the partials added in order in
  // float64, as the host adds them), decides whether the step counts (a finite norm), computes the
  // clipping coefficient min(1, max_norm / (norm + 1e-6)) (none when max_norm <= 0), and updates
  // with `if_previous_counted` when the step decided before this one counted, else with
  // `if_previous_skipped` (their grad_scale is not read); nothing comes back yet. read_step()
  // then starts bringing back the squared norm, whether it counted, the deferred loss sums and
  // the step's time marks; take_step() returns them, oldest first, waiting only for that copy.
  // At most two steps may be read and not yet taken.
  virtual bool decides_steps() const { return false; }
  struct DecidedStep {
    double max_grad_norm = 0;
    AdamWStep if_previous_skipped, if_previous_counted;
  };
  virtual void decide_and_update(std::span<const Tensor> grads, float scale, std::span<const AdamWTensor> tensors,
                                 const DecidedStep& step);
  virtual void read_step();
  struct StepReadback {
    double sum_squares = 0, loss_sum = 0;
    bool counted = false;
    std::vector<double> marks;  // seconds since mark 0 (time_marks), empty without timestamps
  };
  virtual StepReadback take_step();

  // Collectives (distributed/) read and write device memory: `op` runs with that memory reachable by
  // the communicator. overlaps_collectives(): whether a non-blocking collective may stay in
  // flight while the backend computes (false makes the trainer reduce after backward).
  virtual void collective(const std::function<void()>& op) { op(); }
  virtual bool overlaps_collectives() const { return true; }
};

// Whole tensors cross between host and device in slices of at most this many bytes, through
// host staging of that size (loading, saving, checkpoints).
inline constexpr size_t kTransferBytes = size_t{8} << 20;

// Host-side helpers over copy_to_host / copy_to_device: a device view's values as float32 in a
// host vector (converted on the host), and the reverse (converted to the view's dtype). For
// loading, saving, merging and tests; never on a step's path.
std::vector<float> download_f32(Backend& backend, const Tensor& tensor);
void upload_f32(Backend& backend, const Tensor& tensor, std::span<const float> values);

// Page-aligned, zero-filled anonymous host memory, committed when it is made (every page faulted
// in, as a device allocation is): the arena of the host backends. The planned bytes are then
// resident from the first step, not from the step that first meets the data's largest
// micro-batch, so a run that does not fit the machine fails at its start and the process's
// measured RSS can be checked against the plan. An Error naming the size when it is refused.
void* map_host_pages(size_t bytes);

}  // namespace memtune

// The cpu backend's kernels: every op of the decoder as an explicit forward/backward pair in
// float32 on raw pointers (llm.c style). GEMMs go to OpenBLAS; everything else is OpenMP loops.
// No kernel allocates. Conventions (layouts, accumulate contract) are backend.h's;
// cpu_backend.cpp checks the views and calls these.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/labels.h"

namespace memtune::cpu {

// The cpu backend's tuning (Backend::stored_weight_rows, quantized_scratch_elems):
// Up to this many rows matmul_forward takes a 16-bit weight as it is stored (widened in
// registers: decoding reads each weight once); with more rows the caller widens it into float32
// scratch first and sgemm runs on it. Quantized products read the codes directly up to this many
// rows.
constexpr int64_t kSixteenBitWeightRows = 16;
// Output rows of a quantized weight dequantized at once (into float32 scratch [rows, in]) when a
// quantized product has more input rows than kSixteenBitWeightRows.
constexpr int64_t kQuantizedTileRows = 256;

// The OpenBLAS kernel set sgemm runs (e.g. "Cooperlake", "Haswell"), for benchmark reports:
// OPENBLAS_CORETYPE in the environment pins it (=Haswell keeps an AVX-512 CPU on AVX2 kernels, and
// its sgemm below what the CPU can do), otherwise OpenBLAS picks by CPU. Figures of one machine
// differ by kernel set, so reports name it (docs/benchmarks.md).
const char* blas_kernels();
// The name the float32 products are counted under (products.h): "OpenBLAS sgemm (<kernel set>)".
const std::string& blas_kernel();

// out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias[OC])
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC);
// out[N,OC] += bias[OC] on every row.
void add_bias(float* out, const float* bias, int64_t N, int64_t OC);
// acc[C] += the column sums of x[N, C] (float32 or 16-bit, widened), summed in float32.
void column_sums_accumulate(float* acc, const void* x, DType dtype, int64_t N, int64_t C);
// out[N,OC] += scale * inp[N,C] @ weight[OC,C]^T
void matmul_accumulate(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC,
                       float scale);
// For out = scale * inp @ weight^T (+ bias): dinp += scale * dout @ weight;
// dweight += scale * dout^T @ inp; dbias += scale * colsum(dout). Null outputs are skipped.
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC, float scale = 1.0f);

// out = x * rsqrt(mean(x^2) + eps) * weight; saves rstd[N].
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
// dweight may be null (frozen norm).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C);

// Rotary embedding in place on x[N, heads*head_dim], Hugging Face rotate-half convention.
void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t heads, int64_t head_dim, const float* inv_freq);
// In-place gradient: rotates dx back by the same angles.
void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t heads, int64_t head_dim,
                   const float* inv_freq);

// Causal grouped-query attention over packed sequences, online softmax, never materializing a
// [T, T] score matrix. q[N, Hq*hd], k/v[N, Hkv*hd] -> out[N, Hq*hd]; saves lse[N, Hq].
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_seqlens, int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t hd);
// Recomputes probabilities from lse. dq, dk, dv are OVERWRITTEN (every token belongs to one sequence).
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const int32_t* cu_seqlens, int64_t num_seqs,
                        int64_t Hq, int64_t Hkv, int64_t hd);

// Quantized weights (quantized_ops.cpp): out[N,OC] = inp[N,C] @ W^T (+ bias) and
// dinp[N,C] += dout[N,OC] @ W; scratch holds kQuantizedTileRows x in floats.
void quantized_matmul_forward(float* out, const float* inp, const QuantizedWeight& weight, const float* bias,
                              int64_t N, float* scratch);
// Output rows o0 .. o0 + rows of a quantized weight as float32 [rows, in] (the LM head's slices).
void dequantize_weight_rows(float* out, const QuantizedWeight& weight, int64_t o0, int64_t rows);
void quantized_matmul_backward_input(float* dinp, const float* dout, const QuantizedWeight& weight, int64_t N,
                                     float* scratch);
// The same forward product with int8 activations (int8_activation_ops.cpp, int8_activations.h),
// which quantized_matmul_forward takes where rounds_activations(weight, N) (in the float path's
// tile scratch); scratch_bytes must hold every thread's tile and a few rows
// (int8_activation_scratch_bytes(rows)). int8_activation_kernels(): this build has them (AVX2).
void quantized_matmul_int8_activations(float* out, const float* inp, const QuantizedWeight& weight, const float* bias,
                                       int64_t N, void* scratch, size_t scratch_bytes);
size_t int8_activation_scratch_bytes(int64_t rows, const QuantizedWeight& weight);
bool int8_activation_kernels();
// Decoding's products with int8 activations (rounds_activations for at most kInt8ActivationRows
// rows, where the model sets QuantizedWeight::int8_decode): int8_decode_prepare rounds N input
// rows into `prepared` (int8_decode_prepared_bytes), int8_decode_rows writes output rows
// [o0, o1) of them. int8_decode_kernels(): this build has them (AVX512-VNNI).
bool int8_decode_kernels();
size_t int8_decode_prepared_bytes(const QuantizedWeight& weight, int64_t rows);
void int8_decode_prepare(const float* inp, const QuantizedWeight& weight, int64_t N, void* prepared);
void int8_decode_rows(float* out, const void* prepared, const QuantizedWeight& weight, const float* bias, int64_t N,
                      int64_t o0, int64_t o1);
// Which of them: "memtune int8 x int8 (AVX512-VNNI)", "(AVX-VNNI)" or "(AVX2)".
const char* int8_activation_kernel();

// out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias) for few rows: each weight row is read once
// (widened from bfloat16 / float16 in registers) and applied to every input row; parallel over
// output columns. The decode path, memory-bound on the weights; bias may be null.
void matmul_skinny(float* out, const float* inp, const void* weight, DType weight_dtype, const float* bias, int64_t N,
                   int64_t C, int64_t OC);
// The same product cut into tasks of output rows (any thread may run any task, each once), so that
// several products share one parallel region (CpuBackend::matmul_forward_group).
struct SkinnyMatmul {
  float* out;
  const float* inp;
  const void* weight;
  DType dtype;
  const float* bias;
  int64_t N, C, OC;
  int64_t tasks() const;
  void run(int64_t task) const;
};
// A quantized product for few rows (N <= kSixteenBitWeightRows) in tasks: prepare() forms what
// every task reads from the input (its permutation and sums per group, in scratch); tasks can
// share one prepared input when their weights have the same layout (same_input_layout).
struct QuantizedSkinny {
  float* out;
  const QuantizedWeight* weight;
  const float* bias;
  int64_t N;
  const float* inp;       // set by prepare()
  const float* prepared;  // scratch, after prepare()
  void prepare(const float* input, float* scratch);
  int64_t tasks() const;
  void run(int64_t task) const;
};
bool same_input_layout(const QuantizedWeight& a, const QuantizedWeight& b);

// Paged KV cache (backend.h): caches [slots, Hkv*hd] in cache_dtype (f32, bf16 or f16).
void kv_cache_write(void* k_cache, void* v_cache, DType cache_dtype, const float* k, const float* v,
                    const int32_t* slots, int64_t N, int64_t kvd);
void paged_attention_forward(float* out, const float* q, const void* k_cache, const void* v_cache, DType cache_dtype,
                             const int32_t* block_tables, int64_t max_blocks, const int32_t* cu_seqlens,
                             const int32_t* context_lens, int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t hd,
                             int64_t block_size);
void gather_rows(float* out, const float* inp, const int32_t* index, int64_t R, int64_t C);
// out[n] += sum over k of weights[rows[n, k]] * inp[rows[n, k]] for N rows of C, in k order
// (rows null: K = 1, row n); inp has R rows. Parallel over output rows.
void combine_rows(float* out, const float* inp, const int32_t* rows, int64_t K, const float* weights, int64_t N,
                  int64_t C, int64_t R);
// combine_rows' backward (Backend::combine_rows_backward); dinp may alias inp.
void combine_rows_backward(float* dinp, float* dweights, const float* inp, const float* dout, const int32_t* tokens,
                           const float* weights, int64_t R, int64_t C, int64_t N);

// h = silu(gate) * up
void swiglu_forward(float* h, const float* gate, const float* up, int64_t n);
void swiglu_backward(float* dgate, float* dup, const float* dh, const float* gate, const float* up, int64_t n);

// out[n] = table[ids[n]], the table stored in any storage dtype.
void embedding_forward(float* out, const int32_t* ids, const void* table, DType table_dtype, int64_t N, int64_t D);
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t D);

// Inverted dropout: out = x * keep / (1 - p), keep drawn from a counter-based hash of (key, i),
// so the same key reproduces the same mask (backward regenerates it instead of storing it).
// out may alias x.
void dropout_forward(float* out, const float* x, int64_t n, uint64_t key, float p);

// y += x
void add_inplace(float* y, const float* x, int64_t n);
// x *= s; returns sum(x^2) after scaling.
double scale_and_sum_squares(float* x, float s, int64_t n);
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step);

// The fused LM head (backend.h: LmHeadArgs), on host-addressable memory.
LossSum lm_head_loss(const LmHeadArgs& args);

// How a 16-bit head lays out its products (lm_head_loss): Strided writes each vocabulary slice's
// logits in place into the [rows, V] chunk and reads the rounded gradient there (row stride 2V);
// Dense gives every product dense operands through a [chunk_rows, kDenseHeadSliceRows] float32
// buffer (LmHeadArgs::product_slice), at the cost of a copy of the logits. oneDNN runs a product
// on the CPU's tile unit (AMX) only with dense operands, so Dense is chosen where oneDNN's kernel
// for a dense slice is a tile-unit kernel; elsewhere Strided measured faster (docs/benchmarks.md).
// MEMTUNE_HEAD_PRODUCTS=dense|strided|auto overrides the choice (tests take both on any CPU).
enum class HeadProducts { Strided, Dense };
constexpr int64_t kDenseHeadSliceRows = 2048;
HeadProducts head_products(DType operands);

}  // namespace memtune::cpu

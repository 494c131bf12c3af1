// CPU reference backend: every op of the Qwen2 decoder as an explicit forward/backward pair in
// float32 (llm.c style). GEMMs go to OpenBLAS; everything else is OpenMP loops. No op allocates:
// all memory (outputs, saved tensors, scratch) comes from the caller, i.e. from the arena.
//
// Conventions: row-major; activations are [N, C] over a flat token stream of N tokens holding
// several sequences back to back (cu_seqlens[s]..cu_seqlens[s+1]); linear weights are
// [out, in] as in PyTorch. Backward functions ACCUMULATE (+=) into parameter gradients and into
// input gradients; callers zero what must start at zero.
#pragma once

#include <bit>
#include <cstdint>

#include "backend/cpu/chunk_loss.h"
#include "core/dtype.h"
#include "core/labels.h"

namespace memtune::cpu {

// exp(x) to ~2e-7 relative error, branch-free and inline so loops over it vectorize:
// exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-7 Taylor polynomial on r.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias[OC])
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC);
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
void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t heads, int64_t head_dim, float theta);
// In-place gradient: rotates dx back by the same angles.
void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t heads, int64_t head_dim, float theta);

// Causal grouped-query attention over packed sequences, online softmax, never materializing a
// [T, T] score matrix. q[N, Hq*hd], k/v[N, Hkv*hd] -> out[N, Hq*hd]; saves lse[N, Hq].
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_seqlens, int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t hd);
// Recomputes probabilities from lse. dq, dk, dv are OVERWRITTEN (every token belongs to one sequence).
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const int32_t* cu_seqlens, int64_t num_seqs,
                        int64_t Hq, int64_t Hkv, int64_t hd);

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
// out = a + b
void add(float* out, const float* a, const float* b, int64_t n);
void scale_inplace(float* y, float s, int64_t n);

// Fused LM head + loss over the positions whose target is not ignore_index. Logits exist only
// as a [chunk_rows, V] workspace reused chunk after chunk; `loss` turns each chunk into its loss
// sum and, for backward, d(sum)/d(logits) in place. Returns the SUM and the COUNT of targets;
// gradients are those of the sum. When dhidden is null only the loss is computed. dhidden rows
// are OVERWRITTEN (zero at ignored positions); dweight (float32, may be null for a frozen head)
// is accumulated. A weight stored in 16 bits is widened `slice_rows` vocabulary rows at a time
// into `weight_slice`, so no float32 copy of the whole [V, D] head ever exists.
struct LmHeadWorkspace {
  float* logits;         // [chunk_rows, V]
  float* rows;           // [chunk_rows, D] gathered hidden rows
  float* drows;          // [chunk_rows, D]
  int32_t* positions;    // [N] positions with a target
  int32_t* row_targets;  // [chunk_rows] the targets of the chunk's rows
  int64_t chunk_rows;
  float* weight_slice;  // [slice_rows, D], used only for 16-bit weights
  int64_t slice_rows;
};
struct LossSum {
  double sum = 0;
  int64_t count = 0;
};
// grad_scale multiplies every gradient it produces (dynamic loss scaling); 1 for none. An
// observer (streaming metrics) sees each chunk's logits before the loss touches them.
LossSum lm_head_loss(const float* hidden, const int32_t* targets, int64_t N, const void* weight, DType weight_dtype,
                     int64_t V, int64_t D, const ChunkLoss& loss, float* dhidden, float* dweight,
                     const LmHeadWorkspace& ws, float grad_scale = 1.0f, ChunkObserver* observer = nullptr);

}  // namespace memtune::cpu

#version 460
// attention_coopmat.comp's forward with VK_NV_cooperative_matrix2's subgroup matrices of flexible
// size: the softmax on the matrices themselves, so the output accumulator stays in registers.
//
// A workgroup per (tile of B query tokens, head), four subgroups; subgroup i owns the tile's rows
// [i R, (i + 1) R), R = B / 4, as FlashAttention-2 splits a tile over its warps: no subgroup reads
// another's rows. The queries stay in shared memory as float16; the head's keys, then its values,
// stream B at a time through one more array (float16, rounded as loaded, as every
// cooperative-matrix shader here). Per key tile:
//   S = Q K^T (R x B, float32) as a loop of products of R x KC by KC x B (one product over the
//   whole head dimension took lavapipe 1.5 times as long to compile at head_dim 64, 2.9 times at
//   128), masked and scaled element by
//   element (coopMatPerElementNV: the causal mask and the sequence borders from each element's
//   row and column);
//   m' = max(m, rowmax S) and l' = l exp(m - m') + rowsum exp(S - m') (coopMatReduceNV: every
//   element of a row holds the row's value, as the reduction returns it);
//   O = O exp(m - m') + P V, P = exp(S - m') rounded to float16, O kept as HD / OC matrices of
//   R x OC (float32), each rescaled by the row factor spread to R x OC by a row reduction.
// out = O / l and lse = m + log(l), as attention.comp's, written through a small per-subgroup
// stage (rows past the tensor's end are never written). The rounding points are the KHR
// shader's: q, k, v as loaded, p against the running maximum.
//
// Spec constants: HD, B, the subgroup size, OC and KC (the device's column and inner granularity
// for these types). R is the device's row granularity, B and HD multiples of the column and inner
// ones (vulkan_geometry::attention_coopmat2_tile).
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "../common.glsl"
layout(constant_id = 0) const uint HD = 64;
layout(constant_id = 1) const uint B = 32;
layout(constant_id = 2) const uint SUBGROUP = 32;
layout(constant_id = 3) const uint OC = 16;
layout(constant_id = 4) const uint KC = 16;  // the inner dimension of one product of S = Q K^T
layout(local_size_x_id = 5) in;  // 4 x SUBGROUP
const uint THREADS = 4u * SUBGROUP;
const uint R = B / 4u;
const uint H_STRIDE = HD + 8u;  // a row of a [B, HD] float16 tile (padded)
const uint CHUNKS = HD / OC;
#define SMAT coopmat<float, gl_ScopeSubgroup, R, B, gl_MatrixUseAccumulator>
#define OMAT coopmat<float, gl_ScopeSubgroup, R, OC, gl_MatrixUseAccumulator>
#define QMAT coopmat<float16_t, gl_ScopeSubgroup, R, KC, gl_MatrixUseA>
#define KMAT coopmat<float16_t, gl_ScopeSubgroup, KC, B, gl_MatrixUseB>
#define PMAT coopmat<float16_t, gl_ScopeSubgroup, R, B, gl_MatrixUseA>
#define VMAT coopmat<float16_t, gl_ScopeSubgroup, B, OC, gl_MatrixUseB>
layout(push_constant) uniform Push { F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale; } p;
shared float16_t q_s[B * H_STRIDE];
shared float16_t kv_s[B * H_STRIDE];  // each key tile, then its value tile
shared float stage[B * OC];  // a subgroup's R x OC results on their way out
shared uint begin_s[B];      // each tile row's sequence start (~0u past the end: nothing counts)

float16_t half_of(float x) { return uint16BitsToFloat16(f32_to_f16(x)); }
float largest(const in float a, const in float b) { return max(a, b); }
float sum_of(const in float a, const in float b) { return a + b; }
// s scaled where key j0 + c counts for query row0 + r (its sequence's keys up to itself), else -inf.
float masked(const in uint r, const in uint c, const in float s, const in uint row0, const in uint q0,
             const in uint j0, const in float scale) {
  const uint j = j0 + c;
  return (j >= begin_s[row0 + r] && j <= q0 + row0 + r) ? s * scale : NEG_INF;
}
float larger(const in uint r, const in uint c, const in float a, const in float b) { return max(a, b); }
float probability(const in uint r, const in uint c, const in float s, const in float m) {
  return m == NEG_INF ? 0.0 : exp(s - m);
}
float rounded(const in uint r, const in uint c, const in float x) { return float(half_of(x)); }
// exp(m - m'): 0 for a row's first counted keys (m = -inf), 1 while nothing has counted.
float correction(const in uint r, const in uint c, const in float m, const in float m_new) {
  return m_new == NEG_INF ? 1.0 : exp(m - m_new);
}
float rescaled_sum(const in uint r, const in uint c, const in float l, const in float f, const in float add) {
  return l * f + add;
}
float log_sum(const in uint r, const in uint c, const in float m, const in float l) { return m + log(l); }

void main() {
  const uint tid = gl_LocalInvocationID.x, sub = tid / SUBGROUP, lane = tid % SUBGROUP, row0 = sub * R;
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * B;
  const uint last = min(q0 + B, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, d = e % HD, t = q0 + r;
    q_s[r * H_STRIDE + d] = half_of(t < p.N ? p.q.v[(t * p.Hq + h) * HD + d] : 0.0);
  }
  for (uint r = tid; r < B; r += THREADS) begin_s[r] = q0 + r < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, q0 + r)]) : ~0u;
  SMAT m = SMAT(NEG_INF), l = SMAT(0.0);
  OMAT o[CHUNKS];
  for (uint c = 0u; c < CHUNKS; ++c) o[c] = OMAT(0.0);
  for (uint j0 = first; j0 <= last; j0 += B) {
    barrier();  // every subgroup is done with the last value tile
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint c = e / HD, d = e % HD, j = j0 + c;
      kv_s[c * H_STRIDE + d] = half_of(j <= last ? p.k.v[(j * p.Hkv + g) * HD + d] : 0.0);
    }
    barrier();
    SMAT s = SMAT(0.0);
    for (uint kk = 0u; kk < HD; kk += KC) {
      QMAT qm;
      KMAT kt;
      coopMatLoad(qm, q_s, row0 * H_STRIDE + kk, H_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
      coopMatLoad(kt, kv_s, kk, H_STRIDE, gl_CooperativeMatrixLayoutColumnMajor);
      s = coopMatMulAdd(qm, kt, s);
    }
    barrier();  // every subgroup is done with the key tile
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint c = e / HD, d = e % HD, j = j0 + c;
      kv_s[c * H_STRIDE + d] = half_of(j <= last ? p.v.v[(j * p.Hkv + g) * HD + d] : 0.0);
    }
    coopMatPerElementNV(s, s, masked, row0, q0, j0, p.scale);
    SMAT mx, m_new, w, sum, f;
    coopMatReduceNV(mx, s, gl_CooperativeMatrixReduceRowNV, largest);
    coopMatPerElementNV(m_new, m, larger, mx);
    coopMatPerElementNV(w, s, probability, m_new);
    coopMatReduceNV(sum, w, gl_CooperativeMatrixReduceRowNV, sum_of);
    coopMatPerElementNV(f, m, correction, m_new);
    coopMatPerElementNV(l, l, rescaled_sum, f, sum);
    m = m_new;
    coopMatPerElementNV(w, w, rounded);
    const PMAT pm = PMAT(w);
    OMAT fo;
    coopMatReduceNV(fo, f, gl_CooperativeMatrixReduceRowNV, largest);
    barrier();  // the value tile
    for (uint c = 0u; c < CHUNKS; ++c) {
      VMAT vm;
      coopMatLoad(vm, kv_s, c * OC, H_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
      o[c] = coopMatMulAdd(pm, vm, o[c] * fo);
    }
  }
  OMAT lo;
  coopMatReduceNV(lo, l, gl_CooperativeMatrixReduceRowNV, largest);
  for (uint c = 0u; c < CHUNKS; ++c) {
    const OMAT out_chunk = o[c] / lo;
    coopMatStore(out_chunk, stage, row0 * OC, OC, gl_CooperativeMatrixLayoutRowMajor);
    barrier();
    for (uint e = lane; e < R * OC; e += SUBGROUP) {
      const uint t = q0 + row0 + e / OC;
      if (t < p.N) p.out_.v[(t * p.Hq + h) * HD + c * OC + e % OC] = stage[row0 * OC + e];
    }
    barrier();
  }
  SMAT lse;
  coopMatPerElementNV(lse, m, log_sum, l);
  OMAT lse_o;
  coopMatReduceNV(lse_o, lse, gl_CooperativeMatrixReduceRowNV, largest);
  coopMatStore(lse_o, stage, row0 * OC, OC, gl_CooperativeMatrixLayoutRowMajor);
  barrier();
  for (uint r = lane; r < R; r += SUBGROUP)
    if (q0 + row0 + r < p.N) p.lse.v[(q0 + row0 + r) * p.Hq + h] = stage[(row0 + r) * OC];
}

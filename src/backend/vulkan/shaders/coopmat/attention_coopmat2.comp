#version 460
// attention_coopmat.comp's forward on VK_NV_cooperative_matrix2's subgroup matrices
// (attention_coopmat2.glsl): the softmax on the matrices themselves, so the output accumulator
// stays in registers.
//
// A workgroup per (tile of B query tokens, head); each subgroup holds its rows of the queries
// as A operands in registers (staged once as float16 through the array that then holds the
// head's keys, then its values, B at a time). Per key tile:
//   S = Q K^T (R x B, float32), masked and scaled element by element (the causal mask and the
//   sequence borders from each element's row and column);
//   m' = max(m, rowmax S) and l' = l exp(m - m') + rowsum exp(S - m') (coopMatReduceNV: every
//   element of a row holds the row's value, as the reduction returns it);
//   O = O exp(m - m') + P V, P = exp(S - m') rounded to float16, each of O's R x OC matrices
//   rescaled by the row factor spread to R x OC by a row reduction.
// out = O / l and lse = m + log(l), as attention.comp's. The rounding points are the KHR
// shader's: q, k, v as loaded, p against the running maximum.
#include "attention_coopmat2.glsl"
layout(push_constant) uniform Push { F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale; } p;
shared float16_t kv_s[B * H_STRIDE];  // the queries once, then each key tile and its value tile
shared uint begin_s[B];      // each tile row's sequence start (~0u past the end: nothing counts)

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
// exp(m - m'): 0 for a row's first counted keys (m = -inf), 1 while nothing has counted.
float correction(const in uint r, const in uint c, const in float m, const in float m_new) {
  return m_new == NEG_INF ? 1.0 : exp(m - m_new);
}
float rescaled_sum(const in uint r, const in uint c, const in float l, const in float f, const in float add) {
  return l * f + add;
}
float log_sum(const in uint r, const in uint c, const in float m, const in float l) { return m + log(l); }

void main() {
  const uint tid = gl_LocalInvocationID.x, lane = tid % SUBGROUP, row0 = subgroup_row0();
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * B;
  const uint last = min(q0 + B, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, d = e % HD, t = q0 + r;
    kv_s[r * H_STRIDE + d] = half_of(t < p.N ? p.q.v[(t * p.Hq + h) * HD + d] : 0.0);
  }
  for (uint r = tid; r < B; r += THREADS) begin_s[r] = q0 + r < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, q0 + r)]) : ~0u;
  barrier();
  QMAT qm[KCHUNKS];
  LOAD_ROWS(qm, kv_s)
  SMAT m = SMAT(NEG_INF), l = SMAT(0.0);
  OMAT o[CHUNKS];
  for (uint c = 0u; c < CHUNKS; ++c) o[c] = OMAT(0.0);
  for (uint j0 = first; j0 <= last; j0 += B) {
    barrier();  // every subgroup is done with the queries or the last value tile
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint c = e / HD, d = e % HD, j = j0 + c;
      kv_s[c * H_STRIDE + d] = half_of(j <= last ? p.k.v[(j * p.Hkv + g) * HD + d] : 0.0);
    }
    barrier();
    SMAT s;
    PRODUCT_XYT(s, qm, kv_s)
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
    for (uint c = 0u; c < CHUNKS; ++c) o[c] = o[c] * fo;
    barrier();  // the value tile
    PRODUCT_PY(o, pm, kv_s)
  }
  OMAT lo;
  coopMatReduceNV(lo, l, gl_CooperativeMatrixReduceRowNV, largest);
  for (uint c = 0u; c < CHUNKS; ++c) store_chunk(o[c] / lo, c, p.out_, q0 + row0, p.N, p.Hq, h);
  SMAT lse;
  coopMatPerElementNV(lse, m, log_sum, l);
  OMAT lse_o;
  coopMatReduceNV(lse_o, lse, gl_CooperativeMatrixReduceRowNV, largest);
  coopMatStore(lse_o, stage, row0 * OC, OC, gl_CooperativeMatrixLayoutRowMajor);
  barrier();
  for (uint r = lane; r < R; r += SUBGROUP)
    if (q0 + row0 + r < p.N) p.lse.v[(q0 + row0 + r) * p.Hq + h] = stage[(row0 + r) * OC];
}

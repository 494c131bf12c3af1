#version 460
// attention_backward_dq_coopmat.comp (FlashAttention-2's dQ pass) on VK_NV_cooperative_matrix2's
// subgroup matrices (attention_coopmat2.glsl): the scores, their gradient and dQ never leave
// registers.
//
// A workgroup per (tile of B query tokens, head); each subgroup holds its rows of q and dout as A
// operands in registers (staged once as float16 through the one shared array, which then holds
// each value tile, then its key tile). Per tile of B keys:
//   dP = dO V^T and S = Q K^T (R x B, float32);
//   ds = p (dp - D) scale, p = exp(s scale - lse) where the key counts for the query (its
//   sequence's keys up to itself), else 0; D = dout . out (float32, per row); rounded to float16
//   and converted to an A operand, element by element from each element's row and column;
//   dQ += dS K into HD / OC matrices of R x OC.
// dq is written once at the end. The rounding points are the KHR shader's: q, dout, k, v as
// loaded, ds before its product.
#include "attention_coopmat2.glsl"
layout(push_constant) uniform Push {
  F32 dq; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale;
} p;
shared float16_t kv_s[B * H_STRIDE];  // q, then dout, once; then each value tile and its key tile
shared float lse_s[B], d_s[B];
shared uint begin_s[B];  // each tile row's sequence start (~0u past the end: nothing counts)

// The scores' gradient where key j0 + c counts for query row0 + r, rounded to float16; else 0.
float score_gradient(const in uint r, const in uint c, const in float s, const in float dp, const in uint row0,
                     const in uint q0, const in uint j0, const in float scale) {
  const uint i = row0 + r, j = j0 + c;
  const float w = (j >= begin_s[i] && j <= q0 + i) ? exp(s * scale - lse_s[i]) : 0.0;
  return float(half_of(w * (dp - d_s[i]) * scale));
}

void main() {
  const uint tid = gl_LocalInvocationID.x, row0 = subgroup_row0();
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * B;
  const uint last = min(q0 + B, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  for (uint r = tid; r < B; r += THREADS) {
    const uint t = q0 + r;
    float D = 0.0;
    if (t < p.N)
      for (uint d = 0u; d < HD; ++d) D += p.dout.v[(t * p.Hq + h) * HD + d] * p.out_.v[(t * p.Hq + h) * HD + d];
    d_s[r] = D;
    lse_s[r] = t < p.N ? p.lse.v[t * p.Hq + h] : 0.0;
    begin_s[r] = t < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, t)]) : ~0u;
  }
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, d = e % HD, t = q0 + r;
    kv_s[r * H_STRIDE + d] = half_of(t < p.N ? p.q.v[(t * p.Hq + h) * HD + d] : 0.0);
  }
  barrier();
  QMAT qm[KCHUNKS], dom[KCHUNKS];
  LOAD_ROWS(qm, kv_s)
  barrier();
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, d = e % HD, t = q0 + r;
    kv_s[r * H_STRIDE + d] = half_of(t < p.N ? p.dout.v[(t * p.Hq + h) * HD + d] : 0.0);
  }
  barrier();
  LOAD_ROWS(dom, kv_s)
  OMAT dq[CHUNKS];
  for (uint c = 0u; c < CHUNKS; ++c) dq[c] = OMAT(0.0);
  for (uint j0 = first; j0 <= last; j0 += B) {
    barrier();  // every subgroup is done with dout or the last key tile
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint c = e / HD, d = e % HD, j = j0 + c;
      kv_s[c * H_STRIDE + d] = half_of(j <= last ? p.v.v[(j * p.Hkv + g) * HD + d] : 0.0);
    }
    barrier();
    SMAT dp, s;
    PRODUCT_XYT(dp, dom, kv_s)
    barrier();  // every subgroup is done with the value tile
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint c = e / HD, d = e % HD, j = j0 + c;
      kv_s[c * H_STRIDE + d] = half_of(j <= last ? p.k.v[(j * p.Hkv + g) * HD + d] : 0.0);
    }
    barrier();
    PRODUCT_XYT(s, qm, kv_s)
    coopMatPerElementNV(s, s, score_gradient, dp, row0, q0, j0, p.scale);
    const PMAT ds = PMAT(s);
    PRODUCT_PY(dq, ds, kv_s)
  }
  for (uint c = 0u; c < CHUNKS; ++c) store_chunk(dq[c], c, p.dq, q0 + row0, p.N, p.Hq, h);
}

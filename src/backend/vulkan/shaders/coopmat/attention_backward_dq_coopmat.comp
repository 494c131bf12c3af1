#version 460
// attention_backward_dq.comp (FlashAttention-2's dQ pass) with its products on the matrix units
// (attention_coopmat.glsl): a workgroup per (tile of B query tokens, head) keeps its q and dout as
// float16 in shared memory and streams the key and value tiles its queries see. Per tile:
// S = Q K^T and dP = dO V^T into shared memory; elementwise p = exp(s scale - lse) where the key
// counts, ds = p (dp - D) scale with D = dout . out (float32, per row) rounded to float16; then
// dQ += dS K in accumulators held across tiles, written once at the end (staged through the
// scores' array, free by then).
#include "attention_coopmat.glsl"
layout(push_constant) uniform Push {
  F32 dq; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale;
} p;
shared float16_t q_s[B * H_STRIDE];
shared float16_t do_s[B * H_STRIDE];
shared float16_t k_s[B * H_STRIDE];
shared float16_t v_s[B * H_STRIDE];
shared float s_s[B * S_STRIDE];
shared float dp_s[B * S_STRIDE];
shared float16_t ds_s[B * T_STRIDE];
shared float lse_s[B], d_s[B];
shared uint begin_s[B];
uint query_row(uint r) {
  const uint t = gl_WorkGroupID.x * B + r;
  return t < p.N ? (t * p.Hq + gl_WorkGroupID.y) * HD : ~0u;
}
void main() {
  const uint tid = gl_LocalInvocationID.x, sm = quarter_rows(), sn = quarter_cols(), hn = quarter_dims();
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * B;
  const uint last = min(q0 + B, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, d = e % HD, t = q0 + r, at = (t * p.Hq + h) * HD + d;
    q_s[r * H_STRIDE + d] = half_of(t < p.N ? p.q.v[at] : 0.0);
    do_s[r * H_STRIDE + d] = half_of(t < p.N ? p.dout.v[at] : 0.0);
  }
  for (uint r = tid; r < B; r += THREADS) {
    const uint t = q0 + r;
    float D = 0.0;
    if (t < p.N)
      for (uint d = 0u; d < HD; ++d) D += p.dout.v[(t * p.Hq + h) * HD + d] * p.out_.v[(t * p.Hq + h) * HD + d];
    d_s[r] = D;
    lse_s[r] = t < p.N ? p.lse.v[t * p.Hq + h] : 0.0;
    begin_s[r] = t < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, t)]) : ~0u;
  }
  ACC acc[QM][QN];
  ACC dq[QM][HN];
  for (uint i = 0u; i < QM; ++i)
    for (uint j = 0u; j < HN; ++j) dq[i][j] = ACC(0.0);
  for (uint j0 = first; j0 <= last; j0 += B) {
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint j = j0 + e / HD, at = (j * p.Hkv + g) * HD + e % HD;
      k_s[(e / HD) * H_STRIDE + e % HD] = half_of(j <= last ? p.k.v[at] : 0.0);
      v_s[(e / HD) * H_STRIDE + e % HD] = half_of(j <= last ? p.v.v[at] : 0.0);
    }
    barrier();
    PRODUCT_XYT(acc, q_s, k_s, sm, sn)
    STORE_SCORES(acc, s_s, sm, sn)
    PRODUCT_XYT(acc, do_s, v_s, sm, sn)
    STORE_SCORES(acc, dp_s, sm, sn)
    barrier();
    for (uint e = tid; e < B * B; e += THREADS) {
      const uint r = e / B, c = e % B, j = j0 + c, t = q0 + r;
      const float w = (j >= begin_s[r] && j <= t) ? exp(s_s[r * S_STRIDE + c] * p.scale - lse_s[r]) : 0.0;
      ds_s[r * T_STRIDE + c] = half_of(w * (dp_s[r * S_STRIDE + c] - d_s[r]) * p.scale);
    }
    barrier();
    PRODUCT_PY(dq, ds_s, k_s, sm, hn)
    barrier();
  }
  WRITE_OUT(dq, s_s, sm, hn, p.dq, query_row)
}

#version 460
// Attention backward without atomics: every output row is written by one invocation.
// mode 0, an invocation per (query t, head): dq[t] = scale sum_j ds_j k_j over its keys.
// mode 1, an invocation per (key j, kv head g): dk[j] = scale sum ds q_t, dv[j] = sum p dout_t
// over the queries t >= j of its sequence and the query heads of group g.
// p = exp(s - lse), ds = p (dout . v_j - dout . out).
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 dq; F32 dk; F32 dv; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu;
  uint N, S, Hq, Hkv, hd, mode; float scale;
} p;
void main() {
  const uint group = p.Hq / p.Hkv;
  if (p.mode == 0u) {
    FOR_EACH(row, p.N * p.Hq) {
      const uint t = row / p.Hq, h = row % p.Hq, g = h / group, qt = row * p.hd;
      const uint begin = uint(p.cu.v[sequence_of(p.cu, p.S, t)]);
      const float d_out = dot_rows(p.dout, qt, p.out_, qt, p.hd), lse = p.lse.v[row];
      float acc[MAX_HD];
      for (uint d = 0u; d < p.hd; ++d) acc[d] = 0.0;
      for (uint j = begin; j <= t; ++j) {
        const uint kv = (j * p.Hkv + g) * p.hd;
        const float w = exp(dot_rows(p.q, qt, p.k, kv, p.hd) * p.scale - lse);
        const float ds = w * (dot_rows(p.dout, qt, p.v, kv, p.hd) - d_out) * p.scale;
        for (uint d = 0u; d < p.hd; ++d) acc[d] += ds * p.k.v[kv + d];
      }
      for (uint d = 0u; d < p.hd; ++d) p.dq.v[qt + d] = acc[d];
    }
    return;
  }
  FOR_EACH(row, p.N * p.Hkv) {
    const uint j = row / p.Hkv, g = row % p.Hkv, kv = row * p.hd;
    const uint end = uint(p.cu.v[sequence_of(p.cu, p.S, j) + 1u]);
    float acc_k[MAX_HD], acc_v[MAX_HD];
    for (uint d = 0u; d < p.hd; ++d) acc_k[d] = 0.0, acc_v[d] = 0.0;
    for (uint t = j; t < end; ++t) {
      for (uint h = g * group; h < (g + 1u) * group; ++h) {
        const uint qt = (t * p.Hq + h) * p.hd;
        const float d_out = dot_rows(p.dout, qt, p.out_, qt, p.hd);
        const float w = exp(dot_rows(p.q, qt, p.k, kv, p.hd) * p.scale - p.lse.v[t * p.Hq + h]);
        const float ds = w * (dot_rows(p.dout, qt, p.v, kv, p.hd) - d_out) * p.scale;
        for (uint d = 0u; d < p.hd; ++d) {
          acc_k[d] += ds * p.q.v[qt + d];
          acc_v[d] += w * p.dout.v[qt + d];
        }
      }
    }
    for (uint d = 0u; d < p.hd; ++d) {
      p.dk.v[kv + d] = acc_k[d];
      p.dv.v[kv + d] = acc_v[d];
    }
  }
}

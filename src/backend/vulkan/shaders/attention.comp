#version 460
// Causal grouped-query attention over packed sequences, flash style: one invocation per (query
// token, head) walks its keys once with an online softmax (running max and sum), so no [T, T]
// score matrix exists. out[t, head] and lse[t, head] (saved for backward). Neighbouring
// invocations are heads of one token, so a key row is read by the heads of its group together.
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv, hd; float scale; } p;
void main() {
  FOR_EACH(row, p.N * p.Hq) {
    const uint t = row / p.Hq, h = row % p.Hq;
    const uint begin = uint(p.cu.v[sequence_of(p.cu, p.S, t)]), g = h / (p.Hq / p.Hkv), qt = row * p.hd;
    float acc[MAX_HD];
    for (uint d = 0u; d < p.hd; ++d) acc[d] = 0.0;
    float m = -1.0 / 0.0, l = 0.0;
    for (uint j = begin; j <= t; ++j) {
      const uint kv = (j * p.Hkv + g) * p.hd;
      const float s = dot_rows(p.q, qt, p.k, kv, p.hd) * p.scale;
      const float m_new = max(m, s), correction = exp(m - m_new), w = exp(s - m_new);
      l = l * correction + w;
      for (uint d = 0u; d < p.hd; ++d) acc[d] = acc[d] * correction + w * p.v.v[kv + d];
      m = m_new;
    }
    for (uint d = 0u; d < p.hd; ++d) p.out_.v[qt + d] = acc[d] / l;
    p.lse.v[row] = m + log(l);
  }
}

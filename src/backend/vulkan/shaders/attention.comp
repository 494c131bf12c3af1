#version 460
// Causal grouped-query attention over packed sequences, flash style: one 64-wide workgroup per
// (query token, head) walks its keys once with an online softmax (running max and sum), so no
// [T, T] score matrix exists. out[t, head] and lse[t, head] (saved for backward).
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 64) in;
layout(push_constant) uniform Push { F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint S, Hq, Hkv, hd; float scale; } p;
void main() {
  const uint t = gl_WorkGroupID.x, h = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
  const uint begin = uint(p.cu.v[sequence_of(p.cu, p.S, t)]), g = h / (p.Hq / p.Hkv);
  float qd[DIMS], acc[DIMS];
  for (uint i = 0u; i < DIMS; ++i) {
    const uint d = tid + 64u * i;
    qd[i] = d < p.hd ? p.q.v[(t * p.Hq + h) * p.hd + d] : 0.0;
    acc[i] = 0.0;
  }
  float m = -1.0 / 0.0, l = 0.0;
  for (uint j = begin; j <= t; ++j) {
    const uint kv = (j * p.Hkv + g) * p.hd;
    float part = 0.0;
    for (uint i = 0u; i < DIMS; ++i) {
      const uint d = tid + 64u * i;
      if (d < p.hd) part += qd[i] * p.k.v[kv + d];
    }
    const float s = workgroup_sum(part) * p.scale;
    const float m_new = max(m, s), correction = exp(m - m_new), w = exp(s - m_new);
    l = l * correction + w;
    for (uint i = 0u; i < DIMS; ++i) {
      const uint d = tid + 64u * i;
      if (d < p.hd) acc[i] = acc[i] * correction + w * p.v.v[kv + d];
    }
    m = m_new;
  }
  for (uint i = 0u; i < DIMS; ++i) {
    const uint d = tid + 64u * i;
    if (d < p.hd) p.out_.v[(t * p.Hq + h) * p.hd + d] = acc[i] / l;
  }
  if (tid == 0u) p.lse.v[t * p.Hq + h] = m + log(l);
}

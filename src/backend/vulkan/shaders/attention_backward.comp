#version 460
// Attention backward without atomics: every output row is written by one workgroup.
// mode 0, a workgroup per (query t, head): dq[t] = scale sum_j ds_j k_j over its keys.
// mode 1, a workgroup per (key j, kv head g): dk[j] = scale sum ds q_t, dv[j] = sum p dout_t over
// the queries t >= j of its sequence and the query heads of group g.
// p = exp(s - lse), ds = p (dout . v_j - dout . out).
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 64) in;
layout(push_constant) uniform Push {
  F32 dq; F32 dk; F32 dv; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu;
  uint S, Hq, Hkv, hd, mode; float scale;
} p;
float dot_rows(F32 a, uint at_a, F32 b, uint at_b) {
  float part = 0.0;
  for (uint i = 0u; i < DIMS; ++i) {
    const uint d = gl_LocalInvocationID.x + 64u * i;
    if (d < p.hd) part += a.v[at_a + d] * b.v[at_b + d];
  }
  return workgroup_sum(part);
}
void main() {
  const uint tid = gl_LocalInvocationID.x, group = p.Hq / p.Hkv;
  float acc_a[DIMS], acc_b[DIMS];
  for (uint i = 0u; i < DIMS; ++i) acc_a[i] = 0.0, acc_b[i] = 0.0;
  if (p.mode == 0u) {
    const uint t = gl_WorkGroupID.x, h = gl_WorkGroupID.y, g = h / group;
    const uint begin = uint(p.cu.v[sequence_of(p.cu, p.S, t)]), qt = (t * p.Hq + h) * p.hd;
    const float d_out = dot_rows(p.dout, qt, p.out_, qt), lse = p.lse.v[t * p.Hq + h];
    for (uint j = begin; j <= t; ++j) {
      const uint kv = (j * p.Hkv + g) * p.hd;
      const float w = exp(dot_rows(p.q, qt, p.k, kv) * p.scale - lse);
      const float ds = w * (dot_rows(p.dout, qt, p.v, kv) - d_out);
      for (uint i = 0u; i < DIMS; ++i) {
        const uint d = tid + 64u * i;
        if (d < p.hd) acc_a[i] += ds * p.k.v[kv + d] * p.scale;
      }
    }
    for (uint i = 0u; i < DIMS; ++i) {
      const uint d = tid + 64u * i;
      if (d < p.hd) p.dq.v[qt + d] = acc_a[i];
    }
    return;
  }
  const uint j = gl_WorkGroupID.x, g = gl_WorkGroupID.y, s = sequence_of(p.cu, p.S, j);
  const uint end = uint(p.cu.v[s + 1u]), kv = (j * p.Hkv + g) * p.hd;
  for (uint t = j; t < end; ++t) {
    for (uint h = g * group; h < (g + 1u) * group; ++h) {
      const uint qt = (t * p.Hq + h) * p.hd;
      const float d_out = dot_rows(p.dout, qt, p.out_, qt);
      const float w = exp(dot_rows(p.q, qt, p.k, kv) * p.scale - p.lse.v[t * p.Hq + h]);
      const float ds = w * (dot_rows(p.dout, qt, p.v, kv) - d_out);
      for (uint i = 0u; i < DIMS; ++i) {
        const uint d = tid + 64u * i;
        if (d < p.hd) {
          acc_a[i] += ds * p.q.v[qt + d] * p.scale;
          acc_b[i] += w * p.dout.v[qt + d];
        }
      }
    }
  }
  for (uint i = 0u; i < DIMS; ++i) {
    const uint d = tid + 64u * i;
    if (d < p.hd) {
      p.dk.v[kv + d] = acc_a[i];
      p.dv.v[kv + d] = acc_b[i];
    }
  }
}

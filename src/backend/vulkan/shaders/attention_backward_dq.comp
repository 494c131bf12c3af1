#version 460
// Attention backward, the query side (FlashAttention-2's dQ pass): a workgroup per (tile of ROWS
// query tokens, head), laid out as the forward (attention.comp), streaming K and V tiles:
// p = exp(s - lse), ds = p (dout . v_j - D) scale with D = dout . out (computed here, per row),
// dq[t] = sum_j ds_j k_j over the keys of t, written (not accumulated). No atomics: every output
// row is one workgroup's, summed in key order.
#include "common.glsl"
#include "attention_common.glsl"
layout(push_constant) uniform Push {
  F32 dq; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale;
} p;
shared float k_tile[TILE * HD];
shared float v_tile[TILE * HD];
void main() {
  const uint id = place(), r = id / LANES, d0 = (id % LANES) * DIMS;
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * ROWS, t = q0 + r;
  const bool live = t < p.N;
  const uint last = min(q0 + ROWS, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  const uint begin = live ? uint(p.cu.v[sequence_of(p.cu, p.S, t)]) : 0u, qt = (t * p.Hq + h) * HD + d0;
  float q[DIMS], dout[DIMS], dq[DIMS];
  float d_part = 0.0;
  for (uint d = 0u; d < DIMS; ++d) {
    q[d] = live ? p.q.v[qt + d] : 0.0;
    dout[d] = live ? p.dout.v[qt + d] : 0.0;
    d_part += live ? dout[d] * p.out_.v[qt + d] : 0.0;
    dq[d] = 0.0;
  }
  const float D = row_sum(d_part), lse = live ? p.lse.v[t * p.Hq + h] : 0.0;
  for (uint j0 = first; j0 <= last; j0 += TILE) {
    for (uint e = id; e < TILE * HD; e += THREADS) {
      const uint j = j0 + e / HD, at = (j * p.Hkv + g) * HD + e % HD;
      k_tile[tile_at(e / HD, e % HD)] = j <= last ? p.k.v[at] : 0.0;
      v_tile[tile_at(e / HD, e % HD)] = j <= last ? p.v.v[at] : 0.0;
    }
    barrier();
    for (uint c = 0u; c < TILE; ++c) {
      float s_part = 0.0, dp_part = 0.0;
      for (uint d = 0u; d < DIMS; ++d) {
        s_part += q[d] * k_tile[tile_at(c, d0 + d)];
        dp_part += dout[d] * v_tile[tile_at(c, d0 + d)];
      }
      const float s = row_sum(s_part) * p.scale, dp = row_sum(dp_part);
      const uint j = j0 + c;
      const float w = (live && j >= begin && j <= t) ? exp(s - lse) : 0.0;
      const float ds = w * (dp - D) * p.scale;
      for (uint d = 0u; d < DIMS; ++d) dq[d] += ds * k_tile[tile_at(c, d0 + d)];
    }
    barrier();
  }
  if (!live) return;
  for (uint d = 0u; d < DIMS; ++d) p.dq.v[qt + d] = dq[d];
}

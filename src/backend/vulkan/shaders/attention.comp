#version 460
// Causal grouped-query attention over packed sequences, FlashAttention-2's forward: a workgroup
// per (tile of ROWS query tokens, head) holds its queries in registers and streams the keys and
// values of the head's kv group through shared memory TILE rows at a time, from the first key of
// the tile's first sequence to its last query (tiles above the diagonal are never read), with an
// online softmax (running max m and sum l); out[t, head] and lse[t, head] = m + log(l), kept for
// backward. A key j counts for query t when t's sequence begins at or before j and j <= t.
#include "common.glsl"
#include "attention_common.glsl"
layout(push_constant) uniform Push { F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale; } p;
shared float k_tile[TILE * HD];
shared float v_tile[TILE * HD];
void main() {
  const uint id = place(), r = id / LANES, d0 = (id % LANES) * DIMS;
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * ROWS, t = q0 + r;
  const bool live = t < p.N;
  const uint last = min(q0 + ROWS, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  const uint begin = live ? uint(p.cu.v[sequence_of(p.cu, p.S, t)]) : 0u, qt = (t * p.Hq + h) * HD + d0;
  float q[DIMS], acc[DIMS];
  for (uint d = 0u; d < DIMS; ++d) {
    q[d] = live ? p.q.v[qt + d] : 0.0;
    acc[d] = 0.0;
  }
  float m = NEG_INF, l = 0.0;
  for (uint j0 = first; j0 <= last; j0 += TILE) {
    for (uint e = id; e < TILE * HD; e += THREADS) {  // coalesced: neighbours load neighbouring words
      const uint j = j0 + e / HD, at = (j * p.Hkv + g) * HD + e % HD;
      k_tile[tile_at(e / HD, e % HD)] = j <= last ? p.k.v[at] : 0.0;
      v_tile[tile_at(e / HD, e % HD)] = j <= last ? p.v.v[at] : 0.0;
    }
    barrier();
    float s[TILE];
    float m_new = m;
    for (uint c = 0u; c < TILE; ++c) {
      float part = 0.0;
      for (uint d = 0u; d < DIMS; ++d) part += q[d] * k_tile[tile_at(c, d0 + d)];
      const float sc = row_sum(part) * p.scale;
      const uint j = j0 + c;
      s[c] = (live && j >= begin && j <= t) ? sc : NEG_INF;
      m_new = max(m_new, s[c]);
    }
    if (m_new != NEG_INF) {  // some key of this tile counts for this query
      const float correction = exp(m - m_new);
      l *= correction;
      for (uint d = 0u; d < DIMS; ++d) acc[d] *= correction;
      for (uint c = 0u; c < TILE; ++c) {
        const float w = exp(s[c] - m_new);
        l += w;
        for (uint d = 0u; d < DIMS; ++d) acc[d] += w * v_tile[tile_at(c, d0 + d)];
      }
      m = m_new;
    }
    barrier();
  }
  if (!live) return;
  for (uint d = 0u; d < DIMS; ++d) p.out_.v[qt + d] = acc[d] / l;
  if (d0 == 0u) p.lse.v[t * p.Hq + h] = m + log(l);
}

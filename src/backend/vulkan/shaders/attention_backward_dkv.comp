#version 460
// Attention backward, the key side (FlashAttention-2's dK/dV pass): a workgroup per (tile of ROWS
// key tokens, kv head g) holds its keys and values in registers and streams, for every query head
// of the group, the tiles of queries that see them (from the tile's first key to the end of its
// last key's sequence) through shared memory: their q, dout, lse and D = dout . out.
// dv[j] = sum p dout_t, dk[j] = sum ds q_t over those queries and heads, written (not
// accumulated), each row by one workgroup in a fixed order: no atomics, the same bits every run.
// With head_splits > 1 (vulkan_geometry::attention_key_splits) workgroup y = g x head_splits + s
// takes the s-th share of the group's heads and writes its sums to partials ([s][N, kv_dim] for
// dk, then [head_splits + s] for dv), which gemm_reduce.comp adds in order.
#include "common.glsl"
#include "attention_common.glsl"
layout(push_constant) uniform Push {
  F32 dk; F32 dv; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale;
  F32 partials; uint head_splits;
} p;
shared float q_tile[TILE * HD];
shared float o_tile[TILE * HD];  // dout
shared float lse_tile[TILE];
shared float delta_tile[TILE];
void main() {
  const uint id = place(), r = id / LANES, d0 = (id % LANES) * DIMS;
  const uint g = gl_WorkGroupID.y / p.head_splits, share = gl_WorkGroupID.y % p.head_splits, group = p.Hq / p.Hkv;
  const uint j0 = gl_WorkGroupID.x * ROWS, j = j0 + r, per = (group + p.head_splits - 1u) / p.head_splits;
  const uint h_begin = g * group + min(share * per, group), h_end = g * group + min((share + 1u) * per, group);
  const bool live = j < p.N;
  const uint last = min(j0 + ROWS, p.N) - 1u, stop = uint(p.cu.v[sequence_of(p.cu, p.S, last) + 1u]);
  const uint end = live ? uint(p.cu.v[sequence_of(p.cu, p.S, j) + 1u]) : 0u, kv = (j * p.Hkv + g) * HD + d0;
  float k[DIMS], v[DIMS], dk[DIMS], dv[DIMS];
  for (uint d = 0u; d < DIMS; ++d) {
    k[d] = live ? p.k.v[kv + d] : 0.0;
    v[d] = live ? p.v.v[kv + d] : 0.0;
    dk[d] = 0.0;
    dv[d] = 0.0;
  }
  for (uint h = h_begin; h < h_end; ++h) {
    for (uint t0 = j0; t0 < stop; t0 += TILE) {
      for (uint e = id; e < TILE * HD; e += THREADS) {
        const uint t = t0 + e / HD, at = (t * p.Hq + h) * HD + e % HD;
        q_tile[tile_at(e / HD, e % HD)] = t < stop ? p.q.v[at] : 0.0;
        o_tile[tile_at(e / HD, e % HD)] = t < stop ? p.dout.v[at] : 0.0;
      }
      for (uint row = r; row < TILE; row += ROWS) {  // D of query t0 + row: its lanes sum dout . out
        const uint t = t0 + row, at = (t * p.Hq + h) * HD + d0;
        float part = 0.0;
        for (uint d = 0u; d < DIMS; ++d) part += t < stop ? p.dout.v[at + d] * p.out_.v[at + d] : 0.0;
        part = row_sum(part);
        if (d0 == 0u) {
          delta_tile[row] = part;
          lse_tile[row] = t < stop ? p.lse.v[t * p.Hq + h] : 0.0;
        }
      }
      barrier();
      for (uint c = 0u; c < TILE; ++c) {
        float s_part = 0.0, dp_part = 0.0;
        for (uint d = 0u; d < DIMS; ++d) {
          s_part += k[d] * q_tile[tile_at(c, d0 + d)];
          dp_part += v[d] * o_tile[tile_at(c, d0 + d)];
        }
        const float s = row_sum(s_part) * p.scale, dp = row_sum(dp_part);
        const uint t = t0 + c;
        const float w = (live && t >= j && t < end) ? exp(s - lse_tile[c]) : 0.0;
        const float ds = w * (dp - delta_tile[c]) * p.scale;
        for (uint d = 0u; d < DIMS; ++d) {
          dv[d] += w * o_tile[tile_at(c, d0 + d)];
          dk[d] += ds * q_tile[tile_at(c, d0 + d)];
        }
      }
      barrier();
    }
  }
  if (!live) return;
  const uint64_t size = uint64_t(p.N) * p.Hkv * HD * 4u;  // bytes of one [N, kv_dim] partial
  F32 to_dk = p.head_splits == 1u ? p.dk : F32(uint64_t(p.partials) + share * size);
  F32 to_dv = p.head_splits == 1u ? p.dv : F32(uint64_t(p.partials) + (p.head_splits + share) * size);
  for (uint d = 0u; d < DIMS; ++d) {
    to_dk.v[kv + d] = dk[d];
    to_dv.v[kv + d] = dv[d];
  }
}

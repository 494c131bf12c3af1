#version 460
// Attention of new queries over a paged KV cache (float32 or 16-bit: CDTYPE 0 f32, 1 bf16, 2 f16),
// split over the context (split-KV, FlashDecoding's shape) so that one sequence at a long context
// still fills the device. A workgroup per (kv head g, chunk of its query heads, context split,
// query token) reads each key and value of g once for the whole GQA group: it stages the keys
// [split x split_keys, +split_keys) up to the token's position, TILE at a time, through its
// sequence's block table into shared memory, and each row of invocations (LANES of them, the head
// dimension split over them as in attention.comp) is one query head of the group with its own
// online softmax over the tile. With one split a row's result is its output; with several it is a
// partial (m, l, acc[HD]) that paged_attention_merge.comp combines. No atomics.
#include "common.glsl"
#include "attention_common.glsl"
layout(constant_id = 4) const uint CDTYPE = 0;
layout(push_constant) uniform Push {
  F32 out_; F32 q; uint64_t k_cache; uint64_t v_cache; I32 tables; I32 cu; I32 context; F32 partials;
  uint N, S, Hq, Hkv, max_blocks, block_size, split_keys, splits; float scale;
} p;
shared float k_tile[TILE * HD];
shared float v_tile[TILE * HD];
void main() {
  const uint id = place(), r = id / LANES, d0 = (id % LANES) * DIMS;
  const uint group = p.Hq / p.Hkv, chunks = (group + ROWS - 1u) / ROWS;
  const uint g = gl_WorkGroupID.x % p.Hkv, chunk = gl_WorkGroupID.x / p.Hkv % chunks;
  const uint split = gl_WorkGroupID.x / (p.Hkv * chunks);
  // Query rows over y, and z beyond 65,535 of them (the grid's limit per dimension).
  const uint t = gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y;
  if (t >= p.N) return;
  const uint s = sequence_of(p.cu, p.S, t), begin = uint(p.cu.v[s]), end = uint(p.cu.v[s + 1u]);
  const uint position = uint(p.context.v[s]) - (end - begin) + (t - begin);
  const uint kvd = p.Hkv * HD, lo = split * p.split_keys, hi = min(lo + p.split_keys, position + 1u);
  const bool live = chunk * ROWS + r < group;
  const uint h = g * group + chunk * ROWS + r, qt = (t * p.Hq + h) * HD;
  float q[DIMS], acc[DIMS];
  for (uint d = 0u; d < DIMS; ++d) {
    q[d] = live ? p.q.v[qt + d0 + d] : 0.0;
    acc[d] = 0.0;
  }
  float m = NEG_INF, l = 0.0;
  for (uint j0 = lo; j0 < hi; j0 += TILE) {
    for (uint e = id; e < TILE * HD; e += THREADS) {  // neighbours load neighbouring words of a key
      const uint j = j0 + e / HD;
      const bool key = j < hi;
      const uint at = key ? (uint(p.tables.v[s * p.max_blocks + j / p.block_size]) * p.block_size +
                             j % p.block_size) * kvd + g * HD + e % HD
                          : 0u;
      k_tile[tile_at(e / HD, e % HD)] = key ? load_f32(p.k_cache, CDTYPE, at) : 0.0;
      v_tile[tile_at(e / HD, e % HD)] = key ? load_f32(p.v_cache, CDTYPE, at) : 0.0;
    }
    barrier();
    float sc[TILE];
    float m_new = m;
    for (uint c = 0u; c < TILE; ++c) {
      float part = 0.0;
      for (uint d = 0u; d < DIMS; ++d) part += q[d] * k_tile[tile_at(c, d0 + d)];
      const float dot = row_sum(part) * p.scale;  // every invocation takes part in the shuffles
      sc[c] = j0 + c < hi ? dot : NEG_INF;
      m_new = max(m_new, sc[c]);
    }
    const float correction = exp(m - m_new);  // the tile's first key is always in range: m_new is finite
    l *= correction;
    for (uint d = 0u; d < DIMS; ++d) acc[d] *= correction;
    for (uint c = 0u; c < TILE; ++c) {
      const float w = exp(sc[c] - m_new);
      l += w;
      for (uint d = 0u; d < DIMS; ++d) acc[d] += w * v_tile[tile_at(c, d0 + d)];
    }
    m = m_new;
    barrier();
  }
  if (!live) return;
  if (p.splits == 1u) {
    for (uint d = 0u; d < DIMS; ++d) p.out_.v[qt + d0 + d] = acc[d] / l;
    return;
  }
  const uint part_at = ((t * p.Hq + h) * p.splits + split) * (HD + 2u);
  for (uint d = 0u; d < DIMS; ++d) p.partials.v[part_at + 2u + d0 + d] = acc[d];
  if (d0 == 0u) {
    p.partials.v[part_at] = m;
    p.partials.v[part_at + 1u] = l;
  }
}

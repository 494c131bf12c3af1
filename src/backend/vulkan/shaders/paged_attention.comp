#version 460
// Attention of new queries over a paged KV cache (float32 or 16-bit: CDTYPE 0 f32, 1 bf16, 2 f16),
// split over the context (split-KV, FlashDecoding's shape) so that one sequence at a long context
// still fills the device. A workgroup per (kv head g, chunk of HEADS of its query heads, context
// split, query token) reads each key and value of g once for the whole GQA group: it stages the
// keys [split x split_keys, +split_keys) up to the token's position, TILE at a time, through its
// sequence's block table into shared memory. Its ROWS rows of invocations (LANES each, the head
// dimension split over them as in attention.comp) are HEADS query heads times KP key phases: row r
// serves head r % HEADS and the tile's keys r / HEADS, r / HEADS + KP, ..., with an online softmax
// of its own; at the end each head's KP rows merge in shared memory in phase order. With one
// split a head's result is its output; with several it is a partial (m, l, acc[HD]) that
// paged_attention_merge.comp combines. No atomics.
#include "common.glsl"
#include "attention_common.glsl"
layout(constant_id = 4) const uint CDTYPE = 0;
layout(constant_id = 5) const uint HEADS = 8;  // query heads a workgroup serves: a power of two up to ROWS
const uint KP = ROWS / HEADS;                    // key phases
layout(push_constant) uniform Push {
  F32 out_; F32 q; uint64_t k_cache; uint64_t v_cache; I32 tables; I32 cu; I32 context; F32 partials;
  uint N, S, Hq, Hkv, max_blocks, block_size, split_keys, splits; float scale;
} p;
// The key and value tiles while the keys stream, then the rows' accumulators (ROWS <= 2 TILE).
shared float tiles[2u * TILE * HD];
shared float row_m[ROWS], row_l[ROWS];
void main() {
  const uint id = place(), r = id / LANES, d0 = (id % LANES) * DIMS, head = r % HEADS, phase = r / HEADS;
  const uint group = p.Hq / p.Hkv, chunks = (group + HEADS - 1u) / HEADS;
  const uint g = gl_WorkGroupID.x % p.Hkv, chunk = gl_WorkGroupID.x / p.Hkv % chunks;
  const uint split = gl_WorkGroupID.x / (p.Hkv * chunks);
  // Query rows over y, and z beyond 65,535 of them (the grid's limit per dimension).
  const uint t = gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y;
  if (t >= p.N) return;
  const uint s = sequence_of(p.cu, p.S, t), begin = uint(p.cu.v[s]), end = uint(p.cu.v[s + 1u]);
  const uint position = uint(p.context.v[s]) - (end - begin) + (t - begin);
  const uint kvd = p.Hkv * HD, lo = split * p.split_keys, hi = min(lo + p.split_keys, position + 1u);
  const bool live = chunk * HEADS + head < group;
  const uint h = g * group + chunk * HEADS + head, qt = (t * p.Hq + h) * HD;
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
      tiles[tile_at(e / HD, e % HD)] = key ? load_f32(p.k_cache, CDTYPE, at) : 0.0;
      tiles[TILE * HD + tile_at(e / HD, e % HD)] = key ? load_f32(p.v_cache, CDTYPE, at) : 0.0;
    }
    barrier();
    // The same trip count in every row (shuffles in uniform control flow); a phase past the tile
    // reads its last key and drops it.
    for (uint i = 0u; i < (TILE + KP - 1u) / KP; ++i) {
      const uint c = min(phase + i * KP, TILE - 1u);
      float part = 0.0;
      for (uint d = 0u; d < DIMS; ++d) part += q[d] * tiles[tile_at(c, d0 + d)];
      const float dot = row_sum(part) * p.scale;
      if (phase + i * KP < TILE && j0 + c < hi) {
        const float m_new = max(m, dot), correction = exp(m - m_new), w = exp(dot - m_new);
        l = l * correction + w;
        for (uint d = 0u; d < DIMS; ++d) acc[d] = acc[d] * correction + w * tiles[TILE * HD + tile_at(c, d0 + d)];
        m = m_new;
      }
    }
    barrier();
  }
  for (uint d = 0u; d < DIMS; ++d) tiles[r * HD + d0 + d] = acc[d];
  if (d0 == 0u) {
    row_m[r] = m;
    row_l[r] = l;
  }
  barrier();
  // Each head's phases merged in phase order: its output, or its split's partial.
  for (uint e = id; e < HEADS * HD; e += THREADS) {
    const uint hh = e / HD, dim = e % HD;
    if (chunk * HEADS + hh >= group) continue;
    float M = NEG_INF, L = 0.0, a = 0.0;
    for (uint k = 0u; k < KP; ++k) M = max(M, row_m[k * HEADS + hh]);
    for (uint k = 0u; k < KP; ++k) {
      const uint rr = k * HEADS + hh;
      if (row_m[rr] == NEG_INF) continue;  // a phase that saw no key
      const float w = exp(row_m[rr] - M);
      L += w * row_l[rr];
      a += w * tiles[rr * HD + dim];
    }
    const uint hq = g * group + chunk * HEADS + hh, out_at = (t * p.Hq + hq) * HD;
    if (p.splits == 1u) {
      p.out_.v[out_at + dim] = a / L;
    } else {
      const uint part_at = ((t * p.Hq + hq) * p.splits + split) * (HD + 2u);
      p.partials.v[part_at + 2u + dim] = a;
      if (dim == 0u) {
        p.partials.v[part_at] = M;
        p.partials.v[part_at + 1u] = L;
      }
    }
  }
}

#version 460
// Attention of new queries over a paged KV cache (float32 or 16-bit: CDTYPE 0 f32, 1 bf16, 2 f16),
// split over the context (split-KV, FlashDecoding's shape) so that one sequence at a long context
// still fills the device: a workgroup per (head, context split, query token) walks the keys
// [split x split_keys, +split_keys) up to the token's position through its sequence's block table,
// ROWS keys at a time, a key per row of invocations (its head dimension split over LANES, as in
// attention.comp), each row keeping its own online softmax. The rows' (max, sum, acc) merge in
// shared memory in row order; with one split the result is the output, with several it is a
// partial (m, l, acc[HD]) that paged_attention_merge.comp combines. No atomics.
#include "common.glsl"
#include "attention_common.glsl"
layout(constant_id = 4) const uint CDTYPE = 0;
layout(push_constant) uniform Push {
  F32 out_; F32 q; uint64_t k_cache; uint64_t v_cache; I32 tables; I32 cu; I32 context; F32 partials;
  uint N, S, Hq, Hkv, max_blocks, block_size, split_keys, splits; float scale;
} p;
shared float row_m[ROWS], row_l[ROWS];
shared float row_acc[ROWS * HD];
float cache_at(uint64_t cache, uint i) { return load_f32(cache, CDTYPE, i); }
void main() {
  const uint id = place(), r = id / LANES, d0 = (id % LANES) * DIMS;
  const uint h = gl_WorkGroupID.x % p.Hq, split = gl_WorkGroupID.x / p.Hq;
  // Query rows over y, and z beyond 65,535 of them (the grid's limit per dimension).
  const uint t = gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y;
  if (t >= p.N) return;
  const uint s = sequence_of(p.cu, p.S, t), begin = uint(p.cu.v[s]), end = uint(p.cu.v[s + 1u]);
  const uint position = uint(p.context.v[s]) - (end - begin) + (t - begin), g = h / (p.Hq / p.Hkv);
  const uint kvd = p.Hkv * HD, lo = split * p.split_keys, hi = min(lo + p.split_keys, position + 1u);
  const uint qt = (t * p.Hq + h) * HD;
  float q[DIMS], acc[DIMS];
  for (uint d = 0u; d < DIMS; ++d) {
    q[d] = p.q.v[qt + d0 + d];
    acc[d] = 0.0;
  }
  float m = NEG_INF, l = 0.0;
  for (uint j0 = lo; j0 < hi; j0 += ROWS) {
    const uint j = j0 + r;
    const bool live = j < hi;
    const uint key = live ? j : lo;  // rows past the end read a key that exists, and drop it
    const uint slot = uint(p.tables.v[s * p.max_blocks + key / p.block_size]) * p.block_size + key % p.block_size;
    const uint at = slot * kvd + g * HD + d0;
    float part = 0.0;
    for (uint d = 0u; d < DIMS; ++d) part += q[d] * cache_at(p.k_cache, at + d);
    const float sc = row_sum(part) * p.scale;
    if (live) {
      const float m_new = max(m, sc), correction = exp(m - m_new), w = exp(sc - m_new);
      l = l * correction + w;
      for (uint d = 0u; d < DIMS; ++d) acc[d] = acc[d] * correction + w * cache_at(p.v_cache, at + d);
      m = m_new;
    }
  }
  for (uint d = 0u; d < DIMS; ++d) row_acc[r * HD + d0 + d] = acc[d];
  if (d0 == 0u) {
    row_m[r] = m;
    row_l[r] = l;
  }
  barrier();
  float M = NEG_INF, L = 0.0;
  for (uint c = 0u; c < ROWS; ++c) M = max(M, row_m[c]);
  for (uint c = 0u; c < ROWS; ++c) L += row_m[c] == NEG_INF ? 0.0 : exp(row_m[c] - M) * row_l[c];
  const uint part_at = ((t * p.Hq + h) * p.splits + split) * (HD + 2u);
  for (uint dim = id; dim < HD; dim += THREADS) {
    float a = 0.0;
    for (uint c = 0u; c < ROWS; ++c) a += row_m[c] == NEG_INF ? 0.0 : exp(row_m[c] - M) * row_acc[c * HD + dim];
    if (p.splits == 1u) p.out_.v[qt + dim] = a / L;
    else p.partials.v[part_at + 2u + dim] = a;
  }
  if (p.splits > 1u && id == 0u) {
    p.partials.v[part_at] = M;
    p.partials.v[part_at + 1u] = L;
  }
}

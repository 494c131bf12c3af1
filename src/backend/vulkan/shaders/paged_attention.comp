#version 460
// Attention of new queries over a paged KV cache (float32 or 16-bit; cdtype 0 f32, 1 bf16,
// 2 f16): an invocation per (query token, head) walks the keys 0..its position through the
// sequence's block table with an online softmax.
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 out_; F32 q; uint64_t k_cache; uint64_t v_cache; I32 tables; I32 cu; I32 context;
  uint N, S, Hq, Hkv, hd, max_blocks, block_size, cdtype; float scale;
} p;
float cache_at(uint64_t cache, uint i) { return load_f32(cache, p.cdtype, i); }
void main() {
  FOR_EACH(row, p.N * p.Hq) {
    const uint t = row / p.Hq, h = row % p.Hq, qt = row * p.hd;
    const uint s = sequence_of(p.cu, p.S, t), begin = uint(p.cu.v[s]), end = uint(p.cu.v[s + 1u]);
    const uint position = uint(p.context.v[s]) - (end - begin) + (t - begin), g = h / (p.Hq / p.Hkv);
    const uint kvd = p.Hkv * p.hd;
    float acc[MAX_HD];
    for (uint d = 0u; d < p.hd; ++d) acc[d] = 0.0;
    float m = -1.0 / 0.0, l = 0.0;
    for (uint j = 0u; j <= position; ++j) {
      const uint slot = uint(p.tables.v[s * p.max_blocks + j / p.block_size]) * p.block_size + j % p.block_size;
      const uint at = slot * kvd + g * p.hd;
      float sc = 0.0;
      for (uint d = 0u; d < p.hd; ++d) sc += p.q.v[qt + d] * cache_at(p.k_cache, at + d);
      sc *= p.scale;
      const float m_new = max(m, sc), correction = exp(m - m_new), w = exp(sc - m_new);
      l = l * correction + w;
      for (uint d = 0u; d < p.hd; ++d) acc[d] = acc[d] * correction + w * cache_at(p.v_cache, at + d);
      m = m_new;
    }
    for (uint d = 0u; d < p.hd; ++d) p.out_.v[qt + d] = acc[d] / l;
  }
}

#version 460
// k_cache[slots[n], c] = k[n, c] and the same for v, the caches in float32 or 16-bit storage
// (cdtype 0 f32, 1 bf16, 2 f16).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { uint64_t k_cache; uint64_t v_cache; F32 k; F32 v; I32 slots; uint N; uint C; uint cdtype; } p;
void store(uint64_t cache, uint i, float x) { store_f32(cache, p.cdtype, i, x); }
void main() {
  FOR_EACH(idx, p.N * p.C) {
    const uint n = idx / p.C, c = idx % p.C;
    const uint at = uint(p.slots.v[n]) * p.C + c;
    store(p.k_cache, at, p.k.v[idx]);
    store(p.v_cache, at, p.v.v[idx]);
  }
}

#version 460
// Rotary embedding in place (Hugging Face's rotate-half): element pair (i, i + hd/2) of every
// head of token n turns by positions[n] * inv_freq[i] (the angle in float32, as transformers
// forms it); direction -1 rotates back (backward). One thread per (token, pair, head).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 x; I32 positions; F32 inv_freq; uint N; uint half_dim; uint heads; float direction; } p;
void main() {
  const uint total = p.N * p.half_dim * p.heads;
  FOR_EACH(idx, total) {
    const uint h = idx % p.heads, i = (idx / p.heads) % p.half_dim, n = idx / (p.heads * p.half_dim);
    const float angle = float(p.positions.v[n]) * p.inv_freq.v[i];
    const float c = cos(angle), s = p.direction * sin(angle);
    const uint base = (n * p.heads + h) * 2u * p.half_dim;
    const float x1 = p.x.v[base + i], x2 = p.x.v[base + i + p.half_dim];
    p.x.v[base + i] = x1 * c - x2 * s;
    p.x.v[base + i + p.half_dim] = x2 * c + x1 * s;
  }
}

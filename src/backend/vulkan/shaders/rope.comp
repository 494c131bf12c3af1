#version 460
// Rotary embedding in place (Hugging Face's rotate-half): element pair (i, i + hd/2) of every
// head of token n turns by positions[n] * inv_freq[i] (the angle in float32, as transformers
// forms it); direction -1 rotates back (backward). One thread per (token, pair, head), over x's
// heads and then y's (y_heads of them, 0 for x alone): a layer's q and k in one dispatch.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 x; F32 y; I32 positions; F32 inv_freq; uint N; uint half_dim; uint heads; uint y_heads; float direction;
} p;
void main() {
  const uint all_heads = p.heads + p.y_heads, total = p.N * p.half_dim * all_heads;
  FOR_EACH(idx, total) {
    const uint head = idx % all_heads, i = (idx / all_heads) % p.half_dim, n = idx / (all_heads * p.half_dim);
    const bool in_x = head < p.heads;
    F32 t = in_x ? p.x : p.y;
    const uint h = in_x ? head : head - p.heads, heads = in_x ? p.heads : p.y_heads;
    const float angle = float(p.positions.v[n]) * p.inv_freq.v[i];
    const float c = cos(angle), s = p.direction * sin(angle);
    const uint base = (n * heads + h) * 2u * p.half_dim;
    const float x1 = t.v[base + i], x2 = t.v[base + i + p.half_dim];
    t.v[base + i] = x1 * c - x2 * s;
    t.v[base + i + p.half_dim] = x2 * c + x1 * s;
  }
}

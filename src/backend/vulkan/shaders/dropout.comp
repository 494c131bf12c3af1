#version 460
// Inverted dropout with the cpu backend's mask: element i is kept when the top 24 bits of
// mix64(key + i * golden) are at least threshold (p in 24-bit units); kept elements * scale.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 x; uint64_t key; uint n; uint threshold; float scale; } p;
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9UL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebUL;
  return z ^ (z >> 31);
}
void main() {
  FOR_EACH(i, p.n) {
    const uint64_t z = mix64(p.key + uint64_t(i) * 0x9e3779b97f4a7c15UL);
    p.out_.v[i] = uint(z >> 40) >= p.threshold ? p.x.v[i] * p.scale : 0.0;
  }
}

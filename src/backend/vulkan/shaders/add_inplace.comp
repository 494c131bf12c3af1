#version 460
// y += x (float32).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 y; F32 x; uint n; } p;
void main() {
  FOR_EACH(i, p.n) p.y.v[i] += p.x.v[i];
}

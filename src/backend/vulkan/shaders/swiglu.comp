#version 460
// h = silu(gate) * up (forward).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 h; F32 gate; F32 up; uint n; } p;
void main() {
  FOR_EACH(i, p.n) {
    p.h.v[i] = silu_times(p.gate.v[i], p.up.v[i]);
  }
}

#version 460
// SwiGLU backward: dgate += dh up sig (1 + g (1 - sig)); dup += dh g sig.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 dgate; F32 dup; F32 dh; F32 gate; F32 up; uint n; } p;
void main() {
  FOR_EACH(i, p.n) {
    const float g = p.gate.v[i], sig = 1.0 / (1.0 + exp(-g)), dh = p.dh.v[i];
    p.dgate.v[i] += dh * p.up.v[i] * sig * (1.0 + g * (1.0 - sig));
    p.dup.v[i] += dh * g * sig;
  }
}

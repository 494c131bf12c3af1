#version 460
// dst = src converted between float32 and 16-bit storage. mode: 0 f32 -> bf16, 1 f32 -> f16,
// 2 bf16 -> f32, 3 f16 -> f32.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { uint64_t dst; uint64_t src; uint n; uint mode; } p;
void main() {
  FOR_EACH(i, p.n) {
    if (p.mode == 0u) U16(p.dst).v[i] = f32_to_bf16(F32(p.src).v[i]);
    else if (p.mode == 1u) U16(p.dst).v[i] = f32_to_f16(F32(p.src).v[i]);
    else if (p.mode == 2u) F32(p.dst).v[i] = bf16_to_f32(U16(p.src).v[i]);
    else F32(p.dst).v[i] = f16_to_f32(U16(p.src).v[i]);
  }
}

#version 460
// dst[i] = value (float32).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 dst; uint n; float value; } p;
void main() {
  FOR_EACH(i, p.n) p.dst.v[i] = p.value;
}

#version 460
// x *= scale, and each workgroup's sum of the squares of its elements into partials[group]
// (a fixed grid-stride share and a shared-memory tree: the same sums every run). The host adds
// the partials in float64.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 x; F32 partials; uint n; float scale; } p;
shared float partial[256];
void main() {
  const uint t = gl_LocalInvocationID.x;
  float s = 0.0;
  FOR_EACH(i, p.n) {
    const float v = p.x.v[i] * p.scale;
    p.x.v[i] = v;
    s += v * v;
  }
  partial[t] = s;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) partial[t] += partial[t + half_];
    barrier();
  }
  if (t == 0u) p.partials.v[gl_WorkGroupID.x] = partial[0];
}

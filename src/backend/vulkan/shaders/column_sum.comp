#version 460
// dbias[c] += alpha * sum over rows of dout[n, c], rows in order (one thread per column).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 x; uint N; uint C; float alpha; } p;
void main() {
  const uint c = gl_GlobalInvocationID.x;
  if (c >= p.C) return;
  float s = 0.0;
  for (uint n = 0u; n < p.N; ++n) s += p.x.v[n * p.C + c];
  p.out_.v[c] += p.alpha * s;
}

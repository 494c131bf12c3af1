#version 460
// RMSNorm forward, one 256-wide workgroup per row (folded_row: beyond 65,535 rows the grid has a
// y): the row's sum of squares reduced in shared memory in a fixed order (deterministic), then
// out = x * rstd * w; rstd[n] saved for backward.
// With an `add` address, the residual add before the norm runs in the same pass: x += add is
// written back and normalized (each invocation reads back only what it wrote).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 rstd; F32 inp; F32 w; F32 add; uint N; uint C; float eps; } p;
shared float partial[256];
void main() {
  const uint n = folded_row(), t = gl_LocalInvocationID.x;
  if (n >= p.N) return;
  const uint row = n * p.C;
  const bool add = uint64_t(p.add) != 0ul;
  float s = 0.0;
  for (uint c = t; c < p.C; c += 256u) {
    float x = p.inp.v[row + c];
    if (add) {
      x += p.add.v[row + c];
      p.inp.v[row + c] = x;
    }
    s += x * x;
  }
  partial[t] = s;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) partial[t] += partial[t + half_];
    barrier();
  }
  const float r = inversesqrt(partial[0] / float(p.C) + p.eps);
  if (t == 0u) p.rstd.v[n] = r;
  for (uint c = t; c < p.C; c += 256u) p.out_.v[row + c] = p.inp.v[row + c] * r * p.w.v[c];
}

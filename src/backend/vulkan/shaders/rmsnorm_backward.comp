#version 460
// RMSNorm backward, one workgroup per row (folded_row: beyond 65,535 rows the grid has a y):
// dinp += r (w dy - x r^2 mean(w dy x)). The weight's
// gradient, sum over rows of dy x r, is column_partials.comp's mode 1.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 dinp; F32 dout; F32 inp; F32 w; F32 rstd; uint N; uint C; } p;
shared float partial[256];
void main() {
  const uint t = gl_LocalInvocationID.x;
  const uint n = folded_row(), row = n * p.C;
  if (n >= p.N) return;
  float s = 0.0;
  for (uint c = t; c < p.C; c += 256u) s += p.w.v[c] * p.dout.v[row + c] * p.inp.v[row + c];
  partial[t] = s;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) partial[t] += partial[t + half_];
    barrier();
  }
  const float r = p.rstd.v[n], mean_dot = partial[0] / float(p.C);
  for (uint c = t; c < p.C; c += 256u)
    p.dinp.v[row + c] += r * (p.w.v[c] * p.dout.v[row + c] - p.inp.v[row + c] * r * r * mean_dot);
}

#version 460
// The sum of a training step's per-row losses, left on the device (Backend::take_deferred_loss_sum):
// one workgroup, each invocation walking every 256th row in order, then a shared-memory tree;
// the same bits every run. out[0] = sum of x[0 .. n).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 x; uint n; } p;
shared float s_sum[256];
void main() {
  const uint t = gl_LocalInvocationID.x;
  float s = 0.0;
  for (uint i = t; i < p.n; i += 256u) s += p.x.v[i];
  s_sum[t] = s;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) s_sum[t] += s_sum[t + half_];
    barrier();
  }
  if (t == 0u) p.out_.v[0] = s_sum[0];
}

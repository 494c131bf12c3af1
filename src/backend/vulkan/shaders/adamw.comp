#version 460
// One AdamW update (torch.optim.AdamW, as the cpu backend computes it in float32): the step's
// constants (step size, bias corrections, decay) come from the host.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 param; F32 grad; F32 m; F32 v; uint n;
  float b1, b2, step_size, inv_sqrt_bias2, eps, keep, grad_scale;
} p;
void main() {
  FOR_EACH(i, p.n) {
    const float g = p.grad.v[i] * p.grad_scale;
    const float m = p.b1 * p.m.v[i] + (1.0 - p.b1) * g;
    const float v = p.b2 * p.v.v[i] + (1.0 - p.b2) * g * g;
    p.m.v[i] = m;
    p.v.v[i] = v;
    p.param.v[i] = p.param.v[i] * p.keep - p.step_size * m / (sqrt(v) * p.inv_sqrt_bias2 + p.eps);
  }
}

#version 460
// A training step decided on the device, so that the host need not wait for the gradient norm
// before it records the next step (Backend::decide_and_update). One workgroup: the norm's
// partial sums (scale_sum_squares.comp's, one per workgroup) pass through shared memory 256 at a
// time and invocation 0 adds them in order in float64, the sum the host makes of them; then
// whether the step counts (a finite norm), torch's clipping coefficient min(1, max_norm / (norm +
// 1e-6)) (1 when max_norm <= 0), and AdamW's constants: candidate set 1 when the step decided
// before this one counted, else set 0 (the host cannot know which when it records this step;
// each set is step size, 1 / sqrt(bias correction 2), the decay factor).
#include "common.glsl"
#include "tensor_table.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 partials; Decision decision; double max_norm; uint n;
  float step_size0, inv_sqrt_bias2_0, keep0, step_size1, inv_sqrt_bias2_1, keep1;
} p;
shared float chunk[256];
void main() {
  const uint t = gl_LocalInvocationID.x;
  double sumsq = 0.0;
  for (uint base = 0u; base < p.n; base += 256u) {
    if (base + t < p.n) chunk[t] = p.partials.v[base + t];
    barrier();
    if (t == 0u)
      for (uint i = 0u; i < min(256u, p.n - base); ++i) sumsq += double(chunk[i]);
    barrier();
  }
  if (t != 0u) return;
  const uint previous = p.decision.counted;
  const double norm = sqrt(sumsq);
  const bool counted = !isnan(norm) && !isinf(norm);
  double clip = 1.0;
  if (p.max_norm > 0.0 && counted) clip = min(1.0, p.max_norm / (norm + 1e-6));
  p.decision.counted = counted ? 1u : 0u;
  p.decision.clip = float(clip);
  p.decision.step_size = previous != 0u ? p.step_size1 : p.step_size0;
  p.decision.inv_sqrt_bias2 = previous != 0u ? p.inv_sqrt_bias2_1 : p.inv_sqrt_bias2_0;
  p.decision.keep = previous != 0u ? p.keep1 : p.keep0;
  p.decision.previous = previous;
  p.decision.sumsq = unpackDouble2x32(sumsq);
}

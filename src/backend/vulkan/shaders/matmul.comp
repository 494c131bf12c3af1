#version 460
// out[N, OC] = inp[N, C] @ W[OC, C]^T (+ bias[OC]), W float32 or 16-bit (wdtype 0 f32, 1 bf16,
// 2 f16, widened as read). A 16 x 16 output tile per workgroup; both operands pass through
// shared memory 16 inputs at a time, so each element of inp and W is read from device memory
// once per tile. accumulate: out += scale * product (matmul_accumulate), else out = product + bias.
#include "common.glsl"
layout(local_size_x = 16, local_size_y = 16) in;
layout(push_constant) uniform Push {
  F32 out_;
  F32 inp;
  uint64_t w;
  F32 bias;
  uint N, OC, C, has_bias, wdtype, accumulate;
  float scale;
} p;
shared float a_tile[16][17];
shared float w_tile[16][17];
float weight(uint index) {
  if (p.wdtype == 0u) return F32(p.w).v[index];
  if (p.wdtype == 1u) return bf16_to_f32(U16(p.w).v[index]);
  return f16_to_f32(U16(p.w).v[index]);
}
void main() {
  const uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y;
  const uint n = gl_WorkGroupID.y * 16u + ly, oc = gl_WorkGroupID.x * 16u + lx;
  const uint w_row = gl_WorkGroupID.x * 16u + ly;
  float acc = 0.0;
  for (uint k0 = 0u; k0 < p.C; k0 += 16u) {
    const uint k = k0 + lx;
    a_tile[ly][lx] = (n < p.N && k < p.C) ? p.inp.v[n * p.C + k] : 0.0;
    w_tile[ly][lx] = (w_row < p.OC && k < p.C) ? weight(w_row * p.C + k) : 0.0;
    barrier();
    for (uint j = 0u; j < 16u; ++j) acc += a_tile[ly][j] * w_tile[lx][j];
    barrier();
  }
  if (n >= p.N || oc >= p.OC) return;
  const uint at = n * p.OC + oc;
  if (p.accumulate != 0u) p.out_.v[at] += p.scale * acc;
  else p.out_.v[at] = acc + (p.has_bias != 0u ? p.bias.v[oc] : 0.0);
}

#version 460
// out = inp @ W^T (+ bias), or out += scale * inp @ W^T, for a few input rows (decoding: one row
// per sequence), where gemm.comp's 64 x 64 tiles would stay mostly idle: one invocation per
// output element walks its weight row once (k increasing), so nothing waits at a barrier and a
// step of N rows reads the weights N times from cache, once from memory.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 out_;
  F32 inp;
  uint64_t w;
  F32 bias;
  uint N, OC, C, has_bias, wdtype, accumulate;
  float scale;
} p;
void main() {
  FOR_EACH(i, p.N * p.OC) {
    const uint n = i / p.OC, oc = i % p.OC, a = n * p.C, row = oc * p.C;
    float acc = 0.0;
    if (p.wdtype == 0u) {
      for (uint k = 0u; k < p.C; ++k) acc += p.inp.v[a + k] * F32(p.w).v[row + k];
    } else if (p.wdtype == 1u) {
      for (uint k = 0u; k < p.C; ++k) acc += p.inp.v[a + k] * bf16_to_f32(U16(p.w).v[row + k]);
    } else {
      for (uint k = 0u; k < p.C; ++k) acc += p.inp.v[a + k] * f16_to_f32(U16(p.w).v[row + k]);
    }
    if (p.accumulate != 0u) {
      p.out_.v[i] += p.scale * acc;
    } else {
      p.out_.v[i] = acc + (p.has_bias != 0u ? p.bias.v[oc] : 0.0);
    }
  }
}

#version 460
// The second pass of a split-K gemm.comp: out[i] (+)= alpha * sum over splits of partials[s, i]
// (+ bias), the splits added in order: the same bits every run.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 partials; F32 bias; uint n, Nc, splits, has_bias, accumulate; float alpha; } p;
void main() {
  FOR_EACH(i, p.n) {
    float s = 0.0;
    for (uint z = 0u; z < p.splits; ++z) s += p.partials.v[z * p.n + i];
    if (p.accumulate != 0u) p.out_.v[i] += p.alpha * s;
    else p.out_.v[i] = p.alpha * s + (p.has_bias != 0u ? p.bias.v[i % p.Nc] : 0.0);
  }
}

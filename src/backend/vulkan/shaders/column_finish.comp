#version 460
// The second pass of column_partials.comp: out[c] += alpha * the sum of the blocks' partials of
// column c, blocks in order.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 partials; uint C, blocks; float alpha; } p;
void main() {
  FOR_EACH(c, p.C) {
    float s = 0.0;
    for (uint b = 0u; b < p.blocks; ++b) s += p.partials.v[b * p.C + c];
    p.out_.v[c] += p.alpha * s;
  }
}

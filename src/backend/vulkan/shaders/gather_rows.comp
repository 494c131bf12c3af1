#version 460
// mode 0: out[r, c] = inp[index[r], c]; mode 1 (scatter): out[index[r], c] = inp[r, c] (float32).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 inp; I32 index; uint R; uint C; uint mode; } p;
void main() {
  FOR_EACH(idx, p.R * p.C) {
    const uint r = idx / p.C, c = idx % p.C;
    if (p.mode == 0u) p.out_.v[idx] = p.inp.v[uint(p.index.v[r]) * p.C + c];
    else p.out_.v[uint(p.index.v[r]) * p.C + c] = p.inp.v[idx];
  }
}

#version 460
// mode 0: out[r, c] = inp[index[r], c]; mode 1 (scatter): out[index[r], c] = inp[r, c]; mode 2
// (combine, Backend::combine_rows): out[r, c] += sum over k < K of weights[j] * inp[j, c], j =
// index[r * K + k] (or r itself where has_index is 0), in k order: each element written by one
// invocation. Float32 rows.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 inp; I32 index; F32 weights; uint R; uint C; uint mode; uint K; uint has_index; } p;
void main() {
  FOR_EACH(idx, p.R * p.C) {
    const uint r = idx / p.C, c = idx % p.C;
    if (p.mode == 0u) {
      p.out_.v[idx] = p.inp.v[uint(p.index.v[r]) * p.C + c];
    } else if (p.mode == 1u) {
      p.out_.v[uint(p.index.v[r]) * p.C + c] = p.inp.v[idx];
    } else {
      float acc = p.out_.v[idx];
      for (uint k = 0u; k < p.K; ++k) {
        const uint j = p.has_index != 0u ? uint(p.index.v[r * p.K + k]) : r;
        acc += p.weights.v[j] * p.inp.v[j * p.C + c];
      }
      p.out_.v[idx] = acc;
    }
  }
}

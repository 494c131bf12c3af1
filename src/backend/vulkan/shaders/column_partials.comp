#version 460
// Column sums in two passes, without atomics and in a fixed order: this pass gives each
// workgroup 256 columns of a block of `rows_per_block` rows, each invocation summing its column
// over the block's rows in order into partials[block * C + c]; column_finish.comp adds the
// blocks in order. mode 0: the sum of a[n, c] (a bias gradient); mode 1: of a[n, c] b[n, c]
// rstd[n] (RMSNorm's weight gradient: dy x r); modes 2 and 3: the sum of a[n, c] stored in
// bfloat16 / float16 (a bias gradient with 16-bit operands: the rounded output gradient).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 partials; F32 a; F32 b; F32 rstd; uint N, C, rows_per_block, mode; } p;
void main() {
  const uint c = gl_WorkGroupID.x * 256u + gl_LocalInvocationID.x, block = gl_WorkGroupID.y;
  if (c >= p.C) return;
  const uint begin = block * p.rows_per_block, end = min(begin + p.rows_per_block, p.N);
  float s = 0.0;
  if (p.mode == 0u) {
    for (uint n = begin; n < end; ++n) s += p.a.v[n * p.C + c];
  } else if (p.mode >= 2u) {
    for (uint n = begin; n < end; ++n) s += load_f32(uint64_t(p.a), p.mode - 1u, n * p.C + c);
  } else {
    for (uint n = begin; n < end; ++n) s += p.a.v[n * p.C + c] * p.b.v[n * p.C + c] * p.rstd.v[n];
  }
  p.partials.v[block * p.C + c] = s;
}

#version 460
// Embedding. mode 0 (forward): out[n, d] = table[ids[n], d], the table float32 or 16-bit
// (tdtype 0 f32, 1 bf16, 2 f16). mode 1 (backward): dtable[ids[n], d] += dout[n, d], one thread
// per column d walking the tokens in order: no two threads touch one element, and repeated ids
// add up in the same order every run.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { uint64_t table; F32 rows; I32 ids; uint N; uint D; uint tdtype; uint mode; } p;
float table_at(uint i) { return load_f32(p.table, p.tdtype, i); }
void main() {
  if (p.mode == 0u) {
    FOR_EACH(idx, p.N * p.D) {
      const uint n = idx / p.D, d = idx % p.D;
      p.rows.v[idx] = table_at(uint(p.ids.v[n]) * p.D + d);
    }
    return;
  }
  const uint d = gl_GlobalInvocationID.x;
  if (d >= p.D) return;
  for (uint n = 0u; n < p.N; ++n) F32(p.table).v[uint(p.ids.v[n]) * p.D + d] += p.rows.v[n * p.D + d];
}

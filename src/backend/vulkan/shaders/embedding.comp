#version 460
// Embedding. mode 0 (forward): out[n, d] = table[ids[n], d], the table float32 or 16-bit
// (tdtype 0 f32, 1 bf16, 2 f16). mode 1 (backward): dtable[ids[n], d] += dout[n, d] over a grid
// of (256 columns, token rows; rows beyond the grid loop): row n owns its id where no earlier row
// has it (the workgroup checks the earlier ids 256 at a time), and the owner's invocations each
// add every row of that id to one column of the table row, in token order. Each element is
// written by one invocation and its additions come in the order a walk over the tokens makes:
// no atomics on floats, the same bits every run, and as many workgroups as there are tokens.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { uint64_t table; F32 rows; I32 ids; uint N; uint D; uint tdtype; uint mode; } p;
shared uint earlier;
float table_at(uint i) { return load_f32(p.table, p.tdtype, i); }
void main() {
  if (p.mode == 0u) {
    FOR_EACH(idx, p.N * p.D) {
      const uint n = idx / p.D, d = idx % p.D;
      p.rows.v[idx] = table_at(uint(p.ids.v[n]) * p.D + d);
    }
    return;
  }
  const uint t = gl_LocalInvocationID.x, d = gl_WorkGroupID.x * 256u + t;
  for (uint n = gl_WorkGroupID.y; n < p.N; n += gl_NumWorkGroups.y) {
    const int id = p.ids.v[n];
    if (t == 0u) earlier = 0u;
    barrier();
    for (uint m = t; m < n; m += 256u)
      if (p.ids.v[m] == id) atomicOr(earlier, 1u);
    barrier();
    const bool owner = earlier == 0u;
    barrier();  // read by all before the next row resets it
    if (!owner || d >= p.D) continue;
    const uint at = uint(id) * p.D + d;
    float acc = F32(p.table).v[at];
    for (uint m = n; m < p.N; ++m)
      if (p.ids.v[m] == id) acc += p.rows.v[m * p.D + d];
    F32(p.table).v[at] = acc;
  }
}

#version 460
// x *= scale for the grad of every tensor of a table (tensor_table.glsl) in one dispatch, and
// each workgroup's sum of the squares of its elements into partials[group]: a fixed share of the
// chunks per workgroup and a shared-memory tree, the same sums every run. The host adds the
// partials in float64.
#include "common.glsl"
#include "tensor_table.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { Table table; uint64_t total; F32 partials; uint count; float scale; } p;
shared float partial[256];
void main() {
  const uint t = gl_LocalInvocationID.x;
  float s = 0.0;
  const uint64_t chunks = (p.total + CHUNK - 1u) / CHUNK;
  for (uint64_t c = gl_WorkGroupID.x; c < chunks; c += gl_NumWorkGroups.x) {
    const uint64_t begin = c * CHUNK, end = min(begin + CHUNK, p.total);
    uint k = table_find(p.table, p.count, begin);
    for (uint64_t e = begin + t; e < end; e += 256u) {
      while (e >= table_first(p.table, k) + table_count(p.table, k)) ++k;
      F32 x = F32(table_word(p.table, k, 1u));
      const uint i = uint(e - table_first(p.table, k));
      const float v = x.v[i] * p.scale;
      x.v[i] = v;
      s += v * v;
    }
  }
  partial[t] = s;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) partial[t] += partial[t + half_];
    barrier();
  }
  if (t == 0u) p.partials.v[gl_WorkGroupID.x] = partial[0];
}

#version 460
// The grad of every tensor of a table (tensor_table.glsl) set to `value` in one dispatch: a step's
// gradients zeroed by one command instead of a fill per tensor (Backend::fill_group). Chunks are
// walked as scale_sum_squares.comp walks them.
#include "common.glsl"
#include "tensor_table.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { Table table; uint64_t total; uint count; float value; } p;
void main() {
  const uint64_t chunks = (p.total + CHUNK - 1u) / CHUNK;
  for (uint64_t c = gl_WorkGroupID.x; c < chunks; c += gl_NumWorkGroups.x) {
    const uint64_t begin = c * CHUNK, end = min(begin + CHUNK, p.total);
    uint k = table_find(p.table, p.count, begin);
    for (uint64_t e = begin + gl_LocalInvocationID.x; e < end; e += 256u) {
      while (e >= table_first(p.table, k) + table_count(p.table, k)) ++k;
      F32(table_word(p.table, k, 1u)).v[uint(e - table_first(p.table, k))] = p.value;
    }
  }
}

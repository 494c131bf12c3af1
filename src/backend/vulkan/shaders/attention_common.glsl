// Shared by the attention shaders (FlashAttention-2's structure, in float32 FMAs).
//
// A workgroup of THREADS invocations holds ROWS rows (query or key rows of one head); a row's HD
// dimensions are split over LANES neighbouring invocations of one subgroup, DIMS each, so a
// dot product is DIMS FMAs per invocation and a butterfly of subgroup shuffles (row_sum). The
// other operand streams through shared memory in tiles of TILE rows, each element read from
// memory once per workgroup and by every row of the workgroup from shared memory.
//
// HD, LANES, TILE and THREADS are specialization constants (src/backend/vulkan/geometry.cpp
// chooses them): each head dimension is a pipeline of its own, so every loop has a compile-time
// trip count and per-row arrays stay in registers.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
layout(constant_id = 0) const uint HD = 64;     // head_dim
layout(constant_id = 1) const uint LANES = 4;   // invocations per row (4, or 8 beyond head_dim 128)
layout(constant_id = 2) const uint TILE = 32;   // rows per shared-memory tile
layout(constant_id = 3) const uint THREADS = 128;  // the workgroup
layout(local_size_x_id = 3) in;
const uint ROWS = THREADS / LANES;
const uint DIMS = HD / LANES;

// This invocation's place in subgroup order (subgroup, then invocation in it): LANES consecutive
// places are neighbours in one subgroup, whatever order the device numbers invocations in.
uint place() { return gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID; }
// The sum over the LANES invocations of a row, the same bits in each of them (each step adds a
// pair of partial sums in one order or the other, and float addition commutes).
float row_sum(float x) {
  for (uint o = 1u; o < LANES; o <<= 1u) x += subgroupShuffleXor(x, o);
  return x;
}
// Where dimension d of tile row r sits in shared memory: the dimensions of a row interleaved
// by lane, so the LANES invocations of a row read LANES neighbouring words (no bank conflict),
// and every row of the workgroup reads the same ones (a broadcast).
uint tile_at(uint r, uint d) { return r * HD + (d % DIMS) * LANES + d / DIMS; }

// Shared by the attention shaders on VK_NV_cooperative_matrix2's subgroup matrices of flexible
// size (attention_coopmat2.comp and its backward passes): FlashAttention-2's passes as
// attention_coopmat.glsl's, with the elementwise work (mask, softmax, the scores' gradient) done
// on the matrices themselves (coopMatPerElementNV, coopMatReduceNV) instead of through shared
// memory.
//
// A workgroup of four subgroups works on a tile of B rows (queries, or keys in the dK/dV pass);
// subgroup i owns the tile's rows [i R, (i + 1) R), R = B / 4, as FlashAttention-2 splits a tile
// over its warps: no subgroup reads another's rows, and its results stay in registers as
// HD / OC matrices of R x OC (float32) until they are written once at the end. Operands are
// staged in shared memory as float16, rounded as they are loaded (f32_to_f16: round to nearest
// even, as the cpu and the reference convert); products of the head dimension run as loops of
// R x KC by KC x B products (one product over the whole head dimension took lavapipe 1.5 times as
// long to compile at head_dim 64, 2.9 times at 128).
//
// Spec constants: HD, B, the subgroup size, OC and KC (the device's column and inner granularity
// for these types). R is the device's row granularity, B and HD multiples of the column and inner
// ones (vulkan_geometry::attention_coopmat2_tile).
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "../common.glsl"
layout(constant_id = 0) const uint HD = 64;
layout(constant_id = 1) const uint B = 32;
layout(constant_id = 2) const uint SUBGROUP = 32;
layout(constant_id = 3) const uint OC = 16;
layout(constant_id = 4) const uint KC = 16;  // the inner dimension of one product over the head dimension
layout(local_size_x_id = 5) in;  // 4 x SUBGROUP
const uint THREADS = 4u * SUBGROUP;
const uint R = B / 4u;
const uint H_STRIDE = HD + 8u;  // a row of a [B, HD] float16 tile (padded)
const uint CHUNKS = HD / OC;    // a subgroup's R x HD result in R x OC matrices
const uint KCHUNKS = HD / KC;   // the head dimension in products of KC
#define SMAT coopmat<float, gl_ScopeSubgroup, R, B, gl_MatrixUseAccumulator>
#define OMAT coopmat<float, gl_ScopeSubgroup, R, OC, gl_MatrixUseAccumulator>
#define QMAT coopmat<float16_t, gl_ScopeSubgroup, R, KC, gl_MatrixUseA>
#define KMAT coopmat<float16_t, gl_ScopeSubgroup, KC, B, gl_MatrixUseB>
#define PMAT coopmat<float16_t, gl_ScopeSubgroup, R, B, gl_MatrixUseA>
#define VMAT coopmat<float16_t, gl_ScopeSubgroup, B, OC, gl_MatrixUseB>
shared float stage[B * OC];  // a subgroup's R x OC results on their way out

float16_t half_of(float x) { return uint16BitsToFloat16(f32_to_f16(x)); }
float rounded(const in uint r, const in uint c, const in float x) { return float(half_of(x)); }
float largest(const in float a, const in float b) { return max(a, b); }

uint subgroup_row0() { return gl_LocalInvocationID.x / SUBGROUP * R; }

// x[r, KC c .. KC (c + 1)) of a [B, HD] float16 tile in shared memory (rows of H_STRIDE), as the
// subgroup's A operands: its rows of the tile held in registers over the whole head dimension.
#define LOAD_ROWS(mats, tile)                                                                      \
  for (uint c_ = 0u; c_ < KCHUNKS; ++c_)                                                           \
    coopMatLoad(mats[c_], tile, subgroup_row0() * H_STRIDE + c_ * KC, H_STRIDE, gl_CooperativeMatrixLayoutRowMajor);

// s = X Y^T (R x B) from the subgroup's rows of X held as A operands (LOAD_ROWS) and a [B, HD]
// float16 tile Y in shared memory, read as column-major B operands.
#define PRODUCT_XYT(s, xs, Y)                                                                      \
  s = SMAT(0.0);                                                                                   \
  for (uint c_ = 0u; c_ < KCHUNKS; ++c_) {                                                         \
    KMAT y_;                                                                                       \
    coopMatLoad(y_, Y, c_ * KC, H_STRIDE, gl_CooperativeMatrixLayoutColumnMajor);                  \
    s = coopMatMulAdd(xs[c_], y_, s);                                                              \
  }

// acc[c] += P Y[:, OC c .. OC (c + 1)) for every chunk: P an R x B A operand, Y a [B, HD] float16
// tile in shared memory.
#define PRODUCT_PY(acc, P, Y)                                                                      \
  for (uint c_ = 0u; c_ < CHUNKS; ++c_) {                                                          \
    VMAT y_;                                                                                       \
    coopMatLoad(y_, Y, c_ * OC, H_STRIDE, gl_CooperativeMatrixLayoutRowMajor);                    \
    acc[c_] = coopMatMulAdd(P, y_, acc[c_]);                                                       \
  }

// Writes chunk c of the subgroup's R x HD result through its part of the stage: its row r is
// token t0 + r, written where below `count`, to dst[(token heads + head) HD + c OC ...]. Every
// subgroup calls it alike (barriers).
void store_chunk(const in OMAT m, const in uint c, F32 dst, const in uint t0, const in uint count,
                 const in uint heads, const in uint head) {
  const uint row0 = subgroup_row0();
  coopMatStore(m, stage, row0 * OC, OC, gl_CooperativeMatrixLayoutRowMajor);
  barrier();
  for (uint e = gl_LocalInvocationID.x % SUBGROUP; e < R * OC; e += SUBGROUP) {
    const uint t = t0 + e / OC;
    if (t < count) dst.v[(t * heads + head) * HD + c * OC + e % OC] = stage[row0 * OC + e];
  }
  barrier();
}

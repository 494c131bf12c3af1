// Shared by the cooperative-matrix attention shaders: FlashAttention-2's passes with their
// products on the device's matrix units (VK_KHR_cooperative_matrix), float16 operands and
// float32 accumulation, as attention.comp and its backward passes compute them in float32 FMAs.
//
// A workgroup of four subgroups works on tiles of B query rows and B key rows of one head. Every
// product is a B x B or B x HD tile, each subgroup computing a quarter of it (2 x 2 quarters) as
// unit-shaped matrices (CM x CN x CK: 8 x 8 x 8 on lavapipe, 16 x 16 x 16 on NVIDIA) from
// operands staged in shared memory as float16, rounded as they are loaded (f32_to_f16: round to
// nearest even, as the cpu and the reference convert). Scores, probabilities and their gradients
// go through shared memory between the products, where invocations apply the mask and the
// softmax elementwise. No atomics: every output is written once, in a fixed order of the tiles,
// so a rerun on one device gives the same bits.
//
// HD, B and the unit are specialization constants (vulkan_geometry::attention_coopmat picks B
// from the device's shared memory; HD is a multiple of 2 CN and of CK).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "../common.glsl"
layout(constant_id = 0) const uint HD = 64;        // head_dim
layout(constant_id = 1) const uint B = 32;         // rows of a query tile and of a key tile
layout(constant_id = 2) const uint SUBGROUP = 32;
layout(constant_id = 3) const uint CM = 16;
layout(constant_id = 4) const uint CN = 16;
layout(constant_id = 5) const uint CK = 16;
layout(local_size_x_id = 6) in;  // 4 x SUBGROUP
const uint THREADS = 4u * SUBGROUP;
const uint H_STRIDE = HD + 8u;  // a row of a [B, HD] float16 tile (padded)
const uint T_STRIDE = B + 8u;   // a row of a [B, B] float16 tile
const uint S_STRIDE = B + 4u;   // a row of a [B, B] float32 tile
const uint HALF = B / 2u;
const uint QM = HALF / CM, QN = HALF / CN;  // a quarter of a [B, B] tile in unit matrices
const uint HN = HD / 2u / CN;               // a quarter of a [B, HD] tile: QM x HN of them
#define ACC coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, CM, CK, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, CK, CN, gl_MatrixUseB>

float16_t half_of(float x) { return uint16BitsToFloat16(f32_to_f16(x)); }

// The subgroup's quarter: rows sm.. of every tile, columns sn.. of a [B, B] tile and hn.. of a
// [B, HD] one.
uint quarter_rows() { return (gl_LocalInvocationID.x / SUBGROUP / 2u) * HALF; }
uint quarter_cols() { return (gl_LocalInvocationID.x / SUBGROUP % 2u) * HALF; }
uint quarter_dims() { return (gl_LocalInvocationID.x / SUBGROUP % 2u) * (HD / 2u); }

// acc = X Y^T over the head dimension for the quarter (sm, sn) of a [B, B] tile: X and Y are
// [B, HD] float16 tiles in shared memory (rows of H_STRIDE), Y read as column-major B operands.
#define PRODUCT_XYT(acc, X, Y, sm, sn)                                                             \
  for (uint i_ = 0u; i_ < QM; ++i_)                                                                \
    for (uint j_ = 0u; j_ < QN; ++j_) acc[i_][j_] = ACC(0.0);                                      \
  for (uint k_ = 0u; k_ < HD; k_ += CK) {                                                          \
    MAT_A a_[QM];                                                                                  \
    for (uint i_ = 0u; i_ < QM; ++i_)                                                              \
      coopMatLoad(a_[i_], X, (sm + i_ * CM) * H_STRIDE + k_, H_STRIDE, gl_CooperativeMatrixLayoutRowMajor); \
    for (uint j_ = 0u; j_ < QN; ++j_) {                                                            \
      MAT_B b_;                                                                                    \
      coopMatLoad(b_, Y, (sn + j_ * CN) * H_STRIDE + k_, H_STRIDE, gl_CooperativeMatrixLayoutColumnMajor); \
      for (uint i_ = 0u; i_ < QM; ++i_) acc[i_][j_] = coopMatMulAdd(a_[i_], b_, acc[i_][j_]);     \
    }                                                                                              \
  }

// acc += P Y for the quarter (sm, hn) of a [B, HD] tile: P a [B, B] float16 tile (rows of
// T_STRIDE), Y a [B, HD] float16 tile.
#define PRODUCT_PY(acc, P, Y, sm, hn)                                                              \
  for (uint k_ = 0u; k_ < B; k_ += CK) {                                                           \
    MAT_A a_[QM];                                                                                  \
    for (uint i_ = 0u; i_ < QM; ++i_)                                                              \
      coopMatLoad(a_[i_], P, (sm + i_ * CM) * T_STRIDE + k_, T_STRIDE, gl_CooperativeMatrixLayoutRowMajor); \
    for (uint j_ = 0u; j_ < HN; ++j_) {                                                            \
      MAT_B b_;                                                                                    \
      coopMatLoad(b_, Y, k_ * H_STRIDE + hn + j_ * CN, H_STRIDE, gl_CooperativeMatrixLayoutRowMajor); \
      for (uint i_ = 0u; i_ < QM; ++i_) acc[i_][j_] = coopMatMulAdd(a_[i_], b_, acc[i_][j_]);     \
    }                                                                                              \
  }

// Stores a [QM][QN] quarter of a [B, B] float32 tile into S (rows of S_STRIDE).
#define STORE_SCORES(acc, S, sm, sn)                                                               \
  for (uint i_ = 0u; i_ < QM; ++i_)                                                                \
    for (uint j_ = 0u; j_ < QN; ++j_)                                                              \
      coopMatStore(acc[i_][j_], S, (sm + i_ * CM) * S_STRIDE + sn + j_ * CN, S_STRIDE,             \
                   gl_CooperativeMatrixLayoutRowMajor);

// Writes a [QM][HN] quarter of a [B, HD] float32 result to memory, matrix by matrix through
// the subgroup's CM x CN of STAGE (a float32 array of at least 4 CM CN: a [B, B] tile's): element (r, d) of the tile goes to out[at(r) + d] where
// at(r) is not ~0u (rows past the tensor's end). Every subgroup runs the same loop (barriers).
#define WRITE_OUT(acc, STAGE, sm, hn, out, at)                                                     \
  for (uint i_ = 0u; i_ < QM; ++i_)                                                                \
    for (uint j_ = 0u; j_ < HN; ++j_) {                                                            \
      const uint base_ = gl_LocalInvocationID.x / SUBGROUP * CM * CN;                              \
      coopMatStore(acc[i_][j_], STAGE, base_, CN, gl_CooperativeMatrixLayoutRowMajor);            \
      barrier();                                                                                   \
      for (uint e_ = gl_LocalInvocationID.x % SUBGROUP; e_ < CM * CN; e_ += SUBGROUP) {            \
        const uint row_ = at(sm + i_ * CM + e_ / CN);                                              \
        if (row_ != ~0u) out.v[row_ + hn + j_ * CN + e_ % CN] = STAGE[base_ + e_];                \
      }                                                                                            \
      barrier();                                                                                   \
    }

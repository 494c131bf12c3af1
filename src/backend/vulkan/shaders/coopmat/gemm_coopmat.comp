#version 460
// Products of 16-bit operands on the device's matrix units (VK_KHR_cooperative_matrix): out[M, Nc]
// = alpha * A[M, K] @ B[K, Nc] (+ bias[Nc]), or out += alpha * A @ B (accumulate), A and B
// float16 (ELEM: the build's one source for every 16-bit type the device multiplies), given by
// strides as gemm.comp's are (A(m, k) = a[m * a_m + k * a_k], B(k, n) = b[k * b_k + n * b_n]),
// float32 accumulation, float32 out. An operand stored in float32 (ADTYPE / BDTYPE 0: the LM
// head's gathered rows and its loss gradient) is rounded to float16 as it is loaded, A times
// a_scale first (the head's grad_scale, applied before the rounding as the cpu backend does);
// ADTYPE / BDTYPE 2 read float16 storage as it is. Split-K as gemm.comp: workgroup z writes its K range's
// product into its slice of the scratch (partial), gemm_reduce.comp adds the slices in order.
//
// A workgroup of four subgroups computes a TILE x TILE output tile, each subgroup a
// (TILE / 2)-square quarter of it as (TILE / 2 / CM) x (TILE / 2 / CN) accumulators of the
// device's CM x CN x CK shape (8 x 8 x 8 on lavapipe, 16 x 16 x 16 on NVIDIA: specialization
// constants from the device's reported properties). K advances BK at a time: the workgroup
// stages A's [TILE, BK] and B's [BK, TILE] tiles in shared memory as 16-bit values (zero beyond
// the operands; the next step's read from memory while this one multiplies: two stages), each
// subgroup multiplies its quarter from them, and the accumulators go through
// shared memory once at the end so every output is written by one invocation (no atomics; a fixed
// order over K: the same bits every run on one device).
//
// SWIGLU (Backend::matmul_forward_group_swiglu over many rows, the training forward's gate and
// up): B is gate's weight and b2 up's, of one shape; the workgroup computes its tile of gate,
// writes it (out_, plus bias when has_bias bit 0), then the same tile of up from the same A
// (out2, plus bias2 when bit 1), and with it h = silu(gate) * up, each invocation reading back
// the gate values it wrote itself. No split over K, no accumulation, alpha 1.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "../common.glsl"
layout(constant_id = 0) const uint TILE = 64;  // 32 or 64
layout(constant_id = 1) const uint SUBGROUP = 32;
layout(constant_id = 2) const uint CM = 16;
layout(constant_id = 3) const uint CN = 16;
layout(constant_id = 4) const uint CK = 16;
layout(local_size_x_id = 5) in;  // 4 x SUBGROUP
layout(constant_id = 6) const uint ADTYPE = 2;
layout(constant_id = 7) const uint BDTYPE = 2;
layout(constant_id = 8) const uint SWIGLU = 0;
layout(push_constant) uniform Push {
  F32 out_; uint64_t a; uint64_t b; F32 bias;
  uint M, Nc, K, a_m, a_k, b_k, b_n, has_bias, accumulate, k_split, partial;
  uint vectors;  // gemm.comp's (the two share this block); unused here
  float alpha, a_scale;
  F32 out2; uint64_t b2; F32 bias2; F32 h;  // SWIGLU: up's output, weight and bias; the activation
} p;
#define ELEM float16_t
const uint BK = 32u;
const uint QUARTER = TILE / 2u, TM = QUARTER / CM, TN = QUARTER / CN;
const uint A_STRIDE = BK + 8u, B_STRIDE = TILE + 8u, C_STRIDE = TILE + 4u;  // padded rows
const uint STAGED = TILE * BK / (4u * SUBGROUP);  // elements of each operand an invocation stages per K step
shared ELEM a_s[TILE * A_STRIDE];  // [m][k]
shared ELEM b_s[BK * B_STRIDE];    // [k][n]
shared float c_s[TILE * C_STRIDE];  // [m][n], the accumulators on their way out

ELEM elem_at(uint64_t base, uint dtype, uint i, float scale) {
  if (dtype == 0u) return uint16BitsToFloat16(f32_to_f16(scale * F32(base).v[i]));
  return uint16BitsToFloat16(U16(base).v[i]);
}

// Two stages: the next K step's operands are read from memory into registers (a_r, b_r) while
// the subgroups multiply the current one from shared memory, and stored there after the barrier
// that ends it. Loads run along whichever dimension is contiguous (neighbouring invocations,
// neighbouring words). B is `bw`, the pass's weight.
#define FETCH(k0)                                                                                    \
  for (uint i = 0u; i < STAGED; ++i) {                                                             \
    const uint e = tid + i * threads;                                                              \
    const uint am = p.a_k == 1u ? e / BK : e % TILE, ak = p.a_k == 1u ? e % BK : e / TILE;         \
    const uint gm = m0 + am, gka = (k0) + ak;                                                      \
    a_r[i] = gm < p.M && gka < k_end ? elem_at(p.a, ADTYPE, gm * p.a_m + gka * p.a_k, p.a_scale) : zero; \
    const uint bn = p.b_n == 1u ? e % TILE : e / BK, bk = p.b_n == 1u ? e / TILE : e % BK;         \
    const uint gn = n0 + bn, gkb = (k0) + bk;                                                      \
    b_r[i] = gn < p.Nc && gkb < k_end ? elem_at(bw, BDTYPE, gkb * p.b_k + gn * p.b_n, 1.0) : zero; \
  }
#define STAGE()                                                                                      \
  for (uint i = 0u; i < STAGED; ++i) {                                                             \
    const uint e = tid + i * threads;                                                              \
    a_s[(p.a_k == 1u ? e / BK : e % TILE) * A_STRIDE + (p.a_k == 1u ? e % BK : e / TILE)] = a_r[i]; \
    b_s[(p.b_n == 1u ? e / TILE : e % BK) * B_STRIDE + (p.b_n == 1u ? e % TILE : e / BK)] = b_r[i]; \
  }

void main() {
  const uint threads = 4u * SUBGROUP, tid = gl_LocalInvocationID.x, sg = tid / SUBGROUP;
  const uint sm = (sg / 2u) * QUARTER, sn = (sg % 2u) * QUARTER;
  const uint m0 = gl_WorkGroupID.y * TILE, n0 = gl_WorkGroupID.x * TILE;
  const uint passes = SWIGLU == 1u ? 2u : 1u;
  for (uint pass = 0u; pass < passes; ++pass) {
    const uint64_t bw = pass == 0u ? p.b : p.b2;
    if (pass > 0u) barrier();  // the first pass's tile is out of c_s before the next is stored there
    coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator> acc[TM][TN];
    for (uint i = 0u; i < TM; ++i)
      for (uint j = 0u; j < TN; ++j) acc[i][j] = coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator>(0.0);
    const uint k_begin = gl_WorkGroupID.z * p.k_split, k_end = min(k_begin + p.k_split, p.K);
    ELEM a_r[STAGED], b_r[STAGED];
    const ELEM zero = ELEM(0.0);
    if (k_begin < k_end) {
      FETCH(k_begin)
      STAGE()
    }
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
      const bool next = k0 + BK < k_end;
      if (next) FETCH(k0 + BK)
      barrier();
      for (uint kk = 0u; kk < BK; kk += CK) {
        coopmat<ELEM, gl_ScopeSubgroup, CM, CK, gl_MatrixUseA> am[TM];
        for (uint i = 0u; i < TM; ++i)
          coopMatLoad(am[i], a_s, (sm + i * CM) * A_STRIDE + kk, A_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
        for (uint j = 0u; j < TN; ++j) {
          coopmat<ELEM, gl_ScopeSubgroup, CK, CN, gl_MatrixUseB> bm;
          coopMatLoad(bm, b_s, kk * B_STRIDE + sn + j * CN, B_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
          for (uint i = 0u; i < TM; ++i) acc[i][j] = coopMatMulAdd(am[i], bm, acc[i][j]);
        }
      }
      barrier();
      if (next) STAGE()  // made visible by the next step's first barrier
    }
    for (uint i = 0u; i < TM; ++i)
      for (uint j = 0u; j < TN; ++j)
        coopMatStore(acc[i][j], c_s, (sm + i * CM) * C_STRIDE + sn + j * CN, C_STRIDE,
                     gl_CooperativeMatrixLayoutRowMajor);
    barrier();
    for (uint e = tid; e < TILE * TILE; e += threads) {
      const uint m = m0 + e / TILE, n = n0 + e % TILE;
      if (m >= p.M || n >= p.Nc) continue;
      const float x = c_s[(e / TILE) * C_STRIDE + e % TILE];
      const uint at = m * p.Nc + n;
      if (SWIGLU == 1u) {
        if (pass == 0u) {
          p.out_.v[at] = p.alpha * x + ((p.has_bias & 1u) != 0u ? p.bias.v[n] : 0.0);
        } else {
          const float u = p.alpha * x + ((p.has_bias & 2u) != 0u ? p.bias2.v[n] : 0.0);
          p.out2.v[at] = u;
          p.h.v[at] = silu_times(p.out_.v[at], u);  // this invocation's own write in the first pass
        }
      } else if (p.partial != 0u) p.out_.v[gl_WorkGroupID.z * p.M * p.Nc + at] = x;
      else if (p.accumulate != 0u) p.out_.v[at] += p.alpha * x;
      else p.out_.v[at] = p.alpha * x + (p.has_bias != 0u ? p.bias.v[n] : 0.0);
    }
  }
}

#version 460
// out[N, OUT] = inp[N, IN] @ W^T (+ bias) for a GPTQ / AWQ weight (quantized_matmul.comp's codes,
// float16 scales and zeros per group, no g_idx) with the input rounded to int8 per block of BLOCK
// inputs (int8_activations.h: q = roundEven(x * (127 / amax)), scale amax / 127), on the device's
// int8 matrix units (VK_KHR_cooperative_matrix, int8 x int8 -> int32).
//
// A workgroup of four subgroups computes a TILE x TILE output tile, K a block at a time (a block
// lies in one group of the weight). Per block: an invocation per tile row finds the row's amax,
// rounds the row to int8 into shared memory and sums its values; the codes of the tile's columns
// go to shared memory as int8 (a 4-bit code as it is, an 8-bit one minus 128); each subgroup
// multiplies its quarter in int32, exactly; then every output adds
//   sx[m] * scale[n] * (dot[m, n] + (offset - zero[n]) * sum_q[m])
// (offset 0 or 128: sum over the block of q (code - zero), the dequantized weight times the
// rounded input) to its float32 accumulator, in block order: the same bits every run.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_int8 : require
#include "../common.glsl"
layout(constant_id = 0) const uint TILE = 32;
layout(constant_id = 1) const uint SUBGROUP = 32;
layout(constant_id = 2) const uint CM = 16;
layout(constant_id = 3) const uint CN = 16;
layout(constant_id = 4) const uint CK = 32;
layout(local_size_x_id = 5) in;  // 4 x SUBGROUP
layout(constant_id = 6) const uint BLOCK = 128;  // inputs per activation scale: 32, 64 or 128
layout(push_constant) uniform Push {
  F32 out_; F32 inp; I32 codes; U16 scales; U16 zeros; I32 g_idx; uint64_t bias;
  uint N, IN, OUT, bits, group_size, groups, has_g_idx, bdtype, mode;
} p;
const uint THREADS = 4u * SUBGROUP, QUARTER = TILE / 2u, TM = QUARTER / CM, TN = QUARTER / CN;
const uint A_STRIDE = BLOCK + 16u, B_STRIDE = TILE + 16u, C_STRIDE = TILE + 4u;
shared int8_t a_s[TILE * A_STRIDE];  // [m][k]: the rounded input
shared int8_t b_s[BLOCK * B_STRIDE];  // [k][n]: the codes, offset
shared int dot_s[TILE * C_STRIDE];
shared float acc_s[TILE * C_STRIDE];
shared float sx_s[TILE], sumq_s[TILE], scale_s[TILE], zero_s[TILE];
void main() {
  const uint tid = gl_LocalInvocationID.x, sg = tid / SUBGROUP;
  const uint sm = (sg / 2u) * QUARTER, sn = (sg % 2u) * QUARTER;
  const uint m0 = gl_WorkGroupID.y * TILE, n0 = gl_WorkGroupID.x * TILE;
  const uint per_word = 32u / p.bits, words = p.IN / per_word, mask = (1u << p.bits) - 1u;
  const float offset = p.bits == 8u ? 128.0 : 0.0;
  for (uint e = tid; e < TILE * TILE; e += THREADS) acc_s[(e / TILE) * C_STRIDE + e % TILE] = 0.0;
  for (uint k0 = 0u; k0 < p.IN; k0 += BLOCK) {
    for (uint r = tid; r < TILE; r += THREADS) {
      const uint m = m0 + r, at = m * p.IN + k0;
      float amax = 0.0;
      if (m < p.N)
        for (uint k = 0u; k < BLOCK; ++k) amax = max(amax, abs(p.inp.v[at + k]));
      const float inverse = amax == 0.0 ? 0.0 : 127.0 / amax;
      int sum = 0;
      for (uint k = 0u; k < BLOCK; ++k) {
        const int q = m < p.N ? int(roundEven(p.inp.v[at + k] * inverse)) : 0;
        a_s[r * A_STRIDE + k] = int8_t(q);
        sum += q;
      }
      sx_s[r] = amax / 127.0;
      sumq_s[r] = float(sum);
      const uint n = n0 + r, g = k0 / p.group_size;
      scale_s[r] = n < p.OUT ? f16_to_f32(p.scales.v[n * p.groups + g]) : 0.0;
      zero_s[r] = n < p.OUT ? f16_to_f32(p.zeros.v[n * p.groups + g]) : 0.0;
    }
    for (uint e = tid; e < BLOCK * TILE; e += THREADS) {  // neighbours read neighbouring codes of a row
      const uint c = e / BLOCK, k = e % BLOCK, n = n0 + c, kk = k0 + k;
      int code = 0;
      if (n < p.OUT) {
        const uint word = uint(p.codes.v[n * words + kk / per_word]);
        code = int((word >> (p.bits * (kk % per_word))) & mask) - int(offset);
      }
      b_s[k * B_STRIDE + c] = int8_t(code);
    }
    barrier();
    coopmat<int, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator> dot[TM][TN];
    for (uint i = 0u; i < TM; ++i)
      for (uint j = 0u; j < TN; ++j) dot[i][j] = coopmat<int, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator>(0);
    for (uint kk = 0u; kk < BLOCK; kk += CK) {
      coopmat<int8_t, gl_ScopeSubgroup, CM, CK, gl_MatrixUseA> am[TM];
      for (uint i = 0u; i < TM; ++i)
        coopMatLoad(am[i], a_s, (sm + i * CM) * A_STRIDE + kk, A_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
      for (uint j = 0u; j < TN; ++j) {
        coopmat<int8_t, gl_ScopeSubgroup, CK, CN, gl_MatrixUseB> bm;
        coopMatLoad(bm, b_s, kk * B_STRIDE + sn + j * CN, B_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
        for (uint i = 0u; i < TM; ++i) dot[i][j] = coopMatMulAdd(am[i], bm, dot[i][j]);
      }
    }
    for (uint i = 0u; i < TM; ++i)
      for (uint j = 0u; j < TN; ++j)
        coopMatStore(dot[i][j], dot_s, (sm + i * CM) * C_STRIDE + sn + j * CN, C_STRIDE,
                     gl_CooperativeMatrixLayoutRowMajor);
    barrier();
    for (uint e = tid; e < TILE * TILE; e += THREADS) {
      const uint r = e / TILE, c = e % TILE, at = r * C_STRIDE + c;
      acc_s[at] += sx_s[r] * scale_s[c] * (float(dot_s[at]) + (offset - zero_s[c]) * sumq_s[r]);
    }
    barrier();
  }
  for (uint e = tid; e < TILE * TILE; e += THREADS) {
    const uint m = m0 + e / TILE, n = n0 + e % TILE;
    if (m >= p.N || n >= p.OUT) continue;
    p.out_.v[m * p.OUT + n] = acc_s[(e / TILE) * C_STRIDE + e % TILE] + (p.bias != 0ul ? load_f32(p.bias, p.bdtype, n) : 0.0);
  }
}

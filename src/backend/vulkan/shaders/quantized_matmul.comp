#version 460
// Products with a weight-only quantized W [out, in] (backend.h: QuantizedWeight; GPTQ / AWQ
// codes packed in int32 words, float16 scales and zeros per group, an optional g_idx), each
// element dequantized as it is read into the shared-memory tile, never stored whole.
// mode 0: out[N, OUT] = inp[N, IN] @ W^T (+ bias, bdtype 0 f32, 1 bf16, 2 f16).
// mode 1: dinp[N, IN] += dout[N, OUT] @ W.
#include "common.glsl"
layout(local_size_x = 16, local_size_y = 16) in;
layout(push_constant) uniform Push {
  F32 out_; F32 inp; I32 codes; U16 scales; U16 zeros; I32 g_idx; uint64_t bias;
  uint N, IN, OUT, bits, group_size, groups, has_g_idx, bdtype, mode;
} p;
shared float a_tile[16][17];
shared float w_tile[16][17];
float w_at(uint n, uint k) {
  const uint per_word = 32u / p.bits, words = p.IN / per_word;
  const uint word = uint(p.codes.v[n * words + k / per_word]);
  const float code = float((word >> (p.bits * (k % per_word))) & ((1u << p.bits) - 1u));
  const uint g = p.has_g_idx != 0u ? uint(p.g_idx.v[k]) : k / p.group_size;
  return f16_to_f32(p.scales.v[n * p.groups + g]) * (code - f16_to_f32(p.zeros.v[n * p.groups + g]));
}
void main() {
  const uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y;
  const uint rows = p.N, cols = p.mode == 0u ? p.OUT : p.IN, depth = p.mode == 0u ? p.IN : p.OUT;
  const uint r = gl_WorkGroupID.y * 16u + ly, c = gl_WorkGroupID.x * 16u + lx;
  const uint c_row = gl_WorkGroupID.x * 16u + ly;  // the output column this thread loads W for
  float acc = 0.0;
  for (uint k0 = 0u; k0 < depth; k0 += 16u) {
    const uint k = k0 + lx;
    a_tile[ly][lx] = (r < rows && k < depth) ? p.inp.v[r * depth + k] : 0.0;
    // w_tile[col][k]: mode 0 W(col, k), mode 1 W(k, col).
    w_tile[ly][lx] = (c_row < cols && k < depth) ? (p.mode == 0u ? w_at(c_row, k) : w_at(k, c_row)) : 0.0;
    barrier();
    for (uint j = 0u; j < 16u; ++j) acc += a_tile[ly][j] * w_tile[lx][j];
    barrier();
  }
  if (r >= rows || c >= cols) return;
  if (p.mode == 1u) {
    p.out_.v[r * cols + c] += acc;
    return;
  }
  float b = 0.0;
  if (p.bias != 0UL) b = load_f32(p.bias, p.bdtype, c);
  p.out_.v[r * cols + c] = acc + b;
}

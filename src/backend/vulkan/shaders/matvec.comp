#version 460
// out = inp @ W^T (+ bias), or out += scale * inp @ W^T, for at most 32 input rows (decoding: a
// row per sequence), where gemm.comp's tiles would stay mostly idle: a workgroup per 4 output
// columns, 32 invocations per column walking its weight row together (neighbours read neighbouring
// words, 16 bytes each with VEC: 8 16-bit weights or 4 float32 ones), each keeping a partial sum
// per input row; the 32 partials of a (row, column) are then summed in a fixed order in shared
// memory. The weights are read once per step whatever the number of rows. WDTYPE: 0 f32, 1 bf16,
// 2 f16. Up to three products of one input in one dispatch (Backend::matmul_forward_group:
// decoding's q / k / v, gate / up): their workgroups one after another (ceil(OC0 / 4), then
// OC1's, then OC2's), each member with its own output, weight and bias (bit m of has_bias); the
// member is the workgroup's, so its addresses stay uniform (a per-invocation address made
// lavapipe gather every load, 12x slower).
// SWIGLU (Backend::matmul_forward_group_swiglu): the MLP's gate and up (members 0 and 1, OC0
// columns each), then out2 = silu(gate) * up as swiglu.comp computes it, in the same pass: each
// workgroup takes its columns of gate, then the same columns of up, so both products of an
// output meet in one invocation.
#include "common.glsl"
layout(constant_id = 0) const uint WDTYPE = 0;
layout(constant_id = 1) const uint VEC = 0;  // 1: 16-byte loads (C a multiple of 8, aligned tensors)
layout(constant_id = 2) const uint SWIGLU = 0;
layout(local_size_x = 128) in;
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U32x4 { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer F32x4 { vec4 v[]; };
layout(push_constant) uniform Push {
  F32 out0; F32 out1; F32 out2; F32 inp; uint64_t w0; uint64_t w1; uint64_t w2; F32 bias0; F32 bias1; F32 bias2;
  uint N, OC0, OC1, OC2, C, has_bias, accumulate;
  float scale;
} p;
const uint OUTS = 4u, LANES = 32u, MAX_ROWS = 32u, PER_LOAD = WDTYPE == 0u ? 4u : 8u;
shared float partial[OUTS][MAX_ROWS][LANES + 1u];
float widen(uint half_word) { return WDTYPE == 1u ? bf16_to_f32(uint16_t(half_word)) : f16_to_f32(uint16_t(half_word)); }
// Column oc (< OC) of inp @ w^T for every input row: invocation `lane` of the column's 32 returns
// input row lane's sum (0 past the rows or the columns). Every invocation calls it (a barrier).
float column(uint64_t w, uint OC, uint oc, uint o, uint lane) {
  float acc[MAX_ROWS];
  for (uint n = 0u; n < MAX_ROWS; ++n) acc[n] = 0.0;
  if (oc < OC) {
    const uint row = oc * p.C;
    if (VEC == 1u) {
      for (uint k = lane * PER_LOAD; k < p.C; k += LANES * PER_LOAD) {
        float wv[8];
        if (WDTYPE == 0u) {
          const vec4 x = F32x4(w).v[(row + k) / 4u];
          wv[0] = x.x, wv[1] = x.y, wv[2] = x.z, wv[3] = x.w;
        } else {
          const uvec4 x = U32x4(w).v[(row + k) / 8u];
          for (uint i = 0u; i < 4u; ++i) {
            wv[2u * i] = widen(x[i] & 0xffffu);
            wv[2u * i + 1u] = widen(x[i] >> 16);
          }
        }
        for (uint n = 0u; n < MAX_ROWS; ++n) {
          if (n >= p.N) break;
          for (uint c = 0u; c < PER_LOAD; c += 4u) {
            const vec4 x = F32x4(p.inp).v[(n * p.C + k + c) / 4u];
            acc[n] += wv[c] * x.x + wv[c + 1u] * x.y + wv[c + 2u] * x.z + wv[c + 3u] * x.w;
          }
        }
      }
    } else {
      for (uint k = lane; k < p.C; k += LANES) {
        const float wk = load_f32(w, WDTYPE, row + k);
        for (uint n = 0u; n < MAX_ROWS; ++n) {
          if (n >= p.N) break;
          acc[n] += wk * p.inp.v[n * p.C + k];
        }
      }
    }
  }
  for (uint n = 0u; n < MAX_ROWS; ++n) partial[o][n][lane] = acc[n];
  barrier();
  float sum = 0.0;  // invocation `lane` finishes input row n = lane of this column
  if (oc < OC && lane < p.N)
    for (uint l = 0u; l < LANES; ++l) sum += partial[o][lane][l];
  return sum;
}

void main() {
  const uint o = gl_LocalInvocationID.x / LANES, lane = gl_LocalInvocationID.x % LANES;
  const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;  // over every member
  if (SWIGLU == 1u) {
    const uint oc = wg * OUTS + o;
    float g = column(p.w0, p.OC0, oc, o, lane);
    barrier();  // gate's partials are read before up's are written
    float u = column(p.w1, p.OC0, oc, o, lane);
    if (oc >= p.OC0 || lane >= p.N) return;
    const uint at = lane * p.OC0 + oc;
    if ((p.has_bias & 1u) != 0u) g += p.bias0.v[oc];
    if ((p.has_bias & 2u) != 0u) u += p.bias1.v[oc];
    p.out0.v[at] = g;
    p.out1.v[at] = u;
    p.out2.v[at] = silu_times(g, u);
    return;
  }
  const uint g0 = (p.OC0 + OUTS - 1u) / OUTS, g1 = (p.OC1 + OUTS - 1u) / OUTS;
  const uint m = wg < g0 ? 0u : (wg < g0 + g1 ? 1u : 2u);
  const uint OC = m == 0u ? p.OC0 : (m == 1u ? p.OC1 : p.OC2);
  const uint oc = (wg - (m == 0u ? 0u : (m == 1u ? g0 : g0 + g1))) * OUTS + o;  // the member's column
  const float sum = column(m == 0u ? p.w0 : (m == 1u ? p.w1 : p.w2), OC, oc, o, lane);
  if (oc >= OC || lane >= p.N) return;
  const uint at = lane * OC + oc;
  F32 out_ = m == 0u ? p.out0 : (m == 1u ? p.out1 : p.out2);
  if (p.accumulate != 0u) {
    out_.v[at] += p.scale * sum;
  } else {
    F32 bias = m == 0u ? p.bias0 : (m == 1u ? p.bias1 : p.bias2);
    out_.v[at] = sum + ((p.has_bias >> m & 1u) != 0u ? bias.v[oc] : 0.0);
  }
}

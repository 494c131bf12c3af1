#version 460
// Every float product of the backend: out[M, Nc] = alpha * A[M, K] @ B[K, Nc] (+ bias[Nc]), or
// out += alpha * A @ B (accumulate), A float32 and B float32 or 16-bit (BDTYPE 0 f32, 1 bf16,
// 2 f16), both given by strides so one shader serves every transpose:
// A(m, k) = a[m * a_m + k * a_k], B(k, n) = b[k * b_k + n * b_n]. A linear layer's forward is
// inp @ W^T (B(k, n) = W[n, k]); its backward dinp += dout @ W and dweight += dout^T @ inp.
//
// Register tiling: a workgroup of 16 x 16 invocations computes a TILE x TILE output tile (128,
// 64, or 32: the largest that still fills the device, src/backend/vulkan/geometry.cpp), each
// invocation OUT x OUT outputs (rows ly + 16i, columns lx + 16j: neighbouring invocations store
// neighbouring columns). K advances STEP at a time through double-buffered shared memory: the
// next step's operands load while this step's are multiplied, one barrier per step.
//
// Loads run along whichever operand dimension is contiguous in memory. Where the strides, the
// sizes and the address allow (the host's `vectors` bits: a vector never crosses the operand's
// end), they are 128-bit: four float32 values, or eight bfloat16 values along K; bfloat16
// contiguous along N takes two 64-bit loads, rows k and k + 1. Zero beyond the operand.
// bfloat16 B stays 16-bit in shared memory: one 32-bit word holds the values of k and k + 1 for a
// column (low and high half), widened by a shift where it is multiplied. float16 is widened as
// it is loaded (its exact conversion is too long for the inner loop), so its tile is float32.
// Shared memory: 16.5 KiB for A and 8.3 (bfloat16) or 16.5 KiB for B at 128 x 128 (K steps of 8
// where B is 32-bit), 16.6 KiB in all at 64 x 64.
//
// Each output is written by one invocation, in a fixed order over K: no atomics, the same bits
// every run.
//
// SWIGLU (Backend::matmul_forward_group_swiglu over many rows of float32 operands, the training
// forward's gate and up): b is gate's weight and b2 up's, of one shape and dtype; the workgroup
// computes its tile of gate and writes it (out_, plus bias where has_bias bit 0), then the same
// tile of up (out2, plus bias2 where bit 1) and h = silu(gate) * up, each invocation reading
// back the gate values it wrote itself. No split, no accumulation, alpha 1.
//
// Split-K (a product whose output tiles alone would leave the device idle against a
// long K): workgroup z multiplies K range [z k_split, (z + 1) k_split) into its own slice of
// out_ (a scratch of splits x M x Nc, written whole), and gemm_reduce.comp adds the slices in
// order.
#include "common.glsl"
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4 { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4 { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U2 { uvec2 v[]; };
layout(constant_id = 0) const uint TILE = 64;
layout(constant_id = 1) const uint BDTYPE = 0;
layout(constant_id = 2) const uint SWIGLU = 0;
layout(local_size_x = 16, local_size_y = 16) in;
layout(push_constant) uniform Push {
  F32 out_; uint64_t a; uint64_t b; F32 bias;
  uint M, Nc, K, a_m, a_k, b_k, b_n, has_bias, accumulate, k_split, partial;
  uint vectors;  // bit 0: A's 128-bit loads, bit 1: B's (the strides and addresses allow them)
  float alpha, a_scale;  // a_scale: gemm_coopmat.comp's (the two share this block); 1 here
  F32 out2; uint64_t b2; F32 bias2; F32 h;  // SWIGLU: up's output, weight and bias; the activation
} p;
uint64_t b_operand;  // B: p.b, or in SWIGLU's second pass p.b2
const bool B16 = BDTYPE == 1u;
const uint STEP = (TILE == 128u && BDTYPE != 1u) ? 8u : 16u;
const uint OUT = TILE / 16u;
shared float a_tile[2][STEP][TILE + 1u];                 // [buffer][k][m]
shared float b_tile[2][B16 ? 1u : STEP][TILE + 1u];      // [buffer][k][n], float32
shared uint b_pair[2][B16 ? STEP / 2u : 1u][TILE + 1u];  // [buffer][k / 2][n], bfloat16 pairs

// A float32 operand's tile: `line` runs over the output dimension (m of A, n of B), k over K.
float f32_at(uint64_t base, uint line, uint k, uint line_stride, uint k_stride, uint lines, uint k_end) {
  return (line < lines && k < k_end) ? F32(base).v[line * line_stride + k * k_stride] : 0.0;
}
void put_f32(uint operand, uint buf, uint k, uint line, float x) {
  if (operand == 0u) a_tile[buf][k][line] = x;
  else b_tile[buf][k][line] = x;
}
void load_f32_tile(uint operand, uint64_t base, uint line_stride, uint k_stride, uint lines, bool vectors, uint buf,
              uint k0, uint k_end, uint id, uint l0) {
  if (!vectors) {
    for (uint e = id; e < STEP * TILE; e += 256u) {
      const uint l = k_stride == 1u ? e / STEP : e % TILE, k = k_stride == 1u ? e % STEP : e / TILE;
      put_f32(operand, buf, k, l, f32_at(base, l0 + l, k0 + k, line_stride, k_stride, lines, k_end));
    }
    return;
  }
  const bool along_k = k_stride == 1u;  // else along the lines
  const uint per = along_k ? STEP / 4u : TILE / 4u;
  for (uint e = id; e < STEP * TILE / 4u; e += 256u) {
    const uint outer = e / per, q = 4u * (e % per);
    const uint l = along_k ? outer : q, k = along_k ? q : outer;
    const uint gl = l0 + l, gk = k0 + k;
    const vec4 v = gl < lines && gk < k_end ? V4(base).v[(gl * line_stride + gk * k_stride) / 4u] : vec4(0.0);
    for (uint c = 0u; c < 4u; ++c) put_f32(operand, buf, along_k ? k + c : k, along_k ? l : l + c, v[c]);
  }
}

// bfloat16 B as pairs: the word of (k, k + 1) for column n.
uint bf16_at(uint k, uint n, uint k_end) {
  return (n < p.Nc && k < k_end) ? uint(U16(b_operand).v[k * p.b_k + n * p.b_n]) : 0u;
}
void load_b_pairs(uint buf, uint k0, uint k_end, uint id, uint n0) {
  const bool vectors = (p.vectors & 2u) != 0u;
  if (vectors && p.b_k == 1u) {  // eight k of one column per 128-bit load: four pairs
    for (uint e = id; e < STEP * TILE / 8u; e += 256u) {
      const uint n = e / (STEP / 8u), kq = 8u * (e % (STEP / 8u)), gn = n0 + n, gk = k0 + kq;
      const uvec4 w = gn < p.Nc && gk < k_end ? U4(b_operand).v[(gn * p.b_n + gk) / 8u] : uvec4(0u);
      for (uint c = 0u; c < 4u; ++c) b_pair[buf][kq / 2u + c][n] = w[c];
    }
  } else if (vectors && p.b_n == 1u) {  // four columns of rows k and k + 1 per two 64-bit loads
    for (uint e = id; e < STEP * TILE / 8u; e += 256u) {
      const uint kk = e / (TILE / 4u), nq = 4u * (e % (TILE / 4u)), gk = k0 + 2u * kk, gn = n0 + nq;
      uvec2 rows[2];
      for (uint r = 0u; r < 2u; ++r)
        rows[r] = gn < p.Nc && gk + r < k_end ? U2(b_operand).v[((gk + r) * p.b_k + gn) / 4u] : uvec2(0u);
      for (uint c = 0u; c < 4u; ++c) {
        const uint shift = 16u * (c & 1u);
        b_pair[buf][kk][nq + c] = ((rows[0][c / 2u] >> shift) & 0xffffu) | (((rows[1][c / 2u] >> shift) & 0xffffu) << 16);
      }
    }
  } else {
    for (uint e = id; e < STEP * TILE / 2u; e += 256u) {
      const uint n = p.b_n == 1u ? e % TILE : e / (STEP / 2u), kk = p.b_n == 1u ? e / TILE : e % (STEP / 2u);
      const uint gk = k0 + 2u * kk, gn = n0 + n;
      b_pair[buf][kk][n] = bf16_at(gk, gn, k_end) | (bf16_at(gk + 1u, gn, k_end) << 16);
    }
  }
}

void load(uint buf, uint k0, uint k_end, uint id, uint m0, uint n0) {
  load_f32_tile(0u, p.a, p.a_m, p.a_k, p.M, (p.vectors & 1u) != 0u, buf, k0, k_end, id, m0);
  if (B16) {
    load_b_pairs(buf, k0, k_end, id, n0);
  } else if (BDTYPE == 0u) {
    load_f32_tile(1u, b_operand, p.b_n, p.b_k, p.Nc, (p.vectors & 2u) != 0u, buf, k0, k_end, id, n0);
  } else {  // float16, widened as loaded
    for (uint e = id; e < STEP * TILE; e += 256u) {
      const uint n = p.b_n == 1u ? e % TILE : e / STEP, k = p.b_n == 1u ? e / TILE : e % STEP;
      const uint gn = n0 + n, gk = k0 + k;
      b_tile[buf][k][n] = (gn < p.Nc && gk < k_end) ? f16_to_f32(U16(b_operand).v[gk * p.b_k + gn * p.b_n]) : 0.0;
    }
  }
}

void main() {
  const uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y, id = ly * 16u + lx;
  const uint m0 = gl_WorkGroupID.y * TILE, n0 = gl_WorkGroupID.x * TILE;
  const uint passes = SWIGLU == 1u ? 2u : 1u;
  for (uint pass = 0u; pass < passes; ++pass) {
    b_operand = pass == 0u ? p.b : p.b2;
    if (pass > 0u) barrier();  // every invocation is done with the first pass's tiles
    float acc[OUT][OUT];
    for (uint i = 0u; i < OUT; ++i)
      for (uint j = 0u; j < OUT; ++j) acc[i][j] = 0.0;
    const uint k_begin = gl_WorkGroupID.z * p.k_split, k_end = min(k_begin + p.k_split, p.K);
    load(0u, k_begin, k_end, id, m0, n0);
    barrier();
    uint buf = 0u;
    for (uint k0 = k_begin; k0 < k_end; k0 += STEP) {
      if (k0 + STEP < k_end) load(buf ^ 1u, k0 + STEP, k_end, id, m0, n0);
      if (B16) {
        for (uint kk = 0u; kk < STEP / 2u; ++kk) {
          float a0[OUT], a1[OUT];
          uint bw[OUT];
          for (uint i = 0u; i < OUT; ++i) {
            a0[i] = a_tile[buf][2u * kk][ly + 16u * i];
            a1[i] = a_tile[buf][2u * kk + 1u][ly + 16u * i];
          }
          for (uint j = 0u; j < OUT; ++j) bw[j] = b_pair[buf][kk][lx + 16u * j];
          for (uint j = 0u; j < OUT; ++j) {
            const float b0 = uintBitsToFloat(bw[j] << 16), b1 = uintBitsToFloat(bw[j] & 0xffff0000u);
            for (uint i = 0u; i < OUT; ++i) {
              acc[i][j] += a0[i] * b0;
              acc[i][j] += a1[i] * b1;
            }
          }
        }
      } else {
        for (uint k = 0u; k < STEP; ++k) {
          float av[OUT], bv[OUT];
          for (uint i = 0u; i < OUT; ++i) av[i] = a_tile[buf][k][ly + 16u * i];
          for (uint j = 0u; j < OUT; ++j) bv[j] = b_tile[buf][k][lx + 16u * j];
          for (uint i = 0u; i < OUT; ++i)
            for (uint j = 0u; j < OUT; ++j) acc[i][j] += av[i] * bv[j];
        }
      }
      barrier();
      buf ^= 1u;
    }
    for (uint i = 0u; i < OUT; ++i) {
      const uint m = m0 + ly + 16u * i;
      if (m >= p.M) break;
      for (uint j = 0u; j < OUT; ++j) {
        const uint n = n0 + lx + 16u * j;
        if (n >= p.Nc) break;
        const uint at = m * p.Nc + n;
        if (SWIGLU == 1u) {
          if (pass == 0u) {
            p.out_.v[at] = p.alpha * acc[i][j] + ((p.has_bias & 1u) != 0u ? p.bias.v[n] : 0.0);
          } else {
            const float u = p.alpha * acc[i][j] + ((p.has_bias & 2u) != 0u ? p.bias2.v[n] : 0.0);
            p.out2.v[at] = u;
            p.h.v[at] = silu_times(p.out_.v[at], u);  // this invocation's own write in the first pass
          }
        } else if (p.partial != 0u) p.out_.v[gl_WorkGroupID.z * p.M * p.Nc + at] = acc[i][j];
        else if (p.accumulate != 0u) p.out_.v[at] += p.alpha * acc[i][j];
        else p.out_.v[at] = p.alpha * acc[i][j] + (p.has_bias != 0u ? p.bias.v[n] : 0.0);
      }
    }
  }
}

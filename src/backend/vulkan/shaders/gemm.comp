#version 460
// Every float product of the backend: out[M, Nc] = alpha * A[M, K] @ B[K, Nc] (+ bias[Nc]), or
// out += alpha * A @ B (accumulate), A float32 and B float32 or 16-bit (BDTYPE 0 f32, 1 bf16,
// 2 f16, widened as read), both given by strides so one shader serves every transpose:
// A(m, k) = a[m * a_m + k * a_k], B(k, n) = b[k * b_k + n * b_n]. A linear layer's forward is
// inp @ W^T (B(k, n) = W[n, k]); its backward dinp += dout @ W and dweight += dout^T @ inp.
//
// Register tiling: a workgroup of 16 x 16 invocations computes a TILE x TILE output tile (64, or
// 32 where 64 would leave the device idle: src/backend/vulkan/geometry.cpp), each invocation
// OUT x OUT outputs (rows ly + 16i, columns lx + 16j: neighbouring invocations store neighbouring
// columns). K advances STEP at a time through double-buffered shared memory: the next step's
// operands load while this step's are multiplied, one barrier per step. Loads run along whichever
// operand dimension is contiguous in memory, so neighbouring invocations read neighbouring words.
// Each output is written by one invocation, in a fixed order over K: no atomics, the same bits
// every run. Split-K (a product whose output tiles alone would leave the device idle against a
// long K): workgroup z multiplies K range [z k_split, (z + 1) k_split) into its own slice of
// out_ (a scratch of splits x M x Nc, written whole), and gemm_reduce.comp adds the slices in
// order.
#include "common.glsl"
layout(constant_id = 0) const uint TILE = 64;
layout(constant_id = 1) const uint BDTYPE = 0;
layout(local_size_x = 16, local_size_y = 16) in;
layout(push_constant) uniform Push {
  F32 out_; F32 a; uint64_t b; F32 bias;
  uint M, Nc, K, a_m, a_k, b_k, b_n, has_bias, accumulate, k_split, partial;
  float alpha;
} p;
const uint STEP = 16u, OUT = TILE / 16u, LOADS = TILE * STEP / 256u;
shared float a_tile[2][STEP][TILE + 1u];  // [buffer][k][m]
shared float b_tile[2][STEP][TILE + 1u];  // [buffer][k][n]
void load(uint buf, uint k0, uint k_end, uint id, uint m0, uint n0) {
  for (uint r = 0u; r < LOADS; ++r) {
    const uint e = id + 256u * r;
    const uint am = p.a_k == 1u ? e / STEP : e % TILE, ak = p.a_k == 1u ? e % STEP : e / TILE;
    const uint m = m0 + am, ka = k0 + ak;
    a_tile[buf][ak][am] = (m < p.M && ka < k_end) ? p.a.v[m * p.a_m + ka * p.a_k] : 0.0;
    const uint bn = p.b_n == 1u ? e % TILE : e / STEP, bk = p.b_n == 1u ? e / TILE : e % STEP;
    const uint n = n0 + bn, kb = k0 + bk;
    b_tile[buf][bk][bn] = (n < p.Nc && kb < k_end) ? load_f32(p.b, BDTYPE, kb * p.b_k + n * p.b_n) : 0.0;
  }
}
void main() {
  const uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y, id = ly * 16u + lx;
  const uint m0 = gl_WorkGroupID.y * TILE, n0 = gl_WorkGroupID.x * TILE;
  float acc[OUT][OUT];
  for (uint i = 0u; i < OUT; ++i)
    for (uint j = 0u; j < OUT; ++j) acc[i][j] = 0.0;
  const uint k_begin = gl_WorkGroupID.z * p.k_split, k_end = min(k_begin + p.k_split, p.K);
  load(0u, k_begin, k_end, id, m0, n0);
  barrier();
  uint buf = 0u;
  for (uint k0 = k_begin; k0 < k_end; k0 += STEP) {
    if (k0 + STEP < k_end) load(buf ^ 1u, k0 + STEP, k_end, id, m0, n0);
    for (uint k = 0u; k < STEP; ++k) {
      float av[OUT], bv[OUT];
      for (uint i = 0u; i < OUT; ++i) av[i] = a_tile[buf][k][ly + 16u * i];
      for (uint j = 0u; j < OUT; ++j) bv[j] = b_tile[buf][k][lx + 16u * j];
      for (uint i = 0u; i < OUT; ++i)
        for (uint j = 0u; j < OUT; ++j) acc[i][j] += av[i] * bv[j];
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
      if (p.partial != 0u) p.out_.v[gl_WorkGroupID.z * p.M * p.Nc + at] = acc[i][j];
      else if (p.accumulate != 0u) p.out_.v[at] += p.alpha * acc[i][j];
      else p.out_.v[at] = p.alpha * acc[i][j] + (p.has_bias != 0u ? p.bias.v[n] : 0.0);
    }
  }
}

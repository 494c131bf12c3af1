#version 460
// Every float product of the backend: out[M, Nc] = alpha * A[M, K] @ B[K, Nc] (+ bias[Nc]), or
// out += alpha * A @ B (accumulate), A float32 and B float32 or 16-bit (b_dtype 0 f32, 1 bf16,
// 2 f16, widened as read), both given by strides so one shader serves every transpose:
// A(m, k) = a[m * a_m + k * a_k], B(k, n) = b[k * b_k + n * b_n]. A linear layer's forward is
// inp @ W^T (B(k, n) = W[n, k]); its backward dinp += dout @ W and dweight += dout^T @ inp.
//
// Register tiling: a workgroup of 16 x 16 invocations computes a 64 x 64 output tile, each
// invocation 4 x 4 outputs (rows ly + 16i, columns lx + 16j: neighbouring invocations store
// neighbouring columns). K advances 16 at a time through shared memory, loaded along whichever
// operand dimension is contiguous in memory so that neighbouring invocations read neighbouring
// words. Per barrier, 16x the arithmetic of a 16 x 16 tile with one output per invocation. Each
// output is written by one invocation, in a fixed order over K: no atomics, the same bits every run.
#include "common.glsl"
layout(local_size_x = 16, local_size_y = 16) in;
layout(push_constant) uniform Push {
  F32 out_; F32 a; uint64_t b; F32 bias;
  uint M, Nc, K, a_m, a_k, b_k, b_n, b_dtype, has_bias, accumulate;
  float alpha;
} p;
const uint TILE = 64u, STEP = 16u;
shared float a_tile[STEP][TILE + 1u];  // [k][m]
shared float b_tile[STEP][TILE + 1u];  // [k][n]
float b_at(uint i) { return load_f32(p.b, p.b_dtype, i); }
void main() {
  const uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y, id = ly * 16u + lx;
  const uint m0 = gl_WorkGroupID.y * TILE, n0 = gl_WorkGroupID.x * TILE;
  float acc[4][4];
  for (uint i = 0u; i < 4u; ++i)
    for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0;
  for (uint k0 = 0u; k0 < p.K; k0 += STEP) {
    for (uint r = 0u; r < 4u; ++r) {  // 1024 elements of each operand, 4 per invocation
      const uint e = id + 256u * r;
      const uint am = p.a_k == 1u ? e / STEP : e % TILE, ak = p.a_k == 1u ? e % STEP : e / TILE;
      const uint m = m0 + am, ka = k0 + ak;
      a_tile[ak][am] = (m < p.M && ka < p.K) ? p.a.v[m * p.a_m + ka * p.a_k] : 0.0;
      const uint bn = p.b_n == 1u ? e % TILE : e / STEP, bk = p.b_n == 1u ? e / TILE : e % STEP;
      const uint n = n0 + bn, kb = k0 + bk;
      b_tile[bk][bn] = (n < p.Nc && kb < p.K) ? b_at(kb * p.b_k + n * p.b_n) : 0.0;
    }
    barrier();
    for (uint k = 0u; k < STEP; ++k) {
      float av[4], bv[4];
      for (uint i = 0u; i < 4u; ++i) av[i] = a_tile[k][ly + 16u * i];
      for (uint j = 0u; j < 4u; ++j) bv[j] = b_tile[k][lx + 16u * j];
      for (uint i = 0u; i < 4u; ++i)
        for (uint j = 0u; j < 4u; ++j) acc[i][j] += av[i] * bv[j];
    }
    barrier();
  }
  for (uint i = 0u; i < 4u; ++i) {
    const uint m = m0 + ly + 16u * i;
    if (m >= p.M) break;
    for (uint j = 0u; j < 4u; ++j) {
      const uint n = n0 + lx + 16u * j;
      if (n >= p.Nc) break;
      const uint at = m * p.Nc + n;
      if (p.accumulate != 0u) p.out_.v[at] += p.alpha * acc[i][j];
      else p.out_.v[at] = p.alpha * acc[i][j] + (p.has_bias != 0u ? p.bias.v[n] : 0.0);
    }
  }
}

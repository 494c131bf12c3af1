#version 460
// out[M, Nc] += alpha * A[M, K] @ B[K, Nc] over float32 operands given by strides, so one shader
// serves every transpose: A(m, k) = a[m * a_m + k * a_k], B(k, n) = b[k * b_k + n * b_n]. The
// backward products of a linear layer: dinp += scale dout @ W (A = dout, B = W), dweight +=
// scale dout^T @ inp (A = dout^T, B = inp). A 16 x 16 tile per workgroup through shared memory;
// each output element is written by one thread (no atomics).
#include "common.glsl"
layout(local_size_x = 16, local_size_y = 16) in;
layout(push_constant) uniform Push {
  F32 out_; F32 a; uint64_t b;
  uint M, Nc, K, a_m, a_k, b_k, b_n, b_dtype;
  float alpha;
} p;
float b_at(uint i) {
  if (p.b_dtype == 0u) return F32(p.b).v[i];
  if (p.b_dtype == 1u) return bf16_to_f32(U16(p.b).v[i]);
  return f16_to_f32(U16(p.b).v[i]);
}
shared float a_tile[16][17];
shared float b_tile[16][17];
void main() {
  const uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y;
  const uint m = gl_WorkGroupID.y * 16u + ly, n = gl_WorkGroupID.x * 16u + lx;
  float acc = 0.0;
  for (uint k0 = 0u; k0 < p.K; k0 += 16u) {
    const uint ka = k0 + lx, kb = k0 + ly;
    a_tile[ly][lx] = (m < p.M && ka < p.K) ? p.a.v[m * p.a_m + ka * p.a_k] : 0.0;
    b_tile[ly][lx] = (n < p.Nc && kb < p.K) ? b_at(kb * p.b_k + n * p.b_n) : 0.0;
    barrier();
    for (uint j = 0u; j < 16u; ++j) acc += a_tile[ly][j] * b_tile[j][lx];
    barrier();
  }
  if (m < p.M && n < p.Nc) p.out_.v[m * p.Nc + n] += p.alpha * acc;
}

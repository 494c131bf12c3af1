#version 460
// attention_backward_dkv.comp (FlashAttention-2's dK/dV pass) with its products on the matrix
// units (attention_coopmat.glsl): a workgroup per (tile of B key tokens, kv head g), four
// subgroups, keeps its keys and values as float16 in shared memory and streams, for every query
// head of the group, the tiles of queries that see them (from the tile's first key to the end of
// its last key's sequence): their q and dout as float16, lse and D = dout . out. Per tile:
// S^T = K Q^T into shared memory, elementwise p = exp(s scale - lse) where the key counts for the
// query (kept in registers, and rounded to float16 for dV += P^T dO); then dP^T = V dO^T into the
// same float32 array, and ds = p (dp - D) scale rounded to float16 for dK += dS^T Q. One float32
// array instead of two: at head_dim 128, tiles of 32 keys fit the 48 KiB NVIDIA's driver reports
// (and 32 at head_dim 64 fit lavapipe's 32 KiB). The accumulators are held across all tiles and
// written once at the end (staged through the scores' array, free by then).
#include "attention_coopmat.glsl"
layout(push_constant) uniform Push {
  F32 dk; F32 dv; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale;
  F32 partials; uint head_splits;  // as attention_backward_dkv.comp's: a share of the group's heads
} p;
shared float16_t k_s[B * H_STRIDE];
shared float16_t v_s[B * H_STRIDE];
shared float16_t q_s[B * H_STRIDE];
shared float16_t do_s[B * H_STRIDE];
shared float st_s[B * S_STRIDE];   // [key][query]: S^T, then dP^T
shared float16_t pt_s[B * T_STRIDE];
shared float16_t dst_s[B * T_STRIDE];
shared float lse_s[B], d_s[B];
shared uint end_s[B];
const uint PER_THREAD = (B * B + THREADS - 1u) / THREADS;
uint key_row(uint r) {
  const uint j = gl_WorkGroupID.x * B + r;
  return j < p.N ? (j * p.Hkv + gl_WorkGroupID.y / p.head_splits) * HD : ~0u;
}
void main() {
  const uint tid = gl_LocalInvocationID.x, sm = quarter_rows(), sn = quarter_cols(), hn = quarter_dims();
  const uint g = gl_WorkGroupID.y / p.head_splits, share = gl_WorkGroupID.y % p.head_splits, group = p.Hq / p.Hkv;
  const uint j0 = gl_WorkGroupID.x * B, per = (group + p.head_splits - 1u) / p.head_splits;
  const uint h_begin = g * group + min(share * per, group), h_end = g * group + min((share + 1u) * per, group);
  const uint last = min(j0 + B, p.N) - 1u, stop = uint(p.cu.v[sequence_of(p.cu, p.S, last) + 1u]);
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint c = e / HD, d = e % HD, j = j0 + c, at = (j * p.Hkv + g) * HD + d;
    k_s[c * H_STRIDE + d] = half_of(j < p.N ? p.k.v[at] : 0.0);
    v_s[c * H_STRIDE + d] = half_of(j < p.N ? p.v.v[at] : 0.0);
  }
  for (uint c = tid; c < B; c += THREADS) end_s[c] = j0 + c < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, j0 + c) + 1u]) : 0u;
  ACC acc[QM][QN];
  ACC dk[QM][HN], dv[QM][HN];
  float w[PER_THREAD];  // this invocation's p of the tile, elements tid, tid + THREADS, ...
  for (uint i = 0u; i < QM; ++i)
    for (uint j = 0u; j < HN; ++j) {
      dk[i][j] = ACC(0.0);
      dv[i][j] = ACC(0.0);
    }
  for (uint h = h_begin; h < h_end; ++h) {
    for (uint t0 = j0; t0 < stop; t0 += B) {
      for (uint e = tid; e < B * HD; e += THREADS) {
        const uint r = e / HD, d = e % HD, t = t0 + r, at = (t * p.Hq + h) * HD + d;
        q_s[r * H_STRIDE + d] = half_of(t < stop ? p.q.v[at] : 0.0);
        do_s[r * H_STRIDE + d] = half_of(t < stop ? p.dout.v[at] : 0.0);
      }
      for (uint r = tid; r < B; r += THREADS) {
        const uint t = t0 + r;
        float D = 0.0;
        if (t < stop)
          for (uint d = 0u; d < HD; ++d) D += p.dout.v[(t * p.Hq + h) * HD + d] * p.out_.v[(t * p.Hq + h) * HD + d];
        d_s[r] = D;
        lse_s[r] = t < stop ? p.lse.v[t * p.Hq + h] : 0.0;
      }
      barrier();
      PRODUCT_XYT(acc, k_s, q_s, sm, sn)
      STORE_SCORES(acc, st_s, sm, sn)
      barrier();
      for (uint i = 0u; i < PER_THREAD; ++i) {
        const uint e = tid + i * THREADS, c = e / B, r = e % B, j = j0 + c, t = t0 + r;
        if (e >= B * B) break;
        w[i] = (t >= j && t < end_s[c]) ? exp(st_s[c * S_STRIDE + r] * p.scale - lse_s[r]) : 0.0;
        pt_s[c * T_STRIDE + r] = half_of(w[i]);
      }
      barrier();
      PRODUCT_XYT(acc, v_s, do_s, sm, sn)
      STORE_SCORES(acc, st_s, sm, sn)
      PRODUCT_PY(dv, pt_s, do_s, sm, hn)
      barrier();
      for (uint i = 0u; i < PER_THREAD; ++i) {
        const uint e = tid + i * THREADS, c = e / B, r = e % B;
        if (e >= B * B) break;
        dst_s[c * T_STRIDE + r] = half_of(w[i] * (st_s[c * S_STRIDE + r] - d_s[r]) * p.scale);
      }
      barrier();
      PRODUCT_PY(dk, dst_s, q_s, sm, hn)
      barrier();
    }
  }
  const uint64_t size = uint64_t(p.N) * p.Hkv * HD * 4u;  // bytes of one [N, kv_dim] partial
  F32 to_dk = p.head_splits == 1u ? p.dk : F32(uint64_t(p.partials) + share * size);
  F32 to_dv = p.head_splits == 1u ? p.dv : F32(uint64_t(p.partials) + (p.head_splits + share) * size);
  WRITE_OUT(dk, st_s, sm, hn, to_dk, key_row)
  WRITE_OUT(dv, st_s, sm, hn, to_dv, key_row)
}

#version 460
// attention_backward_dkv_coopmat.comp (FlashAttention-2's dK/dV pass) on
// VK_NV_cooperative_matrix2's subgroup matrices (attention_coopmat2.glsl): the transposed scores,
// their gradient, dK and dV never leave registers.
//
// A workgroup per (tile of B key tokens, kv head g, share of the group's query heads); each
// subgroup holds its rows of k and v as A operands in registers (staged once as float16 through
// the queries' array). For every query head of the share, the tiles of B queries that see the
// keys (from the tile's first key to the end of its last key's sequence) stream through shared
// memory: q and dout as float16, lse and D = dout . out. Per tile:
//   S^T = K Q^T (R x B: rows keys, columns queries); p = exp(s scale - lse) where the key counts
//   for the query, else 0, element by element from each element's row and column;
//   dV += P^T dO with p rounded to float16;
//   dP^T = V dO^T; ds = p (dp - D) scale rounded to float16; dK += dS^T Q.
// dk and dv are written once at the end, to the share's partials where the heads are split (as
// attention_backward_dkv.comp's). The rounding points are the KHR shader's.
#include "attention_coopmat2.glsl"
layout(push_constant) uniform Push {
  F32 dk; F32 dv; F32 dout; F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale;
  F32 partials; uint head_splits;  // as attention_backward_dkv.comp's: a share of the group's heads
} p;
shared float16_t q_s[B * H_STRIDE];   // k, then v, once; then each query tile
shared float16_t do_s[B * H_STRIDE];  // each query tile's dout
shared float lse_s[B], d_s[B];
shared uint end_s[B];  // each key row's sequence end (0 past the tensor's end: nothing counts)

// p where key row0 + r counts for query t0 + c (the key's sequence, from the key on), else 0.
float probability_t(const in uint r, const in uint c, const in float s, const in uint row0, const in uint j0,
                    const in uint t0, const in float scale) {
  const uint i = row0 + r, t = t0 + c;
  return (t >= j0 + i && t < end_s[i]) ? exp(s * scale - lse_s[c]) : 0.0;
}
float score_gradient_t(const in uint r, const in uint c, const in float w, const in float dp, const in float scale) {
  return float(half_of(w * (dp - d_s[c]) * scale));
}

void main() {
  const uint tid = gl_LocalInvocationID.x, row0 = subgroup_row0();
  const uint g = gl_WorkGroupID.y / p.head_splits, share = gl_WorkGroupID.y % p.head_splits, group = p.Hq / p.Hkv;
  const uint j0 = gl_WorkGroupID.x * B, per = (group + p.head_splits - 1u) / p.head_splits;
  const uint h_begin = g * group + min(share * per, group), h_end = g * group + min((share + 1u) * per, group);
  const uint last = min(j0 + B, p.N) - 1u, stop = uint(p.cu.v[sequence_of(p.cu, p.S, last) + 1u]);
  for (uint c = tid; c < B; c += THREADS) end_s[c] = j0 + c < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, j0 + c) + 1u]) : 0u;
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint c = e / HD, d = e % HD, j = j0 + c;
    q_s[c * H_STRIDE + d] = half_of(j < p.N ? p.k.v[(j * p.Hkv + g) * HD + d] : 0.0);
    do_s[c * H_STRIDE + d] = half_of(j < p.N ? p.v.v[(j * p.Hkv + g) * HD + d] : 0.0);
  }
  barrier();
  QMAT km[KCHUNKS], vm[KCHUNKS];
  LOAD_ROWS(km, q_s)
  LOAD_ROWS(vm, do_s)
  OMAT dk[CHUNKS], dv[CHUNKS];
  for (uint c = 0u; c < CHUNKS; ++c) {
    dk[c] = OMAT(0.0);
    dv[c] = OMAT(0.0);
  }
  for (uint h = h_begin; h < h_end; ++h) {
    for (uint t0 = j0; t0 < stop; t0 += B) {
      barrier();  // every subgroup is done with k and v or the last query tile
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
      SMAT w, dpt;
      PRODUCT_XYT(w, km, q_s)
      coopMatPerElementNV(w, w, probability_t, row0, j0, t0, p.scale);
      SMAT w16;
      coopMatPerElementNV(w16, w, rounded);
      const PMAT pt = PMAT(w16);
      PRODUCT_PY(dv, pt, do_s)
      PRODUCT_XYT(dpt, vm, do_s)
      coopMatPerElementNV(w, w, score_gradient_t, dpt, p.scale);
      const PMAT dst = PMAT(w);
      PRODUCT_PY(dk, dst, q_s)
    }
  }
  const uint64_t size = uint64_t(p.N) * p.Hkv * HD * 4u;  // bytes of one [N, kv_dim] partial
  F32 to_dk = p.head_splits == 1u ? p.dk : F32(uint64_t(p.partials) + share * size);
  F32 to_dv = p.head_splits == 1u ? p.dv : F32(uint64_t(p.partials) + (p.head_splits + share) * size);
  for (uint c = 0u; c < CHUNKS; ++c) store_chunk(dk[c], c, to_dk, j0 + row0, p.N, p.Hkv, g);
  for (uint c = 0u; c < CHUNKS; ++c) store_chunk(dv[c], c, to_dv, j0 + row0, p.N, p.Hkv, g);
}

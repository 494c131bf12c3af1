#version 460
// attention.comp's forward (causal grouped-query attention over packed sequences, FlashAttention-2)
// with q.k and p.v on the matrix units (attention_coopmat.glsl): a workgroup per (tile of B query
// tokens, head) keeps its queries as float16 in shared memory and streams the head's key and value
// tiles from the first key of its first sequence to its last query. Per key tile: S = Q K^T into
// shared memory; one invocation per query row applies the mask, updates the row's running max m
// and sum l (float32), writes the probabilities exp(s - m) rounded to float16 and rescales its row
// of the output accumulator O (float32, in shared memory); then O += P V. out = O / l and
// lse = m + log(l), as attention.comp's.
#include "attention_coopmat.glsl"
layout(push_constant) uniform Push { F32 out_; F32 lse; F32 q; F32 k; F32 v; I32 cu; uint N, S, Hq, Hkv; float scale; } p;
const uint O_STRIDE = HD + 4u;
shared float16_t q_s[B * H_STRIDE];
shared float16_t kv_s[B * H_STRIDE];  // the key tile, then the value tile
shared float s_s[B * S_STRIDE];
shared float16_t p_s[B * T_STRIDE];
shared float o_s[B * O_STRIDE];
shared float m_s[B], l_s[B];
shared uint begin_s[B];
void main() {
  const uint tid = gl_LocalInvocationID.x, sm = quarter_rows(), sn = quarter_cols(), hn = quarter_dims();
  const uint h = gl_WorkGroupID.y, g = h / (p.Hq / p.Hkv), q0 = gl_WorkGroupID.x * B;
  const uint last = min(q0 + B, p.N) - 1u, first = uint(p.cu.v[sequence_of(p.cu, p.S, q0)]);
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, d = e % HD, t = q0 + r;
    q_s[r * H_STRIDE + d] = half_of(t < p.N ? p.q.v[(t * p.Hq + h) * HD + d] : 0.0);
    o_s[r * O_STRIDE + d] = 0.0;
  }
  for (uint r = tid; r < B; r += THREADS) {
    m_s[r] = NEG_INF;
    l_s[r] = 0.0;
    begin_s[r] = q0 + r < p.N ? uint(p.cu.v[sequence_of(p.cu, p.S, q0 + r)]) : ~0u;
  }
  ACC acc[QM][QN];
  ACC o[QM][HN];
  for (uint j0 = first; j0 <= last; j0 += B) {
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint j = j0 + e / HD;
      kv_s[(e / HD) * H_STRIDE + e % HD] = half_of(j <= last ? p.k.v[(j * p.Hkv + g) * HD + e % HD] : 0.0);
    }
    barrier();
    PRODUCT_XYT(acc, q_s, kv_s, sm, sn)
    STORE_SCORES(acc, s_s, sm, sn)
    barrier();
    for (uint e = tid; e < B * HD; e += THREADS) {
      const uint j = j0 + e / HD;
      kv_s[(e / HD) * H_STRIDE + e % HD] = half_of(j <= last ? p.v.v[(j * p.Hkv + g) * HD + e % HD] : 0.0);
    }
    for (uint r = tid; r < B; r += THREADS) {  // the row's softmax update
      const uint t = q0 + r;
      float m_new = m_s[r];
      for (uint c = 0u; c < B; ++c) {
        const uint j = j0 + c;
        if (j >= begin_s[r] && j <= t) m_new = max(m_new, s_s[r * S_STRIDE + c] * p.scale);
      }
      float sum = 0.0;
      for (uint c = 0u; c < B; ++c) {
        const uint j = j0 + c;
        const float w = (m_new != NEG_INF && j >= begin_s[r] && j <= t) ? exp(s_s[r * S_STRIDE + c] * p.scale - m_new) : 0.0;
        sum += w;
        p_s[r * T_STRIDE + c] = half_of(w);
      }
      if (m_new != NEG_INF) {
        const float correction = exp(m_s[r] - m_new);  // 0 for a row's first keys (m = -inf)
        l_s[r] = l_s[r] * correction + sum;
        m_s[r] = m_new;
        for (uint d = 0u; d < HD; ++d) o_s[r * O_STRIDE + d] *= correction;
      }
    }
    barrier();
    for (uint i = 0u; i < QM; ++i)
      for (uint j = 0u; j < HN; ++j)
        coopMatLoad(o[i][j], o_s, (sm + i * CM) * O_STRIDE + hn + j * CN, O_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
    PRODUCT_PY(o, p_s, kv_s, sm, hn)
    for (uint i = 0u; i < QM; ++i)
      for (uint j = 0u; j < HN; ++j)
        coopMatStore(o[i][j], o_s, (sm + i * CM) * O_STRIDE + hn + j * CN, O_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
    barrier();
  }
  for (uint e = tid; e < B * HD; e += THREADS) {
    const uint r = e / HD, t = q0 + r;
    if (t < p.N) p.out_.v[(t * p.Hq + h) * HD + e % HD] = o_s[r * O_STRIDE + e % HD] / l_s[r];
  }
  for (uint r = tid; r < B; r += THREADS)
    if (q0 + r < p.N) p.lse.v[(q0 + r) * p.Hq + h] = m_s[r] + log(l_s[r]);
}

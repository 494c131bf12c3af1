#version 460
// The context splits of paged_attention.comp combined, an invocation per output element:
// out[row, d] = sum_s e^(m_s - M) acc_s[d] / sum_s e^(m_s - M) l_s over the splits that saw a key
// (M their largest max), in split order.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 out_; F32 partials; uint rows, hd, splits; } p;
void main() {
  FOR_EACH(i, p.rows * p.hd) {
    const uint row = i / p.hd, base = row * p.splits * (p.hd + 2u);
    float M = -1.0 / 0.0, L = 0.0, a = 0.0;
    for (uint s = 0u; s < p.splits; ++s) M = max(M, p.partials.v[base + s * (p.hd + 2u)]);
    for (uint s = 0u; s < p.splits; ++s) {
      const uint at = base + s * (p.hd + 2u);
      if (p.partials.v[at + 1u] == 0.0) continue;  // a split past the context
      const float w = exp(p.partials.v[at] - M);
      L += w * p.partials.v[at + 1u];
      a += w * p.partials.v[at + 2u + i % p.hd];
    }
    p.out_.v[i] = a / L;
  }
}

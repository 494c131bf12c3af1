#version 460
// AdamW (torch.optim.AdamW, as the cpu backend computes it in float32) over every tensor of a
// table (tensor_table.glsl) in one dispatch: the step's constants (step size, bias corrections,
// decay, the clipping scale) from the host, weight decay per tensor, each updated value rounded
// into the tensor's 16-bit storage where it has one (the convert that would follow); or, with a decision
// (step_decision.comp), the constants and the clipping scale from it, and nothing done when the
// step does not count.
#include "common.glsl"
#include "tensor_table.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  Table table; uint64_t total; Decision decision; uint count;
  float b1, b2, step_size, inv_sqrt_bias2, eps, keep, grad_scale;
} p;
void main() {
  float step_size = p.step_size, inv_sqrt_bias2 = p.inv_sqrt_bias2, decay_keep = p.keep, grad_scale = p.grad_scale;
  if (uint64_t(p.decision) != 0UL) {
    if (p.decision.counted == 0u) return;
    step_size = p.decision.step_size;
    inv_sqrt_bias2 = p.decision.inv_sqrt_bias2;
    decay_keep = p.decision.keep;
    grad_scale = p.decision.clip;
  }
  const uint64_t chunks = (p.total + CHUNK - 1u) / CHUNK;
  for (uint64_t c = gl_WorkGroupID.x; c < chunks; c += gl_NumWorkGroups.x) {
    const uint64_t begin = c * CHUNK, end = min(begin + CHUNK, p.total);
    uint k = table_find(p.table, p.count, begin);
    for (uint64_t e = begin + gl_LocalInvocationID.x; e < end; e += 256u) {
      while (e >= table_first(p.table, k) + table_count(p.table, k)) ++k;
      const uint i = uint(e - table_first(p.table, k));
      F32 param = F32(table_word(p.table, k, 0u)), grad = F32(table_word(p.table, k, 1u));
      F32 mm = F32(table_word(p.table, k, 2u)), vv = F32(table_word(p.table, k, 3u));
      const float keep = table_decay(p.table, k) ? decay_keep : 1.0;
      const float g = grad.v[i] * grad_scale;
      const float m = p.b1 * mm.v[i] + (1.0 - p.b1) * g;
      const float v = p.b2 * vv.v[i] + (1.0 - p.b2) * g * g;
      mm.v[i] = m;
      vv.v[i] = v;
      const float updated = param.v[i] * keep - step_size * m / (sqrt(v) * inv_sqrt_bias2 + p.eps);
      param.v[i] = updated;
      const uint64_t storage = table_word(p.table, k, 6u);
      if (storage != 0UL) store_f32(storage, uint(table_word(p.table, k, 7u)), i, updated);
    }
  }
}

#version 460
// The rows of a logits chunk, one workgroup per row (row r's target is targets[positions[r]]):
//   flags & 1: the row's cross-entropy with PyTorch's label smoothing into losses[r],
//              (1 - eps) * (lse - z_t) + eps * (lse - mean_v z_v);
//   flags & 2: its gradient written over the logits, softmax - (1 - eps) onehot(t) - eps / V;
//   flags & 4: the row's RowStats (backend/chunk_loss.h) into stats[4 r ..]: log-sum-exp, z_t,
//              the first argmax, and the target's rank (higher logits, plus equal ones with a
//              lower id).
// Reductions are shared-memory trees over a fixed split of the row: the same sums every run.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 logits;
  I32 targets;
  I32 positions;
  F32 losses;
  I32 stats;
  uint V;
  uint flags;
  float smoothing;
} p;
shared float s_max[256];
shared uint s_arg[256];
shared float s_sum[256];
shared float s_zsum[256];
shared uint s_above[256];

void main() {
  const uint t = gl_LocalInvocationID.x, row = gl_WorkGroupID.x, V = p.V;
  const uint base = row * V;
  const uint target = uint(p.targets.v[p.positions.v[row]]);
  // The maximum and its first index: each thread walks its share in increasing order.
  float best = -1.0 / 0.0;
  uint best_at = 0xffffffffu;
  for (uint v = t; v < V; v += 256u) {
    const float z = p.logits.v[base + v];
    if (z > best) {
      best = z;
      best_at = v;
    }
  }
  s_max[t] = best;
  s_arg[t] = best_at;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) {
      const float o = s_max[t + half_];
      const uint oi = s_arg[t + half_];
      if (o > s_max[t] || (o == s_max[t] && oi < s_arg[t])) {
        s_max[t] = o;
        s_arg[t] = oi;
      }
    }
    barrier();
  }
  const float m = s_max[0];
  const float zt = p.logits.v[base + target];
  float se = 0.0, zs = 0.0;
  uint above = 0u;
  for (uint v = t; v < V; v += 256u) {
    const float z = p.logits.v[base + v];
    se += exp(z - m);
    zs += z;
    above += uint(z > zt || (z == zt && v < target));
  }
  s_sum[t] = se;
  s_zsum[t] = zs;
  s_above[t] = above;
  barrier();
  for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
    if (t < half_) {
      s_sum[t] += s_sum[t + half_];
      s_zsum[t] += s_zsum[t + half_];
      s_above[t] += s_above[t + half_];
    }
    barrier();
  }
  const float lse = m + log(s_sum[0]);
  const float eps = p.smoothing;
  if (t == 0u) {
    if ((p.flags & 1u) != 0u) p.losses.v[row] = (1.0 - eps) * (lse - zt) + eps * (lse - s_zsum[0] / float(V));
    if ((p.flags & 4u) != 0u) {
      p.stats.v[4u * row] = floatBitsToInt(lse);
      p.stats.v[4u * row + 1u] = floatBitsToInt(zt);
      p.stats.v[4u * row + 2u] = int(s_arg[0]);
      p.stats.v[4u * row + 3u] = int(s_above[0]);
    }
  }
  if ((p.flags & 2u) != 0u) {
    const float shift = eps / float(V);
    for (uint v = t; v < V; v += 256u) {
      const float z = p.logits.v[base + v];
      p.logits.v[base + v] = exp(z - lse) - shift - (v == target ? 1.0 - eps : 0.0);
    }
  }
}

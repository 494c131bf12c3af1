#version 460
// The first pass of cross_entropy.comp: a workgroup per (piece of `piece` columns, row) of a
// logits chunk reduces its piece to six numbers in partials[(row * pieces + piece) * 6 ..]: the
// piece's maximum, the first column holding it, sum exp(z - that maximum), sum z, how many
// of its logits rank above the row's target (higher, or equal with a lower id), and the target's
// logit z_t (every piece reads it; the second pass takes it from here, never from the logits,
// whose target column that pass overwrites). Shared-memory
// trees over a fixed split: the same sums every run. Rows split into pieces so that a chunk of a
// few hundred rows of a 150k vocabulary still gives the device thousands of workgroups.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 logits; I32 targets; I32 positions; F32 partials; uint V, piece, pieces; } p;
shared float s_max[256];
shared uint s_arg[256];
shared float s_sum[256];
shared float s_zsum[256];
shared uint s_above[256];
void main() {
  const uint t = gl_LocalInvocationID.x, piece = gl_WorkGroupID.x, row = gl_WorkGroupID.y;
  const uint base = row * p.V, begin = piece * p.piece, end = min(begin + p.piece, p.V);
  const uint target = uint(p.targets.v[p.positions.v[row]]);
  const float zt = p.logits.v[base + target];
  float best = -1.0 / 0.0;
  uint best_at = 0xffffffffu;
  for (uint v = begin + t; v < end; v += 256u) {
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
  float se = 0.0, zs = 0.0;
  uint above = 0u;
  for (uint v = begin + t; v < end; v += 256u) {
    const float z = p.logits.v[base + v];
    se += exp(z - m);
    zs += z;
    above += uint(z > zt || (z == zt && v < target));
  }
  barrier();  // every invocation has read s_max[0]
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
  if (t != 0u) return;
  const uint at = (row * p.pieces + piece) * 6u;
  p.partials.v[at] = m;
  p.partials.v[at + 1u] = uintBitsToFloat(s_arg[0]);
  p.partials.v[at + 2u] = s_sum[0];
  p.partials.v[at + 3u] = s_zsum[0];
  p.partials.v[at + 4u] = uintBitsToFloat(s_above[0]);
  p.partials.v[at + 5u] = zt;
}

#version 460
// The rows of a logits chunk (row r's target is targets[positions[r]]), from the pieces that
// cross_entropy_partials.comp reduced: a workgroup per (piece, row) combines the row's pieces in
// order (every workgroup of the row gets the same bits), then
//   flags & 1: the row's cross-entropy with PyTorch's label smoothing into losses[r],
//              (1 - eps) * (lse - z_t) + eps * (lse - mean_v z_v);
//   flags & 2: its gradient written over its piece of the logits, softmax - (1 - eps) onehot(t) - eps / V;
//   flags & 4: the row's RowStats (backend/chunk_loss.h) into stats[4 r ..]: log-sum-exp, z_t,
//              the first argmax, and the target's rank (higher logits, plus equal ones with a
//              lower id).
// The losses and stats are written by the row's first piece. z_t comes from the first piece's
// partials, not from the logits: the workgroup holding the target's piece overwrites that column
// with its gradient while other workgroups of the row may still be reading. flags & 8 runs only
// the pieces holding their row's target, flags & 16 only the others: the backend's debug ordering
// (MEMTUNE_VULKAN_TARGET_PIECE_FIRST) dispatches the first, then the second, which is the order
// that would expose a read of the overwritten column.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push {
  F32 logits; I32 targets; I32 positions; F32 losses; I32 stats; F32 partials;
  uint V, piece, pieces, flags; float smoothing;
} p;
void main() {
  const uint t = gl_LocalInvocationID.x, piece = gl_WorkGroupID.x, row = gl_WorkGroupID.y;
  const uint base = row * p.V, target = uint(p.targets.v[p.positions.v[row]]), first = row * p.pieces * 6u;
  const bool holds_target = target / p.piece == piece;
  if (((p.flags & 8u) != 0u && !holds_target) || ((p.flags & 16u) != 0u && holds_target)) return;
  float m = -1.0 / 0.0;
  uint arg = 0xffffffffu;
  for (uint i = 0u; i < p.pieces; ++i) {
    const float mi = p.partials.v[first + 6u * i];
    if (mi > m) {  // strictly: the first piece holding the maximum has its first column
      m = mi;
      arg = floatBitsToUint(p.partials.v[first + 6u * i + 1u]);
    }
  }
  float se = 0.0, zs = 0.0;
  uint above = 0u;
  for (uint i = 0u; i < p.pieces; ++i) {
    const uint at = first + 6u * i;
    se += p.partials.v[at + 2u] * exp(p.partials.v[at] - m);
    zs += p.partials.v[at + 3u];
    above += floatBitsToUint(p.partials.v[at + 4u]);
  }
  const float lse = m + log(se), eps = p.smoothing, zt = p.partials.v[first + 5u];
  if (t == 0u && piece == 0u) {
    if ((p.flags & 1u) != 0u) p.losses.v[row] = (1.0 - eps) * (lse - zt) + eps * (lse - zs / float(p.V));
    if ((p.flags & 4u) != 0u) {
      p.stats.v[4u * row] = floatBitsToInt(lse);
      p.stats.v[4u * row + 1u] = floatBitsToInt(zt);
      p.stats.v[4u * row + 2u] = int(arg);
      p.stats.v[4u * row + 3u] = int(above);
    }
  }
  if ((p.flags & 2u) == 0u) return;
  const float shift = eps / float(p.V);
  const uint end = min((piece + 1u) * p.piece, p.V);
  for (uint v = piece * p.piece + t; v < end; v += 256u) {
    const float z = p.logits.v[base + v];
    p.logits.v[base + v] = exp(z - lse) - shift - (v == target ? 1.0 - eps : 0.0);
  }
}

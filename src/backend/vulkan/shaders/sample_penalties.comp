#version 460
// The penalties of sampling (backend/sample_row.h) applied to the logits in place, one thread per
// penalty token: entries[3 i ..] = (token id, times in the output, row); the row's settings are
// rows[10 r ..] (sample.comp). A row lists each id once, so no two threads touch one logit.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 logits; I32 rows; I32 entries; uint n; uint V; } p;
void main() {
  FOR_EACH(i, p.n) {
    const uint id = uint(p.entries.v[3u * i]), count = uint(p.entries.v[3u * i + 1u]), row = uint(p.entries.v[3u * i + 2u]);
    const float repetition = intBitsToFloat(p.rows.v[10u * row + 4u]);
    const float presence = intBitsToFloat(p.rows.v[10u * row + 5u]);
    const float frequency = intBitsToFloat(p.rows.v[10u * row + 6u]);
    float x = p.logits.v[row * p.V + id];
    if (repetition != 1.0) x = x > 0.0 ? x / repetition : x * repetition;
    if (count > 0u) x -= presence + frequency * float(count);
    p.logits.v[row * p.V + id] = x;
  }
}

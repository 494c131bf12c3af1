// A table of tensors for the multi-tensor shaders (adamw.comp, scale_sum_squares.comp): entry k is
// TABLE_WORDS 64-bit words, the addresses of param, grad, m and v (those a shader uses), the
// index of the tensor's first element among all the table's elements, its element count (bit
// 63: weight decay applies), and the address of the 16-bit storage the updated param rounds into
// (0: none) with its dtype (common.glsl's numbering). Elements are walked in chunks of CHUNK: a
// workgroup finds a chunk's first tensor once (a binary search over the table) and moves on
// tensor by tensor.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer Table { uint64_t w[]; };
const uint CHUNK = 4096u, TABLE_WORDS = 8u;
uint64_t table_word(Table t, uint k, uint j) { return t.w[TABLE_WORDS * k + j]; }
uint64_t table_first(Table t, uint k) { return table_word(t, k, 4u); }
uint64_t table_count(Table t, uint k) { return table_word(t, k, 5u) & 0x7fffffffffffffffUL; }
bool table_decay(Table t, uint k) { return (table_word(t, k, 5u) >> 63) != 0UL; }
// The tensor holding element e of the table's `count` tensors.
uint table_find(Table t, uint count, uint64_t e) {
  uint lo = 0u, hi = count;
  while (hi - lo > 1u) {
    const uint mid = (lo + hi) / 2u;
    if (table_first(t, mid) <= e) lo = mid; else hi = mid;
  }
  return lo;
}
// A training step decided on the device (step_decision.comp writes it, adamw.comp reads it):
// whether the step counts (its gradient norm is finite), the clipping coefficient, AdamW's
// constants for the step, whether the decided step before it counted, and the squared norm's
// float64 bits (as two words: a shader that reads a decision needs no float64 arithmetic).
layout(buffer_reference, std430, buffer_reference_align = 8) buffer Decision {
  uint counted; float clip, step_size, inv_sqrt_bias2, keep; uint previous; uvec2 sumsq;
};

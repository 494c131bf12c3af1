// Shared by the attention shaders: one invocation per (token, head) row walks its keys in order
// (every output row is written by one invocation, its sums in a fixed order: the same results
// every run, no barriers, no atomics), and the sequence of a token.
// The largest head_dim (kMaxAttentionHeadDim): a row's accumulators live in the invocation.
#define MAX_HD 256
// The sequence s with cu[s] <= token < cu[s + 1] among S sequences.
uint sequence_of(I32 cu, uint S, uint token) {
  uint lo = 0u, hi = S;
  while (hi - lo > 1u) {
    const uint mid = (lo + hi) / 2u;
    if (uint(cu.v[mid]) <= token) lo = mid; else hi = mid;
  }
  return lo;
}
float dot_rows(F32 a, uint at_a, F32 b, uint at_b, uint n) {
  float s = 0.0;
  for (uint d = 0u; d < n; ++d) s += a.v[at_a + d] * b.v[at_b + d];
  return s;
}
